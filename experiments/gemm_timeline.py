"""Maintainer experiment, not maintained (experiments/README.md): where p3_gemm_send's fused
time goes at the decode shape. Builds an instrumented copy of the kernel (nvcc, from
ptx/cuda/p3_gemm_send.cu with %globaltimer stamps added in memory; nothing shipped changes)
and of p3_send_rows, then prints per launch, as medians over the launches (us from the
first CTA's start):

    main   the last CTA to have its last tile staged by the consumers (the mainloop's end:
           gated, send warp 0's wait for it; fused, the end of that wait in p3_send_rows)
    tail   kernel end (the last send warp done, its flush included) - main
    and, fused, inside the last p3_send_rows call of each CTA's send warp 0: its phases
    (checks, acct, resolve and the wait for the tile run before it is staged)

for the gated GEMM (C written), the fused GEMM and the fused GEMM without the signal.
The stamps go to cfg.trace_ptr (trace_on stays 0: the kernels' own trace is off).

    PYTHONPATH=. python3 experiments/gemm_timeline.py [--tokens 128] [--launches 30]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))          # build_gemm
sys.path.insert(0, str(ROOT / "experiments"))    # gemm_ab

import build_gemm  # noqa: E402
from gemm_ab import E, K, N, problem  # noqa: E402

from p3send.cuda import driver, loader, ptxdoc  # noqa: E402
from p3send.ops.gemm import GroupedGemmSend  # noqa: E402

NOW = '({ uint64_t g_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); g_; })'
TRACE = 'asm("ld.param.u64 %0, [p3_gemm_send_param_0+160];" : "=l"(tp_));'   # cfg.trace_ptr
# p3_send_rows: entry .. CHECKED .. ACCT_SET .. RESOLVED .. COPY (the tile is there) .. ACCOUNT
ROWS_PHASES = ("checks", "acct", "resolve", "wait", "copy rows 0-3", "copy rest")


def _edit(text: str, pairs) -> str:
    for old, new in pairs:
        if text.count(old) != 1:
            sys.exit(f"gemm_timeline: the source changed, cannot place a stamp at:\n{old}")
        text = text.replace(old, new)
    return text


def stamped_gemm() -> str:
    """The kernel with stamps u64[8*cta + k] of the CTA's last tile (send warp 0): 0 before
    p3_send_rows or the wait for the staged tile, 1 after that wait (gated), 2 after its send
    or C stores, 3 after the flush, 4 CTA start."""
    # the send warps live in the shared header: stamp a copy of it, inlined into the source
    common = (build_gemm.SRC.parent / "p3_gemm_common.cuh").read_text()
    common = _edit(common, [
        ("""        const Tile T = grouped_tile(t, n_tiles, n_experts, mp, offs, bm, L::BN);
        if (send) {""",
         f"""        const Tile T = grouped_tile(t, n_tiles, n_experts, mp, offs, bm, L::BN);
        uint64_t tp_;
        {TRACE}
        uint64_t *st_ = warp_rank == 0 && lane == 0 && t + (int)gridDim.x >= total ?
                        reinterpret_cast<uint64_t *>(tp_) + 8 * blockIdx.x : nullptr;
        if (st_) st_[0] = {NOW};
        if (send) {{"""),
        ("""            mbar_wait(staged, i & 1);
""", """            mbar_wait(staged, i & 1);
            if (st_) st_[1] = {NOW};
""".replace("{NOW}", NOW)),
        ("""        __syncwarp();
        if (lane == 0)
            mbar_arrive(freed);""",
         f"""        if (st_) st_[2] = {NOW};
        __syncwarp();
        if (lane == 0)
            mbar_arrive(freed);"""),
        ("""            p3_send_flush(cfg, ctx, acct);
    }
}""", f"""            p3_send_flush(cfg, ctx, acct);
        if (st_) st_[3] = {NOW};
    }}
}}"""),
    ])
    src = build_gemm.SRC.read_text()
    src = _edit(src, [
        ('#include "p3_gemm_common.cuh"', common),
        ("    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;\n",
         "    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;\n"
         f"    if (tid == 0) {{ uint64_t tp_; {TRACE}\n"
         f"        reinterpret_cast<uint64_t *>(tp_)[8 * blockIdx.x + 4] = {NOW}; }}\n"),
    ])
    return build_gemm.build(source=src)


def stamped_rows() -> str:
    """p3_send_rows with stamps u64[8*(grid + cta) + k] by warp_rank 0, lane 0 (the last call
    of the launch stays): 0 entry, 1 CHECKED, 2 ACCT_SET, 3 RESOLVED, 4 COPY (the tile is
    there), 5 ACCOUNT (the last batch's, where a call has several), 6 the first four rows copied."""
    text = (loader.ptx_dir() / "p3_send_rows.ptx").read_text()
    f0 = text.index(".visible .func p3_send_rows(")
    f1 = text.index("RET:", f0)

    def stamp(k):
        return f"    mov.u64             %dbgt, %globaltimer;\n    @%dbgq st.global.u64 [%dbgp+{8 * k}], %dbgt;\n"
    body = _edit(text[f0:f1], [
        ("    .reg .b32   %rlo, %rhi, %vpeer, %dst, %rbar;\n",
         "    .reg .b32   %rlo, %rhi, %vpeer, %dst, %rbar;\n"
         "    .reg .b64   %dbgp, %dbgt;\n    .reg .pred  %dbgq, %dbgr;\n"),
        ("    bar.warp.sync       0xffffffff;                 // acct writes of earlier calls, by any lane\n",
         "    ld.u64              %dbgp, [%cfgp+160];\n"
         "    mov.u32             %t1, %ctaid.x;\n    mov.u32             %t2, %nctaid.x;\n"
         "    add.u32             %t1, %t1, %t2;\n    mul.wide.u32        %u0, %t1, 64;\n"
         "    add.s64             %dbgp, %dbgp, %u0;\n    setp.eq.u32         %dbgq, %wr, 0;\n"
         "    and.pred            %dbgq, %dbgq, %lane0;\n" + stamp(0) +
         "    bar.warp.sync       0xffffffff;                 // acct writes of earlier calls, by any lane\n"),
        ("CHECKED:\n", "CHECKED:\n" + stamp(1)),
        ("ACCT_SET:\n", "ACCT_SET:\n" + stamp(2)),
        ("RESOLVED:\n", "RESOLVED:\n" + stamp(3)),
        ("COPY:\n", "COPY:\n" + stamp(4)),
        ("ACCOUNT:\n", "ACCOUNT:\n" + stamp(5)),
        ("    add.u32             %i, %i, 4;\n", "    setp.eq.u32         %dbgr, %i, 0;\n"
         "    and.pred            %dbgr, %dbgr, %dbgq;\n    mov.u64             %dbgt, %globaltimer;\n"
         "    @%dbgr st.global.u64 [%dbgp+48], %dbgt;\n    add.u32             %i, %i, 4;\n"),
    ])
    return text[:f0] + body + text[f1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (rows = tokens x 8)")
    ap.add_argument("--launches", type=int, default=30)
    a = ap.parse_args()
    import torch
    dev = driver.device()
    rng = np.random.default_rng(7)
    P = problem(torch, rng, a.tokens)
    others = [(p.name, p.read_text()) for p in sorted(loader.ptx_dir().glob("*.ptx"))
              if p.name not in ("p3_gemm_send.ptx", "p3_send_rows.ptx")]
    module = ptxdoc.module_text(stamped_gemm(), others + [("p3_send_rows.ptx", stamped_rows())])
    s = driver.Stream()
    g = GroupedGemmSend(E, device=dev)
    stamps = driver.DeviceBuffer(8 * 16 * g.grid, fill=0)
    cfg = P.cfg
    cfg.trace_ptr = stamps.ptr
    g.k = loader.load(module, device=dev, name="p3_gemm_send (stamped)")["p3_gemm_send"]
    driver.set_max_dynamic_smem(g.k.func, g.smem)
    common = dict(expert_offsets_host=P.off, rows=P.rows, n_cols=N, k_dim=K)
    blocks = {"gated": g.prepare(cfg, P.x, P.w, P.expert_offsets, P.c, into=g.k.params_block(), **common),
              "fused": g.prepare(cfg, P.x, P.w, P.expert_offsets, count_ptrs=[b.ptr for b in P.counts], p3_control=0,
                                 same_gpu=True, into=g.k.params_block(), **common),
              "fused, no signal": g.prepare(cfg, P.x, P.w, P.expert_offsets, p3_control=0, same_gpu=True,
                                            into=g.k.params_block(), **common)}
    res = {k: [] for k in blocks}
    for it in range(a.launches + 3):
        for name, blk in blocks.items():
            stamps.fill(0, s)
            g.launch(s, blk)
            s.synchronize()
            st = stamps.download(np.uint64).reshape(2, g.grid, 8).astype(np.int64)
            if it < 3:
                continue
            gm, rw = st[0], st[1]
            t0 = gm[:, 4].min()
            staged = gm[:, 1] if name == "gated" else rw[:, 4]
            r = {"main": (staged.max() - t0) / 1e3, "tail": (gm[:, 3].max() - staged.max()) / 1e3}
            if name != "gated":
                ph = np.diff(rw[:, [0, 1, 2, 3, 4, 6, 5]], axis=1) / 1e3
                r.update({f"rows {p}": float(np.median(ph[:, i])) for i, p in enumerate(ROWS_PHASES)})
                r["flush"] = float(np.median(gm[:, 3] - gm[:, 2])) / 1e3
            res[name].append(r)
    print(f"p3_gemm_send timeline, {P.rows} rows over {E} experts, K={K}, N={N}, median of {a.launches} launches "
          f"(us; rows/flush: medians over CTAs of the last call)")
    for name, v in res.items():
        print(f"  {name:<18}" + "  ".join(f"{q} {np.median([r[q] for r in v]):.2f}" for q in v[0]))
    g.close()
    stamps.free()
    P.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
