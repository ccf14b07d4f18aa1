"""Sections ``dispatch`` and ``layer``: the dispatch of 8 ranks on this GPU (DeepSeek-V3
shapes: top-8 of 256 experts, 32 per rank) at the prefill and decode token counts, bf16
and fp8 payloads, timed in turns with

- the copy floor: one kernel reading every token's row once and storing each of its
  copies at the very row the dispatch puts it (destinations precomputed on the host from
  the reference plan; no checks, no src_info, no signal);
- the ceiling: the floor between the count exchange and the least signal of the protocol
  (``Ceiling``: one kernel in which every rank stores its (given) count of every expert into
  every rank's exchange buffer and waits for all of them, the floor, then one kernel in which
  every rank stores one flag into every rank and waits for its own; three launches on one
  stream);
- the dispatch as shipped (``Dispatch``: one launch per kernel for every rank, on one
  stream, the launches after the first with PDL), without PDL, and with every rank's
  kernels on its own stream (``per_rank``, the step before);
- each of dispatch, floor and ceiling also replayed as a captured CUDA graph (the production
  mode at decode), reported beside the eager figures;
- diagnostics: the dispatch with its single-CTA token pass (where the tally is the default),
  the dispatch at 0 tokens (its launches, exchange and signal with nothing to move), and a
  per-kernel breakdown of a step (events on the stream between the launches; for the
  per-rank streams, on every rank's stream around each kernel);
- what a torch user writes instead: a stable sort of the copies by expert, then
  ``index_select`` of the rows into the same grouped layout (and the counts by bincount),
  every rank's tokens at once.

``layer``: the MoE layer step (``p3send.moe.MoELayer``: router, dispatch, up-projection, SiLU,
down-projection with the send in its epilogue, receive and reduce) replayed as a CUDA
graph, with each part's share from an eager run's events."""
from __future__ import annotations

import statistics

import numpy as np

import ctypes

from ..abi.layout import SENTINEL
from ..cuda import driver, loader
from ..ops.dispatch import ArrayView, Dispatch
from ..ops.dispatch_all import AllRanks
from ..oracle import dispatch as dref
from ..oracle.cases import random_topk
from .baselines import Launch, cuda_function
from .data import random_bytes
from .timing import Timer

