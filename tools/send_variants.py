"""Maintainer experiment: time textual variants of p3_scatter_send side by side (one run,
same inputs), to test performance hypotheses before changing the shipped kernel.
Variants are the shipped PTX with one change each; not shipped.

    python3 tools/send_variants.py                       # prefill shape, 8 ranks on one GPU
    python3 tools/send_variants.py --peer --tokens 128    # decode shape, GPU 0 -> GPU 1
    python3 tools/send_variants.py --epilogue             # p3_epilogue_send variants, prefill shape
    python3 tools/send_variants.py --decode               # one-GPU decode round: SM shares
    python3 tools/send_variants.py --tokens 128 --sets 8  # decode-size send, C rotated past L2
    python3 tools/send_variants.py --decode --recv-ptx F  # the round with another p3_recv_reduce
    python3 tools/send_variants.py --decode --recv-variant preload|gpu-scope  # ... with RECV_VARIANTS' (below)
    python3 tools/send_variants.py --decode --send-ptx F  # ... with another p3_scatter_send"""
from __future__ import annotations

import argparse
import re

import numpy as np

from p3send.abi.config import rank_config
from p3send.abi.layout import encode_range_table
from p3send.cli.bench import Timer, prefill_routing, random_bytes
from p3send.cuda import driver, loader, ptxdoc
from p3send.ops.send import EpilogueSend, ScatterSend

BASE = (loader.ptx_dir() / "p3_scatter_send.ptx").read_text()
EPI = (loader.ptx_dir() / "p3_epilogue_send.ptx").read_text()
ROWS = (loader.ptx_dir() / "p3_send_rows.ptx").read_text()
RECV = (loader.ptx_dir() / "p3_recv_reduce.ptx").read_text()


def variants():
    v = {"baseline": (BASE, {"tile": True})}    # the launcher's default shape
    v["tile, no signal"] = (BASE, {"tile": True, "signal": False})
    # what the tile path's signal costs, part by part (wrong counts: timing only)
    tile_at = BASE.index("\nTILE:\n")
    head, tail = BASE[:tile_at], BASE[tile_at:]
    fence = "    @%gpu_scope fence.acq_rel.gpu;\n    @!%gpu_scope fence.acq_rel.sys;\n"
    v["tile, signal without the CTA fence (timing only)"] = (head + tail.replace(fence, "", 1), {"tile": True})
    v["tile, the CTA fence only, no counter (timing only)"] = (
        head + tail.replace("TILE_EXPERT:\n", "    bra.uni             TILE_NEXT;\nTILE_EXPERT:\n", 1), {"tile": True})
    v["tile, pair counts read with the done RMW"] = (head + speculative_pairs(tail), {"tile": True})
    v["tile, range table's second round loaded at kernel start"] = (second_round_early(BASE), {"tile": True})
    for thr, vec in ((128, 7), (224, 4), (448, 2), (128, 4), (128, 2), (256, 4), (256, 8), (256, 2), (64, 8),
                     (512, 2), (128, 1)):
        v[f"tile {vec} vec/thr x {thr}"] = (BASE, {"tile": True, "tile_threads": thr, "TILE_VECTORS": vec})
    v["tile 4 vec/thr x 256, no signal"] = (BASE, {"tile": True, "tile_threads": 256, "TILE_VECTORS": 4,
                                                   "signal": False})
    # one row of the bench's 14,336-byte rows (896 vectors) per CTA
    v["tile 7 vec/thr x 128, no signal"] = (BASE, {"tile": True, "tile_threads": 128, "TILE_VECTORS": 7,
                                                   "signal": False})
    v["persistent 132 x 1024 (num_sms = all, no tiles)"] = (BASE, {})
    # occupancy: the kernel's 64 registers (the chunk path's) allow 1024 threads per SM; the
    # tile path holds no data in registers (cp.async), so a register cap shows what it
    # would do with more CTAs per SM
    for n in (32, 40, 48):
        capped = BASE.replace(".maxntid 1024, 1, 1\n", f".maxntid 1024, 1, 1\n.maxnreg {n}\n")
        assert capped != BASE
        v[f"tile 8 vec/thr x 128, maxnreg {n}"] = (capped, {"tile": True})
        v[f"tile 4 vec/thr x 128, maxnreg {n}"] = (capped, {"tile": True, "tile_threads": 128, "TILE_VECTORS": 4})
    v["no_signal"] = (BASE, {"signal": False})
    v["st.cs"] = (BASE.replace("st.global.v4.u32    [%u1]", "st.global.cs.v4.u32 [%u1]"), {})
    v["cp.async L2::256B"] = (BASE.replace("cp.async.cg.shared.global [", "cp.async.cg.shared.global.L2::256B ["), {})
    v["512thr x 2/SM"] = (BASE, {"threads": 512, "grid_mult": 2})
    v["256thr x 4/SM"] = (BASE, {"threads": 256, "grid_mult": 4})
    v["half the SMs"] = (BASE, {"grid_div": 2})
    v["gpu-scope fences"] = (re.sub(r"(fence\.acq_rel|st\.release|st\.relaxed)\.sys", r"\1.gpu", BASE),
                             {"local_only": True})
    # every warp flushes each expert itself (fence per warp) instead of the CTA-level flush
    warp_flush = BASE.replace("    @%q0 bra            WARP_FLUSH;\n", "    bra.uni             WARP_FLUSH;\n")
    v["warp flush"] = (warp_flush, {})
    v["gpu-scope fences, warp flush"] = (re.sub(r"(fence\.acq_rel|st\.release|st\.relaxed)\.sys", r"\1.gpu",
                                                warp_flush), {"local_only": True})
    # chunks dealt round-robin over all CTAs (chunk J to CTA J mod G) instead of one
    # contiguous window per CTA
    inter = BASE
    for a, b in (("""    mul.lo.u64          %u5, %u2, %u4;
    div.u64             %u5, %u5, %u3;              // c*V/G
    add.s64             %u4, %u4, 1;
    mul.lo.u64          %vend, %u2, %u4;
    div.u64             %vend, %vend, %u3;          // (c+1)*V/G
""", """    mov.b64             %u5, 0;
    mov.b64             %vend, %u2;
"""), ("""    shr.u32             %j, %thr, 5;                // this warp's first chunk
    shr.u32             %jstep, %nthr, 5;           // then every (warps per CTA)-th
""", """    shr.u32             %j, %thr, 5;
    mov.u32             %t1, %nctaid.x;
    mov.u32             %t2, %ctaid.x;
    mad.lo.u32          %j, %j, %t1, %t2;
    shr.u32             %jstep, %nthr, 5;
    mul.lo.u32          %jstep, %jstep, %t1;
""")):
        assert inter.count(a) == 1, a
        inter = inter.replace(a, b)
    v["chunks over CTAs"] = (inter, {})
    v["chunks over CTAs, no signal"] = (inter, {"signal": False})
    # diagnostic for --peer (identity routing there): no resolve, row r goes to slot r of peer 1
    ident = """RESOLVE:
    setp.eq.u32         %head, %vb, 0;
    ld.shared.u64       %base, [s_peer_buf+8];
    cvt.s64.s32         %u0, %row;
    ld.param.s64        %u2, [cfg+112];
    mad.lo.s64          %base, %u0, %u2, %base;
    mov.u32             %peer, 1;
    setp.eq.u32         %ok, 0, 0;
    bra.uni             RESOLVED;
"""
    old_resolve = "RESOLVE:\n    setp.eq.u32         %head, %vb, 0;\n"
    v["diagnostic: no resolve"] = (BASE.replace(old_resolve, ident), {"peer_only": True})
    v["diagnostic: no resolve, over CTAs, no signal"] = (inter.replace(old_resolve, ident),
                                                        {"peer_only": True, "signal": False})
    # small sends: the chunk path instead of the table mode (the variants above that edit
    # the chunk path only differ from the baseline where the chunk path runs)
    no_table = "    and.pred            %tab, %tab, !%cache_on;\n"
    assert BASE.count(no_table) == 1
    chunk_only = BASE.replace(no_table, no_table + "    setp.ne.u32         %tab, 0, 0;\n")
    v["chunk path (no table mode)"] = (chunk_only, {})
    # many short-lived CTAs (issue 15): the chunk path split over grid = rows / k CTAs, so
    # each CTA streams one small contiguous window (k rows) and exits
    for k, threads in ((1, 128), (1, 256), (2, 256), (2, 512), (4, 512), (8, 1024)):
        v[f"many CTAs: rows/{k} x {threads}"] = (chunk_only, {"threads": threads, "grid_rows": k})
        v[f"many CTAs: rows/{k} x {threads}, no signal"] = (chunk_only, {"threads": threads, "grid_rows": k,
                                                                        "signal": False})
    return v


