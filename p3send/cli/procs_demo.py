"""``p3send demo --procs``: one process per rank, each verifying its own rank."""
from __future__ import annotations

import os
import time

from ..abi.errors import ConfigError
from ..cuda import driver
from ..ops.procs import run_ranks
from ..oracle.rounds import RoundJob, run_round_job

# ---------------------------------------------------------------- p3send demo --procs

def demo_devices() -> list[int]:
    """GPUs for the ranks, round-robin: $P3SEND_DEVICES = "all" or "0,1,..."; else
    [$P3SEND_DEVICE or 0] (every rank on one GPU)."""
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


def demo_procs(args, seed: int) -> int:
    """``p3send demo --procs``: one process per rank, each verifying its own rank."""
    n = args.ranks
    if not (1 <= n <= 8):
        print(f"p3send demo --procs: --ranks expected 1..8, got {n}")
        return 2
    devices = demo_devices()
    job = RoundJob(tokens=args.tokens, top_k=args.top_k, n_local=args.experts, hidden=args.hidden, seed=seed,
                   rounds=1, replays=args.rounds, fresh_c=False, sync_timeout_s=180.0)
    placement = [devices[r % len(devices)] for r in range(n)]
    print(f"p3send demo --procs: {n} processes (one per rank), GPUs {placement}; {n} ranks x {args.tokens} tokens, "
          f"top-{args.top_k}, {args.experts} experts/rank, hidden {args.hidden} bf16; seed {seed}")
    t0 = time.perf_counter()
    outcomes = run_ranks(run_round_job, n, job, devices=devices, timeout_s=1200.0, sync_timeout_s=job.sync_timeout_s)
    ok = True
    for o in outcomes:
        v = o.value or {}
        if o.ok and not v.get("problems"):
            print(f"  rank {o.rank} (GPU {v['device']}, pid {v['pid']}): verified; send {v['send_us']:.1f} us, "
                  f"receive {v['recv_us']:.1f} us, round {v['round_us']:.1f} us incl. host syncs "
                  f"(medians of {job.replays} graph replays)")
            continue
        ok = False
        why = v.get("problems") or (o.error or f"exit code {o.exitcode}").strip().splitlines()[:1]
        print(f"  rank {o.rank}: NOT VERIFIED:\n    " + "\n    ".join(why[:8]))
    wall = time.perf_counter() - t0
    if not ok:
        print(f"  FAILED ({wall:.1f} s)")
        return 1
    v0 = outcomes[0].value
    print(f"  all {n} ranks verified: receive buffers byte-exact (guards and unowned slots untouched), counts "
          f"exact and re-armed, reduce within bf16 rounding, after {v0['rounds']} rounds "
          f"(mid-round barrier {'on' if v0['sync_sends'] else 'off'}); "
          f"slowest rank's round {max(o.value['round_us'] for o in outcomes):.1f} us; {wall:.1f} s in all")
    return 0