# The copy floor: thread u copies vector u mod nv of row u / nv to each of its K non-zero
# destinations dst[row*K + k] (+ 16 * vector). One vector per thread, one tile per CTA. With a
# counter (a diagnostic, not the floor), the send's per-CTA signal after the stores: bar.sync,
# thread 0 fences and counts the CTA, the last CTA fences again and re-arms the counter.
FANOUT_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry p3_bench_fanout(.param .u64 src, .param .u64 dst, .param .u32 rows, .param .u32 nv,
                                .param .u32 k, .param .u64 counter)
{
    .reg .pred  %p<3>;
    .reg .b32   %r<12>;
    .reg .b64   %rd<10>;
    mov.u32             %r1, %ctaid.x;
    mov.u32             %r2, %ntid.x;
    mov.u32             %r3, %tid.x;
    mad.lo.u32          %r4, %r1, %r2, %r3;
    ld.param.u32        %r5, [rows];
    ld.param.u32        %r6, [nv];
    mul.lo.u32          %r7, %r5, %r6;
    setp.ge.u32         %p0, %r4, %r7;
    @%p0 bra            STORED;
    div.u32             %r8, %r4, %r6;
    mul.lo.u32          %r9, %r8, %r6;
    sub.u32             %r9, %r4, %r9;
    ld.param.u64        %rd1, [src];
    mul.wide.u32        %rd2, %r4, 16;
    add.s64             %rd1, %rd1, %rd2;
    ld.global.nc.L1::no_allocate.v4.u32 {%r0, %r1, %r2, %r3}, [%rd1];
    ld.param.u32        %r10, [k];
    ld.param.u64        %rd3, [dst];
    mul.lo.u32          %r11, %r8, %r10;
    mad.wide.u32        %rd3, %r11, 8, %rd3;
    mul.wide.u32        %rd4, %r9, 16;
    mov.u32             %r5, 0;
K:
    setp.ge.u32         %p1, %r5, %r10;
    @%p1 bra            STORED;
    ld.global.nc.u64    %rd5, [%rd3];
    setp.ne.u64         %p2, %rd5, 0;
    add.s64             %rd5, %rd5, %rd4;
    @%p2 st.global.v4.u32 [%rd5], {%r0, %r1, %r2, %r3};
    add.s64             %rd3, %rd3, 8;
    add.u32             %r5, %r5, 1;
    bra                 K;
STORED:
    ld.param.u64        %rd6, [counter];
    setp.eq.u64         %p0, %rd6, 0;
    @%p0 bra            DONE;
    bar.sync            0;
    mov.u32             %r3, %tid.x;
    setp.ne.u32         %p0, %r3, 0;
    @%p0 bra            DONE;
    fence.acq_rel.gpu;
    atom.relaxed.gpu.global.add.u64 %rd7, [%rd6], 1;
    mov.u32             %r3, %nctaid.x;
    sub.u32             %r3, %r3, 1;
    cvt.u64.u32         %rd8, %r3;
    setp.ne.u64         %p0, %rd7, %rd8;
    @%p0 bra            DONE;
    fence.acq_rel.gpu;
    mov.b64             %rd9, 0;
    st.relaxed.gpu.global.u64 [%rd6], %rd9;
DONE:
    ret;
}
"""
THREADS = 256


class Fanout:
    """The copy floor for one array of rows: src (rows, nv*16) bytes, dst u64 (rows, K)."""

    def __init__(self, dev, src: int, dst: np.ndarray, nv: int):
        self.k = loader.load(FANOUT_PTX, device=dev, name="bench fanout")["p3_bench_fanout"]
        rows, K = dst.shape
        self.dst = driver.DeviceBuffer.from_array(np.ascontiguousarray(dst, np.uint64))
        self.counter = driver.DeviceBuffer(8, fill=0)
        self.grid = max(1, -(-rows * nv // THREADS))
        self.blk = self.k.params_block(src=src, dst=self.dst, rows=rows, nv=nv, k=K, counter=0)
        self.blk_signal = self.k.params_block(src=src, dst=self.dst, rows=rows, nv=nv, k=K, counter=self.counter)

    def launch(self, stream, signal: bool = False) -> None:
        (self.blk_signal if signal else self.blk).launch((self.grid,), (THREADS,), stream)

    def close(self) -> None:
        self.dst.free()
        self.counter.free()


class Ceiling:
    """The dispatch's ceiling on one stream: ``dispatch_exchange`` (kernels/baselines.cu: every
    rank's counts to every rank, waited for), the floor's launches, ``dispatch_signal`` (one
    flag per (source, destination), waited for). ``counts``: uint32 (n_ranks, n_experts),
    the step's counts (stored, not computed); waits bounded by ``timeout_ns`` (``errors``)."""

    def __init__(self, dev, counts: np.ndarray, floor: list, timeout_ns: int = 200_000_000):
        R, E = counts.shape
        self.floor = floor
        self.bufs = [driver.DeviceBuffer(8 * 2 * R * R * E, fill=0), driver.DeviceBuffer.from_array(
            np.ascontiguousarray(counts, np.uint32)), driver.DeviceBuffer(8 * R, fill=0),
            driver.DeviceBuffer(8 * R * R, fill=0), driver.DeviceBuffer(4, fill=0)]
        xbuf, cnt, epoch, flag, self.err = self.bufs
        u64, i32 = ctypes.c_uint64, ctypes.c_int32
        self.exchange = Launch(cuda_function(dev, "dispatch_exchange"), "dispatch_exchange", R, 256, 0,
                               [u64(xbuf.ptr), u64(cnt.ptr), u64(epoch.ptr), u64(self.err.ptr), i32(R), i32(E),
                                u64(timeout_ns)])
        self.signal = Launch(cuda_function(dev, "dispatch_signal"), "dispatch_signal", R, 32, 0,
                             [u64(flag.ptr), u64(epoch.ptr), u64(self.err.ptr), i32(R), u64(timeout_ns)])

    def launch(self, stream) -> None:
        self.exchange(stream)
        for f in self.floor:
            f.launch(stream)
        self.signal(stream)

    def errors(self) -> int:
        """Waits that timed out since construction (0 for a sound measurement)."""
        return int(self.err.download(np.uint32)[0])

    def close(self) -> None:
        for b in self.bufs:
            b.free()


PARTS = ("fork", "tally", "count", "send", "wait", "join")


