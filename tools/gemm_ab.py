"""Maintainer experiment: the shipped p3_gemm_send against other versions of it (e.g. an
earlier commit's PTX), gated and fused, timed in turns in one run, at the decode and the
prefill shapes; checks first that every version's fused launch writes the same bytes and
counts. Prints each version's fused / gated.

    git show REV:ptx/p3_gemm_send.ptx > /tmp/old.ptx
    PYTHONPATH=. python3 tools/gemm_ab.py --ptx old=/tmp/old.ptx [--ptx NAME=GEMM.ptx,ROWS.ptx]
    PYTHONPATH=. python3 tools/gemm_ab.py --variants       # what the send's parts cost (below)

A version is NAME=FILE (p3_gemm_send.ptx text; the shipped p3_send_rows.ptx is appended)
or NAME=FILE,ROWS (with that p3_send_rows.ptx instead).

--variants adds textual variants of the shipped sources, one change each (those marked
"timing only" publish counts without the required ordering, or none: never shipped; the
others write the same bytes and counts). Those that change the kernel's source are built
with nvcc (skipped without it):
    no signal        p3_send_flush only resets acct (no count is published)
    relaxed flush    the flush's atom on done[e] and the count stores relaxed (no release)
    relaxed mid      relaxed flushes except each send warp's last one (nvcc)
    release          atom.release on done[e]; the last arriver's fence.acq_rel is the acquire
    sleep            3 us of __nanosleep before every flush but the last: its stores have
                     landed when the release waits for them (nvcc)
    bulk copies      rows copied by cp.async.bulk (one per row and lane; the flush waits for
                     the bulk group, then fence.proxy.async), the consumers fence the staged
                     tile for the async proxy (nvcc)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from p3send.abi.config import rank_config
from p3send.cli.bench import Timer, prefill_routing
from p3send.cuda import driver, loader, ptxdoc
from p3send.ops.gemm import GroupedGemmSend

ROOT = Path(__file__).resolve().parents[1]


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
    return SimpleNamespace(off=off, rows=rows, x=x, w=w, c=c, offs=bufs[2], recv=recv, counts=counts, cfg=cfg,
                           free=free)


def _flush_of(rows: str) -> tuple[str, str]:
    at = rows.index(".visible .func p3_send_flush(")
    return rows[:at], rows[at:]


def _swap(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) == count, f"variant anchor not found {count} time(s): {old[:60]!r}"
    return text.replace(old, new)


def variants(gemm: str, rows: str) -> dict:
    """NAME -> (p3_gemm_send text, p3_send_rows text): the variants of --variants."""
    import shutil
    sys.path.insert(0, str(ROOT / "tools"))
    import build_gemm
    head, flush = _flush_of(rows)
    v = {}
    gate = "    ld.s32              %t1, [%ctxp+96];            // p3_control\n"
    v["no signal (timing only)"] = (gemm, head + _swap(flush, gate, "    bra.uni             RET;\n" + gate))
    relaxed = _swap(flush, "@%lane0 atom.acq_rel.gpu.global.add.u64", "@%lane0 atom.relaxed.gpu.global.add.u64")
    relaxed = _swap(relaxed, "st.release.gpu.global.u64 [%cntp]", "st.relaxed.gpu.global.u64 [%cntp]", 2)
    v["relaxed flush (timing only)"] = (gemm, head + relaxed)
    release = _swap(flush, "@%lane0 atom.acq_rel.gpu.global.add.u64", "@%lane0 atom.release.gpu.global.add.u64")
    release = _swap(release, "    // Last arriver for e: every vector of e is stored and released (acquired above).\n",
                    "    fence.acq_rel.gpu;                              // the acquire\n")
    v["release"] = (gemm, head + release)
    if not shutil.which("nvcc"):
        print("(--variants: no nvcc, the variants built from p3_gemm_send.cu are skipped)")
        return v
    src = build_gemm.SRC.read_text()
    last = """        if (send && (t + (int)gridDim.x >= total ||
                     tile_at(t + gridDim.x, n_tiles, n_experts, mp, offs, bm).e != T.e))
            p3_send_flush(cfg, ctx, acct);"""

    def mid(call: str) -> str:      # the send warp's flushes but its last one: ``call``
        return _swap(src, last, "        if (send && t + (int)gridDim.x >= total)\n"
                                "            p3_send_flush(cfg, ctx, acct);\n"
                                "        else if (send && tile_at(t + gridDim.x, n_tiles, n_experts, mp, offs, bm).e"
                                " != T.e) {\n"
                                f"            {call}\n        }}")
    rlx_src = _swap(mid("p3_send_flush_rlx(cfg, ctx, acct);"), '#include "../p3send.h"\n',
                    '#include "../p3send.h"\nextern "C" __device__ void p3_send_flush_rlx(const P3PeerSendConfig *, '
                    'const P3SendCtx *, P3SendAcct *);\n')
    rlx_gemm = build_gemm.build(source=rlx_src).replace(".extern .func p3_send_flush_rlx",
                                                         ".visible .func p3_send_flush_rlx")
    v["relaxed mid flushes (timing only)"] = (rlx_gemm, rows + "\n" + relaxed.replace("p3_send_flush(",
                                                                                        "p3_send_flush_rlx(", 1))
    v["sleep before mid flushes"] = (build_gemm.build(source=mid("__nanosleep(3000);\n            "
                                                                   "p3_send_flush(cfg, ctx, acct);")), rows)
    fenced = _swap(src, "        mbar_arrive(staged);",
                   '        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");\n        mbar_arrive(staged);')
    copy = head[head.index("COPY:\n"):head.index("BATCH_NEXT:\n")]
    bulk = _swap(head, copy, """COPY:
    sub.u32             %cnt, %nmine, %kb;
    min.u32             %cnt, %cnt, 32;
    setp.lt.u32         %q1, %lane, %cnt;
    and.pred            %q1, %q1, %okl;
    add.u32             %t1, %kb, %lane;
    mad.lo.u32          %t1, %t1, %nw, %wr;
    mad.lo.u32          %t1, %t1, %pitch, %smem;
    cvt.u64.u32         %u1, %boff;
    add.s64             %u0, %val, %u1;
    cvta.to.global.u64  %u0, %u0;
    shl.b32             %t2, %nseg, 4;
    @%q1 cp.async.bulk.global.shared::cta.bulk_group [%u0], [%t1], %t2;
    cp.async.bulk.commit_group;
