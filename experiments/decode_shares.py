"""Maintainer experiment, not maintained (experiments/README.md): the one-GPU decode round
(8 ranks x 128 tokens, top-8, 32 local experts, hidden 7168; `Combine` as the bench's section
`wire` builds it) on both wires, by send SMs per rank (`num_sms`; None: the default, 2 x SMs /
ranks). Every round checked first (bf16 against the oracle, FP8 byte for byte against
`oracle.wire` through the bench's `fp8_round_problems`), then the round and its sends alone
timed as graph replays, all contenders in turns (medians).

    PYTHONPATH=. python3 experiments/decode_shares.py
    PYTHONPATH=. python3 experiments/decode_shares.py --profile fp8     # for a profiler: see below

``--profile WIRE`` (bf16 or fp8) only builds the default share of that wire, runs three rounds,
checks them and exits, for Nsight Compute (docs/PERF.md, "The FP8 wire", Session 10): the
third round's first sender is launch 16 of its kernel.
"""
from __future__ import annotations

import argparse

import numpy as np

from p3send.cuda import driver
from p3send.ops.combine import Combine
from p3send.oracle.cases import world_case, check_world
from p3send.bench.wire import fp8_round_problems
from p3send.bench.timing import Timer

ap = argparse.ArgumentParser(description="the one-GPU decode round by send SMs per rank")
ap.add_argument("--profile", choices=("bf16", "fp8"),
                help="three checked rounds of this wire's default share, no timing")
profile = ap.parse_args().profile
dev = driver.Device(0)
seed = int(np.random.default_rng().integers(1 << 31))
print("seed", seed)
world = world_case(n_ranks=8, tokens=128, top_k=8, n_local=32, hidden=7168, seed=seed)
shares = [None] if profile else [None, 8, 12, 16, 24, 33, 48, 66, 132]
combs, graphs, fns = {}, [], {}
s = driver.Stream()
for w in (profile,) if profile else ("bf16", "fp8"):
    for share in shares:
        c = Combine(8, max_tokens=128, top_k=8, hidden=7168, n_local_experts=32, device=dev, stamps=False,
                    guard=True, wire=w, num_sms=share)
        c.load(world)
        for _ in range(3 if profile else 1):
            c.round()
        p = fp8_round_problems(world, c) if w == "fp8" else check_world(
            world, lambda r, c=c: c.recv_view(r, with_guard=True), c.output, guard=c.guard, recv_bytes=c.recv_bytes)
        name = f"{w} send SMs {c.senders[0].grid}"
        if name in combs:                  # the default share is one of the listed ones: measured once
            c.close()
            continue
        print(name, "check:", p or "exact", flush=True)
        if p:
            continue
        combs[name] = c
        if profile:                        # a profiler wants the rounds only
            continue
        g1, g2 = c.capture(), c.capture(receive=False)
        graphs += [g1, g2]
        fns["round, " + name] = lambda i, g=g1: g.launch(s)
        fns["sends, " + name] = lambda i, g=g2: g.launch(s)
if profile:
    for c in combs.values():
        c.close()
    raise SystemExit(0 if combs else 1)
t = Timer(s, hold=True).interleaved(fns, rounds=20, per_round=4, warmup=3)
for k, v in t.items():
    print(f"{k:40s} {v['median_us']:8.1f} us")
for g in graphs:
    g.close()
for c in combs.values():
    c.close()
