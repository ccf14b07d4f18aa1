"""Maintainer experiment, not maintained (experiments/README.md): p3_scatter_send_fp8 in launch
shapes its launcher does not use (warps a CTA, shared memory a warp: the kernel takes the
widest tile that fits the warp's share), and another version of its PTX, in the one-GPU
decode round on the FP8 wire (8 ranks x 128 tokens, top-8, 32 local experts, hidden 7168;
`Combine` as the bench's section `wire` builds it). Every round checked byte for byte first
(`fp8_round_problems`), then the rounds and their sends alone timed as graph replays, all
contenders in turns (medians).

    PYTHONPATH=. python3 experiments/fp8_send_shapes.py
    PYTHONPATH=. python3 experiments/fp8_send_shapes.py --ptx old=OLD.ptx:384:199680   # another version, its launch
    PYTHONPATH=. python3 experiments/fp8_send_shapes.py --send-rows new=ROWS.ptx   # another p3_send_rows.ptx

A shape of more than 12 warps needs the entry's `.maxntid` raised: the script does that in
the text it loads (whole-program only; p3send ships 12 warps, see ScatterSend.FP8_THREADS).
"""
from __future__ import annotations

import argparse
import re

import numpy as np

from p3send.bench.timing import Timer
from p3send.bench.wire import fp8_round_problems
from p3send.cuda import driver, loader, ptxdoc
from p3send.ops.combine import Combine
from p3send.oracle.cases import world_case

SHIPPED = loader.ptx_dir() / "p3_scatter_send_fp8.ptx"


def module_kernel(text: str, dev, name: str, send_rows: str | None = None):
    siblings = [(p.name, send_rows if send_rows and p.name == "p3_send_rows.ptx" else p.read_text())
                for p in sorted(loader.ptx_dir().glob("*.ptx")) if p != SHIPPED]
    return loader.load(ptxdoc.module_text(text, siblings), device=dev, name=name)["p3_scatter_send_fp8"]


def shapes(extra: list[str], rows: list[str], all_shapes: bool) -> dict:
    """NAME -> (PTX text, threads, dynamic shared memory, p3_send_rows text or None)."""
    base = SHIPPED.read_text()
    v = {}
    for warps, per_warp, what in ((12, 16640, "4 x 1792"), (12, 8448, "4 x 1024"), (12, 4352, "4 x 512"),
                                  (15, 14592, "4 x 1792"), (16, 8448, "4 x 1024"), (8, 16640, "4 x 1792")):
        if warps == 12 and per_warp == 16640 or all_shapes:
            text = base if warps <= 12 else re.sub(r"^\.maxntid \d+, 1, 1", f".maxntid {32 * warps}, 1, 1",
                                                   base, flags=re.M)
            v[f"one stage {what}, {warps} warps"] = (text, 32 * warps, warps * per_warp, None)
    for spec in extra:                     # NAME=FILE:THREADS:SMEM
        name, rest = spec.split("=", 1)
        path, thr, smem = rest.rsplit(":", 2)
        v[name] = (open(path).read(), int(thr), int(smem), None)
    for spec in rows:                      # NAME=FILE: the shipped kernel and launch, another p3_send_rows
        name, path = spec.split("=", 1)
        v[name] = (base, 384, 12 * 16640, open(path).read())
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description="p3_scatter_send_fp8's launch shapes in the decode round")
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE:THREADS:SMEM",
                    help="another p3_scatter_send_fp8.ptx and its launch")
    ap.add_argument("--send-rows", action="append", default=[], metavar="NAME=FILE",
                    help="the shipped kernel and launch with another p3_send_rows.ptx")
    ap.add_argument("--all-shapes", action="store_true", help="every launch shape, not only p3send's")
    a = ap.parse_args()
    dev = driver.Device(0)
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    world = world_case(n_ranks=8, tokens=128, top_k=8, n_local=32, hidden=7168, seed=seed)
    s = driver.Stream()
    combs, graphs, fns = [], [], {}
    todo = shapes(a.ptx, a.send_rows, a.all_shapes)
    kernels = {name: module_kernel(text, dev, name, rows) for name, (text, _, _, rows) in todo.items()}
    for k in {id(k): k for k in kernels.values()}.values():     # one module per text: its largest launch
        driver.set_max_dynamic_smem(k.func, max(todo[n][2] for n in todo if kernels[n] is k))
    for name, (_, threads, smem, _) in todo.items():
        k = kernels[name]
        c = Combine(8, max_tokens=128, top_k=8, hidden=7168, n_local_experts=32, device=dev, stamps=False,
                    guard=True, wire="fp8")
        for snd in c.senders:              # before load(): its prepare fills these blocks
            snd.k_fp8, snd.block_fp8 = k, k.params_block()
            snd.FP8_THREADS, snd.FP8_SMEM = threads, smem
        c.load(world)
        c.round()
        p = fp8_round_problems(world, c)
        print(f"{name:40s} {threads} threads, {smem} B: check:", p or "exact", flush=True)
        combs.append(c)
        if p:
            continue
        g1, g2 = c.capture(), c.capture(receive=False)
        graphs += [g1, g2]
        fns["round, " + name] = lambda i, g=g1: g.launch(s)
        fns["sends, " + name] = lambda i, g=g2: g.launch(s)
    t = Timer(s, hold=True).interleaved(fns, rounds=20, per_round=4, warmup=3)
    for k_, v in t.items():
        print(f"{k_:52s} {v['median_us']:8.1f} us")
    for c in combs:                        # the checks again, after the timing (one more round:
        c.round()                          # the last replay may have been a sends-only graph)
        print("after timing:", fp8_round_problems(world, c) or "exact")
    for g in graphs:
        g.close()
    for c in combs:
        c.close()


if __name__ == "__main__":
    main()
