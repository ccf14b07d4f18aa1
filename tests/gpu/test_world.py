"""Real ranks on ONE GPU: one process per rank, the peers' receive buffers and counts
mapped with legacy CUDA IPC. Whole receive buffers byte for byte (guards pre-filled
0xAB), exact counts, reduce within bf16 rounding, rounds and graph replays with fresh C;
a rank that never sends or that dies: the others' waits time out naming it and its
pairs, every process exits, and a fresh world on the same GPU works afterwards.
Every test runs its processes under a wall-clock bound (run_ranks terminates them)."""
from __future__ import annotations

import os
import time

import pytest

from p3send import ArrivalTimeout
from p3send.ops.procs import run_ranks
from p3send.oracle.rounds import RoundJob, run_round_job, verify_rank
from tests.gpu.conftest import OK, WHY, fresh_seed

pytestmark = pytest.mark.skipif(not OK, reason=f"no usable GPU: {WHY}")

SHAPES = {
    "2_ranks": (2, dict(tokens=48, top_k=4, n_local=3, hidden=264)),
    "4_ranks": (4, dict(tokens=40, top_k=3, n_local=2, hidden=128)),
    "4_ranks_dsv3_rows": (4, dict(tokens=16, top_k=8, n_local=2, hidden=7168)),
}


def assert_verified(outcomes, what: str) -> None:
    for o in outcomes:
        assert o.ok, f"{what}: rank {o.rank}: {o.error}"
        assert not o.value["problems"], f"{what}: rank {o.rank}:\n" + "\n".join(o.value["problems"])


def report(outcomes) -> None:
    for o in outcomes:
        v = o.value
        print(f"  rank {o.rank} GPU {v['device']} pid {v['pid']}: send {v['send_us']:.1f} us, receive "
              f"{v['recv_us']:.1f} us, round {v['round_us']:.1f} us incl. host syncs")


# ---------------------------------------------------------------- child entry points (module level: spawn pickles them)

def never_sends_job(rank, ex, spec):
    job, victim = spec
    world = job.world(ex.n_ranks)
    res = {}
    with job.rank(rank, ex) as me:
        me.load(world)
        t0 = time.monotonic()
        try:
            me.round(skip_send=(rank == victim))
            res["missing"] = None
        except ArrivalTimeout as e:
            res.update(missing=sorted(e.missing), message=str(e))
        res["waited"] = time.monotonic() - t0
        me.round()                                   # the same world, every rank sending again
        res["problems"] = verify_rank(me, world)
        me.barrier()
    return res


def exits_early_job(rank, ex, spec):
    job, victim = spec
    world = job.world(ex.n_ranks)
    with job.rank(rank, ex) as me:
        me.load(world)
        if rank == victim:
            os._exit(17)                             # dies holding its buffers: no teardown, no goodbye
        t0 = time.monotonic()
        try:
            me.round()
            return {"missing": None}
        except ArrivalTimeout as e:
            return {"missing": sorted(e.missing), "message": str(e), "cause": str(e.__cause__),
                    "cause_ranks": getattr(e.__cause__, "ranks", None), "waited": time.monotonic() - t0,
                    "broken": me.broken}


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("name", list(SHAPES))
def test_rounds_and_graph_replays_one_process_per_rank(name):
    n, shape = SHAPES[name]
    job = RoundJob(**shape, seed=fresh_seed(name), rounds=3, replays=5, fresh_c=True)
    t0 = time.monotonic()
    out = run_ranks(run_round_job, n, job, timeout_s=300)
    assert_verified(out, f"{name} (seed {job.seed})")
    assert time.monotonic() - t0 < 300
    assert len({o.value["pid"] for o in out}) == n
    assert all(o.value["sync_sends"] for o in out), "ranks sharing one GPU must barrier between send and receive"
    report(out)


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_that_never_sends_is_named_then_the_world_goes_on(n):
    victim, n_local = n - 1, 3
    job = RoundJob(tokens=24, top_k=2, n_local=n_local, hidden=64, seed=fresh_seed("never_sends"), timeout_ms=300)
    t0 = time.monotonic()
    out = run_ranks(never_sends_job, n, (job, victim), timeout_s=180)
    assert time.monotonic() - t0 < 180
    for o in out:
        assert o.ok, f"rank {o.rank}: {o.error}"
        v = o.value
        # every pair from the victim is missing, at the victim too (its own pairs)
        assert v["missing"] == [(o.rank, e, victim) for e in range(n_local)], v
        assert f"rank(s) [{victim}]" in v["message"], v["message"]
        assert v["waited"] < 10, f"rank {o.rank} waited {v['waited']:.1f} s"
        assert not v["problems"], f"rank {o.rank} after recovery:\n" + "\n".join(v["problems"])


def test_a_rank_that_dies_is_named_every_process_exits_and_a_fresh_world_works():
    n, victim, n_local = 3, 1, 2
    job = RoundJob(tokens=24, top_k=2, n_local=n_local, hidden=64, seed=fresh_seed("dies"), timeout_ms=300,
                   sync_timeout_s=3.0)
    t0 = time.monotonic()
    out = run_ranks(exits_early_job, n, (job, victim), timeout_s=120)
    elapsed = time.monotonic() - t0
    assert elapsed < 120, f"took {elapsed:.1f} s"
    assert out[victim].exitcode == 17, out[victim]
    for o in out:
        if o.rank == victim:
            continue
        assert o.ok, f"rank {o.rank}: {o.error}"
        v = o.value
        assert v["missing"] == [(o.rank, e, victim) for e in range(n_local)], v
        assert f"rank(s) [{victim}]" in v["message"], v["message"]
        assert v["cause_ranks"] == [victim], v            # the broken barrier names it too
        assert v["broken"], "the world is out of step after a dead rank"
        assert v["waited"] < 30, v
    # the GPU and the driver are fine: a new world of processes on the same GPU
    fresh = RoundJob(tokens=24, top_k=2, n_local=n_local, hidden=64, seed=fresh_seed("after"), rounds=2, replays=2)
    assert_verified(run_ranks(run_round_job, 2, fresh, timeout_s=180), "the world after the dead rank")
