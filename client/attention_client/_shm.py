"""Tensors through shared memory, for a server on the same host (AttentionClient(...,
shared_memory=True)): Triton's system shared-memory extension at /v2.

A request's inputs are copied into a POSIX shared-memory region this client made and registered
with the server; the server reads them from it, and writes the outputs into the same region, after
the inputs; only a small JSON head travels over HTTP. The outputs are returned as views of the
region, not copies: the region goes back to this client's free regions once every array viewing it
is gone (a finalizer on their base), so a result you keep is never overwritten, and a region is
reused by the next request that fits (one registration, then none).

Where the server refuses (not on this host, ATTN_ALLOW_CLIENT_SHM off, an older server) the
request goes by the binary wire, and so does every later one to that server. A region the server
no longer knows (it restarted) is dropped and the request goes by the binary wire; the next one
registers a fresh region.

Shape legend as in _client: ... leading axes, T queries, S keys, d width, dv value width."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from . import _wire
from ._http import Answer

ALIGN = 64  # each tensor starts at a multiple of this in its region
MIN_REGION = 1 << 16
CODE = "bad_shared_memory"  # the server's code for a region it cannot use

Send = Callable[[str, str, list, dict], Answer]  # AttentionClient._send bound to one replica: (method, path, parts, headers)


class _Object(shared_memory.SharedMemory):
    """A shared-memory object that results may outlive: unmapping it waits for them, silently."""

    def __del__(self) -> None:
        with contextlib.suppress(BufferError):  # arrays still view it (at exit): the mapping goes with the process
            super().__del__()


class Region:
    """One shared-memory object of this client, registered with one server under its name."""

    def __init__(self, size: int):
        self.name = f"attention-client-{os.getpid()}-{secrets.token_hex(8)}"
        self.shm = _Object(self.name, create=True, size=size)  # shm_open("/" + name); unlinked at exit if left
        self.size = size

    @property
    def key(self) -> str:
        return f"/{self.name}"

    def destroy(self) -> None:
        """Unlink the object; unmap it unless arrays still view it (then it goes with them)."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self.shm.close()
        except BufferError:  # a result still views it: the mapping lives until that array dies
            pass


