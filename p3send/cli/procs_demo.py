"""``p3send demo --procs``: one process per rank, each verifying its own rank
(``oracle.rounds.run_round_job``); this file starts them and prints what each found."""
from __future__ import annotations

import time

from ..ops.procs import run_ranks
from ..oracle.rounds import RoundJob, devices_from_env, run_round_job


def demo_procs(args, seed: int) -> int:
    """0 when every rank verified, 1 otherwise (the shape was checked by ``demo``)."""
    n = args.ranks
    devices = devices_from_env()
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
