"""Run a function as every rank of a world, one spawned process per rank, each bound to
its GPU, with a deadline: ``run_ranks`` collects what each returned or raised."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass

from .exchange import ProcessExchange

# ---------------------------------------------------------------- processes

@dataclass
class RankOutcome:
    """What one process of ``run_ranks`` did. rank: its rank; device: the GPU ordinal it
    was given ($P3SEND_DEVICE; None: the default); exitcode None: it was still running at the
    deadline (then terminated); value: what the target returned; error: what it raised,
    or why no result came."""
    rank: int
    device: int | None
    exitcode: int | None
    value: object = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def _rank_entry(target, rank, exchange, job, device, results) -> None:
    """Child process body (module level: 'spawn' pickles it by name)."""
    if device is not None:
        os.environ["P3SEND_DEVICE"] = str(device)   # driver.device() picks it; set before any CUDA call
    exchange.bind(rank)
    try:
        value, error = target(rank, exchange, job), None
    except Exception as e:   # reported to the parent, and the process exits non-zero
        value, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    results.put((rank, value, error))
    results.close()
    results.join_thread()
    if error is not None:
        sys.exit(1)


def run_ranks(target, n_ranks: int, job=None, *, devices=None, timeout_s: float = 300.0,
              sync_timeout_s: float = 60.0) -> list[RankOutcome]:
    """Run ``target(rank, exchange, job)`` in ``n_ranks`` new processes ('spawn' start
    method), rank r on GPU ``devices[r % len(devices)]`` (default: the child's
    $P3SEND_DEVICE or 0), all sharing one ``ProcessExchange`` (``sync_timeout_s``).
    ``target`` must be a module-level function and ``job`` picklable. Returns when every
    process has exited, or at ``timeout_s``, when those still running are terminated:
    it never hangs."""
    ctx = mp.get_context("spawn")
    devices = list(devices) if devices else [None]
    exchange = ProcessExchange(n_ranks, timeout_s=sync_timeout_s, ctx=ctx)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, name=f"p3send-rank{r}", daemon=True,
                         args=(target, r, exchange, job, devices[r % len(devices)], results))
             for r in range(n_ranks)]
    got, terminated = {}, set()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(got) < n_ranks and time.monotonic() < deadline:
            try:
                r, value, error = results.get(timeout=0.2)
                got[r] = (value, error)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    _drain(results, got, 0.5)   # whatever the exited ones queued is in the pipe
                    break
        for p in procs:                         # results are drained first: no child blocks on a full pipe
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for r, p in enumerate(procs):           # ours, by their Process objects
            if p.pid is not None and p.is_alive():
                terminated.add(r)
                p.terminate()
                p.join(5)
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5)
    outcomes = []
    for r, p in enumerate(procs):
        value, error = got.get(r, (None, None))
        if r not in got:
            error = f"no result: exit code {p.exitcode}" + \
                (f" (still running at the {timeout_s:g} s deadline: terminated)" if r in terminated else "")
        outcomes.append(RankOutcome(r, devices[r % len(devices)], p.exitcode, value, error))
    return outcomes


def _drain(results, got: dict, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            r, value, error = results.get(timeout=max(0.0, end - time.monotonic()))
            got[r] = (value, error)
        except queue.Empty:
            return


