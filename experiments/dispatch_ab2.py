"""Batch-2 experiment (issue 29): variants of the shipped all-ranks dispatch step, in turns
with the per-rank-stream step, the floor and the ceiling, eager and graphed: PDL on / off,
the wait launch kept / left out, the count kernel's block (1024, 512, 256 threads: a
Dispatch each, at decode). Every variant's outputs checked byte for byte on every checked
rank (rows, scales, src_info, offsets, range table, counts, checked topk_idx) before and
after the timing, graphs replayed with new routing.

    python experiments/dispatch_ab2.py [--cases decode_bf16,decode_fp8,prefill_fp8] [--rounds 10]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

T0 = time.time()  # noqa: E402 below: the clock starts before the imports

from experiments.dispatch_ab import Case, capture, say  # noqa: E402
from p3send.bench.timing import Timer  # noqa: E402
from p3send.cuda import driver  # noqa: E402
from p3send.ops import dispatch as dmod  # noqa: E402
from p3send.ops.dispatch_all import FUSED  # noqa: E402

R, K, L, H = 8, 8, 32, 7168


HEAD_COUNT = __import__("pathlib").Path(__file__).resolve().parent / "data" / "p3_dispatch_count.fbb32ce.ptx.txt"


def head_count_launcher(d):
    """An AllRanks of ``d`` whose count kernel is fbb32ce's (before the tally sum's four loads in
    flight and the DEST pass's two-ahead prefetch), the other kernels the shipped ones."""
    from p3send.cuda import loader
    from p3send.ops.dispatch_all import AllRanks, all_ranks_ptx, kernel_all

    def load(entry, dev, mode):
        if entry != "p3_dispatch_count":
            return kernel_all(entry, dev, mode)
        text, stride, gofs = all_ranks_ptx(HEAD_COUNT.read_text(), entry, mode)
        return loader.load(text, device=dev, name="p3_dispatch_count_all.fbb32ce.ptx")[entry + "_all"], stride, gofs
    return AllRanks(d, load=load)


def launch_parts(d, parts, pdl, s):
    keep = d.all.pdl
    d.all.pdl = pdl and keep
    d.all.launch(s, parts)
    d.all.pdl = keep