def speculative_pairs(tile: str) -> str:
    """The tile path's last arriver without its pair-count round trip: every CTA reads the
    pair counts (ld.relaxed) together with its RMW on done[e]; the last arriver publishes
    them when they sum to the expert's rows (all rows counted: each count is final; reset
    with plain stores), else swaps them as the shipped kernel does. Not shipped: no faster."""
    atom = "    atom.relaxed.gpu.global.add.u64 %u3, [%u2], %units;\n"
    pairs = """    mul.wide.u32        %u1, %nexp, 8;
    add.s64             %u1, %kst, %u1;
    mad.wide.u32        %u1, %e, 32, %u1;           // &pair[e][0]
"""
    swap = "    setp.lt.u32         %pp0, 0, %np;\n    @%pp0 atom.relaxed.gpu.global.exch.b32 %c0, [%u1+0], 0;\n"
    for s in (atom, pairs, swap, "    @%pp7 atom.relaxed.gpu.global.exch.b32 %c7, [%u1+28], 0;\n"):
        assert tile.count(s) == 1, s
    r8 = range(8)
    early = (pairs + "".join(f"    setp.lt.u32         %pp{k}, {k}, %np;\n    mov.u32             %c{k}, 0;\n"
                             f"    @%pp{k} ld.relaxed.gpu.global.u32 %c{k}, [%u1+{4 * k}];\n" for k in r8))
    tile = tile.replace(pairs, "").replace(atom, early + atom)
    check = ("    add.u32             %t4, %c0, %c1;\n"
             + "".join(f"    add.u32             %t4, %t4, %c{k};\n" for k in range(2, 8))
             + "    mul.wide.u32        %u3, %t4, %nv;\n    setp.ne.s64         %q0, %u3, %u4;\n"
             + "    @%q0 bra            TILE_PAIRS_SWAP;\n"
             + "".join(f"    @%pp{k} st.relaxed.gpu.global.u32 [%u1+{4 * k}], 0;\n" for k in r8)
             + "    bra.uni             TILE_PAIRS_READ;\nTILE_PAIRS_SWAP:\n")
    last = "    @%pp7 atom.relaxed.gpu.global.exch.b32 %c7, [%u1+28], 0;\n"
    return tile.replace(swap, check + swap).replace(last, last + "TILE_PAIRS_READ:\n")


