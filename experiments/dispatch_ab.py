"""Batch experiment (issue 29): where the decode dispatch's fixed cost goes, and the
all-ranks launch (``p3send.ops.dispatch_all.AllRanks``: one launch per kernel for every
rank) against HEAD's per-rank-stream step, eager and as captured CUDA graphs, in turns
with the floor and the ceiling (each also eager and graphed). Every variant's outputs are
checked byte for byte against the reference (all ranks: rows, scales, src_info, offsets,
range table, counts) before and after timing, and graph replays with new routing.

    python experiments/dispatch_ab.py [--cases decode_bf16,decode_fp8,prefill_fp8] [--rounds 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

T0 = time.time()  # noqa: E402 below: the clock starts before the imports

from p3send.abi.layout import SENTINEL  # noqa: E402
from p3send.bench.data import random_bytes  # noqa: E402
from p3send.bench.dispatch import Ceiling, Fanout  # noqa: E402
from p3send.bench.timing import Timer  # noqa: E402
from p3send.cuda import driver  # noqa: E402
from p3send.oracle import dispatch as dref  # noqa: E402
from p3send.oracle.cases import random_topk  # noqa: E402
from p3send.ops.dispatch import ArrayView, Dispatch  # noqa: E402
from p3send.ops.dispatch_all import SPLIT, AllRanks  # noqa: E402

R, K, L, H = 8, 8, 32, 7168


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


class Case:
    def __init__(self, dev, tokens, payload, rng, ranks_checked):
        self.dev, self.tokens, self.payload, self.rng = dev, tokens, payload, rng
        self.checked = ranks_checked
        self.d = Dispatch(R, max_tokens=tokens, top_k=K, hidden=H, n_local_experts=L, payload=payload, device=dev,
                          inputs=False, per_rank=True)          # HEAD's step: every rank on its own stream
        sh = self.sh = self.d.shape
        self.xs = random_bytes(R * tokens * sh.x_bytes, rng)
        self.ss = random_bytes(R * tokens * sh.s_bytes, rng) if sh.s_bytes else None
        self.tk = driver.DeviceBuffer(R * tokens * K * 4)
        self.xh = self.xs.download(np.uint8).reshape(R, tokens, sh.x_bytes)
        self.sh_h = self.ss.download(np.uint8).reshape(R, tokens, sh.s_bytes) if self.ss else None
        self.new_routing()
        x_dt = np.uint16 if payload == "bf16" else np.uint8
        for r in range(R):
            self.d.bind(r, x=ArrayView(self.xs.ptr + r * tokens * sh.x_bytes, (tokens, H), x_dt),
                        topk_idx=ArrayView(self.tk.ptr + r * tokens * K * 4, (tokens, K), np.int32),
                        scales=ArrayView(self.ss.ptr + r * tokens * sh.s_bytes, (tokens, sh.s_bytes // 4),
                                         np.float32) if self.ss else None)
        self.aa = AllRanks(self.d, "param")
        self.at = AllRanks(self.d, "table")

    def new_routing(self):
        self.topk = random_topk(self.rng, R, self.tokens, K, L)
        self.tk.upload(np.stack(self.topk).astype(np.int32))
        self.plan = dref.plan(self.topk, L)

    def floor_and_ceiling(self):
        sh, d, plan, tokens = self.sh, self.d, self.plan, self.tokens
        dst_x = np.zeros((R * tokens, K), np.uint64)
        dst_s = np.zeros((R * tokens, K), np.uint64)
        bx = np.array([d.ranks[p].ptr("recv_x") for p in range(R)], np.uint64)
        bs = np.array([d.ranks[p].ptr("recv_scales") for p in range(R)], np.uint64) if sh.s_bytes else None
        for s in range(R):
            dr, row = plan.src[s].dst_rank, plan.src[s].dst_row
            ok = dr >= 0
            dst_x[s * tokens:(s + 1) * tokens][ok] = bx[dr[ok]] + row[ok].astype(np.uint64) * np.uint64(sh.x_bytes)
            if sh.s_bytes:
                dst_s[s * tokens:(s + 1) * tokens][ok] = bs[dr[ok]] + row[ok].astype(np.uint64) * np.uint64(sh.s_bytes)
        floor = [Fanout(self.dev, self.xs.ptr, dst_x, sh.x_bytes // 16)] + \
            ([Fanout(self.dev, self.ss.ptr, dst_s, sh.s_bytes // 16)] if self.ss else [])
        counts = np.zeros((R, R * L), np.uint32)
        for r in range(R):
            g = self.topk[r][self.topk[r] >= 0]
            counts[r] = np.bincount(g, minlength=R * L)[: R * L]
        return floor, Ceiling(self.dev, counts, floor)

    def reset_outputs(self):
        for rd in self.d.ranks:
            rd.recv_x_alloc.fill(SENTINEL)
            if rd.recv_scales_alloc is not None:
                rd.recv_scales_alloc.fill(SENTINEL)
            rd.src_info_alloc.fill(SENTINEL)
            for b in (rd.expert_offsets, rd.range_table, rd.expert_counts):
                b.fill(0xAB)
        self.dev.synchronize()

    def problems(self, what):
        """Every checked rank's outputs against the reference after a step on reset outputs."""
        out, plan, sh = [], self.plan, self.sh
        self.d.check()
        for r in self.checked:
            rd, dest = self.d.ranks[r], plan.dest[r]
            n = int(dest.expert_offsets[-1])
            m = min(n + 64, sh.capacity)            # the rows written and 64 beyond them (never written)
            for arr, width, payload in (("recv_x", sh.x_bytes, self.xh), ("recv_scales", sh.s_bytes, self.sh_h)):
                if not width:
                    continue
                got = getattr(rd, arr + "_alloc").download(np.uint8, nbytes=m * width).reshape(m, width)
                want = dref.expected_rows(plan, r, list(payload), np.full_like(got, SENTINEL), zero_padding=False)
                if not np.array_equal(got, want):
                    out.append(f"{what}: rank {r} {arr} differs (rows {n})")
            got = rd.src_info_alloc.download(np.int32, nbytes=m * 8).reshape(m, 2)
            want = dref.expected_src_info(plan, r, np.full((m, 8), SENTINEL, np.uint8).view(np.int32),
                                          zero_padding=False)
            if not np.array_equal(got, want):
                out.append(f"{what}: rank {r} src_info differs")
            for name, w in (("expert_offsets", dest.expert_offsets), ("range_table", dest.range_table),
                            ("expert_counts", dest.expert_counts)):
                if not np.array_equal(getattr(rd, name).download(np.int32), np.asarray(w, np.int32)):
                    out.append(f"{what}: rank {r} {name} differs")
            tko = rd.topk_out.download(np.int32)[: self.tokens * K].reshape(self.tokens, K)
            if not np.array_equal(tko, plan.src[r].topk_idx):
                out.append(f"{what}: rank {r} topk_out differs")
        return out

    def close(self):
        self.aa.close()
        self.at.close()
        self.d.close()
        for b in (self.xs, self.ss, self.tk):
            if b is not None:
                b.free()