def run_case(dev, name, tokens, payload, rounds, rng, checked, threads=(1024,)):
    say(f"== {name}: {tokens} tokens/rank, {payload}")
    cs = {}
    for t in threads:
        dmod.COUNT_THREADS = t
        cs[t] = Case(dev, tokens, payload, rng if t == threads[0] else np.random.default_rng(29), checked)
        if t != threads[0]:             # the same routing and tokens as the first
            cs[t].topk = cs[threads[0]].topk
            cs[t].tk.upload(np.stack(cs[t].topk).astype(np.int32))
            cs[t].plan = cs[threads[0]].plan
            cs[t].xs.upload(cs[threads[0]].xh.reshape(-1))
            cs[t].xh = cs[threads[0]].xh
            if cs[t].ss is not None:
                cs[t].ss.upload(cs[threads[0]].sh_h.reshape(-1))
                cs[t].sh_h = cs[threads[0]].sh_h
    dmod.COUNT_THREADS = 1024
    c = cs[threads[0]]
    d = c.d
    d.per_rank = False
    s, gs = driver.Stream(), driver.Stream()
    no_wait = tuple(p for p in FUSED if p != "wait")
    steps = {"shipped": lambda st: d.enqueue(stream=st),
             "no PDL": lambda st: launch_parts(d, d.all_parts(), False, st),
             "with wait": lambda st: launch_parts(d, FUSED, True, st),
             "with wait, no PDL (06:03 step)": lambda st: launch_parts(d, FUSED, False, st),
             "no wait, no PDL": lambda st: launch_parts(d, no_wait, False, st),
             "no wait, the send's signal kept": lambda st: launch_parts(d, no_wait, True, st)}
    for t in threads[1:]:
        steps[f"count {t} threads"] = lambda st, dd=cs[t].d: dd.enqueue(stream=st)
    ah = head_count_launcher(d)
    steps["count kernel of fbb32ce"] = lambda st: ah.launch(st, d.all_parts())

    def per_rank(st):
        d.per_rank = True
        d.enqueue(stream=st)
        d.per_rank = False
    steps["per-rank streams"] = per_rank
    say(f"built; pdl {d.all.pdl} ({d.all.pdl_error}); launches {d.all_parts()}; count threads "
        f"{[cs[t].d.ranks[0].count_threads for t in threads]}")
    bad = []
    for n, fn in steps.items():
        cc = cs[int(n.split()[1])] if n.endswith(" threads") else c
        cc.reset_outputs()
        fn(s)
        s.synchronize()
        bad += cc.problems(f"{n} eager")
    say(f"pdl after the first steps: {d.all.pdl} ({d.all.pdl_error})")
    floor, ceiling = c.floor_and_ceiling()
    graphs = {"shipped": d.capture(), "no PDL": capture(gs, steps["no PDL"]),
              "floor": capture(gs, lambda st: [f.launch(st) for f in floor]), "ceiling": capture(gs, ceiling.launch)}
    fns = {n: (lambda i, fn=fn: fn(s)) for n, fn in steps.items()}
    fns["floor"] = lambda i: [f.launch(s) for f in floor]
    fns["ceiling"] = lambda i: ceiling.launch(s)
    for n, g in graphs.items():
        fns[f"{n} graph"] = lambda i, g=g: g.launch(s)
    timer = Timer(s, hold=True, device=dev)
    timer.HOLD_NS_PER_ITER = 1_000_000
    res = timer.interleaved(fns, rounds=rounds, per_round=4, warmup=3)
    s.synchronize()
    for cc in cs.values():
        cc.d.check()
    med = {k: v["median_us"] for k, v in res.items()}
    for k, v in res.items():
        extra = (f"  /ceiling {v['median_us'] / med['ceiling']:.3f}" if "graph" not in k else
                 f"  /ceiling graph {v['median_us'] / med['ceiling graph']:.3f}")
        say(f"  {k:<32} median {v['median_us']:8.1f} us  (min {v['min_us']:8.1f}){extra}")
    say(f"  ceiling timeouts {ceiling.errors()}")
    if tokens < 1000:
        try:
            count_phases(dev, c, s)
        except Exception as e:       # a diagnostic: reported, the case goes on
            say(f"  count phases FAILED: {type(e).__name__}: {e}")
    for i in range(2 if tokens < 1000 else 1):
        for gname in ("shipped", "no PDL"):
            c.new_routing()
            c.reset_outputs()
            graphs[gname].launch(s)
            s.synchronize()
            bad += c.problems(f"{gname} graph replay {i} (new routing)")
    c.new_routing()
    c.reset_outputs()
    d.enqueue(stream=s)
    s.synchronize()
    bad += c.problems("shipped eager after the replays")
    say(f"  exact: {not bad} {bad[:6]}; pdl {d.all.pdl} ({d.all.pdl_error})")
    for g in graphs.values():
        g.close()
    ceiling.close()
    for f in floor:
        f.close()
    ah.close()
    for cc in cs.values():
        cc.close()
    return not bad


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="decode_bf16,decode_fp8,prefill_fp8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=60.0, help="skip further cases past this many seconds")
    a = ap.parse_args(argv)
    dev = driver.device()
    say(f"device {dev.name}")
    rng = np.random.default_rng(29)
    shapes = {"decode_bf16": (128, "bf16", range(R), (1024, 512, 256)),
              "decode_fp8": (128, "fp8", range(R), (1024, 512, 256)),
              "prefill_fp8": (4096, "fp8", (0, 7), (1024,)), "prefill_bf16": (4096, "bf16", (0, 7), (1024,))}
    allok = True
    for name in a.cases.split(","):
        if time.time() - T0 > a.budget:
            say(f"skip {name}: past the budget")
            continue
        tokens, payload, checked, threads = shapes[name]
        try:
            allok &= run_case(dev, name, tokens, payload, a.rounds if tokens < 1000 else max(4, a.rounds // 2), rng,
                              checked, threads)
        except Exception as e:         # report and go on to the next case
            import traceback
            traceback.print_exc()
            say(f"{name}: FAILED {type(e).__name__}: {e}")
            allok = False
    say(f"done, all exact: {allok}")
    return 0 if allok else 1



# ---------------------------------------------------------------- where the count kernel's time goes

STAMPS = ("CONFIG_OK", "CHUNKS_DONE", "PUSH_DONE", "POLL_DONE", "SIZES_DONE", "STARTS_DONE", "OWN_TABLE_DONE",
          "DEST_DONE")


def stamped_count(dev):
    """The all-ranks count kernel with %globaltimer stamps by thread 0 of every CTA: at its start
    and at each label of STAMPS, into the u64[16] a pointer after the rank's row points at."""
    import re

    from p3send.cuda import loader
    from p3send.ops.dispatch_all import _derived
    text, stride, gofs = _derived("p3_dispatch_count", "param")
    new = stride + 8
    text = text.replace(f"p3_ranks[{8 * stride}]", f"p3_ranks[{8 * new}]")
    text = text.replace(f"%p3all_y, {stride}, %p3all_row;", f"%p3all_y, {new}, %p3all_row;")
    pro = ("    .reg .pred %p3s0;\n    .reg .b64 %p3sp, %p3st;\n    .reg .b32 %p3sx;\n"
           "    mov.u32 %p3sx, %tid.x;\n    setp.eq.u32 %p3s0, %p3sx, 0;\n"
           f"    ld.param.u64 %p3sp, [%p3all_row+{stride}];\n"
           "    mov.u64 %p3st, %globaltimer;\n    @%p3s0 st.global.u64 [%p3sp], %p3st;\n")
    text = text.replace("    griddepcontrol.wait;", "    griddepcontrol.wait;\n" + pro, 1)
    for i, lab in enumerate(STAMPS, 1):
        text, n = re.subn(rf"^{lab}:\n", f"{lab}:\n    mov.u64 %p3st, %globaltimer;\n"
                                          f"    @%p3s0 st.global.u64 [%p3sp+{8 * i}], %p3st;\n", text, flags=re.M)
        assert n == 1, lab
    k = loader.load(text, device=dev, name="p3_dispatch_count_all.stamped.ptx")["p3_dispatch_count_all"]
    return k, stride, new


def count_phases(dev, c, s, steps=12):
    from p3send.ops.dispatch_all import allow_smem
    d = c.d
    d.per_rank = False
    d.enqueue(stream=s)                  # rows up to date
    s.synchronize()
    d.check()
    k, stride, new = stamped_count(dev)
    rd = d.ranks[0]
    allow_smem(k.func, rd.count_smem)
    raw = bytes(d.all.blk["count"].get("p3_ranks"))
    buf = driver.DeviceBuffer(8 * 16 * R, fill=0)
    rows = b"".join(raw[r * stride:(r + 1) * stride] + (buf.ptr + 128 * r).to_bytes(8, "little") for r in range(R))
    blk = k.params_block(p3_ranks=rows + bytes(8 * new - len(rows)))
    per = []
    for _ in range(steps):
        blk.launch((1, R), (rd.count_threads,), s, rd.count_smem)
        d.all.launch(s, ("send",))
        s.synchronize()
        per.append(buf.download(np.uint64).reshape(R, 16)[:, :len(STAMPS) + 1].astype(np.int64))
    d.check()
    buf.free()
    a = np.stack(per)                                     # (steps, R, 1 + stamps)
    t0 = a[:, :, 0].min(axis=1, keepdims=True)
    rel = (a - t0[:, :, None]) / 1000.0                   # us from the first CTA's start
    names = ("start",) + STAMPS
    say("  count kernel, thread 0 of each rank's CTA, us from the first CTA's start (median over steps; "
        "min / median / max over ranks):")
    med = np.median(rel, axis=0)                          # (R, stamps)
    for j, n in enumerate(names):
        say(f"    {n:<16} {med[:, j].min():7.2f} {np.median(med[:, j]):7.2f} {med[:, j].max():7.2f}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