def swap(text: str, old: str, new: str) -> str:
    """``text`` with its one occurrence of ``old`` replaced (a variant's anchor must be unique)."""
    assert text.count(old) == 1, old
    return text.replace(old, new)


def second_round_early(text: str) -> str:
    """The tile path's range-table copy into shared memory: the second round of words (pair
    thr + blockDim, 128-thread tiles) loaded at kernel start with the first, instead of in
    the fill loop after the first round has landed. Not shipped: no faster."""
    for a, b in (("    .reg .b32   %so, %sr0, %sr1;", "    .reg .b32   %so, %sr0, %sr1, %sr2, %sr3;"),
                 ("    .reg .pred  %sq0, %sq1;", "    .reg .pred  %sq0, %sq1, %sq2;"),
                 ("    @%sq1 ld.global.v2.s32 {%sr0, %sr1}, [%u3];\n",
                  "    @%sq1 ld.global.v2.s32 {%sr0, %sr1}, [%u3];\n    mov.u32             %t2, %ntid.x;\n"
                  "    add.u32             %t3, %thr, %t2;\n    setp.lt.u32         %sq2, %t3, %t1;\n"
                  "    and.pred            %sq2, %sq2, %q0;\n    mad.wide.u32        %u3, %t2, 8, %u3;\n"
                  "    @%sq2 ld.global.v2.s32 {%sr2, %sr3}, [%u3];\n"),
                 ("    @%kp3 mov.u32       %t3, %sr1;\n",
                  "    @%kp3 mov.u32       %t3, %sr1;\n    add.u32             %t5, %thr, %nthr;\n"
                  "    setp.eq.u32         %q3, %t0, %t5;\n    and.pred            %q3, %q3, %sq2;\n"
                  "    @%q3 mov.u32        %t2, %sr2;\n    @%q3 mov.u32        %t3, %sr3;\n"
                  "    or.pred             %kp3, %kp3, %q3;\n")):
        text = swap(text, a, b)
    return text


def recv_preload(text: str) -> str:
    """p3_recv_reduce with a unit's first four slots loaded together with its routing
    (topk_idx, weights) when its CTA found every pair arrived at its start (then every
    slot is acquired): one round trip less per unit; a slot that is masked or past the row
    is zeroed after the load. Correct (tests/gpu/test_combine.py, test_world.py pass with
    it), not shipped: the decode round is slower with it."""
    def sw(a, b):
        nonlocal text
        text = swap(text, a, b)
    sw("    .reg .pred  %known;\n", "    .reg .pred  %known, %allseen, %pre;\n")
    seen0 = "    mov.u32             %seen, 0;\n"
    sw(seen0, seen0 + "    setp.ne.u32         %allseen, 0, 0;\n")
    seen = "    ld.shared.u32       %seen, [%t1];\n"   # every warp's bits, from warp 0
    sw(seen + "SEEN_DONE:\n", seen + """    sub.s32             %t1, %nslots, %lane;
    max.s32             %t1, %t1, 0;
    add.u32             %t1, %t1, 31;
    shr.u32             %t1, %t1, 5;                // slots this lane holds (<= 8)
    mov.u32             %t2, 1;
    shl.b32             %t2, %t2, %t1;
    sub.u32             %t2, %t2, 1;
    and.b32             %t3, %seen, %t2;
    setp.eq.u32         %q0, %t3, %t2;
    vote.sync.all.pred  %allseen, %q0, 0xffffffff;
    and.pred            %allseen, %allseen, %reduce;
SEEN_DONE:
""")
    addr = ("    cvt.u64.u32         %u3, %t3;\n    mad.lo.s64          %u3, %u3, %msg, %voff;\n"
            "    add.s64             %u3, %recv, %u3;\n")
    pre = "".join(f"    setp.lt.u32         %q1, {j}, %topk;\n    and.pred            %q1, %q1, %vin;\n"
                  f"    mad.lo.u32          %t3, %tok, %topk, {j};\n" + addr
                  + f"    @%q1 ld.global.v4.u32 {{%s{j}_0, %s{j}_1, %s{j}_2, %s{j}_3}}, [%u3];\n" for j in range(4))
    row = "    mad.lo.u32          %c, %c, 32, %lane;          // this lane's vector of the token's row\n"
    sw(row, row + "    mov.pred            %pre, %allseen;\n    @!%allseen bra      PRELOADED;\n"
       "    setp.lt.u32         %vin, %c, %nvec;\n    mul.wide.u32        %voff, %c, 16;\n" + pre + "PRELOADED:\n")
    for j in range(4):
        load = f"    @%ld{j} ld.global.v4.u32 {{%s{j}_0, %s{j}_1, %s{j}_2, %s{j}_3}}, [%u3];\n"
        zero = "".join(f"    mov.b32             %s{j}_{i}, 0;\n" for i in range(4))
        sw(zero, f"    and.pred            %q3, %pre, %ld{j};\n"
           + "".join(f"    @!%q3 mov.b32       %s{j}_{i}, 0;\n" for i in range(4)))
        sw(load, f"    and.pred            %q3, %ld{j}, !%pre;\n" + load.replace(f"@%ld{j}", "@%q3"))
    step = "    add.u32             %k, %k, 4;\n"
    sw(step, "    setp.ne.u32         %pre, 0, 0;\n" + step)
    return text


