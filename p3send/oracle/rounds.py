"""A verified world round for real ranks (one process per rank): every process builds the
same seeded world, runs rounds and graph replays, and checks its own rank against the
oracle. Used by the tests and ``p3send demo --procs``."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..abi.layout import NOT_ARRIVED
from ..ops.rank import Rank
from .cases import check_world, world_case, world_counts_expected
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