def breakdown_all(d: Dispatch, s, steps: int = 12) -> dict:
    """Per-launch times of the all-ranks step (``Dispatch.enqueue``'s launches, one stream),
    from events between the launches, the stream held until every step is enqueued: per part
    the median over steps. fork / join are 0 (one stream), wait 0 when the step has none;
    tally: an empty event pair when not used; send: the quiet send where the step uses it."""
    hold = Timer(s, device=d.dev)
    hold.HOLD_NS_PER_ITER = 200_000
    parts = d.all_parts()                        # the shipped step's launches (no wait: 0 us)
    marks = [[driver.Event() for _ in range(len(parts) + 1)] for _ in range(steps)]
    d.enqueue(stream=s)                          # the rows of the launches up to date
    hold.hold_stream(4 * steps)
    for m in marks:
        m[0].record(s)
        for j, part in enumerate(parts):
            d.all.launch(s, (part,))
            m[j + 1].record(s)
    s.synchronize()
    d.check()
    out = {"fork": 0.0, "tally": 0.0, "count": 0.0, "send": 0.0, "wait": 0.0, "join": 0.0}
    for j, part in enumerate(parts):
        n = "send" if part.startswith("send") else "count" if part in ("push", "layout") else part
        out[n] += 1000.0 * statistics.median(m[j].elapsed_ms(m[j + 1]) for m in marks)
    for ev in [e for m in marks for e in m]:
        ev.close()
    return out


def breakdown(d: Dispatch, s, steps: int = 12) -> dict:
    """Per-kernel times of the fused step (as ``Dispatch.enqueue``), from events on every
    rank's stream around each kernel, the stream held until every step is enqueued: per part
    the median over steps of the longest rank. fork: the origin's mark to a rank stream's
    first kernel (the slowest rank); join: the last rank's end to the origin's mark; tally:
    an empty event pair (its cost, ~2.5 us on an H200) when not used. The parts of different
    ranks overlap, and a part's longest rank includes the time the GPU takes to start that
    kernel on every rank's stream: they need not add up to the step."""
    R = d.n_ranks
    marks = [[[driver.Event() for _ in range(5)] for _ in range(R)] for _ in range(steps)]
    ends = [(driver.Event(), driver.Event()) for _ in range(steps)]
    hold = Timer(s, device=d.dev)
    hold.HOLD_NS_PER_ITER = 1_000_000          # ~100 driver calls per step, enqueued before it runs
    hold.hold_stream(steps)
    for i in range(steps):
        ends[i][0].record(s)
        d.fork.record(s)
        for rd, st, m in zip(d.ranks, d.streams, marks[i]):
            st.wait(d.fork)
            m[0].record(st)
            if rd.tally:
                rd.launch_tally(st)
            m[1].record(st)
            rd.launch_count(st, tally=False)
            m[2].record(st)
        for rd, st, m in zip(d.ranks, d.streams, marks[i]):
            rd.launch_send(st)
            m[3].record(st)
            rd.launch_wait(st)
            m[4].record(st)
        for ev, st in zip(d.done, d.streams):
            s.wait(ev.record(st))
        ends[i][1].record(s)
    s.synchronize()
    d.check()
    per = {n: [] for n in PARTS}
    for i in range(steps):
        e0, e1 = ends[i]
        ms = marks[i]
        per["fork"].append(max(e0.elapsed_ms(m[0]) for m in ms))
        for j, n in enumerate(("tally", "count", "send", "wait")):
            per[n].append(max(m[j].elapsed_ms(m[j + 1]) for m in ms))
        per["join"].append(min(m[4].elapsed_ms(e1) for m in ms))
    for ev in [e for step in marks for m in step for e in m] + [e for pair in ends for e in pair]:
        ev.close()
    return {n: 1000.0 * statistics.median(v) for n, v in per.items()}


def _routing(a, rng, tokens: int) -> list:
    return random_topk(rng, a.ranks, tokens, a.top_k, a.experts)