def capture(stream, fn, others=()):
    with driver.Graph.capture(stream, others) as cap:
        fn(stream)
    return cap.graph


def allranks_breakdown(c: Case, s, steps=12):
    """Events between the all-ranks launches on one held stream: medians over steps."""
    aa = c.aa
    ev = [[driver.Event() for _ in range(5)] for _ in range(steps)]
    t = Timer(s, device=c.dev)
    t.HOLD_NS_PER_ITER = 200_000
    t.hold_stream(steps * 4)
    for i in range(steps):
        e = ev[i]
        e[0].record(s)
        for j, part in enumerate(("tally", "count", "send", "wait")):
            aa.launch(s, parts=(part,))
            e[j + 1].record(s)
    s.synchronize()
    c.d.check()
    names = ("tally", "count", "send", "wait")
    return {n: 1000 * statistics.median(ev[i][j].elapsed_ms(ev[i][j + 1]) for i in range(steps))
            for j, n in enumerate(names)}


def run_case(dev, name, tokens, payload, rounds, rng, checked):
    say(f"== {name}: {tokens} tokens/rank, {payload}")
    c = Case(dev, tokens, payload, rng, checked)
    s = driver.Stream()
    cs = driver.Stream()
    d, aa = c.d, c.aa
    say(f"built; send grid {d.ranks[0].send_grid}, tally {d.ranks[0].tally} grid {d.ranks[0].tally_grid}, "
        f"count threads {d.ranks[0].count_threads}")
    bad = []
    c.reset_outputs()
    d.enqueue(stream=s)
    s.synchronize()
    bad += c.problems("HEAD eager")
    c.reset_outputs()
    aa.launch(s)
    s.synchronize()
    bad += c.problems("all-ranks eager")
    c.reset_outputs()
    c.at.launch(s)
    s.synchronize()
    bad += c.problems("all-ranks (table) eager")
    c.reset_outputs()
    aa.launch(s, parts=SPLIT)
    s.synchronize()
    bad += c.problems("all-ranks split eager")
    floor, ceiling = c.floor_and_ceiling()
    g_head = d.capture()
    g_all = capture(cs, aa.launch)
    g_tab = capture(cs, c.at.launch)
    g_floor = capture(cs, lambda st: [f.launch(st) for f in floor])
    g_ceil = capture(cs, ceiling.launch)
    fns = {"HEAD dispatch": lambda i: d.enqueue(stream=s),
           "all-ranks dispatch": lambda i: aa.launch(s),
           "all-ranks (table)": lambda i: c.at.launch(s),
           "all-ranks (table) graph": lambda i: g_tab.launch(s),
           "all-ranks count only": lambda i: aa.launch(s, parts=("tally", "count")),
           "all-ranks count+send": lambda i: aa.launch(s, parts=("tally", "count", "send")),
           "all-ranks split": lambda i: aa.launch(s, parts=SPLIT),
           "floor": lambda i: [f.launch(s) for f in floor],
           "ceiling": lambda i: ceiling.launch(s),
           "HEAD dispatch graph": lambda i: g_head.launch(s),
           "all-ranks graph": lambda i: g_all.launch(s),
           "floor graph": lambda i: g_floor.launch(s),
           "ceiling graph": lambda i: g_ceil.launch(s)}
    timer = Timer(s, hold=True, device=dev)
    timer.HOLD_NS_PER_ITER = 1_000_000
    res = timer.interleaved(fns, rounds=rounds, per_round=4, warmup=3)
    s.synchronize()
    d.check()
    say(f"timed {rounds} rounds x 4; ceiling timeouts {ceiling.errors()}")
    med = {k: v["median_us"] for k, v in res.items()}
    for k, v in res.items():
        say(f"  {k:<24} median {v['median_us']:8.1f} us  (min {min_of(v):8.1f})")
    for mode, sfx in (("eager", ""), ("graph", " graph")):
        hd = med["HEAD dispatch" + sfx]
        al = med[("all-ranks dispatch" if not sfx else "all-ranks graph")]
        say(f"  {mode}: HEAD/ceiling {hd / med['ceiling' + sfx]:.3f}  all-ranks/ceiling {al / med['ceiling' + sfx]:.3f}"
            f"  HEAD/floor {hd / med['floor' + sfx]:.3f}  all-ranks/floor {al / med['floor' + sfx]:.3f}")
    from p3send.bench.dispatch import breakdown
    say("  HEAD breakdown (the bench's; us):", {k: round(v, 1) for k, v in breakdown(d, s).items()})
    say("  all-ranks breakdown (us, medians of 12):",
        {k: round(v, 1) for k, v in allranks_breakdown(c, s).items()})
    # graphs replayed with new routing: each on reset outputs, checked
    for i in range(2 if tokens < 1000 else 1):
        for gname, g in (("HEAD graph", g_head), ("all-ranks graph", g_all), ("all-ranks (table) graph", g_tab)):
            c.new_routing()
            c.reset_outputs()
            g.launch(s)
            s.synchronize()
            bad += c.problems(f"{gname} replay {i} (new routing)")
    # eager after the graphs (epochs continue)
    c.new_routing()
    c.reset_outputs()
    aa.launch(s)
    s.synchronize()
    bad += c.problems("all-ranks eager after replays")
    say(f"  exact: {not bad} {bad[:6]}")
    for g in (g_head, g_all, g_tab, g_floor, g_ceil):
        g.close()
    ceiling.close()
    for f in floor:
        f.close()
    c.close()
    return med, not bad


def min_of(v):
    return v.get("min_us", v.get("min", float("nan")))


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="decode_bf16,decode_fp8,prefill_fp8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=80.0, help="skip further cases past this many seconds")
    a = ap.parse_args(argv)
    dev = driver.device()
    say(f"device {dev.name}")
    rng = np.random.default_rng(29)
    shapes = {"decode_bf16": (128, "bf16", range(R)), "decode_fp8": (128, "fp8", range(R)),
              "prefill_fp8": (4096, "fp8", (0, 7)), "prefill_bf16": (4096, "bf16", (0, 7))}
    allok = True
    for name in a.cases.split(","):
        if time.time() - T0 > a.budget:
            say(f"skip {name}: past the budget")
            continue
        tokens, payload, checked = shapes[name]
        try:
            _, ok = run_case(dev, name, tokens, payload, a.rounds if tokens < 1000 else max(4, a.rounds // 2), rng,
                             checked)
            allok &= ok
        except Exception as e:         # report and go on to the next case
            import traceback
            traceback.print_exc()
            say(f"{name}: FAILED {type(e).__name__}: {e}")
            allok = False
    say(f"done, all exact: {allok}")
    return 0 if allok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
