"""Verified world rounds. For real ranks (one process per rank): every process builds the
same seeded world, runs rounds and graph replays, and checks its own rank against the
oracle (the tests and ``p3send demo --procs``). On one GPU: a guarded ``Combine`` loaded
with a world, its rounds checked, timed or traced (``p3send demo`` and ``p3send trace``).
Without a GPU: the oracle's own round (``p3send demo`` on a CPU)."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..abi.errors import ConfigError
from ..abi.layout import NOT_ARRIVED, SENTINEL
from ..cuda import driver
from ..ops.combine import Combine
from ..ops.rank import Rank
from . import reference
from .cases import check_world, world_case, world_counts_expected, world_recv_expected
from .reference import f32_to_bf16


def verify_rank(me: Rank, world) -> list[str]:
    """``me``'s receive buffer (whole, guards included) and output against the oracle."""
    return check_world(world, lambda r: me.recv_view(with_guard=True), lambda r: me.output(),
                       guard=me.guard, ranks=[me.rank])


# ---------------------------------------------------------------- a verified world round

def reseed_c(world, key) -> None:
    """New random finite bf16 C values for every rank from ``key`` (same routing): every
    process derives the same values, so each can build the oracle of its own rank."""
    for o, d in enumerate(world.ranks):
        vals = np.random.default_rng([*np.atleast_1d(key).tolist(), o]).standard_normal(d.c.shape, dtype=np.float32)
        vals[vals == 0] = 1.0
        d.c = f32_to_bf16(vals)


@dataclass(frozen=True)
class RoundJob:
    """What every process of a verified world does (picklable: shapes and a seed).
    rounds: eager rounds, the first run step by step with its counts checked between
    send and receive; replays: graph replays after them; fresh_c: new C values before
    every round but the first and every one verified (else only the first and last)."""
    tokens: int = 40
    top_k: int = 4
    n_local: int = 3
    hidden: int = 256
    seed: int = 0
    rounds: int = 3
    replays: int = 3
    fresh_c: bool = True
    timeout_ms: float = 2000.0
    sync_timeout_s: float = 60.0
    sync_sends: bool | None = None

    def world(self, n_ranks: int):
        """The seed's world: every process builds the same one."""
        return world_case(n_ranks=n_ranks, tokens=self.tokens, top_k=self.top_k, n_local=self.n_local,
                          hidden=self.hidden, seed=self.seed)

    def rank(self, rank: int, exchange) -> Rank:
        """This job's Rank (guarded receive buffer) for ``rank`` of the exchange's world."""
        return Rank(rank, exchange.n_ranks, exchange, max_tokens=self.tokens, top_k=self.top_k, hidden=self.hidden,
                    n_local_experts=self.n_local, guard=True, timeout_ms=self.timeout_ms,
                    sync_timeout_s=self.sync_timeout_s, sync_sends=self.sync_sends)


def run_round_job(rank: int, exchange, job: RoundJob) -> dict:
    """Child entry: build the seed's world, run ``job`` as ``rank``, verify this rank
    after rounds; return problems and times (us)."""
    world = job.world(exchange.n_ranks)
    problems, times = [], {"send_us": [], "recv_us": [], "round_us": []}
    with job.rank(rank, exchange) as me:
        me.load(world)
        me.send()
        me.barrier()                                    # every rank's signals are in
        got, want = me.counts_view(), world_counts_expected(world, rank)
        if not np.array_equal(got, want):
            problems.append(f"round 0: counts {got.tolist()} != expected {want.tolist()}")
        me.receive()
        me.settle()
        _verify_round(me, world, "round 0", problems)
        graphs = None
        for i in range(1, job.rounds + job.replays):
            if i == job.rounds:
                graphs = me.capture()
            if job.fresh_c:
                reseed_c(world, (job.seed, i))
                me.refill_c(world.ranks[rank].c)
            t0 = time.perf_counter()
            me.round(graphs)
            times["round_us"].append(1e6 * (time.perf_counter() - t0))
            s, r = me.times_us()
            times["send_us"].append(s)
            times["recv_us"].append(r)
            if job.fresh_c or i == job.rounds + job.replays - 1:
                label = f"round {i}" if graphs is None else f"graph replay {i - job.rounds + 1}"
                _verify_round(me, world, label, problems)
        info = {"rank": rank, "device": me.dev.ordinal, "bus_id": me.peers[rank]["bus_id"], "pid": os.getpid(),
                "sync_sends": me.sync_sends, "rounds": job.rounds + job.replays}
    return {**info, "problems": problems,
            **{k: statistics.median(v) if v else None for k, v in times.items()}}


def _verify_round(me: Rank, world, label: str, problems: list) -> None:
    problems += [f"{label}: {p}" for p in verify_rank(me, world)]
    if not (me.counts_view() == NOT_ARRIVED).all():
        problems.append(f"{label}: rank {me.rank}'s counts were not re-armed")
    me.barrier()                                        # no peer's next send before this rank has read


# ---------------------------------------------------------------- one GPU, every rank: Combine