class Regions:
    """This client's regions on one server. Thread-safe: concurrent requests take different regions."""

    def __init__(self) -> None:
        self.refused = False  # the server does not take this client's shared memory: the binary wire, always
        self._free: list[Region] = []
        self._all: dict[str, Region] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, send: Send) -> Region | None:
        """A registered region of at least nbytes, free for this request; None if the server refuses."""
        with self._lock:
            fits = [r for r in self._free if r.size >= nbytes]
            region = min(fits, key=lambda r: r.size) if fits else None
            if region is not None:
                self._free.remove(region)
            drop, self._free = (self._free, []) if region is None else ([], self._free)  # too small for this: unregistered
        for old in drop:
            self._drop(old, send)
        if region is not None:
            return region
        step = 1 << max(16, nbytes.bit_length() - 3)  # sizes rounded up by at most an eighth: requests a little larger reuse it
        try:
            region = Region(max(MIN_REGION, -(-nbytes // step) * step))
        except OSError:  # no POSIX shared memory here
            self.refused = True
            return None
        body = _wire.dumps({"key": region.key, "offset": 0, "byte_size": region.size})
        answer = send("POST", f"/v2/systemsharedmemory/region/{region.name}/register", [body], {"Content-Type": "application/json"})
        if answer.status != 200:
            region.destroy()
            with self._lock:
                self.refused = not self._all  # refused with none registered: this server takes none of ours; else full for now
            return None
        with self._lock:
            self._all[region.name] = region
        return region

    def give(self, region: Region) -> None:
        """region is free again (its results are gone); a region dropped meanwhile stays dropped."""
        with self._lock:
            if region.name in self._all:
                self._free.append(region)

    def forget(self, region: Region, send: Send) -> None:
        """The server no longer knows region (it restarted): drop it."""
        self._drop(region, send)

    def _drop(self, region: Region, send: Send) -> None:
        with self._lock:
            self._all.pop(region.name, None)
        try:
            send("POST", f"/v2/systemsharedmemory/region/{region.name}/unregister", [b""], {})
        except Exception:  # noqa: BLE001 - the server may be gone; the object is unlinked either way
            pass
        region.destroy()

    def close(self, send: Send) -> None:
        """Unregister and unlink every region of this client (results still held keep their memory)."""
        with self._lock:
            regions, self._all, self._free = list(self._all.values()), {}, []
        for region in regions:
            try:
                send("POST", f"/v2/systemsharedmemory/region/{region.name}/unregister", [b""], {})
            except Exception:  # noqa: BLE001 - the server may be gone
                pass
            region.destroy()


def output_bytes(path: str, body: dict, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict[str, int] | None:
    """An upper bound of each output's bytes (the server's answer may be float32 or float64, so
    8 bytes an element unless the request says float32), or None when the shapes are not a
    request's (the binary wire then lets the server say what is wrong)."""
    itemsize = 4 if body.get("dtype") == "float32" else 8
    weights_itemsize = np.dtype(body["weights_dtype"]).itemsize if body.get("weights_dtype") else itemsize
    try:
        if path == "/attention":
            q, k, v = arrays["q"], arrays["k"], arrays["v"]
            rows = math.prod(q.shape[:-1])  # (..., T)
            sizes = {"out": rows * v.shape[-1] * itemsize, "weights": rows * k.shape[-2] * weights_itemsize, "lse": rows * itemsize}
        else:
            x, wv = arrays["x"], arrays["wv"]
            heads = int(body["heads"])
            kv_heads = int(body.get("kv_heads") or heads)
            width = arrays["wo"].shape[1] if "wo" in arrays else heads * (wv.shape[1] // kv_heads)
            rows = math.prod(x.shape[:-1])  # (B, n)
            sizes = {"out": rows * width * itemsize, "weights": rows * heads * x.shape[-2] * weights_itemsize}
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
    return {name: sizes[name] for name in outputs}


def infer(regions: Regions, send: Send, path: str, body: dict, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict | None:
    """One infer request with its tensors in a region: {output name: array viewing the region},
    or None to send it by the binary wire instead."""
    sizes = output_bytes(path, body, arrays, outputs)
    if sizes is None or regions.refused:
        return None
    arrays = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in arrays.items()}
    places, end = {}, 0
    for name, nbytes in [*((n, a.nbytes) for n, a in arrays.items()), *sizes.items()]:
        places[name] = end
        end += -(-max(nbytes, 1) // ALIGN) * ALIGN
    region = regions.take(end, send)
    if region is None:
        return None
    assert region.shm.buf is not None  # mapped until destroyed
    base = np.frombuffer(region.shm.buf, np.uint8, count=end)  # the results' base: the region is free once it dies
    weakref.finalize(base, regions.give, region)
    for name, a in arrays.items():
        base[places[name] : places[name] + a.nbytes] = a.reshape(-1).view(np.uint8)

    def where(name: str, nbytes: int) -> dict:
        return {"shared_memory_region": region.name, "shared_memory_offset": places[name], "shared_memory_byte_size": nbytes}

    head = {
        "inputs": [
            {"name": n, "datatype": _wire.DATATYPES[a.dtype.name], "shape": list(a.shape), "parameters": where(n, a.nbytes)}
            for n, a in arrays.items()
        ],
        "outputs": [{"name": n, "parameters": where(n, sizes[n])} for n in outputs],
        "parameters": {key: _wire.v2_parameter(value) for key, value in body.items() if key not in arrays},
    }
    answer = send("POST", f"/v2/models/{_wire.V2_MODELS[path]}/infer", [_wire.dumps(head)], {"Content-Type": "application/json"})
    if answer.status != 200:
        if answer.status == 400 and answer.headers.get("X-Error-Code") == CODE:
            regions.forget(region, send)  # e.g. a server restarted since the region was registered
        return None  # the binary wire sends it again, and raises what the server says of it
    results = {}
    for spec in _wire.loads(answer.body)["outputs"]:
        name, dtype = spec["name"], _wire.NUMPY[spec["datatype"]].newbyteorder("<")
        count = math.prod(spec["shape"])
        if name not in sizes or count * dtype.itemsize > sizes[name]:
            raise ValueError(f"the server answered output {name!r} of {spec['shape']} {spec['datatype']}, not in the region")
        results[name] = base[places[name] : places[name] + count * dtype.itemsize].view(dtype).reshape(spec["shape"])
    return results