""")
    bulk = _swap(bulk, "ACCOUNT:\n    bar.warp.sync       0xffffffff;\n",
                 "ACCOUNT:\n    cp.async.bulk.wait_group.read 0;\n    bar.warp.sync       0xffffffff;\n")
    bulk_flush = _swap(flush, "    setp.eq.u32         %lane0, %lane, 0;\n",
                       "    setp.eq.u32         %lane0, %lane, 0;\n    cp.async.bulk.wait_group 0;\n"
                       "    fence.proxy.async.global;\n")
    v["bulk copies"] = (build_gemm.build(source=fenced), bulk + bulk_flush)
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE[,ROWS]")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of 4 launches per contender (decode)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--variants", action="store_true", help="also time the textual variants listed above")
    a = ap.parse_args()
    shipped = loader.ptx_dir()
    others = [(p.name, p.read_text()) for p in sorted(shipped.glob("*.ptx"))
              if p.name not in ("p3_gemm_send.ptx", "p3_send_rows.ptx")]
    rows_text = (shipped / "p3_send_rows.ptx").read_text()
    versions = {"shipped": ((shipped / "p3_gemm_send.ptx").read_text(), rows_text)}
    for spec in a.ptx:
        name, _, files = spec.partition("=")
        gemm_file, _, rows_file = files.partition(",")
        missing = [f for f in (gemm_file, rows_file) if f and not Path(f).is_file()]
        if not name or not gemm_file or name in versions or missing:
            ap.error(f"--ptx {spec!r}: expected NAME=FILE[,ROWS] with a new NAME and existing files"
                     + (f" (no file {', '.join(missing)})" if missing else ""))
        versions[name] = (Path(gemm_file).read_text(), Path(rows_file).read_text() if rows_file else rows_text)
    if a.variants:
        versions.update(variants(versions["shipped"][0], rows_text))
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
            gated = g.prepare(P.cfg, P.x, P.w, P.offs, P.c, into=g.k.params_block(), **common)
            fused = g.prepare(P.cfg, P.x, P.w, P.offs, count_ptrs=[b.ptr for b in P.counts], p3_control=0,
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