def recv_gpu_scope(text: str) -> str:
    """p3_recv_reduce with every .sys-scope load, fence and store at .gpu scope: correct only
    when every sender is on the receiver's GPU (as in the one-GPU round); not shipped (the
    receive has no flags parameter to choose it by)."""
    at = text.index(".visible .entry")
    return text[:at] + re.sub(r"\b(ld\.relaxed|ld\.acquire|fence\.acq_rel|st\.relaxed)\.sys\b", r"\1.gpu", text[at:])


def epilogue_items(text: str, n: int, incremental: bool = False) -> str:
    """p3_epilogue_send with n fp32 items (32 B per lane each) in flight per round instead
    of 8; incremental: each item's (stage row, column group) from the previous item's by an
    add and a conditional wrap, instead of a div and a rem per item and phase."""
    head = text.index("    // fp32 -> bf16: items (row, 8 columns)")
    tail = text.index("CONVERTED:")
    L = [f"    // fp32 -> bf16: items (row, 8 columns) of the stage, {n} per thread per round "
         f"({2 * n} loads in flight)",
         "    mul.lo.u32          %items, %valid, %nvt;", "    mov.u32             %t0, %tid.x;",
         "    mov.u32             %it, %t0;"]
    if incremental:
        L += ["    div.u32             %drw, %nthr_e, %nvt;        // item i+1 - item i: rows and column groups",
              "    rem.u32             %dcl, %nthr_e, %nvt;"]
    L += ["CONVERT:", "    setp.ge.u32         %q0, %it, %items;", "    @%q0 bra            CONVERTED;"]
    if incremental:
        L += ["    div.u32             %rw0, %it, %nvt;            // item 0: stage row, column group",
              "    rem.u32             %cl0, %it, %nvt;"]

    def locate(i):
        if not incremental:
            return ["    div.u32             %t1, %q, %nvt;              // stage row",
                    "    rem.u32             %t2, %q, %nvt;              // 8-column group"]
        if i == 0:
            return ["    mov.u32             %t1, %rw0;", "    mov.u32             %t2, %cl0;"]
        return ["    add.u32             %t1, %t1, %drw;", "    add.u32             %t2, %t2, %dcl;",
                "    setp.ge.u32         %q1, %t2, %nvt;", "    @%q1 sub.u32        %t2, %t2, %nvt;",
                "    @%q1 add.u32        %t1, %t1, 1;"]
    for i in range(n):
        f = 8 * i
        L += [f"    mad.lo.u32          %q, %nthr_e, {i}, %it;        // item {i} of this round",
              f"    setp.lt.u32         %ld{i}, %q, %items;", *locate(i),
              "    add.u32             %t3, %r0, %t1;", "    cvt.u64.u32         %u1, %t3;",
              "    mad.lo.u32          %t4, %t2, 8, %nabs;", "    mul.wide.u32        %u2, %t4, 4;",
              "    mad.lo.s64          %u1, %u1, %accs, %u2;", "    add.s64             %u1, %accp, %u1;",
              f"    @%ld{i} ld.global.nc.v4.f32 {{%f{f}, %f{f + 1}, %f{f + 2}, %f{f + 3}}}, [%u1];",
              f"    @%ld{i} ld.global.nc.v4.f32 {{%f{f + 4}, %f{f + 5}, %f{f + 6}, %f{f + 7}}}, [%u1+16];"]
    for i in range(n):
        f, h = 8 * i, 4 * i
        L += [f"    cvt.rn.bf16x2.f32   %h{h + j}, %f{f + 2 * j + 1}, %f{f + 2 * j};" for j in range(4)]
        if not incremental:
            L += [f"    mad.lo.u32          %q, %nthr_e, {i}, %it;"]
        L += [*locate(i), "    mad.lo.u32          %t3, %t1, %pitch, %buf;",
              "    mad.lo.u32          %t3, %t2, 16, %t3;",
              f"    @%ld{i} st.shared.v4.b32 [%t3], {{%h{h}, %h{h + 1}, %h{h + 2}, %h{h + 3}}};"]
    L += [f"    mul.lo.u32          %t1, %nthr_e, {n};", "    add.u32             %it, %it, %t1;",
          "    bra.uni             CONVERT;", ""]
    out = text[:head] + "\n".join(L) + text[tail:]
    if incremental and "%rw0" not in text[:head]:
        out = out.replace("    .reg .b32   %buf, %nvt,",
                          "    .reg .b32   %rw0, %cl0, %drw, %dcl;\n    .reg .b32   %buf, %nvt,", 1)
    return (out.replace("%ld<8>", f"%ld<{n}>").replace(".reg .f32   %f<64>", f".reg .f32   %f<{8 * n}>")
               .replace(".reg .b32   %h<32>", f".reg .b32   %h<{4 * n}>"))


def row_blocks(expert: str) -> str:
    """PTX: %t1, %t2 = the expert's first and end rows, %t3 = its row blocks of bm."""
    return f"""    mad.wide.u32        %u0, {expert}, 4, %offs;
    ld.global.nc.s32    %t1, [%u0];
    ld.global.nc.s32    %t2, [%u0+4];
    sub.s32             %t3, %t2, %t1;
    max.s32             %t3, %t3, 0;
    add.u32             %t3, %t3, %bmr;
    sub.u32             %t3, %t3, 1;
    div.u32             %t3, %t3, %bmr;
"""


