"""Section ``gemm`` (8): the MoE down-projection with the combine's send, in one run.

At the prefill and the decode shapes (rows = tokens x top_k grouped over the local experts,
K = --gemm-k, N = --hidden): ``torch._grouped_mm`` alone (its faster weight layout),
``torch._grouped_mm`` then ``p3_scatter_send`` on one stream, ``p3_gemm_send`` with the send
gated off (writes C), and ``p3_gemm_send`` with the send in its epilogue (8 ranks on this
GPU, .gpu-scope signal for both sends). Before timing, the fused launch's receive buffers and
counts are checked byte for byte against the gated launch's C sent by ``p3_scatter_send``.
"""
from __future__ import annotations

import numpy as np

from ..abi.config import P3PeerSendConfig, rank_config
from ..cuda import driver
from ..ops.gemm import GroupedGemmSend
from ..ops.send import ScatterSend
from ..oracle.cases import prefill_routing
from .timing import Timer

SECTION_SHAPES = ("prefill", "decode")


def _cfg(range_table, src, recv, ranks, top_k, msg, tokens) -> P3PeerSendConfig:
    return rank_config(n_ranks=ranks, recv_bufs=recv[:ranks], top_k=top_k, msg_bytes=msg, max_tokens=tokens,
                       range_table=range_table, src_info=src)


