"""Maintainer experiment, not maintained (experiments/README.md): the shipped p3_gemm_send
against other versions of it (e.g. an earlier commit's PTX), gated and fused, timed in turns
in one run, at the decode and the prefill shapes; checks first that every version's fused
launch writes the same bytes and counts. Prints each version's fused / gated.

    git show REV:ptx/p3_gemm_send.ptx > /tmp/old.ptx
    PYTHONPATH=. python3 experiments/gemm_ab.py --ptx old=/tmp/old.ptx [--ptx NAME=GEMM.ptx,ROWS.ptx]

A version is NAME=FILE (p3_gemm_send.ptx text; the shipped p3_send_rows.ptx is appended,
less its FP8 code, ptxdoc.without_fp8, as GroupedGemmSend's bf16-wire kernel)
or NAME=FILE,ROWS (with that p3_send_rows.ptx instead). The textual variants of the send
measured in docs/PERF.md and not kept (``--variants``) were built by an earlier version of
this script (tools/gemm_ab.py; PERF.md names the commit).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from p3send.abi.config import rank_config
from p3send.bench.timing import Timer
from p3send.cuda import driver, loader, ptxdoc
from p3send.ops.gemm import GroupedGemmSend
from p3send.oracle.cases import prefill_routing

E, N, K, RANKS, TOP_K = 32, 7168, 2048, 8, 8      # the bench's MoE down-projection


def problem(torch, rng, tokens: int) -> SimpleNamespace:
    """One rank's GEMM + send at ``tokens`` tokens: routing, bf16 X and W (E, N, K), C, 8
    receive buffers (sentinel-filled) and counts on this GPU, the send's cfg. ``free()``
    releases the device buffers."""
    off, table, src, _ = prefill_routing(tokens, RANKS, TOP_K, E, rng)
    rows = tokens * TOP_K
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    c = torch.empty((rows, N), device="cuda", dtype=torch.bfloat16)
    bufs = [driver.DeviceBuffer.from_array(v) for v in (table, src, off)]
    recv = [driver.DeviceBuffer(rows * 2 * N, fill=0xAB) for _ in range(RANKS)]
    counts = [driver.DeviceBuffer(8 * E * RANKS, fill=0xFF) for _ in range(RANKS)]
    cfg = rank_config(n_ranks=RANKS, recv_bufs=recv, top_k=TOP_K, msg_bytes=2 * N, max_tokens=tokens,
                      range_table=bufs[0], src_info=bufs[1])
    torch.cuda.synchronize()

    def free():
        for b in recv + counts + bufs:
            b.free()
    return SimpleNamespace(off=off, rows=rows, x=x, w=w, c=c, expert_offsets=bufs[2], recv=recv, counts=counts, cfg=cfg,
                           free=free)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE[,ROWS]")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of 4 launches per contender (decode)")
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    shipped = loader.ptx_dir()
    others = [(p.name, p.read_text()) for p in sorted(shipped.glob("*.ptx"))
              if p.name not in ("p3_gemm_send.ptx", "p3_send_rows.ptx")]
    rows_text = ptxdoc.without_fp8((shipped / "p3_send_rows.ptx").read_text())   # as the launcher's bf16 kernel
    versions = {"shipped": ((shipped / "p3_gemm_send.ptx").read_text(), rows_text)}
    for spec in a.ptx:
        name, _, files = spec.partition("=")
        gemm_file, _, rows_file = files.partition(",")
        missing = [f for f in (gemm_file, rows_file) if f and not Path(f).is_file()]
        if not name or not gemm_file or name in versions or missing:
            ap.error(f"--ptx {spec!r}: expected NAME=FILE[,ROWS] with a new NAME and existing files"
                     + (f" (no file {', '.join(missing)})" if missing else ""))
        versions[name] = (Path(gemm_file).read_text(), Path(rows_file).read_text() if rows_file else rows_text)
    import torch
    dev = driver.device()
    rng = np.random.default_rng(a.seed)
    print(f"[seed] {a.seed}")
    for tokens, bm, rounds in ((128, 64, a.rounds), (4096, 128, max(4, a.rounds // 6))):
        P = problem(torch, rng, tokens)
        s = driver.Stream()
        fns, gems, written = {}, [], {}
        for name, (gemm_text, rtext) in versions.items():
            g = GroupedGemmSend(E, device=dev)
            gems.append(g)
            if name != "shipped":
                g.k = loader.load(ptxdoc.module_text(gemm_text, others + [("p3_send_rows.ptx", rtext)]),
                                  device=dev, name=name)["p3_gemm_send"]
                driver.set_max_dynamic_smem(g.k.func, g.smem)
            common = dict(expert_offsets_host=P.off, rows=P.rows, n_cols=N, k_dim=K, bm=bm)
            gated = g.prepare(P.cfg, P.x, P.w, P.expert_offsets, P.c, into=g.k.params_block(), **common)
            fused = g.prepare(P.cfg, P.x, P.w, P.expert_offsets, count_ptrs=[b.ptr for b in P.counts], p3_control=0,
                              same_gpu=True, into=g.k.params_block(), **common)
            fns[f"{name} gated"] = lambda i, g=g, b=gated: g.launch(s, b)
            fns[f"{name} fused"] = lambda i, g=g, b=fused: g.launch(s, b)
            for buf in P.recv:
                buf.fill(0xAB)
            for buf in P.counts:
                buf.fill(0xFF)
            fns[f"{name} fused"](0)
            s.synchronize()
            written[name] = [buf.download().tobytes() for buf in P.recv + P.counts]
        other = [n for n, v in written.items() if v != written["shipped"]]
        print(f"{P.rows} rows (bm {bm}): fused launches writing other bytes or counts than the shipped one: "
              f"{', '.join(other) or 'none'}")
        res = Timer(s).interleaved(fns, rounds=rounds, per_round=4, warmup=3)
        for k, v in res.items():
            print(f"   {k:<44} {v['median_us']:8.1f} us  (min {v['min_us']:.1f})")
        for name in versions:
            ratio = res[f"{name} fused"]["median_us"] / res[f"{name} gated"]["median_us"]
            print(f"   {name}: fused / gated {ratio:.3f}")
        for g in gems:
            g.close()
        P.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
