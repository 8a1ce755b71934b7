"""An infer request's tensors in client shared-memory regions (Triton's system shared-memory
extension), for kserve.py: an input or a requested output whose parameters name
shared_memory_region and shared_memory_byte_size (and optionally shared_memory_offset) is read from,
or written to, that region instead of the body. The registry and the bytes' moving are
service/shm.py's; this module checks the parameters, keeps a request's reads within
ATTN_MAX_BODY_BYTES (as its body would be), and turns every refusal into a 400."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import RequestError
from schemas.fields import show
from service import shm

from .context import context, services

REGION, OFFSET, SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
PARAMETERS = frozenset({REGION, OFFSET, SIZE})
CODE = "bad_shared_memory"  # errors.STATUS: 400


def registry() -> shm.Registry:
    """The server's registry: 400 unless ATTN_ALLOW_CLIENT_SHM is on."""
    registry = services().shm
    if registry is None:
        raise RequestError(
            CODE, "This server does not take client shared memory; its operator may allow it with ATTN_ALLOW_CLIENT_SHM=true."
        )
    return registry


def refused(err: shm.ShmError, field: str | None = None) -> RequestError:
    return RequestError(CODE, err.message, field)


@dataclass(frozen=True)
class Place:
    """Where a tensor lies: byte_size bytes at offset in a registered region."""

    region: shm.Region
    offset: int
    byte_size: int

    def write(self, arr: np.ndarray, name: str) -> None:
        """Write arr's bytes here."""
        if arr.nbytes > self.byte_size:
            raise RequestError(
                CODE,
                f"output {name} is {arr.nbytes} bytes ({list(arr.shape)} of {arr.dtype.name}) but its "
                f"{SIZE} is {self.byte_size}; give it a region of at least {arr.nbytes} bytes.",
                "outputs",
            )
        try:
            shm.write(self.region, self.offset, memoryview(arr).cast("B"))  # type: ignore[arg-type]  # an ndarray is a buffer
        except shm.ShmError as err:
            raise refused(err, "outputs") from None


def place(params: dict, what: str, field: str) -> Place | None:
    """The region a tensor's parameters name, or None when they name none (what: "input q",
    "output out"; field: what an error names)."""
    given = PARAMETERS & set(params)
    if not given:
        return None
    if REGION not in given or SIZE not in given:
        raise RequestError(CODE, f"{what} needs both {REGION} and {SIZE} (and optionally {OFFSET}).", field)
    name = params[REGION]
    if not isinstance(name, str):
        raise RequestError(CODE, f"{what} has {REGION} {show(name)}; it must be a region's name.", field)
    for key in (SIZE, OFFSET):
        value = params.get(key, 0)
        if type(value) is not int or value < 0:
            raise RequestError(CODE, f"{what} has {key} {show(value)}; it must be a byte count.", field)
    try:
        region = registry().get(name)
    except shm.ShmError as err:
        raise refused(err, field) from None
    offset, size = params.get(OFFSET, 0), params[SIZE]
    if offset + size > region.byte_size:
        raise RequestError(
            CODE, f"{what}: {size} bytes at offset {offset} pass the end of region {name!r}, which holds {region.byte_size} bytes.", field
        )
    return Place(region, offset, size)


def read_input(where: Place, name: str) -> memoryview:
    """Input name's bytes, read out of its region; the request's reads together within
    ATTN_MAX_BODY_BYTES."""
    limit, ctx = services().settings.max_body_bytes, context()
    total = ctx.shm_read + where.byte_size
    if total > limit:
        raise RequestError(
            "too_large",
            f"the inputs in shared memory come to {total} bytes by input {name}, past the limit of {limit} bytes a request "
            "may bring (ATTN_MAX_BODY_BYTES).",
            name,
        )
    ctx.shm_read = total
    try:
        return shm.read(where.region, where.offset, where.byte_size)
    except shm.ShmError as err:
        raise refused(err, name) from None