def prefetch_rows(label: str, row: str, end: str, col: str, nbytes: str) -> str:
    """PTX: lanes bulk-prefetch into L2 the fp32 pieces (column col, nbytes bytes) of rows
    row, row+32, ... below end."""
    return f"""{label}_LOOP:
    setp.ge.s32         %q0, {row}, {end};
    @%q0 bra            {label}_DONE;
    cvt.u64.u32         %u1, {row};
    mul.wide.u32        %u2, {col}, 4;
    mad.lo.s64          %u1, %u1, %accs, %u2;
    add.s64             %u1, %accp, %u1;
    cp.async.bulk.prefetch.L2.global [%u1], {nbytes};
    add.u32             {row}, {row}, 32;
    bra.uni             {label}_LOOP;
{label}_DONE:
"""


def epilogue_prefetch(text: str, first_stage: bool) -> str:
    """p3_epilogue_send where warp 0 bulk-prefetches the tile's fp32 rows into L2 when the
    tile starts (rows past its first stage, or all of them), one cp.async.bulk.prefetch
    per row piece: DRAM reads in flight without registers or shared memory."""
    anchor = "    shr.u32             %nvt, %ncol_t, 3;           // 16-byte bf16 vectors per tile row\n"
    assert text.count(anchor) == 1
    start = "%mabs" if first_stage else "%t1"
    block = f"""    setp.ne.u32         %q0, %warp, 0;
    @%q0 bra            PF_DONE;
    add.u32             %t1, %mabs, %sr;
    add.u32             %t1, {start}, %lane;
    shl.b32             %t2, %ncol_t, 2;            // bytes of a row piece
{prefetch_rows("PF", "%t1", "%mend", "%nabs", "%t2")}"""
    return text.replace(anchor, anchor + block)


def epilogue_prefetch_next(text: str) -> str:
    """p3_epilogue_send where warp 0 bulk-prefetches the fp32 rows of this CTA's NEXT tile
    into L2 when a tile starts."""
    anchor = "    shr.u32             %nvt, %ncol_t, 3;           // 16-byte bf16 vectors per tile row\n"
    block = f"""    setp.ne.u32         %q0, %warp, 0;
    @%q0 bra            PFN_DONE;
    add.u32             %t5, %tile, 1;
    mov.u32             %t6, %e;
    mov.u32             %t7, %tbase;
PFN_SEARCH:
    setp.ge.u32         %q0, %t6, %nexp;
    @%q0 bra            PFN_DONE;
{row_blocks("%t6")}    mul.lo.u32          %t4, %t3, %nblk;
    sub.u32             %t0, %t5, %t7;
    setp.lt.u32         %q0, %t0, %t4;
    @%q0 bra            PFN_FOUND;
    add.u32             %t7, %t7, %t4;
    add.u32             %t6, %t6, 1;
    bra.uni             PFN_SEARCH;
PFN_FOUND:
    div.u32             %t3, %t0, %nblk;
    rem.u32             %t4, %t0, %nblk;
    mad.lo.u32          %t3, %t3, %bmr, %t1;
    add.u32             %t5, %t3, %bmr;
    min.s32             %t5, %t5, %t2;
    mul.lo.u32          %t4, %t4, %bnc;
    sub.u32             %t6, %ncols, %t4;
    min.u32             %t6, %t6, %bnc;
    shl.b32             %t6, %t6, 2;
    add.u32             %t3, %t3, %lane;
{prefetch_rows("PFN", "%t3", "%t5", "%t4", "%t6")}"""
    assert text.count(anchor) == 1
    return text.replace(anchor, anchor + block)


def epilogue_round_robin(text: str) -> str:
    """p3_epilogue_send with tile t going to CTA t mod G (the order before the contiguous
    tile ranges)."""
    for a, b in (("""    mul.lo.u32          %tile, %t2, %t6;
    add.u32             %tend, %tile, %t6;
    min.u32             %tend, %tend, %t5;
""", """    mov.u32             %tile, %t2;
    mov.u32             %tend, %t5;
"""), ("""    add.u32             %tile, %tile, 1;
    bra.uni             TILE;""", """    mov.u32             %t1, %nctaid.x;
    add.u32             %tile, %tile, %t1;
    bra.uni             TILE;""")):
        assert text.count(a) == 1, a
        text = text.replace(a, b)
    return text


def epilogue_variants():
    ld_l2 = EPI.replace("ld.global.nc.v4.f32", "ld.global.nc.L2::256B.v4.f32")
    st_cs = ROWS.replace("st.global.v4.u32    [%u1], {%d0", "st.global.cs.v4.u32 [%u1], {%d0")
    return {"baseline": (EPI, ROWS), "ld .L2::256B": (ld_l2, ROWS), "st.cs": (EPI, st_cs),
            "4 items": (epilogue_items(EPI, 4), ROWS),
            "12 items": (epilogue_items(EPI, 12), ROWS), "16 items": (epilogue_items(EPI, 16), ROWS),
            "8 items, incremental index": (epilogue_items(EPI, 8, True), ROWS),
            "12 items, incremental index": (epilogue_items(EPI, 12, True), ROWS),
            "16 items, incremental index": (epilogue_items(EPI, 16, True), ROWS),
            "tiles round-robin over CTAs": (epilogue_round_robin(EPI), ROWS),
            "tiles column-major": (EPI.replace("div.u32             %t5, %t4, %nblk;            // row block\n"
                                               "    rem.u32             %t6, %t4, %nblk;",
                                               "rem.u32             %t5, %t4, %t3;\n"
                                               "    div.u32             %t6, %t4, %t3;"), ROWS),
            "diagnostic: no fp32 loads (constants converted)": (re.sub(
                r"@%ld\d+ ld\.global\.nc\.v4\.f32 \{(%f\d+), (%f\d+), (%f\d+), (%f\d+)\}, \[[^\]]+\];",
                lambda m: " ".join(f"mov.f32 {r}, 0f3F800000;" for r in m.groups()), EPI), ROWS),
            "L2 prefetch, later stages": (epilogue_prefetch(EPI, False), ROWS),
            "L2 prefetch, whole tile": (epilogue_prefetch(EPI, True), ROWS),
            "L2 prefetch, next tile": (epilogue_prefetch_next(EPI), ROWS),
            "L2 prefetch, this + next tile": (epilogue_prefetch_next(epilogue_prefetch(EPI, False)), ROWS)}


