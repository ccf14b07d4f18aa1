"""Sections ``dispatch`` and ``layer``: the dispatch of 8 ranks on this GPU (DeepSeek-V3
shapes: top-8 of 256 experts, 32 per rank) at the prefill and decode token counts, bf16
and fp8 payloads, timed in turns with

- the copy floor: one kernel reading every token's row once and storing each of its
  copies at the very row the dispatch puts it (destinations precomputed on the host from
  the reference plan; no checks, no src_info, no signal);
- the ceiling: the floor after the count exchange and the least signal of the protocol
  (the same dispatch kernels at 0 tokens: the exchange of every (rank, expert) count, the
  layout, one flag per pair and its wait);
- what a torch user writes instead: a stable sort of the copies by expert, then
  ``index_select`` of the rows into the same grouped layout (and the counts by bincount),
  every rank's tokens at once.

``layer``: the MoE layer step (``p3send.moe.MoELayer``: router, dispatch, up-projection, SiLU,
down-projection with the send in its epilogue, receive and reduce) replayed as a CUDA
graph, with each part's share from an eager run's events."""
from __future__ import annotations

import statistics

import numpy as np

from ..cuda import driver, loader
from ..ops.dispatch import ArrayView, Dispatch
from ..oracle import dispatch as dref
from ..oracle.cases import random_topk
from .data import random_bytes
from .timing import Timer

# The copy floor: thread u copies vector u mod nv of row u / nv to each of its K non-zero
# destinations dst[row*K + k] (+ 16 * vector). One vector per thread, one tile per CTA.
FANOUT_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry p3_bench_fanout(.param .u64 src, .param .u64 dst, .param .u32 rows, .param .u32 nv,
                                .param .u32 k)
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
    @%p0 bra            DONE;
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
    @%p1 bra            DONE;
    ld.global.nc.u64    %rd5, [%rd3];
    setp.ne.u64         %p2, %rd5, 0;
    add.s64             %rd5, %rd5, %rd4;
    @%p2 st.global.v4.u32 [%rd5], {%r0, %r1, %r2, %r3};
    add.s64             %rd3, %rd3, 8;
    add.u32             %r5, %r5, 1;
    bra                 K;
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
        self.grid = max(1, -(-rows * nv // THREADS))
        self.blk = self.k.params_block(src=src, dst=self.dst, rows=rows, nv=nv, k=K)

    def launch(self, stream) -> None:
        self.blk.launch((self.grid,), (THREADS,), stream)

    def close(self) -> None:
        self.dst.free()


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
    # the ceiling's exchange and signal: the dispatch kernels at 0 tokens
    d0 = Dispatch(R, max_tokens=1, top_k=K, hidden=H, n_local_experts=L, payload=payload, capacity=1, device=dev,
                  inputs=False)
    for r in range(R):
        d0.bind(r, x=ArrayView(xs.ptr, (0, H), x_dt), topk_idx=ArrayView(tk.ptr, (0, K), np.int32),
                scales=ArrayView(ss.ptr, (0, sh.s_bytes // 4), np.float32) if ss else None)
    s = ctx.stream
    d.enqueue(stream=s)                      # checked once before timing
    s.synchronize()
    d.check()
    got = d.ranks[0].view("recv_x")[: int(plan.dest[0].expert_offsets[-1])]
    want = dref.expected_rows(plan, 0, [xs.download(np.uint8, offset=p * tokens * sh.x_bytes,
                                                    nbytes=tokens * sh.x_bytes).reshape(tokens, sh.x_bytes)
                                         for p in range(R)], got, zero_padding=False)
    exact = bool(np.array_equal(got, want))
    fns = {"dispatch": lambda i: d.enqueue(stream=s),
           "copy floor": lambda i: [f.launch(s) for f in floor],
           "ceiling": lambda i: (d0.enqueue(stream=s), [f.launch(s) for f in floor])}
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
    timer.HOLD_NS_PER_ITER = 500_000
    res = timer.interleaved(fns, rounds=max(4, a.iters // 5), per_round=4, warmup=max(2, a.warmup // 2))
    moved = R * tokens * (sh.x_bytes + sh.s_bytes) + sum(len(p.data_rows) for p in plan.dest) * (sh.x_bytes +
                                                                                                 sh.s_bytes)
    out = {"tokens": tokens, "payload": payload, "exact": exact, "bytes_moved": moved,
           "capacity_rows": sh.capacity, "bytes_per_rank": sh.bytes_per_rank,
           "results": {k: v["median_us"] for k, v in res.items()}}
    r = out["results"]
    out["over_floor"] = r["dispatch"] / r["copy floor"]
    out["over_ceiling"] = r["dispatch"] / r["ceiling"]
    out["floor_TBps"] = moved / (r["copy floor"] * 1e-6) / 1e12
    if "torch sort + index_select" in r:
        out["torch_over_dispatch"] = r["torch sort + index_select"] / r["dispatch"]
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
         "ceiling = floor after the count exchange and the least signal)",
         f"  {'tokens':>6} {'payload':>7} {'dispatch':>9} {'floor':>9} {'ceiling':>9} {'torch':>9} "
         f"{'/floor':>7} {'/ceil':>7} {'torch/x':>8} exact"]
    for c in sec["cases"]:
        r = c["results"]
        t = r.get("torch sort + index_select")
        ts, tx = (f"{t:.1f}", f"{c['torch_over_dispatch']:.2f}") if t else ("-", "-")
        L.append(f"  {c['tokens']:>6} {c['payload']:>7} {r['dispatch']:>9.1f} {r['copy floor']:>9.1f} "
                 f"{r['ceiling']:>9.1f} {ts:>9} {c['over_floor']:>7.3f} {c['over_ceiling']:>7.3f} {tx:>8} "
                 f"{c['exact']}")
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
