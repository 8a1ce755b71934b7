"""Two of Triton's extensions of the Open Inference Protocol, added to the /v2 door (kserve.bp):
statistics and system shared memory.

Statistics (GET /v2/models[/{name}[/versions/{version}]]/stats): each model's requests, cumulative
since the server started and summed over its workers (service/stats.py's table), in Triton's
document. Each /v2 infer request is recorded once its answer is built (an after-request hook of
the door), from the phases the request timed (http.phase), mapped onto Triton's:

  queue           waiting for a compute slot (admission's queue phase; 0 for a request that did not wait)
  compute_input   reading the inputs out of the body or shared memory, and validating them (decode, validate)
  compute_infer   the numeric core (compute)
  compute_output  encoding the answer's head and writing outputs to shared memory (encode); binary
                  outputs are copied while they are sent, after it
  success         from the request's first byte until its answer is built
  fail            the same, for a request answered with an error (any 4xx or 5xx of a served model)

There is no batcher and no response cache: execution_count and inference_count are the
successes, batch_stats one entry of batch size 1, cache_hit and cache_miss zero.

System shared memory (GET /v2/systemsharedmemory[/region/{name}]/status, POST
.../region/{name}/register, POST /v2/systemsharedmemory[/region/{name}]/unregister): the registry
of service/shm.py, on when ATTN_ALLOW_CLIENT_SHM is true (else 400); infer's tensors in regions are
shared_memory.py's."""

from __future__ import annotations

import time

from flask import Flask, Response, request

from schemas import RequestError
from service import shm, stats

from .context import context, services
from .http import check_media_type, json_response, parse_json, read_body
from .kserve import MODEL_VERSION, MODELS, _model, bp
from .shared_memory import CODE, refused, registry

INFER = f"{bp.name}.infer"  # the endpoint whose requests are counted
SLOTS = {name: slot for slot, name in enumerate(MODELS)}  # each model's cells in the table
assert len(SLOTS) <= stats.MODELS, "more models than the statistics table has slots (service/stats.py MODELS)"


def install(app: Flask) -> None:
    """This worker's row of the server's statistics table (a private table without one), and the
    server's shared-memory registry when ATTN_ALLOW_CLIENT_SHM is on (a private one without one)."""
    svc = services(app)
    svc.stats = stats.join(stats.shared())
    if svc.settings.allow_client_shm:
        svc.shm = shm.shared() or shm.Registry(shared=False)


# --- statistics ------------------------------------------------------------------------------------


@bp.after_request
def _count(resp: Response) -> Response:
    """Record a /v2 infer request to a served model (version) in the statistics."""
    args = request.view_args or {}
    slot = SLOTS.get(args.get("name", ""))
    if request.endpoint != INFER or slot is None or args.get("version", MODEL_VERSION) != MODEL_VERSION:
        return resp
    ctx, row = context(), services().stats
    if row is None:
        return resp
    phases = ctx.phases

    def ns(*names: str) -> int:
        return int(sum(phases.get(n, 0.0) for n in names) * 1e6)

    row.table.record(
        row.row,
        slot,
        ok=resp.status_code == 200,
        when_ms=time.time_ns() // 1_000_000,
        total_ns=int((time.perf_counter() - ctx.arrived) * 1e9),
        queue_ns=ns("queue"),
        input_ns=ns("decode", "validate"),
        infer_ns=ns("compute"),
        output_ns=ns("encode"),
    )
    return resp


@bp.get("/models/stats")
@bp.get("/models/<name>/stats")
@bp.get("/models/<name>/versions/<version>/stats")
def model_stats(name: str | None = None, version: str | None = None):
    """Triton's statistics extension: each model's (or this model's) requests since the server
    started, over all its workers: counts and cumulative nanoseconds of successes, failures, and the
    successes' queue, compute_input (decoding and validating), compute_infer (the core) and
    compute_output (encoding) phases."""
    names = [_model(name, version).name] if name is not None else list(MODELS)
    return json_response({"model_stats": [_model_stat(n) for n in names]})


