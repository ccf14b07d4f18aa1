"""Section ``epilogue`` (6): the in-epilogue send (``p3_epilogue_send``: fp32 tiles -> bf16
in shared memory -> the ranks' receive buffers) against converting then sending."""
from __future__ import annotations

import numpy as np

from ..abi.config import rank_config
from ..cuda import driver
from ..ops.send import EpilogueSend, ScatterSend
from ..oracle.cases import prefill_routing
from .timing import Timer

#: Geometries of p3_epilogue_send measured side by side (the first is EpilogueSend's default).
EPILOGUE_GEOMETRIES = (
    dict(bm=16, bn=1024, num_stages=2, send_warps=1, epilogue_warps=2),
    dict(bm=32, bn=1024, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=16, bn=1024, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=8, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=512, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=1024, num_stages=4, send_warps=1, epilogue_warps=1),
    dict(bm=32, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=8, bn=2048, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=2, bn=7168, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=1024, num_stages=2, send_warps=0, epilogue_warps=1),
    dict(bm=8, bn=1024, num_stages=2, send_warps=0, epilogue_warps=2),
    dict(bm=32, bn=1024, num_stages=4, send_warps=2, epilogue_warps=2),
    dict(bm=16, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=2048, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=32, bn=512, num_stages=2, send_warps=1, epilogue_warps=3),
    dict(bm=64, bn=512, num_stages=4, send_warps=4, epilogue_warps=4),
)


def run(ctx, out: dict) -> None:
    """Section ``epilogue``: fused (fp32 accumulator tiles -> bf16 in shared memory -> the
    ranks' receive buffers, one kernel) against unfused (torch converts fp32 -> bf16 C in
    global memory, then p3_scatter_send), same routing and bytes, prefill shape, every
    geometry of EPILOGUE_GEOMETRIES."""
    a, dev, rng, torch = ctx.args, ctx.dev, ctx.rng, ctx.torch
    n_cols, rows = a.hidden, a.tokens * a.top_k
    msg = 2 * n_cols
    off, table, src, _ = prefill_routing(a.tokens, a.ranks, a.top_k, a.experts, rng)
    if torch is not None:
        acc_t = torch.randn((rows, n_cols), dtype=torch.float32, device="cuda")
        c_t = torch.empty((rows, n_cols), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        acc = acc_t
    else:
        acc = driver.DeviceBuffer.from_array(rng.standard_normal((rows, n_cols)).astype(np.float32))
    recvs = [driver.DeviceBuffer(a.tokens * a.top_k * msg) for _ in range(a.ranks)]
    counts = [driver.DeviceBuffer(8 * a.experts * a.ranks, fill=0xFF) for _ in range(a.ranks)]
    table_buf, src_buf = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offsets = driver.DeviceBuffer.from_array(off)
    cfg = rank_config(n_ranks=a.ranks, recv_bufs=recvs[:a.ranks], top_k=a.top_k, msg_bytes=msg, max_tokens=a.tokens,
                      range_table=table_buf, src_info=src_buf)
    s = driver.Stream()
    timer = Timer(s, hold=a.hold)
    cache = driver.DeviceBuffer(8 * rows, fill=0)       # the row cache: zeroed before every launch
    cfg.row_base_ptr = cache.ptr
    # Every receiver is on this GPU, so both sides signal at .gpu scope (as Combine does).
    kw = dict(expert_offsets_host=off, count_ptrs=counts, same_gpu=True)
    res, geo = {}, {}
    for g in EPILOGUE_GEOMETRIES:
        fused = EpilogueSend(a.experts, device=dev, **g)
        fblk = fused.prepare(cfg, acc, n_cols, offsets, rows_in_acc=rows, **kw)
        name = "fused bm{bm} bn{bn} S{num_stages} N{send_warps} E{epilogue_warps}".format(**g)
        res[name] = timer.run(lambda i, fused=fused, fblk=fblk: fused.launch(s, fblk), a.iters, a.warmup)
        geo[name] = {**g, "threads": fused.threads, "grid": fused.grid}
        fused.close()
    best = min(res, key=lambda k: res[k]["median_us"])
    # the best geometry with the row cache on (zeroed before every launch, as the protocol asks)
    fused = EpilogueSend(a.experts, device=dev, **{k: geo[best][k] for k in EPILOGUE_GEOMETRIES[0]})
    cblk = fused.prepare(cfg, acc, n_cols, offsets, rows_in_acc=rows, row_cache=True, **kw)

    def cached(i):
        cache.fill(0, s)
        fused.launch(s, cblk)
    res[f"diagnostic: {best} + row cache"] = timer.run(cached, a.iters, a.warmup)
    fused.close()
    if torch is not None:
        sender = ScatterSend(a.experts, device=dev)
        sblk = sender.prepare(cfg, c_t, offsets, rows_in_c=rows, **kw)
        ts = torch.cuda.ExternalStream(int(s))

        def unfused(i):
            with torch.cuda.stream(ts):
                c_t.copy_(acc_t)          # fp32 -> bf16, round to nearest even
            sender.launch(s, sblk)
        res["unfused convert+send"] = timer.run(unfused, a.iters, a.warmup)
        sender.close()

        def convert(i):
            with torch.cuda.stream(ts):
                c_t.copy_(acc_t)
        res["diagnostic: the convert alone"] = timer.run(convert, a.iters, a.warmup)
    moved = rows * n_cols * 4 + rows * msg
    for v in res.values():
        v["TBps_rw"] = moved / (v["median_us"] * 1e-6) / 1e12
    out["epilogue"] = {"rows": rows, "n_cols": n_cols, "geometries": geo, "best": best, "results": res}
    if "unfused convert+send" in res:
        out["epilogue"]["fused_over_unfused"] = res[best]["median_us"] / res["unfused convert+send"]["median_us"]
    for b in recvs + counts + [table_buf, src_buf, offsets, cache] + ([] if torch is not None else [acc]):
        b.free()


def table(out: dict) -> str:
    if "epilogue" not in out:
        return ""
    e = out["epilogue"]
    L = [f"\n6. in-epilogue send, prefill shape ({e['rows']} rows x {e['n_cols']} fp32 -> bf16 peers, "
         f"8 ranks on this GPU, .gpu-scope signal; TB/s counts fp32 read + bf16 write)"]
    for k, v in e["results"].items():
        L.append(f"   {k:<36} {v['median_us']:9.1f} us  {v['TBps_rw']:6.2f} TB/s")
    if "fused_over_unfused" in e:
        L.append(f"   best fused / unfused     {e['fused_over_unfused']:.3f}x   (target <= 0.70): {e['best']}")
        conv = e["results"]["diagnostic: the convert alone"]["median_us"]
        best = e["results"][e["best"]]["median_us"]
        L.append(f"   best fused / the convert alone (same bytes, no send)  {best / conv:.3f}x")
    return "\n".join(L)