def world_combine(world, device=None) -> Combine:
    """A guarded one-GPU ``Combine`` sized for ``world`` (a ``cases.World``) and loaded with
    it; closed again if the upload fails.

    Args:
        world: the world whose ranks it runs, all on one GPU.
        device: a ``driver.Device`` (default: ``driver.device()``).

    Returns:
        The Combine (the caller closes it).

    Raises:
        ConfigError: the world's shape is refused; NoDeviceError / CudaError: no GPU, or a
            driver call failed.
    """
    comb = Combine(world.n_ranks, max_tokens=world.tokens, top_k=world.top_k, hidden=world.hidden,
                   n_local_experts=world.n_local, device=device, guard=True)
    try:
        comb.load(world)
    except BaseException:
        comb.close()
        raise
    return comb


def check_combine(world, comb: Combine) -> list[str]:
    """``comb``'s last round against the oracle: every rank's whole receive buffer (guards
    included) byte for byte, its output within bf16 rounding. One line per problem."""
    return check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output, guard=comb.guard)


def replay_times_us(comb: Combine, replays: int) -> list[float]:
    """Capture one round as a graph, replay it ``replays`` times, each timed with events on
    ``comb.origin``; then ``comb.check()`` (the kernels' diagnostics).

    Returns:
        Microseconds per replay, in order.

    Raises:
        ConfigError: ``replays`` < 1; ArrivalTimeout / CudaError from the replays.
    """
    if replays < 1:
        raise ConfigError(f"replays: expected >= 1, got {replays}", "timed replays")
    graph = comb.capture()
    try:
        start, end = driver.Event(), driver.Event()
        times = []
        for _ in range(replays):
            start.record(comb.origin)
            graph.launch(comb.origin)
            end.record(comb.origin)
            end.synchronize()
            times.append(1000.0 * start.elapsed_ms(end))
        comb.check()
    finally:
        graph.close()
    return times


def traced_round(world, comb: Combine, warmup: int = 1) -> tuple[dict, list[str]]:
    """``warmup`` untraced rounds (lazy module loading, cold caches), then one round whose
    stamps are kept.

    Returns:
        (``comb.timeline()`` of that round, ``check_combine`` of it).
    """
    for _ in range(max(0, warmup)):
        comb.round()
    comb.round()
    return comb.timeline(), check_combine(world, comb)


def round_traffic(world) -> tuple[int, int]:
    """(rows sent, bytes read and written) of one combine round of ``world``: each row is
    read and stored once, each rank's receive slots and output are read or written once."""
    rows = sum(len(d.c) for d in world.ranks)
    msg = world.msg_bytes
    return rows, 2 * rows * msg + world.n_ranks * world.tokens * (world.top_k + 1) * msg


def copy_tbps(nbytes: int = 1 << 30, device=None) -> float:
    """The device's copy bandwidth, read + write counted, in TB/s: the median of ten timed
    ``cuMemcpyDtoDAsync`` of ``nbytes`` after two warm-up copies.

    Raises:
        NoDeviceError / CudaError: no GPU, or a driver call failed.
    """
    if device is not None:
        driver.ensure_current(device)
    a, b, s = driver.DeviceBuffer(nbytes, fill=0x5A), driver.DeviceBuffer(nbytes), driver.Stream()
    try:
        e0, e1 = driver.Event(), driver.Event()
        t = []
        for i in range(12):
            e0.record(s)
            driver.memcpy_dtod(b.ptr, a.ptr, nbytes, s)
            e1.record(s)
            e1.synchronize()
            if i >= 2:
                t.append(e0.elapsed_ms(e1))
    finally:
        a.free()
        b.free()
        s.close()
    return 2 * nbytes / (statistics.median(t) * 1e-3) / 1e12


# ---------------------------------------------------------------- no GPU: the oracle's round

def oracle_round(world) -> tuple[dict, dict, list[str]]:
    """The round computed by the oracle alone: what each rank's receive buffer must hold
    (unowned slots at the sentinel) and its reduced bf16 output.

    Returns:
        ({rank: receive buffer, uint8 (tokens * top_k * msg_bytes,)}, {rank: output, bf16
        bits uint16 (tokens, hidden)}, ``check_world`` of them: the demo's verification
        applied to the oracle, empty when it agrees with itself).
    """
    m = world.msg_bytes
    recv, out = {}, {}
    for r, d in enumerate(world.ranks):
        recv[r] = world_recv_expected(world, r, np.full(world.tokens * world.top_k * m, SENTINEL, np.uint8))
        out[r] = f32_to_bf16(reference.reduce(recv[r], d.topk_idx, d.weights, world.n_local, world.n_ranks, m))
    return recv, out, check_world(world, recv.__getitem__, out.__getitem__)


def devices_from_env() -> list[int]:
    """The GPUs for the ranks of a multi-process round, used round-robin:
    ``$P3SEND_DEVICES`` = "all" or "0,1,..."; else [``$P3SEND_DEVICE`` or 0].

    Raises:
        ConfigError: a variable is not an ordinal list, or names a GPU the driver does not report.
    """
    n = driver.device_count()
    spec = os.environ.get("P3SEND_DEVICES", "").strip()
    if spec == "all":
        return list(range(n))
    devs = ([driver.env_ordinal("P3SEND_DEVICES", x) for x in spec.split(",") if x.strip()] if spec
            else [driver.env_ordinal("P3SEND_DEVICE")])
    bad = [d for d in devs if not 0 <= d < n]
    if bad:
        raise ConfigError(f"P3SEND_DEVICES: GPU(s) {bad} do not exist; the driver reports {n}", "P3SEND_DEVICES")
    return devs