def _bench_case(ctx, tokens: int, payload: str) -> dict:
    a, dev, rng, torch = ctx.args, ctx.dev, ctx.rng, ctx.torch
    R, K, L, H = a.ranks, a.top_k, a.experts, a.hidden
    topk = _routing(a, rng, tokens)
    plan = dref.plan(topk, L)
    d = Dispatch(R, max_tokens=tokens, top_k=K, hidden=H, n_local_experts=L, payload=payload, device=dev,
                 inputs=False)
    sh = d.shape
    keep = []
    xs = random_bytes(R * tokens * sh.x_bytes, rng, torch)                 # every rank's rows, rank-major
    ss = random_bytes(R * tokens * sh.s_bytes, rng, torch) if sh.s_bytes else None
    tk = driver.DeviceBuffer.from_array(np.stack(topk).astype(np.int32))
    keep += [xs, tk] + ([ss] if ss else [])
    x_dt = np.uint16 if payload == "bf16" else np.uint8
    for r in range(R):
        d.bind(r, x=ArrayView(xs.ptr + r * tokens * sh.x_bytes, (tokens, H), x_dt),
               topk_idx=ArrayView(tk.ptr + r * tokens * K * 4, (tokens, K), np.int32),
               scales=ArrayView(ss.ptr + r * tokens * sh.s_bytes, (tokens, sh.s_bytes // 4), np.float32)
               if ss else None)
    # the floor's destinations: where the plan puts each copy, in the dispatch's own arrays
    dst_x = np.zeros((R * tokens, K), np.uint64)
    dst_s = np.zeros((R * tokens, K), np.uint64)
    for s in range(R):
        dr, row = plan.src[s].dst_rank, plan.src[s].dst_row
        ok = dr >= 0
        bx = np.array([d.ranks[p].ptr("recv_x") for p in range(R)], np.uint64)
        blk = dst_x[s * tokens:(s + 1) * tokens]
        blk[ok] = bx[dr[ok]] + row[ok].astype(np.uint64) * np.uint64(sh.x_bytes)
        if sh.s_bytes:
            bs = np.array([d.ranks[p].ptr("recv_scales") for p in range(R)], np.uint64)
            dst_s[s * tokens:(s + 1) * tokens][ok] = bs[dr[ok]] + row[ok].astype(np.uint64) * np.uint64(sh.s_bytes)
    floor = [Fanout(dev, xs.ptr, dst_x, sh.x_bytes // 16)] + \
        ([Fanout(dev, ss.ptr, dst_s, sh.s_bytes // 16)] if ss else [])
    counts = np.zeros((R, R * L), np.uint32)
    for r in range(R):
        g = topk[r][topk[r] >= 0]
        counts[r] = np.bincount(g, minlength=R * L)[: R * L]
    ceiling = Ceiling(dev, counts, floor)
    # a diagnostic: the dispatch's own kernels at 0 tokens (launches, exchange, signal)
    d0 = Dispatch(R, max_tokens=1, top_k=K, hidden=H, n_local_experts=L, payload=payload, capacity=1, device=dev,
                  inputs=False)
    for r in range(R):
        d0.bind(r, x=ArrayView(xs.ptr, (0, H), x_dt), topk_idx=ArrayView(tk.ptr, (0, K), np.int32),
                scales=ArrayView(ss.ptr, (0, sh.s_bytes // 4), np.float32) if ss else None)
    s = ctx.stream
    tally_default = d.ranks[0].tally
    n0 = int(plan.dest[0].expert_offsets[-1])
    rows0 = [xs.download(np.uint8, offset=p * tokens * sh.x_bytes, nbytes=tokens * sh.x_bytes).reshape(
        tokens, sh.x_bytes) for p in range(R)]

    def rank0_exact() -> bool:
        """Rank 0's rows after the last step, on rows filled with the sentinel first."""
        got = d.ranks[0].recv_x_alloc.download(np.uint8, nbytes=n0 * sh.x_bytes).reshape(n0, sh.x_bytes)
        want = dref.expected_rows(plan, 0, rows0, np.full_like(got, SENTINEL), zero_padding=False)
        return bool(np.array_equal(got, want))

    def fresh_step(per_rank: bool, graph=None) -> bool:
        """One step (or the graph's replay) of the dispatch on sentinel-filled rows, checked."""
        d.ranks[0].recv_x_alloc.fill(SENTINEL)
        dev.synchronize()
        d.per_rank = per_rank
        if graph is None:
            d.enqueue(stream=s)
        else:
            graph.launch(s)
        s.synchronize()
        d.per_rank = False
        d.check()
        return rank0_exact()

    exact = fresh_step(False) and fresh_step(True)            # checked before timing: both steps
    parts = {"dispatch": breakdown_all(d, s)}
    d.per_rank = True
    parts["dispatch, per-rank streams"] = breakdown(d, s)
    d.per_rank = False
    if tally_default:                        # the single-CTA token pass, for comparison
        d.set_tally(False)
        parts["dispatch, one-CTA count"] = breakdown_all(d, s)
        d.set_tally(None)
    parts["dispatch at 0 tokens"] = breakdown_all(d0, s)
    graphs = {"dispatch": d.capture()}
    d.per_rank = True
    graphs["per-rank streams"] = d.capture()
    d.per_rank = False
    exact = exact and fresh_step(False, graphs["dispatch"]) and fresh_step(True, graphs["per-rank streams"])
    for name, fn in (("copy floor", lambda st: [f.launch(st) for f in floor]), ("ceiling", ceiling.launch)):
        with driver.Graph.capture(s) as cap:
            fn(s)
        graphs[name] = cap.graph

    one = None
    if tally_default:
        # the single-CTA token pass's launches built once: refilling every rank's blocks and the
        # launch rows at every call (set_tally twice) would put host time into the turns
        d.set_tally(False)
        one = AllRanks(d)
        d.set_tally(None)

    def one_cta(i):
        one.launch(s, d.all_parts())

    def per_rank(i):
        d.per_rank = True
        d.enqueue(stream=s)
        d.per_rank = False

    pdl = d.all.pdl

    def no_pdl(i):
        d.all.pdl = False
        d.enqueue(stream=s)
        d.all.pdl = pdl
    fns = {"dispatch": lambda i: d.enqueue(stream=s),
           "dispatch, no PDL": no_pdl,
           "dispatch graph": lambda i: graphs["dispatch"].launch(s),
           "per-rank streams": per_rank,
           "per-rank streams graph": lambda i: graphs["per-rank streams"].launch(s),
           "copy floor": lambda i: [f.launch(s) for f in floor],
           "floor graph": lambda i: graphs["copy floor"].launch(s),
           "ceiling": lambda i: ceiling.launch(s),
           "ceiling graph": lambda i: graphs["ceiling"].launch(s),
           "floor + per-CTA signal": lambda i: [f.launch(s, signal=True) for f in floor],
           "dispatch at 0 tokens": lambda i: d0.enqueue(stream=s)}
    if tally_default:
        fns["dispatch, one-CTA count"] = one_cta
    if torch is not None and payload == "bf16":
        ts = torch.cuda.ExternalStream(int(s))
        with torch.cuda.stream(ts):
            xt = torch.as_tensor(ArrayView(xs.ptr, (R * tokens, H), np.int16), device="cuda").view(torch.bfloat16)
            it = torch.as_tensor(ArrayView(tk.ptr, (R * tokens, K), np.int32), device="cuda")
        torch.cuda.synchronize()

        def torch_dispatch(i):   # the same layout: by global expert (= destination, then local), source, token
            with torch.cuda.stream(ts):
                flat = it.reshape(-1).long()
                order = torch.argsort(flat, stable=True)
                n_masked = (flat < 0).sum()
                rows = xt.index_select(0, order // K)
                counts = torch.bincount(flat.clamp_min(0), minlength=R * L)
                return rows, counts, n_masked
        fns["torch sort + index_select"] = torch_dispatch
    timer = Timer(s, hold=True, device=dev)
    # a step is ~30 driver calls per contender launch (8 ranks x 3 kernels, events): hold the
    # stream long enough that the host has enqueued a whole round before the GPU starts it
    timer.HOLD_NS_PER_ITER = 1_000_000       # and the one-CTA contender refills 16 parameter blocks
    res = timer.interleaved(fns, rounds=max(4, a.iters // 5), per_round=4, warmup=max(2, a.warmup // 2))
    s.synchronize()
    d.check()
    exact = exact and fresh_step(False) and fresh_step(False, graphs["dispatch"])   # after every contender too
    for g in graphs.values():
        g.close()
    if one is not None:
        one.close()
    moved = R * tokens * (sh.x_bytes + sh.s_bytes) + sum(len(p.data_rows) for p in plan.dest) * (sh.x_bytes +
                                                                                                 sh.s_bytes)
    out = {"tokens": tokens, "payload": payload, "exact": exact, "bytes_moved": moved,
           "capacity_rows": sh.capacity, "bytes_per_rank": sh.bytes_per_rank, "tally": tally_default,
           "tally_threads": d.ranks[0].tally_threads, "count_threads": d.ranks[0].count_threads,
           "pdl": d.all.pdl, "pdl_error": d.all.pdl_error, "launches": list(d.all_parts()),
           "results": {k: v["median_us"] for k, v in res.items()}, "breakdown_us": parts,
           "ceiling_timeouts": ceiling.errors()}
    r = out["results"]
    out["over_floor"] = r["dispatch"] / r["copy floor"]
    out["over_ceiling"] = r["dispatch"] / r["ceiling"]
    out["graph_over_floor"] = r["dispatch graph"] / r["floor graph"]
    out["graph_over_ceiling"] = r["dispatch graph"] / r["ceiling graph"]
    out["per_rank_over_ceiling"] = r["per-rank streams"] / r["ceiling"]
    out["no_pdl_over_ceiling"] = r["dispatch, no PDL"] / r["ceiling"]
    if tally_default:
        out["one_cta_over_floor"] = r["dispatch, one-CTA count"] / r["copy floor"]
    out["floor_TBps"] = moved / (r["copy floor"] * 1e-6) / 1e12
    if "torch sort + index_select" in r:
        out["torch_over_dispatch"] = r["torch sort + index_select"] / r["dispatch"]
    ceiling.close()
    for f in floor:
        f.close()
    d0.close()
    d.close()
    for b in keep:
        b.free()
    return out


def run(ctx, out: dict) -> None:
    """Section ``dispatch``: prefill (``--tokens``) and decode (``--decode-tokens``), bf16 and fp8."""
    a = ctx.args
    rows = []
    for tokens in (a.tokens, a.decode_tokens):
        for payload in ("bf16", "fp8"):
            rows.append(_bench_case(ctx, tokens, payload))
    out["dispatch"] = {"cases": rows, "targets": {"prefill_over_floor": 1.15, "decode_over_ceiling": 1.15,
                                                  "torch_prefill": 1.5, "torch_decode": 5.0}}


def table(out: dict) -> str:
    sec = out.get("dispatch")
    if not sec:
        return ""
    L = ["\ndispatch (8 ranks on this GPU; us, median of turns; floor = one copy kernel of every copy to its row; "
         "ceiling = count exchange, floor, least signal; 1-CTA = the dispatch with the single-CTA token pass; "
         "0 tok = the dispatch at 0 tokens; fl+sig = the floor with the send's per-CTA signal)",
         f"  {'tokens':>6} {'payload':>7} {'dispatch':>9} {'floor':>9} {'ceiling':>9} {'torch':>9} "
         f"{'/floor':>7} {'/ceil':>7} {'torch/x':>8} {'1-CTA':>9} {'1-CTA/fl':>8} {'0 tok':>7} {'fl+sig':>8} exact"]
    for c in sec["cases"]:
        r = c["results"]
        t = r.get("torch sort + index_select")
        ts, tx = (f"{t:.1f}", f"{c['torch_over_dispatch']:.2f}") if t else ("-", "-")
        o = r.get("dispatch, one-CTA count")
        os_, ox = (f"{o:.1f}", f"{c['one_cta_over_floor']:.3f}") if o else ("-", "-")
        L.append(f"  {c['tokens']:>6} {c['payload']:>7} {r['dispatch']:>9.1f} {r['copy floor']:>9.1f} "
                 f"{r['ceiling']:>9.1f} {ts:>9} {c['over_floor']:>7.3f} {c['over_ceiling']:>7.3f} {tx:>8} "
                 f"{os_:>9} {ox:>8} {r['dispatch at 0 tokens']:>7.1f} {r['floor + per-CTA signal']:>8.1f} "
                 f"{c['exact']}"
                 + ("" if not c.get("ceiling_timeouts") else f" CEILING TIMEOUTS {c['ceiling_timeouts']}"))
    L.append("  graphs and the per-rank streams (us, median of turns; graph = the contender captured once and "
             "replayed; per-rank = every rank's kernels on its own stream, the step before the all-ranks launches)")
    L.append(f"  {'tokens':>6} {'payload':>7} {'disp gr':>9} {'floor gr':>9} {'ceil gr':>9} {'/fl gr':>7} "
             f"{'/ceil gr':>8} {'per-rank':>9} {'p-r gr':>9} {'p-r/ceil':>8} {'no PDL':>8} {'noPDL/c':>8} launches")
    for c in sec["cases"]:
        r = c["results"]
        L.append(f"  {c['tokens']:>6} {c['payload']:>7} {r['dispatch graph']:>9.1f} {r['floor graph']:>9.1f} "
                 f"{r['ceiling graph']:>9.1f} {c['graph_over_floor']:>7.3f} {c['graph_over_ceiling']:>8.3f} "
                 f"{r['per-rank streams']:>9.1f} {r['per-rank streams graph']:>9.1f} "
                 f"{c['per_rank_over_ceiling']:>8.3f} {r['dispatch, no PDL']:>8.1f} {c['no_pdl_over_ceiling']:>8.3f} "
                 f"{'+'.join(c['launches'])}" + ("" if c["pdl"] else f" (PDL off: {c['pdl_error']})"))
    L.append("  per-kernel breakdown (us; per part the median over 12 steps; all-ranks: events between the launches "
             "on one stream; per-rank streams: the longest rank, events on the rank streams)")
    L.append(f"  {'tokens':>6} {'payload':>7} {'variant':<24} " + " ".join(f"{n:>7}" for n in PARTS))
    for c in sec["cases"]:
        for name, b in c["breakdown_us"].items():
            L.append(f"  {c['tokens']:>6} {c['payload']:>7} {name:<24} " + " ".join(f"{b[n]:>7.1f}" for n in PARTS))
    return "\n".join(L)


# ---------------------------------------------------------------- the layer

def run_layer(ctx, out: dict) -> None:
    """Section ``layer``: the MoE layer step at the prefill and decode token counts."""
    from ..moe import LAYER_BOUND, MoELayer, layer_error      # torch: only when this section runs
    torch = ctx.torch
    if torch is None:
        out["layer"] = {"skipped": "torch is not installed"}
        return
    a = ctx.args
    rows = []
    torch.cuda.empty_cache()           # the other sections' cached blocks back to the driver
    for tokens in (a.decode_tokens, a.tokens):
        layer = MoELayer(a.ranks, hidden=a.hidden, inter=a.gemm_k, n_experts=a.ranks * a.experts, top_k=a.top_k,
                         tokens=tokens, router="deepseek", seed=int(ctx.rng.integers(1 << 30)))
        try:
            g = torch.Generator(device="cuda").manual_seed(1)
            layer.x_in.copy_(torch.randn(layer.x_in.shape, generator=g, device="cuda"))
            names = ("router", "dispatch", "up-projection + SiLU", "down-projection + send", "receive + reduce")
            parts = {n: [] for n in names}
            for i in range(4):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
                layer.forward(events=ev)
                torch.cuda.synchronize()
                layer.check()
                if i:
                    for j, n in enumerate(names):
                        parts[n].append(ev[j].elapsed_time(ev[j + 1]) * 1e3)
            err = layer_error(layer.out, layer.reference(layer.x_in, layer.topk_idx, layer.topk_weights))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer.forward()
            times = []
            for _ in range(max(5, a.iters // 5)):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
            layer.check()
            eager = {n: statistics.median(v) for n, v in parts.items()}
            tot = sum(eager.values())
            rows.append({"tokens": tokens, "graph_step_us": statistics.median(times), "eager_parts_us": eager,
                         "shares": {n: v / tot for n, v in eager.items()}, "rel_error": err, "bound": LAYER_BOUND})
            graph = None
        finally:
            layer.close()
            torch.cuda.empty_cache()
    out["layer"] = {"cases": rows, "hidden": a.hidden, "inter": a.gemm_k, "experts": a.ranks * a.experts}


def table_layer(out: dict) -> str:
    sec = out.get("layer")
    if not sec:
        return ""
    if "skipped" in sec:
        return f"\nlayer: skipped ({sec['skipped']})"
    L = [f"\nMoE layer step (8 ranks, H {sec['hidden']}, I {sec['inter']}, {sec['experts']} experts, DeepSeek-V3 "
         "router; graph replay; parts from an eager run)"]
    for c in sec["cases"]:
        shares = ", ".join(f"{n} {100 * s:.0f}%" for n, s in c["shares"].items())
        L.append(f"  {c['tokens']:>5} tokens/rank: {c['graph_step_us']:.1f} us; {shares}; error {c['rel_error']:.2e} "
                 f"(bound {c['bound']})")
    return "\n".join(L)
