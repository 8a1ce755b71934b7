"""AttentionClient(url, shared_memory=True): the tensors through shared-memory regions it registers
with a server on this host, answers equal to the binary wire's; regions reused, never overwritten
under a result still held; the binary wire where the server refuses or forgets a region."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import requests

from attention_client import AttentionClient

pytestmark = pytest.mark.live

rng = np.random.default_rng(11)
Q, K, V = (rng.standard_normal((2, 4, 32, 16), dtype=np.float32) for _ in range(3))


def registered(url: str) -> list[str]:
    return [r["name"] for r in requests.get(f"{url}/v2/systemsharedmemory/status", timeout=30).json()]


@pytest.fixture
def clients(shm_server):
    requests.post(f"{shm_server.url}/v2/systemsharedmemory/unregister", timeout=30)
    with AttentionClient(shm_server.url, shared_memory=True, split=False) as shm, AttentionClient(shm_server.url, split=False) as wire:
        yield shm, wire
    assert registered(shm_server.url) == []  # close() unregisters its regions


def test_answers_equal_the_binary_wires(clients, shm_server):
    shm, wire = clients
    variants = (
        {},
        {"causal": True, "return_lse": True},
        {"return_weights": False},
        {"dtype": "float64"},
        {"weights_dtype": "float16"},
        {"mask": rng.random((32, 32)) < 0.7, "key_lengths": np.array([[5, 32, 17, 1]] * 2), "bias": rng.standard_normal((1, 4, 32, 32))},
        {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]), "window": (8, 0), "average_weights": True},
    )
    for kwargs in variants:
        got, expected = shm.attention(Q, K, V, **kwargs), wire.attention(Q, K, V, **kwargs)
        for a, b in zip(got, expected, strict=True):
            if b is None:
                assert a is None
            else:
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)  # one server, one BLAS thread a worker: the same bits
    x, wq, wk, wv, wo = (rng.standard_normal(shape, dtype=np.float32) for shape in ((2, 24, 32), (32, 32), (32, 16), (32, 16), (32, 8)))
    for a, b in zip(shm.mha(x, wq, wk, wv, wo, heads=4, kv_heads=2), wire.mha(x, wq, wk, wv, wo, heads=4, kv_heads=2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(registered(shm_server.url)) >= 1  # it did go through shared memory


def test_a_region_is_reused_and_a_result_held_is_never_overwritten(clients, shm_server):
    shm, _ = clients
    for _ in range(3):
        shm.attention(Q, K, V)
    assert len(registered(shm_server.url)) == 1  # one registration, then reuse
    held_out, held_weights = shm.attention(Q, K, V)
    copy_out = held_out.copy()
    other_out, _ = shm.attention(2 * Q, K, V)  # the held result's region is busy: another one
    assert len(registered(shm_server.url)) == 2
    np.testing.assert_array_equal(held_out, copy_out)
    assert not np.array_equal(other_out, held_out)
    del held_out, held_weights, other_out
    gc.collect()
    for _ in range(3):
        shm.attention(Q, K, V)
    assert len(registered(shm_server.url)) == 2  # both free again, reused


def test_a_region_the_server_forgot_goes_by_the_binary_wire_then_registers_again(clients, shm_server):
    shm, wire = clients
    shm.attention(Q, K, V)
    requests.post(f"{shm_server.url}/v2/systemsharedmemory/unregister", timeout=30)  # as a restarted server would
    np.testing.assert_array_equal(shm.attention(Q, K, V)[0], wire.attention(Q, K, V)[0])
    shm.attention(Q, K, V)
    assert len(registered(shm_server.url)) == 1


def test_a_server_that_refuses_gets_the_binary_wire(live_server):
    """The session's default server does not take client shared memory."""
    with AttentionClient(live_server, shared_memory=True) as shm, AttentionClient(live_server) as wire:
        np.testing.assert_array_equal(shm.attention(Q, K, V)[0], wire.attention(Q, K, V)[0])
        assert all(regions.refused for regions in shm._regions.values())  # noqa: SLF001 - the state the next call reads
        np.testing.assert_array_equal(shm.attention(Q, K, V)[1], wire.attention(Q, K, V)[1])


def test_shared_memory_goes_with_the_binary_wire_only():
    with pytest.raises(ValueError, match="binary wire"):
        AttentionClient("http://127.0.0.1:1", shared_memory=True, wire="json")