def run_epilogue(a, dev) -> None:
    import torch
    from p3send.cli.bench import EPILOGUE_GEOMETRIES
    rng = np.random.default_rng(1)
    hidden, top_k, ranks, experts = 7168, 8, a.ranks, 32
    rows, msg = a.tokens * top_k, 2 * hidden
    off, table, src, _ = prefill_routing(a.tokens, ranks, top_k, experts, rng)
    acc = torch.randn((rows, hidden), dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    recvs = [driver.DeviceBuffer(rows * msg) for _ in range(ranks)]
    counts = [driver.DeviceBuffer(8 * experts * ranks, fill=0xFF) for _ in range(ranks)]
    rtab, srcb, offs = (driver.DeviceBuffer.from_array(x) for x in (table, src, off))
    cache = driver.DeviceBuffer(8 * rows, fill=0)
    cfg = rank_config(n_ranks=ranks, recv_bufs=recvs, top_k=top_k, msg_bytes=msg, max_tokens=a.tokens,
                      range_table=rtab, src_info=srcb, row_base=cache)
    s = driver.Stream()
    timer = Timer(s)
    z = timer.run(lambda i: cache.fill(0, s), a.iters, 5)["median_us"]
    print(f"epilogue variants, {rows} rows x {hidden} fp32, as the benchmark: no row cache, .gpu-scope "
          f"signal; row-cache zeroing alone {z:.1f} us")
    geos = [dict(zip(("bm", "bn", "num_stages", "send_warps", "epilogue_warps"), map(int, g.split(","))))
            for g in a.geometry] or list(EPILOGUE_GEOMETRIES[:2])
    kw = dict(expert_offsets_host=off, count_ptrs=counts, rows_in_acc=rows)
    for geo in geos:
        for name, (epi, rws) in epilogue_variants().items():
            if a.variant and name != "baseline" and not any(v in name for v in a.variant):
                continue
            fused = EpilogueSend(experts, device=dev, **geo)
            fused.k = loader.load(ptxdoc.module_text(epi, [("p3_send_rows.ptx", rws)]), device=dev,
                                   name=f"variant {name}")["p3_epilogue_send"]
            driver.set_max_dynamic_smem(fused.k.func, fused.smem)
            fused.grid = max(1, driver.occupancy(fused.k.func, fused.threads, fused.smem)) * dev.sm_count
            fused.block = fused.k.params_block()
            blk = fused.prepare(cfg, acc, hidden, offs, same_gpu=True, **kw)
            t = timer.run(lambda i, fused=fused, blk=blk: fused.launch(s, blk), a.iters, 5)
            print("bm{bm} bn{bn} S{num_stages} N{send_warps} E{epilogue_warps}".format(**geo),
                  f"{name:<24} {t['median_us']:8.1f} us (min {t['min_us']:.1f}, regs {fused.k.num_regs}, "
                  f"grid {fused.grid})")
            if name != "baseline":
                fused.close()
                continue
            diagnostics = (("p3_control < 0 (loads, converts, handshakes; nothing sent)",
                            dict(same_gpu=True, p3_control=-1), False),
                           (".sys-scope signal", {}, False),
                           ("row cache on (zeroed before every launch)", dict(same_gpu=True, row_cache=True), True))
            for label, opts, zero in diagnostics:
                d_blk = fused.prepare(cfg, acc, hidden, offs, **opts, **kw)

                def run(i, blk=d_blk, zero=zero, fused=fused):
                    if zero:
                        cache.fill(0, s)
                    fused.launch(s, blk)
                t = timer.run(run, a.iters, 5)
                print(f"{'':21}diagnostic: {label:<24} {t['median_us']:8.1f} us")
            fused.close()
    for b in recvs + counts + [rtab, srcb, offs, cache]:
        b.free()


def run_decode(a, dev) -> None:
    from p3send.ops.combine import Combine
    from p3send.oracle.cases import world_case
    world = world_case(n_ranks=8, tokens=128, top_k=8, n_local=32, hidden=7168, seed=1)
    n = dev.sm_count
    for share, recv_ctas in ((None, None), (n // 4, None), (n, None), (n, n // 8), (n, n // 4), (n, n),
                             (None, 4 * n), (n, 4 * n)):
        comb = Combine(8, max_tokens=128, top_k=8, hidden=7168, n_local_experts=32, device=dev,
                       stamps=False, num_sms=share)
        if a.send_ptx:   # another version of p3_scatter_send.ptx
            k = loader.load(a.send_ptx, device=dev, name="send variant")["p3_scatter_send"]
            driver.set_max_dynamic_smem(k.func, ScatterSend.SMEM_PER_THREAD * ScatterSend.THREADS)
            for snd in comb.senders:
                snd.k, snd.block = k, k.params_block()
        for r in comb.receivers:
            r.max_ctas = recv_ctas or r.max_ctas
            if a.recv_ptx or a.recv_variant:   # another version of p3_recv_reduce.ptx
                text = a.recv_ptx or RECV_VARIANTS[a.recv_variant](RECV)
                r.k = loader.load(text, device=dev)["p3_recv_reduce"]
                r.block = r.k.params_block()
        comb.load_world(world)
        for r, snd in enumerate(comb.senders):   # the rows known on the host: the tile grid's size
            snd.tile_launch = True
            snd.prepare(comb.cfgs[r], comb.c[r], comb.offs[r], count_ptrs=[comb.counts[p] for p in range(8)],
                        rows_in_c=comb.max_rows, same_gpu=True, expert_offsets_host=world.ranks[r].expert_offsets)
        comb.round()
        times = {}
        for label, kw in (("round", {}), ("sends only", {"receive": False})):
            graph = comb.capture(**kw)
            times[label] = Timer(comb.origin).run(lambda i: graph.launch(comb.origin), 4 * a.iters, 10)["median_us"]
            graph.close()
        comb.round()
        snd0 = comb.senders[0]
        shape = snd0.block.launch_shape or (snd0.grid, snd0.threads, snd0.smem)
        print(f"decode: send SMs/rank {comb.senders[0].grid:>3} (launch {shape[0]} x {shape[1]}), "
              f"receive CTAs/rank {comb.receivers[0].grid:>3}: "
              f"round {times['round']:.1f} us, sends only {times['sends only']:.1f} us")
        comb.close()


RECV_VARIANTS = {"preload": recv_preload, "gpu-scope": recv_gpu_scope}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (rows = tokens x 8)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=8, help="receiving ranks (one buffer each, on this GPU)")
    ap.add_argument("--sets", type=int, default=1, help="copies of C read in turn (8 x 14.7 MB leaves L2)")
    ap.add_argument("--rotate-recv", action="store_true", help="with --sets: as many receive-buffer sets, in turn")
    ap.add_argument("--peer", action="store_true",
                    help="send from GPU 0 into GPU 1 (every row remote) against cuMemcpyPeerAsync")
    ap.add_argument("--epilogue", action="store_true", help="p3_epilogue_send variants")
    ap.add_argument("--decode", action="store_true", help="one-GPU decode round: SM shares")
    ap.add_argument("--recv-ptx", default=None, help="with --decode: this version of p3_recv_reduce.ptx")
    ap.add_argument("--send-ptx", default=None, help="with --decode: this version of p3_scatter_send.ptx")
    ap.add_argument("--recv-variant", choices=("preload", "gpu-scope"), default=None,
                    help="with --decode: that variant of p3_recv_reduce (RECV_VARIANTS)")
    ap.add_argument("--variant", action="append", default=[], help="only variants naming this (and the baseline)")
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE",
                    help="also time FILE, another version of p3_scatter_send.ptx, as variant NAME")
    ap.add_argument("--geometry", action="append", default=[], metavar="BM,BN,S,N,E",
                    help="with --epilogue: geometries to time (default: the first two of the benchmark's)")
    a = ap.parse_args()
    dev = driver.device()
    if a.epilogue:
        run_epilogue(a, dev)
        return 0
    if a.decode:
        run_decode(a, dev)
        return 0
    rng = np.random.default_rng(1)
    hidden, top_k, ranks, experts = 7168, 8, a.ranks, 32
    msg, rows = 2 * hidden, a.tokens * top_k
    # --sets N: N copies of C, launch i reading copy i mod N (as the bench rotates its inputs past L2)
    cs = [random_bytes(rows * msg, rng) for _ in range(a.sets)]
    keep = []
    if a.peer:
        peer = driver.device(1)
        dev.enable_peer_access(peer)
        peer.enable_peer_access(dev)
        ranks = 2
        off = np.concatenate([[0], np.cumsum(np.full(experts, rows // experts))]).astype(np.int32)
        owned = np.zeros((experts, 2), np.int64)
        owned[:, 1] = np.diff(off)
        table = encode_range_table(off, owned)
        src = np.stack([np.arange(rows) // top_k, np.arange(rows) % top_k], 1).astype(np.int32)
        peer.activate()
        far = [driver.DeviceBuffer(rows * msg), driver.DeviceBuffer(8 * experts * ranks, fill=0xFF)]
        dev.activate()
        near = [driver.DeviceBuffer(rows * msg), driver.DeviceBuffer(8 * experts * ranks, fill=0xFF)]
        recv_ptrs, counts = [near[0].ptr, far[0].ptr], [near[1], far[1]]
        keep += near + far
    else:
        off, table, src, _ = prefill_routing(a.tokens, ranks, top_k, experts, rng)
        recvs = [driver.DeviceBuffer(a.tokens * top_k * msg) for _ in range(ranks * (a.sets if a.rotate_recv else 1))]
        counts = [driver.DeviceBuffer(8 * experts * ranks, fill=0xFF) for _ in range(ranks)]
        recv_ptrs = [b.ptr for b in recvs[:ranks]]
        keep += recvs + counts
    rtab, srcb = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offs = driver.DeviceBuffer.from_array(off)
    cfg = rank_config(n_ranks=ranks, recv_bufs=recv_ptrs, top_k=top_k, msg_bytes=msg, max_tokens=a.tokens,
                      range_table=rtab, src_info=srcb)
    # --rotate-recv: launch i also writes receive-buffer set i mod sets (as the bench does)
    cfgs = [cfg] + [rank_config(n_ranks=ranks, recv_bufs=[b.ptr for b in recvs[j * ranks:(j + 1) * ranks]],
                                top_k=top_k, msg_bytes=msg, max_tokens=a.tokens, range_table=rtab, src_info=srcb)
                    for j in range(1, a.sets if a.rotate_recv and not a.peer else 1)]
    s = driver.Stream()
    timer = Timer(s)
    if a.peer:
        ref_name = "cuMemcpyPeerAsync"
        ref = timer.run(lambda i: driver.memcpy_peer(far[0].ptr, peer, cs[i % a.sets].ptr, dev, rows * msg, s),
                        a.iters, 5)["median_us"]
    else:
        ref_name = "d2d copy"
        dst = driver.DeviceBuffer(rows * msg)
        ref = timer.run(lambda i: driver.memcpy_dtod(dst.ptr, cs[i % a.sets].ptr, rows * msg, s), a.iters,
                        5)["median_us"]
    print(f"{rows} rows x {msg} B{' GPU0 -> GPU1' if a.peer else ''}: {ref_name} {ref:.1f} us")
    todo = variants()
    # the tile's row range known at launch instead of loaded at kernel start (timing only:
    # this tool's routing starts at row 0): what the first round trip before the loads costs
    r0 = "    ld.global.nc.s32    %tR0, [%u6];                // R0 = off[0]\n"
    r1 = "    ld.global.nc.s32    %tR1, [%u3];                // R1 = off[n_experts]\n"
    known = swap(swap(BASE, r0, "    mov.u32             %tR0, 0;\n"), r1, f"    mov.u32             %tR1, {rows};\n")
    todo["tile, row range known at launch (timing only)"] = (known, {"tile": True})
    todo["tile, row range known at launch, no signal (timing only)"] = (known, {"tile": True, "signal": False})
    for spec in a.ptx:
        name, _, rest = spec.partition("=")
        path, _, shape = rest.partition("@")      # NAME=FILE[@GRIDxTHREADS] (GRID 0: the launcher's own)
        opt = {"tile": True}
        if shape:
            g, t = (int(x) for x in shape.split("x"))
            opt = {"threads": t, **({"grid": g} if g else {})}
        todo[name] = (open(path).read(), opt)
        todo[name + ", no signal"] = (todo[name][0], {**opt, "signal": False})
    for name, (text, opt) in todo.items():
        if (a.peer and opt.get("local_only")) or (not a.peer and opt.get("peer_only")):
            continue
        if a.variant and name != "baseline" and not any(v in name for v in a.variant):
            continue
        threads = opt.get("threads", 1024)
        sender = ScatterSend(experts, device=dev, threads=threads)
        sender.k = loader.load(text, device=dev, name=f"variant {name}")["p3_scatter_send"]
        driver.set_max_dynamic_smem(sender.k.func, max(sender.smem, 192 * 1024))
        sender.tile_launch = bool(opt.get("tile"))
        for attr in ("tile_threads", "TILE_VECTORS"):
            if attr in opt:
                setattr(sender, attr, opt[attr])
        blks = [sender.prepare(cfgs[j % len(cfgs)], cc, offs, expert_offsets_host=off, rows_in_c=rows,
                               count_ptrs=counts if opt.get("signal", True) else None,
                               into=sender.k.params_block()) for j, cc in enumerate(cs)]
        blk = blks[0]
        # variants with their own grid (the persistent kernel's shapes); tile variants keep
        # the launcher's tile launch
        if not opt.get("tile") or any(k in opt for k in ("grid_mult", "grid_div", "grid_rows", "grid")):
            grid = dev.sm_count * opt.get("grid_mult", 1) // opt.get("grid_div", 1)
            if "grid_rows" in opt:
                grid = min(65535, max(1, rows // opt["grid_rows"]))
            grid = opt.get("grid", grid)
            for b in blks:
                b.launch_shape = (grid, threads, sender.smem)
        t = timer.run(lambda i: sender.launch(s, blks[i % a.sets]), a.iters, 5)
        g, thr, sm = blk.launch_shape or (sender.grid, sender.threads, sender.smem)
        print(f"{name:<24} {t['median_us']:8.1f} us  {t['median_us'] / ref:.3f}x {ref_name}  "
              f"(min {t['min_us']:.1f}, regs {sender.k.num_regs}, grid {g} x {thr}, smem {sm})")
        sender.close()
    # signal latency (one-warp pair, kernels concurrent) of the fence variants
    from p3send.cli import bench
    from p3send.ops import send as send_ops     # ScatterSend looks its kernel up there
    orig = send_ops.kernel
    recv_dev = driver.device(1) if a.peer else dev
    clock = bench.clock_offset(dev, recv_dev) if a.peer else {"offset_ns": 0.0}
    if "offset_ns" not in clock:
        print(f"latency: no clock offset between the GPUs ({clock.get('error')}); skipped")
        clock = None
    for name in ("baseline",) + (() if a.peer else ("gpu-scope fences",)) if clock else ():
        k = loader.load(variants()[name][0], device=dev, name=f"variant {name}")["p3_scatter_send"]
        send_ops.kernel = lambda entry, device=None, k=k: k if entry == "p3_scatter_send" else orig(entry, device)
        try:
            lat = bench.signal_latency(dev, recv_dev, msg, 1, 1, threads=32, clock_offset_ns=clock["offset_ns"])
        finally:
            send_ops.kernel = orig
        print(f"latency {name:<24} median {lat['median_us']:.2f} us, min {lat['min_us']:.2f} us")
    for b in keep + cs + [rtab, srcb, offs]:
        b.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
