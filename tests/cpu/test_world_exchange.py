"""The host exchanges of p3send.ops.exchange without a GPU: spawned processes doing allgather
and barrier, peers that exit early or hang (errors naming them, never a hang), and the
process runner's reports. Every test has a wall-clock bound."""
from __future__ import annotations

import copy
import importlib.util
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from p3send.ops.exchange import ExchangeTimeout, ProcessExchange
from p3send.ops.procs import run_ranks

ROOT = Path(__file__).resolve().parents[2]
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


# ---------------------------------------------------------------- child entry points (module level: spawn pickles them)

def gather_job(rank, ex, job):
    first = ex.allgather({"rank": rank, "pid": os.getpid()})
    ex.barrier()
    second = ex.allgather(rank * 10)
    third = ex.allgather("x" * (rank + 1))           # back to back: a fast rank may be a round ahead
    ex.barrier()
    return first, second, third


def early_exit_job(rank, ex, job):
    kind, victim, timeout = job
    if rank == victim:
        return "left"                                # exits without ever syncing
    t0 = time.monotonic()
    try:
        ex.barrier(timeout) if kind == "barrier" else ex.allgather(rank, timeout)
    except ExchangeTimeout as e:
        return {"ranks": e.ranks, "message": str(e), "waited": time.monotonic() - t0}
    return {"ranks": None, "message": "no error", "waited": time.monotonic() - t0}


def misbehaving_job(rank, ex, how):
    if rank == 1 and how == "raise":
        raise ValueError("rank 1 gave up")
    if rank == 1 and how == "crash":
        os._exit(7)
    if rank == 1 and how == "hang":
        time.sleep(1000)
    return rank


def torch_job(rank, ex, job):
    from datetime import timedelta

    import torch.distributed as dist

    from p3send.ops.exchange import TorchExchange
    store, victim, timeout = job
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ex.n_ranks,
                            timeout=timedelta(seconds=30))
    tx = TorchExchange(timeout_s=timeout)
    got = tx.allgather(("rank", rank))
    if rank == victim:
        os._exit(0)                                  # leaves the group without a word
    try:
        tx.barrier(None if victim is None else timeout)
    except ExchangeTimeout as e:
        return {"gathered": got, "error": str(e), "ranks": e.ranks}
    dist.destroy_process_group()
    return {"gathered": got, "error": None}


# ---------------------------------------------------------------- multiprocessing exchange

def test_allgather_and_barrier_between_spawned_processes():
    t0 = time.monotonic()
    out = run_ranks(gather_job, 3, timeout_s=60, sync_timeout_s=20)
    assert time.monotonic() - t0 < 60
    for o in out:
        assert o.ok, f"rank {o.rank}: {o.error}"
        first, second, third = o.value
        assert [d["rank"] for d in first] == [0, 1, 2]
        assert len({d["pid"] for d in first}) == 3, "every rank is its own process"
        assert second == [0, 10, 20]
        assert third == ["x", "xx", "xxx"]


def test_allgather_keeps_a_later_rounds_message_for_later():
    ex = ProcessExchange(2, timeout_s=5, ctx=mp.get_context("spawn"))
    me, peer = ex.bind(0), copy.copy(ex).bind(1)     # one process, the same queues
    me._inbox[0].put((1, 1, "peer-round-1"))         # arrives before the round-0 message
    me._inbox[0].put((0, 1, "peer-round-0"))
    assert me.allgather("me-0") == ["me-0", "peer-round-0"]
    assert me.allgather("me-1") == ["me-1", "peer-round-1"]
    assert peer.rank == 1 and me.rank == 0


@pytest.mark.parametrize("kind", ["barrier", "allgather"])
def test_a_rank_that_exits_early_is_named_and_nobody_hangs(kind):
    victim, timeout = 1, 1.5
    t0 = time.monotonic()
    out = run_ranks(early_exit_job, 3, (kind, victim, timeout), timeout_s=60, sync_timeout_s=20)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert out[victim].ok and out[victim].value == "left"
    for r in (0, 2):
        v = out[r].value
        assert out[r].ok, out[r].error
        assert v["ranks"] == [victim], v
        assert f"rank(s) [{victim}]" in v["message"], v["message"]
        assert 0.5 * timeout <= v["waited"] < timeout + 10, v


@pytest.mark.parametrize("how", ["raise", "crash", "hang"])
def test_run_ranks_reports_what_each_process_did(how):
    t0 = time.monotonic()
    out = run_ranks(misbehaving_job, 2, how, timeout_s=6)
    assert time.monotonic() - t0 < 30
    assert out[0].ok and out[0].value == 0
    bad = out[1]
    assert not bad.ok and bad.value is None
    if how == "raise":
        assert bad.exitcode == 1 and bad.error.startswith("ValueError: rank 1 gave up"), bad
    elif how == "crash":
        assert bad.exitcode == 7 and "no result: exit code 7" in bad.error, bad
    else:
        assert bad.exitcode is not None and bad.exitcode < 0 and "terminated" in bad.error, bad


def test_unbound_exchange_says_so():
    ex = ProcessExchange(2, ctx=mp.get_context("spawn"))
    with pytest.raises(Exception, match="bind"):
        ex.barrier(0.1)


# ---------------------------------------------------------------- torch.distributed

@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_exchange(tmp_path):
    out = run_ranks(torch_job, 2, (str(tmp_path / "store"), None, 20.0), timeout_s=120)
    for o in out:
        assert o.ok, o.error
        assert o.value["gathered"] == [("rank", 0), ("rank", 1)] and o.value["error"] is None


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_exchange_names_a_rank_that_left(tmp_path):
    t0 = time.monotonic()
    out = run_ranks(torch_job, 3, (str(tmp_path / "store"), 2, 2.0), timeout_s=120)
    assert time.monotonic() - t0 < 90
    assert out[2].exitcode == 0
    for r in (0, 1):
        assert out[r].ok, out[r].error
        assert out[r].value["error"], out[r].value
    assert out[0].value["ranks"] == [2], out[0].value     # gloo's monitored barrier tells rank 0 who


# ---------------------------------------------------------------- MPI

MPI_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from p3send.ops.exchange import ExchangeTimeout, MPIExchange
    ex = MPIExchange(timeout_s=20)
    assert ex.allgather(("r", ex.rank)) == [("r", r) for r in range(ex.n_ranks)]
    ex.barrier()
    if ex.rank == 1:
        time.sleep(3)                       # late: rank 0's short barrier must give up, not hang
    t0 = time.monotonic()
    try:
        ex.barrier(0.5)
        late = "no error"
    except ExchangeTimeout as e:
        late = "timed out" if ex.rank == 0 else "unexpected: " + str(e)
    if ex.rank == 0:
        assert late == "timed out" and time.monotonic() - t0 < 2.5, (late, time.monotonic() - t0)
    print("rank", ex.rank, "ok", late, flush=True)
""")


def _mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(not HAVE_MPI4PY, reason="mpi4py is not installed")
@pytest.mark.skipif(HAVE_MPI4PY and _mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_exchange():
    script = MPI_SCRIPT.format(root=str(ROOT))
    res = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 ok timed out" in res.stdout and "rank 1 ok" in res.stdout, res.stdout + res.stderr