def measure_shape(a, dev, rng, torch, tokens: int, *, linked: bool = False) -> dict:
    """One shape: every contender's median time, TFLOP/s and the ratios (see the module doc)."""
    E, N, K, ranks, top_k = a.experts, a.hidden, a.gemm_k, a.ranks, a.top_k
    off, table, src, _ = prefill_routing(tokens, ranks, top_k, E, rng)
    rows, msg = tokens * top_k, 2 * N
    flops = 2.0 * rows * N * K
    s = driver.Stream()
    ts = torch.cuda.ExternalStream(int(s))
    timer = Timer(s)
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.float32, generator=g) * K ** -0.5).to(torch.bfloat16)
    ends = torch.as_tensor(off[1:], dtype=torch.int32, device="cuda")
    w_kn = w.transpose(1, 2).contiguous()                 # (E, K, N) row-major: the other layout
    layouts = {"w (E,N,K) as B^T": w.transpose(1, 2), "w (E,K,N)": w_kn}
    table_buf, src_buf = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offsets = driver.DeviceBuffer.from_array(off)
    recv_bytes = tokens * top_k * msg
    recvs = [[driver.DeviceBuffer(recv_bytes, fill=0xAB) for _ in range(ranks)] for _ in range(2)]
    counts = [[driver.DeviceBuffer(8 * E * ranks, fill=0xFF) for _ in range(ranks)] for _ in range(2)]
    cfgs = [_cfg(table_buf, src_buf, recvs[i], ranks, top_k, msg, tokens) for i in range(2)]
    c = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    res, out = {}, {"rows": rows, "n": N, "k": K, "experts": E, "gflop": flops / 1e9}
    bms = (128, 64)
    gemms = {"inlined": GroupedGemmSend(E, device=dev)}
    if linked:
        gemms["linked"] = GroupedGemmSend(E, device=dev, linked=True)
    sender = ScatterSend(E, device=dev)
    try:
        gem = gemms["inlined"]
        common = dict(expert_offsets_host=off, rows=rows, n_cols=N, k_dim=K)
        blocks = {}     # one prepared launch per variant
        for bm in bms:
            blocks[f"gated bm={bm}"] = gem.prepare(cfgs[0], x, w, offsets, c, bm=bm, into=gem.k.params_block(),
                                                   **common)
            blocks[f"fused bm={bm}"] = gem.prepare(cfgs[1], x, w, offsets, bm=bm,
                                                   count_ptrs=[b.ptr for b in counts[1]], p3_control=0,
                                                   same_gpu=True, into=gem.k.params_block(), **common)
        # correctness before timing: fused == gated C sent by p3_scatter_send, byte for byte
        out["fused_equals_gated_then_scatter_send"] = fused_equals_gated_then_scatter_send(
            torch, s, gem, blocks, bms, sender, cfgs[0], c, offsets, off, recvs, counts)
        # timings: every contender in turns (Timer.interleaved), weights in both layouts for torch
        prepared = {}

        def tgm(i, bw):
            with torch.cuda.stream(ts):
                return torch._grouped_mm(x, bw, offs=ends)

        def tgm_send(i, bw):
            y = tgm(i, bw)
            blk = prepared.get(y.data_ptr())
            if blk is None:   # the caching allocator hands back the same block: prepared once
                blk = prepared[y.data_ptr()] = sender.prepare(cfgs[0], y.view(torch.uint8), offsets,
                                                              expert_offsets_host=off,
                                                              count_ptrs=[b.ptr for b in counts[0]], same_gpu=True,
                                                              into=sender.k.params_block())
            sender.launch(s, blk)

        fns = {}
        for name, bw in layouts.items():
            try:
                tgm(0, bw)
            except RuntimeError as e:          # a layout this torch does not take
                out.setdefault("torch_layout_errors", {})[name] = str(e)[:200]
                continue
            fns[f"torch._grouped_mm, {name}"] = lambda i, bw=bw: tgm(i, bw)
            fns[f"torch._grouped_mm + p3_scatter_send, {name}"] = lambda i, bw=bw: tgm_send(i, bw)
        for name, blk in blocks.items():
            fns[f"p3_gemm_send {name}"] = lambda i, blk=blk: gem.launch(s, blk)
        if "linked" in gemms:
            lk = gemms["linked"]
            lbm = 128 if rows > 64 * E else 64
            lk.prepare(cfgs[1], x, w, offsets, bm=lbm, count_ptrs=[b.ptr for b in counts[1]], p3_control=0,
                       same_gpu=True, **common)
            fns[f"p3_gemm_send fused bm={lbm}, linked (cuLink)"] = lambda i: lk.launch(s)
        res = timer.interleaved(fns, rounds=max(5, a.iters // 4), per_round=4, warmup=a.warmup)
        best = min((k for k in res if k.startswith("torch._grouped_mm,")), key=lambda k: res[k]["median_us"])
        best_send = min((k for k in res if k.startswith("torch._grouped_mm + ")), key=lambda k: res[k]["median_us"])
        for v in res.values():
            v["TFLOPs"] = flops / (v["median_us"] * 1e-6) / 1e12
        mine = {bm: res[f"p3_gemm_send gated bm={bm}"]["median_us"] for bm in bms}
        bm = min(mine, key=mine.get)
        t_gm = res[best]["median_us"]
        t_fused = res[f"p3_gemm_send fused bm={bm}"]["median_us"]
        out.update(results=res, best_torch=best, best_bm=bm,
                   gemm_over_torch=mine[bm] / t_gm,
                   fused_over_gemm=t_fused / mine[bm],
                   fused_over_torch_then_send=t_fused / res[best_send]["median_us"])
    finally:
        for gm in gemms.values():
            gm.close()
        sender.close()
        for b in [x for r in recvs for x in r] + [x for r in counts for x in r] + [table_buf, src_buf, offsets]:
            b.free()
    return out


def _equal(torch, a, b) -> bool:
    ta = torch.as_tensor(a, device="cuda")
    tb = torch.as_tensor(b, device="cuda")
    return bool(torch.equal(ta, tb))


def fused_equals_gated_then_scatter_send(torch, s, gem, blocks: dict, bms, sender, cfg, c, offsets, off,
                                         recvs, counts) -> dict:
    """Per tile height: whether the fused launch (``blocks["fused bm=..."]``, into ``recvs[1]``
    and ``counts[1]``) writes the bytes and counts that the gated launch's C sent by
    ``p3_scatter_send`` (``sender`` with ``cfg``, into ``recvs[0]`` and ``counts[0]``) writes;
    every buffer re-filled first. Returns {"bm=...": bool}.

    Args:
        torch: the torch module (C is a torch tensor; the receive buffers are compared there).
        s: the stream of every launch.
        gem: the GEMM launcher; blocks: its prepared ``"gated bm=..."`` and ``"fused bm=..."`` blocks.
        bms: the tile heights prepared.
        sender: a ScatterSend; cfg: its config (receive buffers ``recvs[0]``).
        c: the gated C (torch bf16 (rows, N)).
        offsets, off: the expert offsets on the device and as numpy.
        recvs, counts: per side (0: gated then p3_scatter_send, 1: fused), the receive buffers
            and counts of every rank (DeviceBuffers).
    """
    ranks = len(recvs[0])
    checks = {}
    for bm in bms:
        for i in range(2):
            for b in recvs[i]:
                b.fill(0xAB)
            for b in counts[i]:
                b.fill(0xFF)
        gem.launch(s, blocks[f"gated bm={bm}"])
        sender(cfg, c.view(torch.uint8), offsets, expert_offsets_host=off,
               count_ptrs=[b.ptr for b in counts[0]], same_gpu=True, stream=s)
        gem.launch(s, blocks[f"fused bm={bm}"])
        s.synchronize()
        same = all(_equal(torch, recvs[0][p], recvs[1][p]) for p in range(ranks))
        same_counts = all(np.array_equal(counts[0][p].download(np.uint64), counts[1][p].download(np.uint64))
                          for p in range(ranks))
        checks[f"bm={bm}"] = bool(same and same_counts)
    return checks


def shape_results(out: dict, key: str, title: str) -> tuple[dict | None, str]:
    """A section's results by shape (``out[key]``), or None and what its table says instead: ""
    when the section did not run, ``title`` and the reason when it was skipped."""
    g = out.get(key)
    if not g:
        return None, ""
    if "skipped" in g:
        return None, f"\n{title}: skipped ({g['skipped']})"
    return g, ""


def measure(a, dev, rng, torch, *, linked: bool = True) -> dict:
    """Both shapes (``SECTION_SHAPES``): {shape: measure_shape(...)}, or {"skipped": why}."""
    if torch is None:
        return {"skipped": "needs torch (torch._grouped_mm is the baseline)"}
    if tuple(dev.cc) != (9, 0):
        return {"skipped": f"p3_gemm_send is Hopper-only (sm_90a); {dev.name} is sm_{dev.cc[0]}{dev.cc[1]}"}
    return {shape: measure_shape(a, dev, rng, torch, a.tokens if shape == "prefill" else a.decode_tokens,
                                 linked=linked)
            for shape in SECTION_SHAPES}


def run(ctx, out: dict) -> None:
    """Section ``gemm``: both shapes into out["gemm"]."""
    out["gemm"] = measure(ctx.args, ctx.dev, ctx.rng, ctx.torch)


def table(out: dict) -> str:
    g, instead = shape_results(out, "gemm", "8. grouped GEMM + send")
    if g is None:
        return instead
    L = []
    for shape, r in g.items():
        L.append(f"\n8. grouped GEMM + send, {shape}: {r['rows']} rows over {r['experts']} experts, K={r['k']}, "
                 f"N={r['n']} ({r['gflop']:.1f} GFLOP); fused == gated C then p3_scatter_send: "
                 f"{r['fused_equals_gated_then_scatter_send']}; contenders timed in turns, "
                 f"{next(iter(r['results'].values()))['n']} launches each (median, min .. max)")
        for k, v in r["results"].items():
            L.append(f"   {k:<58} {v['median_us']:9.1f} us  {v['TFLOPs']:6.1f} TFLOP/s  "
                     f"({v['min_us']:.0f} .. {v['max_us']:.0f})")
        L.append(f"   gemm (bm={r['best_bm']}) / best torch._grouped_mm  {r['gemm_over_torch']:.3f}x  "
                 f"(target <= 1.00 prefill, < 1.00 decode)")
        L.append(f"   fused / gemm                             {r['fused_over_gemm']:.3f}x  "
                 f"(target <= 1.03 prefill, <= 1.02 decode)")
        L.append(f"   fused / torch._grouped_mm then send      {r['fused_over_torch_then_send']:.3f}x  "
                 "(target <= 0.90)")
    return "\n".join(L)
