"""The split policy (service/cost/split.py, asked by admission, service/admission/): a large request alone on the server is computed on
ATTN_SPLIT_THREADS threads, anything else on one; the decision unit-tested, then through the app
(the gate's count), then on the real server (its answer equals the in-process core's, bit for bit)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import requests
from prometheus_client import REGISTRY

from service.admission import Admission, census
from service.core import attention, kernels
from service.cost import Work, split, threads_for, work_of
from service.web import create_app
from service.web.context import services

from .conftest import SMALL
from .helpers import b64, post, server_blas, serving, tensor

SPLITS = "attention_split_computations_total"


def work(flops: int, blocks: int = 32) -> Work:
    return Work(flops=flops, score_elements=flops // 128, dtype="float32", T=1024, blocks=blocks)


LARGE, SMALL_WORK = split.MIN_FLOPS, split.MIN_FLOPS - 1


@pytest.mark.parametrize(
    "w, computing, max_threads, expect",
    [
        (work(LARGE), 1, 2, 2),
        (work(10 * LARGE), 1, 4, 4),
        (work(LARGE, blocks=3), 1, 8, 3),  # never more threads than blocks
        (work(LARGE, blocks=1), 1, 2, 1),  # one block: nothing to share
        (work(SMALL_WORK), 1, 2, 1),  # small: the split costs more than it saves
        (work(LARGE), 2, 2, 1),  # another request computing: each keeps one core
        (work(100 * LARGE), 5, 2, 1),
        (work(LARGE), 1, 1, 1),  # ATTN_SPLIT_THREADS=1: off
    ],
    ids=["idle large", "idle larger, 4 threads", "bounded by blocks", "one block", "idle small", "busy", "busier", "off"],
)
def test_threads_for(w, computing, max_threads, expect):
    assert threads_for(w, computing, max_threads) == expect


def splits() -> float:
    return REGISTRY.get_sample_value(SPLITS) or 0.0


@pytest.fixture
def split_app(monkeypatch):
    """An app with small limits that splits on two threads anything of 2 blocks and more."""
    monkeypatch.setattr(split, "MIN_FLOPS", 0)
    monkeypatch.setattr(kernels, "SMALL_SHARE", 2**62)  # no one-block path for small problems: these are split in blocks
    app = create_app(dataclasses.replace(SMALL, split_threads=2))
    app.testing = True
    return app


def body(rng, T: int = 64):
    q, k, v = (rng.standard_normal((1, 2, T, 8)).astype(np.float32) for _ in range(3))  # 4 blocks of 16 rows
    return (q, k, v), {"q": b64(q), "k": b64(k), "v": b64(v), "causal": True}


def test_alone_it_splits_and_answers_as_one_thread(split_app, rng):
    (q, k, v), doc = body(rng)
    before = splits()
    r = post(split_app.test_client(), doc)
    assert r.status_code == 200, r.json
    assert splits() == before + 1
    out, weights = attention(q, k, v, causal=True)
    assert tensor(r.json["out"]).tobytes() == out.tobytes()
    assert tensor(r.json["weights"]).tobytes() == weights.tobytes()


@pytest.mark.parametrize("where", ["this worker", "another worker"])
def test_beside_another_request_it_does_not_split(split_app, rng, where):
    """A request admitted and not yet answered, in this worker's gate or in a sibling's that shares
    the server's census, keeps this one on one thread; alone again, it splits."""
    held = services(split_app)
    gate = held.admission
    if where == "another worker":
        table = census.Table(rows=2, shared=False)  # the server's table, as the arbiter makes it (here in-process)
        held.admission = Admission(SMALL, gate.predict, count=gate.count, table=table)
        gate = Admission(SMALL, gate.predict, table=table)
    other = gate.enter(0)
    try:
        before = splits()
        assert post(split_app.test_client(), body(rng)[1]).status_code == 200
        assert splits() == before
    finally:
        other.release()
    assert post(split_app.test_client(), body(rng)[1]).status_code == 200  # alone again
    assert splits() == before + 1


def test_split_off_has_no_pool(rng):
    app = create_app(dataclasses.replace(SMALL, split_threads=1))
    assert services(app).pool is None
    before = splits()
    assert post(app.test_client(), body(rng)[1]).status_code == 200
    assert splits() == before


def test_a_split_compute_does_not_teach_the_cost_model(split_app, rng, monkeypatch):
    """The cost model predicts one thread's time (a request's under load): a split's time is not fed
    to the fit, only to the share splits take."""
    model = services(split_app).cost
    assert post(split_app.test_client(), body(rng)[1]).status_code == 200
    assert all(fit.n == 0 for fit in model._fits.values())
    assert set(model.coefficients()["split_factor_by_threads"]) == {"2"}


@pytest.mark.live
def test_live_big_request_split_equals_the_core():
    """On the real server (2 workers), a large request alone is split (the counter says so) and
    its answer is the in-process core's, bit for bit."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 8, 512, 64)).astype(np.float32) for _ in range(3))
    assert threads_for(attention_work(q, k, v), 1, 2) == 2  # large enough
    with serving({"ATTN_SPLIT_THREADS": "2", "ATTN_WARMUP": "false"}) as srv:

        def split_count() -> float:
            for line in requests.get(f"{srv.url}/metrics", timeout=30).text.splitlines():
                if line.startswith(SPLITS + " "):
                    return float(line.split()[1])
            return 0.0

        before = split_count()
        r = requests.post(f"{srv.url}/attention", json={"q": b64(q), "k": b64(k), "v": b64(v), "causal": True}, timeout=120)
        assert r.status_code == 200, r.text[:500]
        assert split_count() == before + 1
    with server_blas():  # the server's BLAS threads: the same bits
        out, weights = attention(q, k, v, causal=True)
    assert tensor(r.json()["out"]).tobytes() == out.tobytes()
    assert tensor(r.json()["weights"]).tobytes() == weights.tobytes()


def attention_work(q, k, v) -> Work:
    from schemas.jobs import AttentionJob

    return work_of(AttentionJob(q, k, v, None, "top_left", None, None, True, "b64"))


def test_a_request_that_will_split_is_predicted_at_the_split_s_share(split_app, rng, monkeypatch):
    """Alone on the server, a request that will be split is admitted with its one-thread time x
    the share splits have taken (not one thread's time, which would refuse deadlines it can meet),
    and its compute teaches that share, not the fit; beside another request it is predicted at
    one thread's time."""
    model = services(split_app).cost
    monkeypatch.setattr(model, "split_factor", lambda threads: {1: 1.0, 2: 0.5}[threads])
    taught = []  # the model learns nothing: predictions stay comparable
    monkeypatch.setattr(model, "observe", lambda work, ms, cpu_ms, busy, threads, predicted: taught.append((work, threads)))
    r = post(split_app.test_client(), body(rng)[1])
    assert r.status_code == 200, r.json
    [(work, threads)] = taught
    assert threads == 2
    assert r.json["cost"]["predicted_ms"] == pytest.approx(model.predict(work, 1) * 0.5, abs=1e-3)
    other = services(split_app).admission.enter(0)  # another request admitted: no split
    try:
        r = post(split_app.test_client(), body(rng)[1])
    finally:
        other.release()
    assert r.status_code == 200 and taught[1][1] == 1  # computed on one thread
    assert r.json["cost"]["predicted_ms"] == pytest.approx(model.predict(work, 2), abs=1e-3)