def _model_stat(name: str) -> dict:
    row = services().stats
    assert row is not None  # install() made it
    t = row.table.totals(SLOTS[name])

    def duration(count: int, ns: int) -> dict:
        return {"count": count, "ns": ns}

    phases = {
        "compute_input": duration(t.success, t.input_ns),
        "compute_infer": duration(t.success, t.infer_ns),
        "compute_output": duration(t.success, t.output_ns),
    }
    return {
        "name": name,
        "version": MODEL_VERSION,
        "last_inference": t.last_ms,
        "inference_count": t.success,
        "execution_count": t.success,
        "inference_stats": {
            "success": duration(t.success, t.success_ns),
            "fail": duration(t.fail, t.fail_ns),
            "queue": duration(t.success, t.queue_ns),
            **phases,
            "cache_hit": duration(0, 0),
            "cache_miss": duration(0, 0),
        },
        "batch_stats": [{"batch_size": 1, **phases}] if t.success else [],
    }


# --- system shared memory --------------------------------------------------------------------------


@bp.get("/systemsharedmemory/status")
@bp.get("/systemsharedmemory/region/<region>/status")
def shm_status(region: str | None = None):
    """The registered system shared-memory regions (or the one named): name, key, offset, byte_size."""
    try:
        regions = registry().status(region)
    except shm.ShmError as err:
        raise refused(err) from None
    return json_response([r.status() for r in regions])


@bp.post("/systemsharedmemory/region/<region>/register")
def shm_register(region: str):
    """Register byte_size bytes at offset in the POSIX shared-memory object key (shm_open's name) as
    a region that inputs and outputs may name. 400 if the name is taken, the object missing, or the
    bytes not in it."""
    reg = registry()
    check_media_type(require_json=False)  # tritonclient sends no Content-Type
    doc = parse_json(read_body())
    extra = sorted(set(doc) - {"key", "offset", "byte_size"})
    if extra or "key" not in doc or "byte_size" not in doc:
        raise RequestError(CODE, 'A register request is {"key": string, "offset": bytes, "byte_size": bytes}; offset may be left out.')
    try:
        reg.register(region, doc["key"], doc.get("offset", 0), doc["byte_size"])
    except shm.ShmError as err:
        raise refused(err) from None
    return json_response({})


@bp.post("/systemsharedmemory/unregister")
@bp.post("/systemsharedmemory/region/<region>/unregister")
def shm_unregister(region: str | None = None):
    """Unregister the region named (every region, without a name); a name not registered is no error."""
    registry().unregister(region)
    return json_response({})


# CUDA shared memory: this server has no GPU, so no CUDA region can be registered, and there is
# never one to unregister or list. The routes exist because Triton's clients clean up both kinds:
# perf_analyzer --shared-memory system unregisters every CUDA region too, and stops if that fails.


@bp.get("/cudasharedmemory/status")
@bp.get("/cudasharedmemory/region/<region>/status")
def cuda_shm_status(region: str | None = None):
    """CUDA shared-memory regions: none (this server has no GPU); a name is 400."""
    registry()
    if region is not None:
        raise RequestError(CODE, f"no CUDA shared-memory region named {region!r} is registered: this server has no GPU.")
    return json_response([])


@bp.post("/cudasharedmemory/region/<region>/register")
def cuda_shm_register(region: str):
    """Always 400: this server has no GPU; use system shared memory."""
    registry()
    raise RequestError(CODE, "This server has no GPU: CUDA shared memory cannot be registered; use system shared memory.")


@bp.post("/cudasharedmemory/unregister")
@bp.post("/cudasharedmemory/region/<region>/unregister")
def cuda_shm_unregister(region: str | None = None):
    """Nothing to unregister (no CUDA region is ever registered here): 200."""
    registry()
    return json_response({})
