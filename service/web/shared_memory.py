"""An infer request's tensors in client shared-memory regions (Triton's system shared-memory
extension), for kserve.py: an input or a requested output whose parameters name
shared_memory_region and shared_memory_byte_size (and optionally shared_memory_offset; the envelope
schema, schemas/kserve.py, checks them) is read from, or written to, that region instead of the
body. The registry and the bytes' moving are service/shm.py's; this module finds the region,
keeps a request's reads within ATTN_MAX_BODY_BYTES (as its body would be), and turns every
refusal into a 400."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import RequestError
from schemas.kserve import SHM_CODE, Shared
from service import shm

from .context import context, services

CODE = SHM_CODE  # errors.STATUS: 400


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
                f"shared_memory_byte_size is {self.byte_size}; give it a region of at least {arr.nbytes} bytes.",
                "outputs",
            )
        try:
            shm.write(self.region, self.offset, memoryview(arr).cast("B"))  # type: ignore[arg-type]  # an ndarray is a buffer
        except shm.ShmError as err:
            raise refused(err, "outputs") from None


def place(where: Shared, what: str, field: str) -> Place:
    """The registered region a tensor's parameters name (schemas/kserve.py checked their types),
    with its bytes in it (what: "input q", "output out"; field: what an error names)."""
    try:
        region = registry().get(where.region)
    except shm.ShmError as err:
        raise refused(err, field) from None
    if where.offset + where.byte_size > region.byte_size:
        raise RequestError(
            CODE,
            f"{what}: {where.byte_size} bytes at offset {where.offset} pass the end of region {where.region!r}, "
            f"which holds {region.byte_size} bytes.",
            field,
        )
    return Place(region, where.offset, where.byte_size)


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
