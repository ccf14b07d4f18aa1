"""Whole combine rounds on one GPU: bytes, counts, reduce, graph replays, timeouts."""
from __future__ import annotations

import time

import numpy as np
import pytest

from p3send import ArrivalTimeout
from p3send.cuda import driver
from p3send.ops.combine import Combine
from p3send.oracle.cases import check_world, world_case, world_counts_expected
from p3send.oracle.reference import f32_to_bf16
from tests.gpu.conftest import fresh_seed

WORLDS = {
    "small": dict(n_ranks=4, tokens=64, top_k=4, n_local=4, hidden=256),
    "one_rank": dict(n_ranks=1, tokens=33, top_k=2, n_local=3, hidden=24),
    "top1_hidden8": dict(n_ranks=3, tokens=17, top_k=1, n_local=2, hidden=8),
    "masked": dict(n_ranks=4, tokens=50, top_k=4, n_local=2, hidden=136, masked=0.3),
    "starved": dict(n_ranks=4, tokens=40, top_k=3, n_local=2, hidden=64, starve_rank=2),
    "skewed": dict(n_ranks=8, tokens=31, top_k=8, n_local=4, hidden=7168,
                   skew=np.r_[np.full(4, 50.0), np.ones(28)]),
    "no_tokens": dict(n_ranks=2, tokens=0, top_k=2, n_local=2, hidden=64),
    "dsv3_small": dict(n_ranks=8, tokens=128, top_k=8, n_local=4, hidden=7168),
}


def make(dev, world, **kw) -> Combine:
    comb = Combine(world.n_ranks, max_tokens=world.tokens + 3, top_k=world.top_k, hidden=world.hidden,
                   n_local_experts=world.n_local, device=dev, guard=True, timeout_ms=kw.pop("timeout_ms", 2000), **kw)
    comb.load(world)
    return comb


def verify(comb, world):
    problems = check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output, guard=comb.guard)
    assert not problems, f"{world}:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", list(WORLDS))
def test_round_bytes_counts_and_reduce(dev, name):
    world = world_case(**WORLDS[name], seed=fresh_seed(name))
    comb = make(dev, world, row_cache=(name == "masked"))
    try:
        comb.round(receive=False)                          # sends only: inspect the signals
        for r in range(world.n_ranks):
            got, want = comb.counts_view(r), world_counts_expected(world, r)
            assert np.array_equal(got, want), f"{world}: rank {r} counts {got.tolist()} != {want.tolist()}"
        t0 = time.monotonic()
        comb.round(send=False)                             # receives: wait, reduce, re-arm
        assert time.monotonic() - t0 < 2.0
        for r in range(world.n_ranks):
            assert (comb.counts_view(r) == np.uint64(0xFFFF_FFFF_FFFF_FFFF)).all(), f"rank {r}: counts not re-armed"
        verify(comb, world)
        comb.round()                                       # a second whole round on the re-armed state
        verify(comb, world)
    finally:
        comb.close()


def test_graph_replays_with_fresh_inputs(dev):
    seed = fresh_seed("graph")
    world = world_case(n_ranks=8, tokens=48, top_k=4, n_local=2, hidden=512, seed=seed)
    comb = make(dev, world)
    rng = np.random.default_rng(seed + 1)
    try:
        graph = comb.capture()
        for _ in range(20):
            for r, d in enumerate(world.ranks):
                vals = rng.standard_normal(d.c.shape).astype(np.float32)
                vals[vals == 0] = 1.0
                d.c = f32_to_bf16(vals)
                comb.refill_c(r, d.c)
            graph.launch(comb.origin)
            comb.origin.synchronize()
            comb.check()
            verify(comb, world)
        graph.close()
    finally:
        comb.close()


def test_receives_waiting_before_the_sends(dev):
    """The streaming path: every receive is already spinning (its warps' first look saw
    no pair arrived) when the sends start on other streams; the pairs are then acquired
    by the polls, and the round is byte-exact."""
    world = world_case(n_ranks=4, tokens=64, top_k=4, n_local=4, hidden=256, seed=fresh_seed("early"))
    comb = make(dev, world)
    late = [driver.Stream() for _ in range(world.n_ranks)]
    try:
        for r in range(world.n_ranks):
            comb.receivers[r].launch(comb.streams[r])
        time.sleep(0.05)
        assert not all(s.query() for s in comb.streams), "the receives finished before anything was sent"
        for r in range(world.n_ranks):
            comb.senders[r].launch(late[r])
        for s in late + comb.streams:
            s.synchronize()
        comb.check()
        verify(comb, world)
    finally:
        for s in late:
            s.close()
        comb.close()


def test_dead_rank_times_out_naming_the_pairs_then_recovers(dev):
    world = world_case(n_ranks=4, tokens=32, top_k=3, n_local=3, hidden=64, seed=fresh_seed("dead"))
    comb = make(dev, world, timeout_ms=200)
    victim = 2
    try:
        t0 = time.monotonic()
        with pytest.raises(ArrivalTimeout) as ei:
            comb.round(skip_send={victim})
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, f"the timeout took {elapsed:.1f} s"
        missing = set(ei.value.missing)
        want = {(r, e, victim) for r in range(4) for e in range(3)}
        assert missing == want, f"missing {sorted(missing)}, want {sorted(want)}"
        assert f"rank(s) [{victim}]" in str(ei.value)
        comb.round()                                       # the same context, the next round succeeds
        verify(comb, world)
    finally:
        comb.close()
