"""Maintainer experiment, not maintained (experiments/README.md): how fast can the SMs
copy on this GPU, next to the driver's device-to-device copy? Two minimal copy kernels
(written here, not shipped): a grid-stride 16-byte load/store copy, and a bulk-copy (TMA,
cp.async.bulk) copy through shared memory. The scatter-send can only be as fast as the
SM-issued copy."""
from __future__ import annotations

import argparse

import numpy as np

from p3send.bench.data import random_bytes
from p3send.bench.timing import Timer
from p3send.cuda import driver, loader

COPY_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry copy_v4(.param .u64 dst, .param .u64 src, .param .u64 nvec)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b32 %a<16>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nvec];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mad.lo.u32 %r5, %r1, %r2, %r3;
    cvt.u64.u32 %rd4, %r5;                 // v
    mul.wide.u32 %rd5, %r4, %r2;           // stride
    shl.b64 %rd6, %rd5, 2;                 // 4*stride
LOOP:
    mad.lo.u64 %rd7, %rd5, 3, %rd4;
    setp.ge.u64 %p, %rd7, %rd3;
    @%p bra TAIL;
    mad.lo.u64 %rd8, %rd4, 16, %rd2;
    shl.b64 %rd9, %rd5, 4;
    add.s64 %rd10, %rd8, %rd9;
    add.s64 %rd11, %rd10, %rd9;
    add.s64 %rd12, %rd11, %rd9;
    ld.global.nc.v4.u32 {%a0, %a1, %a2, %a3}, [%rd8];
    ld.global.nc.v4.u32 {%a4, %a5, %a6, %a7}, [%rd10];
    ld.global.nc.v4.u32 {%a8, %a9, %a10, %a11}, [%rd11];
    ld.global.nc.v4.u32 {%a12, %a13, %a14, %a15}, [%rd12];
    mad.lo.u64 %rd8, %rd4, 16, %rd1;
    add.s64 %rd10, %rd8, %rd9;
    add.s64 %rd11, %rd10, %rd9;
    add.s64 %rd12, %rd11, %rd9;
    st.global.v4.u32 [%rd8], {%a0, %a1, %a2, %a3};
    st.global.v4.u32 [%rd10], {%a4, %a5, %a6, %a7};
    st.global.v4.u32 [%rd11], {%a8, %a9, %a10, %a11};
    st.global.v4.u32 [%rd12], {%a12, %a13, %a14, %a15};
    add.s64 %rd4, %rd4, %rd6;
    bra.uni LOOP;
TAIL:
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    mad.lo.u64 %rd8, %rd4, 16, %rd2;
    ld.global.nc.v4.u32 {%a0, %a1, %a2, %a3}, [%rd8];
    mad.lo.u64 %rd8, %rd4, 16, %rd1;
    st.global.v4.u32 [%rd8], {%a0, %a1, %a2, %a3};
    add.s64 %rd4, %rd4, %rd5;
    bra.uni TAIL;
DONE:
    ret;
}
"""

# The same copy with the scatter-send's work split: CTA c copies the contiguous window
# [c*n/G, (c+1)*n/G) of vectors, its threads striding through it.
WINDOW_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry copy_v4_window(.param .u64 dst, .param .u64 src, .param .u64 nvec)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b32 %a<4>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nvec];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %nctaid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    cvt.u64.u32 %rd4, %r1;
    cvt.u64.u32 %rd5, %r2;
    mul.lo.u64 %rd6, %rd3, %rd4;
    div.u64 %rd6, %rd6, %rd5;              // window start
    add.s64 %rd7, %rd4, 1;
    mul.lo.u64 %rd7, %rd3, %rd7;
    div.u64 %rd7, %rd7, %rd5;              // window end
    cvt.u64.u32 %rd8, %r3;
    add.s64 %rd6, %rd6, %rd8;
    cvt.u64.u32 %rd9, %r4;
LOOP:
    setp.ge.u64 %p, %rd6, %rd7;
    @%p bra DONE;
    mad.lo.u64 %rd10, %rd6, 16, %rd2;
    ld.global.nc.v4.u32 {%a0, %a1, %a2, %a3}, [%rd10];
    mad.lo.u64 %rd10, %rd6, 16, %rd1;
    st.global.v4.u32 [%rd10], {%a0, %a1, %a2, %a3};
    add.s64 %rd6, %rd6, %rd9;
    bra.uni LOOP;
DONE:
    ret;
}
"""

# The copy with the scatter's bookkeeping, as a small-send design probe: every CTA first
# stages a per-row destination table (u64 per row, read from global memory: one load per
# row, standing in for the resolve) in shared memory, with its first four vectors' loads
# already in flight; then the grid-stride copy stores vector v to table[v / nv] + 16*(v % nv);
# at the end, bar.sync, one .sys fence and one atomic per CTA, and the last CTA stores a flag
# with st.release.sys (the signal's shape).
def _per_vector(ptx: str, first: str, then: str) -> str:
    """The round's four vectors (v + j*S, j < 4; data in %a4j..%a4j+3): the line first (j = 0)
    or then (j > 0), followed by ptx.format(j=, a=)."""
    return "".join((then if j else first) + ptx.format(j=j, a=", ".join(f"%a{4 * j + i}" for i in range(4)))
                   for j in range(4))


# guards %q0..%q3 (vector %rd4 + j*S exists) and the first load address
_TABLE_GUARDS = """    mad.lo.u64 %rd7, %rd5, 3, %rd4;
    setp.lt.u64 %q0, %rd4, %rd3;
    add.s64 %rd10, %rd4, %rd5;
    setp.lt.u64 %q1, %rd10, %rd3;
    add.s64 %rd11, %rd10, %rd5;
    setp.lt.u64 %q2, %rd11, %rd3;
    setp.lt.u64 %q3, %rd7, %rd3;
    mad.lo.u64 %rd8, %rd4, 16, %rd2;
"""
# the loads (%rd9 = 16*S)
_TABLE_LOADS = _per_vector("    @%q{j} ld.global.nc.v4.u32 {{{a}}}, [%rd8];\n", "", "    add.s64 %rd8, %rd8, %rd9;\n")
# vector j goes to table[v / nv] + 16*(v % nv)
_TABLE_STORES = _per_vector("""    div.u64 %rd17, %rd16, %rd15;
    mul.lo.u64 %rd18, %rd17, %rd15;
    sub.s64 %rd18, %rd16, %rd18;
    cvt.u32.u64 %r7, %rd17;
    mov.u32 %r8, s_tab;
    mad.lo.u32 %r8, %r7, 8, %r8;
    @%q{j} ld.shared.u64 %rd19, [%r8];
    mad.lo.u64 %rd19, %rd18, 16, %rd19;
    @%q{j} st.global.v4.u32 [%rd19], {{{a}}};
""", "    mov.b64 %rd16, %rd4;\n", "    add.s64 %rd16, %rd16, %rd5;\n")
TABLE_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.extern .shared .align 16 .b8 s_tab[];
.visible .entry copy_table(.param .u64 table, .param .u64 src, .param .u64 nvec, .param .u32 nv,
                           .param .u32 rows, .param .u64 counter, .param .u64 flag)
{
    .reg .pred %p, %q<4>;
    .reg .b32 %r<16>;
    .reg .b32 %a<16>;
    .reg .b64 %rd<24>;
    ld.param.u64 %rd1, [table];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nvec];
    ld.param.u32 %r10, [nv];
    ld.param.u32 %r11, [rows];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mad.lo.u32 %r5, %r1, %r2, %r3;
    cvt.u64.u32 %rd4, %r5;                 // v
    mul.wide.u32 %rd5, %r4, %r2;           // stride S
    // first four vectors' loads in flight before the table
""" + _TABLE_GUARDS + "    shl.b64 %rd9, %rd5, 4;\n" + _TABLE_LOADS + r"""    // the table
    mov.u32 %r6, %r3;
TAB:
    setp.ge.u32 %p, %r6, %r11;
    @%p bra TAB_DONE;
    mul.wide.u32 %rd12, %r6, 8;
    add.s64 %rd13, %rd1, %rd12;
    ld.global.nc.u64 %rd14, [%rd13];
    mov.u32 %r7, s_tab;
    mad.lo.u32 %r7, %r6, 8, %r7;
    st.shared.u64 [%r7], %rd14;
    add.u32 %r6, %r6, %r2;
    bra.uni TAB;
TAB_DONE:
    bar.sync 0;
    cvt.u64.u32 %rd15, %r10;
LOOP:
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra END;
    // store the four vectors held in registers
""" + _TABLE_STORES + r"""    // next four: load
    shl.b64 %rd6, %rd5, 2;
    add.s64 %rd4, %rd4, %rd6;
""" + _TABLE_GUARDS + _TABLE_LOADS + r"""    bra.uni LOOP;
END:
    ld.param.u64 %rd20, [counter];
    setp.eq.u64 %p, %rd20, 0;
    @%p bra DONE;
    bar.sync 0;
    setp.ne.u32 %p, %r3, 0;
    @%p bra DONE;
    fence.acq_rel.sys;
    atom.relaxed.gpu.global.add.u32 %r12, [%rd20], 1;
    add.u32 %r12, %r12, 1;
    setp.ne.u32 %p, %r12, %r4;
    @%p bra DONE;
    fence.acq_rel.sys;
    st.relaxed.gpu.global.u32 [%rd20], 0;
    ld.param.u64 %rd21, [flag];
    st.relaxed.sys.global.u32 [%rd21], %r4;
DONE:
    ret;
}
"""

# One thread per CTA drives a ring of S stages of CH bytes: loads run L chunks ahead of
# the stores; a stage is reloaded only after the store that read it has finished reading.
BULK_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.extern .shared .align 128 .b8 ring[];
.visible .entry copy_bulk(.param .u64 dst, .param .u64 src, .param .u64 nchunks, .param .u32 chunk)
{
    .shared .align 8 .b64 bars[16];
    .reg .pred %p, %q;
    .reg .b32 %r<16>;
    .reg .b64 %rd<16>;
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p, %r1, 0;
    @%p bra DONE;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nchunks];
    ld.param.u32 %r2, [chunk];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %nctaid.x;
    // my chunks: c = ctaid + k*nctaid, k = 0..n-1
    cvt.u64.u32 %rd4, %r3;
    cvt.u64.u32 %rd5, %r4;
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    sub.s64 %rd6, %rd3, %rd4;
    add.s64 %rd6, %rd6, %rd5;
    sub.s64 %rd6, %rd6, 1;
    div.u64 %rd6, %rd6, %rd5;              // n
    mov.u32 %r5, 0;
INIT:
    mov.u32 %r6, bars;
    mad.lo.u32 %r6, %r5, 8, %r6;
    mbarrier.init.shared::cta.b64 [%r6], 1;
    add.u32 %r5, %r5, 1;
    setp.lt.u32 %p, %r5, 12;
    @%p bra INIT;
    fence.mbarrier_init.release.cluster;
    fence.proxy.async.shared::cta;
    mov.u64 %rd7, 0;                        // k: iteration
    add.s64 %rd8, %rd6, 6;                  // n + L
LOOP:
    setp.ge.u64 %p, %rd7, %rd8;
    @%p bra DRAIN;
    setp.ge.u64 %p, %rd7, %rd6;
    @%p bra STORE_PART;
    // load chunk k into stage k % 12 once the store of chunk k-12 has read it
    setp.ge.u64 %q, %rd7, 12;
    @%q cp.async.bulk.wait_group.read 5;    // S - L - 1 store groups may stay pending
    rem.u64 %rd9, %rd7, 12;
    cvt.u32.u64 %r7, %rd9;
    mov.u32 %r6, bars;
    mad.lo.u32 %r6, %r7, 8, %r6;
    mov.u32 %r8, ring;
    mad.lo.u32 %r8, %r7, %r2, %r8;
    mad.lo.u64 %rd10, %rd7, %rd5, %rd4;     // chunk index
    cvt.u64.u32 %rd11, %r2;
    mad.lo.u64 %rd12, %rd10, %rd11, %rd2;
    mbarrier.arrive.expect_tx.shared::cta.b64 %rd13, [%r6], %r2;
    cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r8], [%rd12], %r2, [%r6];
STORE_PART:
    setp.lt.u64 %p, %rd7, 6;
    @%p bra NEXT;
    sub.s64 %rd9, %rd7, 6;                  // j = k - L
    rem.u64 %rd10, %rd9, 12;
    cvt.u32.u64 %r7, %rd10;
    div.u64 %rd10, %rd9, 12;
    cvt.u32.u64 %r9, %rd10;
    and.b32 %r9, %r9, 1;                    // phase parity of stage use j / S
    mov.u32 %r6, bars;
    mad.lo.u32 %r6, %r7, 8, %r6;
    mov.u32 %r10, 0;
WAIT:
    mbarrier.try_wait.parity.shared::cta.b64 %q, [%r6], %r9;
    add.u32 %r10, %r10, 1;
    setp.gt.u32 %p, %r10, 100000000;
    @%p bra DONE;                           // never hang an experiment
    @!%q bra WAIT;
    mov.u32 %r8, ring;
    mad.lo.u32 %r8, %r7, %r2, %r8;
    mad.lo.u64 %rd10, %rd9, %rd5, %rd4;
    cvt.u64.u32 %rd11, %r2;
    mad.lo.u64 %rd12, %rd10, %rd11, %rd1;
    cp.async.bulk.global.shared::cta.bulk_group [%rd12], [%r8], %r2;
    cp.async.bulk.commit_group;
NEXT:
    add.s64 %rd7, %rd7, 1;
    bra.uni LOOP;
DRAIN:
    cp.async.bulk.wait_group 0;
DONE:
    ret;
}
"""


def _tile_signal(scope: str | None, skip: str, width: str, reg: str, total: str) -> str:
    """A tile's end as the send signals: bar.sync, thread 0's fence at ``scope`` and one
    counter atomic (the last tile resets the counter); empty without a scope."""
    add = "add.s64" if width == "u64" else "add.u32"
    return "" if not scope else f"""    bar.sync 0;
    setp.ne.u32 %p, %r3, 0;
    @%p bra {skip};
    fence.acq_rel.{scope};
    atom.relaxed.gpu.global.add.{width} {reg}, [%rd10], 1;
    {add} {reg}, {reg}, 1;
    setp.eq.{width} %p, {reg}, {total};
    @%p st.relaxed.gpu.global.{width} [%rd10], 0;
"""


# Copy shapes: the driver-like tile grid (CTA c copies the contiguous tile of
# ntid*V vectors c, c+G, ...; with G = tiles each CTA copies one tile and exits), and a
# persistent grid whose CTAs claim tiles in order from an atomic counter (dynamic
# scheduling imitating the hardware's). Each thread issues its V loads, then its V stores.
# With a counter, each tile ends like the send's signal: bar.sync, thread 0's fence at
# scope S and one atomic per tile (the last tile's resets the counter).
def tile_ptx(v: int, scope: str | None) -> str:
    name = f"copy_tile{v}" + (f"_{scope}" if scope else "")
    loads = "".join(f"""    mad.lo.u64 %rd8, %rd6, {j}, %rd4;
    setp.lt.u64 %q{j}, %rd8, %rd3;
    mad.lo.u64 %rd9, %rd8, 16, %rd2;
    @%q{j} ld.global.nc.v4.u32 {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}}, [%rd9];
""" for j in range(v))
    stores = "".join(f"""    mad.lo.u64 %rd8, %rd6, {j}, %rd4;
    mad.lo.u64 %rd9, %rd8, 16, %rd1;
    @%q{j} st.global.v4.u32 [%rd9], {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}};
""" for j in range(v))
    signal = _tile_signal(scope, "NEXT", "u64", "%rd12", "%rd11")
    return f"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry {name}(.param .u64 dst, .param .u64 src, .param .u64 nvec, .param .u64 counter)
{{
    .reg .pred %p, %q<{v}>;
    .reg .b32 %r<8>;
    .reg .b32 %a<{4*v}>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nvec];
    ld.param.u64 %rd10, [counter];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd6, %r2;                 // ntid: stride between a thread's vectors
    mul.lo.u64 %rd7, %rd6, {v};            // vectors per tile
    add.s64 %rd11, %rd3, %rd7;
    sub.s64 %rd11, %rd11, 1;
    div.u64 %rd11, %rd11, %rd7;            // tiles
    cvt.u64.u32 %rd5, %r1;                 // tile
TILE:
    setp.ge.u64 %p, %rd5, %rd11;
    @%p bra DONE;
    cvt.u64.u32 %rd4, %r3;
    mad.lo.u64 %rd4, %rd5, %rd7, %rd4;     // this thread's first vector
{loads}{stores}{signal}NEXT:
    cvt.u64.u32 %rd13, %r4;
    add.s64 %rd5, %rd5, %rd13;
    bra.uni TILE;
DONE:
    ret;
}}
"""


def dyn_ptx(v: int) -> str:
    loads = "".join(f"""    mad.lo.u64 %rd8, %rd6, {j}, %rd4;
    setp.lt.u64 %q{j}, %rd8, %rd3;
    mad.lo.u64 %rd9, %rd8, 16, %rd2;
    @%q{j} ld.global.nc.v4.u32 {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}}, [%rd9];
""" for j in range(v))
    stores = "".join(f"""    mad.lo.u64 %rd8, %rd6, {j}, %rd4;
    mad.lo.u64 %rd9, %rd8, 16, %rd1;
    @%q{j} st.global.v4.u32 [%rd9], {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}};
""" for j in range(v))
    return f"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry copy_dyn{v}(.param .u64 dst, .param .u64 src, .param .u64 nvec, .param .u64 counter)
{{
    .shared .align 4 .b32 s_tile[2];
    .reg .pred %p, %t0, %q<{v}>;
    .reg .b32 %r<12>;
    .reg .b32 %a<{4*v}>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [nvec];
    ld.param.u64 %rd10, [counter];         // u32 [0] next tile, [1] CTAs finished
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    setp.eq.u32 %t0, %r3, 0;
    cvt.u64.u32 %rd6, %r2;
    mul.lo.u64 %rd7, %rd6, {v};
    add.s64 %rd11, %rd3, %rd7;
    sub.s64 %rd11, %rd11, 1;
    div.u64 %rd11, %rd11, %rd7;            // tiles
    mov.u32 %r5, 0;                        // k: iteration (slot k & 1)
    @%t0 atom.relaxed.gpu.global.add.u32 %r6, [%rd10], 1;
    @%t0 st.shared.u32 [s_tile], %r6;
TILE:
    bar.sync 0;
    and.b32 %r7, %r5, 1;
    mov.u32 %r8, s_tile;
    mad.lo.u32 %r8, %r7, 4, %r8;
    ld.shared.u32 %r9, [%r8];
    xor.b32 %r7, %r7, 1;                   // claim the next tile into the other slot
    mov.u32 %r8, s_tile;
    mad.lo.u32 %r8, %r7, 4, %r8;
    cvt.u64.u32 %rd5, %r9;
    setp.ge.u64 %p, %rd5, %rd11;
    @%p bra DONE;
    @%t0 atom.relaxed.gpu.global.add.u32 %r6, [%rd10], 1;
    @%t0 st.shared.u32 [%r8], %r6;
    cvt.u64.u32 %rd4, %r3;
    mad.lo.u64 %rd4, %rd5, %rd7, %rd4;
{loads}{stores}    add.u32 %r5, %r5, 1;
    bra.uni TILE;
DONE:
    @!%t0 bra END;
    atom.relaxed.gpu.global.add.u32 %r6, [%rd10+4], 1;
    add.u32 %r6, %r6, 1;
    mov.u32 %r4, %nctaid.x;
    setp.ne.u32 %p, %r6, %r4;
    @%p bra END;
    st.relaxed.gpu.global.u32 [%rd10], 0;
    st.relaxed.gpu.global.u32 [%rd10+4], 0;
END:
    ret;
}}
"""


# The ceiling for a SCATTER: the tile grid above, but each 16-byte vector goes to
# its row's destination, table[row] + 16*col (u64 per row, precomputed: no resolve), rows
# of nv vectors; the data loads and the destination loads go out together. With a
# counter, each tile ends like the send's signal (bar.sync, one fence.S, one atomic).
def scatter_ptx(v: int, scope: str | None) -> str:
    name = f"scatter_tile{v}" + (f"_{scope}" if scope else "")
    loads = "".join(f"""    mad.lo.u32 %r6, %r2, {j}, %r5;        // tile index
    setp.lt.u32 %q{j}, %r6, %r9;
    add.u32 %r7, %r6, %r8;                 // vector index
    div.u32 %r{10 + j}, %r7, %r20;         // row
    mul.wide.u32 %rd8, %r7, 16;
    add.s64 %rd8, %rd8, %rd2;
    @%q{j} ld.global.nc.v4.u32 {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}}, [%rd8];
    mul.wide.u32 %rd9, %r{10 + j}, 8;
    add.s64 %rd9, %rd9, %rd1;
    @%q{j} ld.global.nc.u64 %rd{20 + j}, [%rd9];
""" for j in range(v))
    stores = "".join(f"""    mad.lo.u32 %r6, %r2, {j}, %r5;
    add.u32 %r7, %r6, %r8;
    mul.lo.u32 %r6, %r{10 + j}, %r20;
    sub.u32 %r7, %r7, %r6;                 // column
    mad.wide.u32 %rd9, %r7, 16, %rd{20 + j};
    @%q{j} st.global.v4.u32 [%rd9], {{%a{4*j}, %a{4*j+1}, %a{4*j+2}, %a{4*j+3}}};
""" for j in range(v))
    signal = _tile_signal(scope, "DONE", "u32", "%r21", "%r4")
    return f"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry {name}(.param .u64 table, .param .u64 src, .param .u32 nvec, .param .u32 nv, .param .u64 counter)
{{
    .reg .pred %p, %q<{v}>;
    .reg .b32 %r<24>;
    .reg .b32 %a<{4*v}>;
    .reg .b64 %rd<{20 + v}>;
    ld.param.u64 %rd1, [table];
    ld.param.u64 %rd2, [src];
    ld.param.u32 %r19, [nvec];
    ld.param.u32 %r20, [nv];
    ld.param.u64 %rd10, [counter];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.lo.u32 %r8, %r2, {v};
    mul.lo.u32 %r8, %r8, %r1;              // the tile's first vector (one tile per CTA)
    sub.u32 %r9, %r19, %r8;                // vectors left
    mov.u32 %r5, %r3;
{loads}{stores}{signal}DONE:
    ret;
}}
"""


def scatter_shapes(dev, s, timer, src, nbytes: int, res: dict, msg: int = 14336) -> None:
    """The scatter's ceiling: rows of msg bytes to a random permutation of row slots."""
    rows, nv = nbytes // msg, msg // 16
    dst = driver.DeviceBuffer(rows * msg)
    perm = np.random.default_rng(3).permutation(rows)
    tab = driver.DeviceBuffer.from_array((dst.ptr + msg * perm.astype(np.uint64)).astype(np.uint64))
    ctr = driver.DeviceBuffer(8, fill=0)
    wrong = []
    for v, threads, scope in ((1, 128, None), (2, 128, None), (4, 128, None), (8, 128, None), (2, 256, None),
                              (4, 256, None), (2, 512, None), (4, 128, "sys"), (8, 128, "sys"), (4, 256, "sys"),
                              (8, 128, "gpu")):
        k = loader.load(scatter_ptx(v, scope), device=dev, name=f"scatter_tile{v}.ptx")
        k = k[f"scatter_tile{v}" + (f"_{scope}" if scope else "")]
        tiles = -(-(rows * nv) // (threads * v))
        blk = k.params_block(table=tab, src=src, nvec=rows * nv, nv=nv, counter=ctr if scope else 0)
        name = f"scatter tile {v} vec/thr x {threads}{' + CTA fence.' + scope if scope else ''} ({tiles} CTAs)"
        res[name] = timer.run(lambda i: blk.launch((tiles,), (threads,), s), 40, 5)["median_us"]
        dst.fill(0)
        blk.launch((tiles,), (threads,), s)
        s.synchronize()
        for r in (0, 1, rows // 2, rows - 1):    # a few rows, each from its slot
            if not np.array_equal(dst.download(np.uint8, offset=int(perm[r]) * msg, nbytes=msg),
                                  src.download(np.uint8, offset=r * msg, nbytes=msg)):
                wrong.append(f"{name} row {r}")
        if ctr.download(np.uint32)[0]:
            wrong.append(name + " (counter not reset)")
    print(f"scatter shapes, results correct (rows 0, 1, R/2, R-1 in their slots, counters reset): "
          f"{'yes' if not wrong else 'NO: ' + ', '.join(wrong)}")
    for b in (dst, tab, ctr):
        b.free()


def shapes(dev, s, timer, dst, src, nbytes: int, res: dict) -> None:
    """The copy shapes of tile_ptx / dyn_ptx into res (name -> median us); checks one of each."""
    nvec = nbytes // 16
    ctr = driver.DeviceBuffer(16, fill=0)
    check = min(nbytes, 1 << 24)
    wrong = []

    def verify(name):
        s.synchronize()
        if not (dst.download(np.uint8, nbytes=check) == src.download(np.uint8, nbytes=check)).all():
            wrong.append(name)
        if ctr.download(np.uint64).any():
            wrong.append(name + " (counter not reset)")
    for v in (1, 2, 4):
        for scope in (None, "gpu", "sys"):
            if scope and v == 2:
                continue
            k = loader.load(tile_ptx(v, scope), device=dev, name=f"copy_tile{v}.ptx")
            k = k[f"copy_tile{v}" + (f"_{scope}" if scope else "")]
            for threads in ((128, 256, 512) if not scope else (256,)):
                tiles = -(-nvec // (threads * v))
                sig = f" + CTA fence.{scope}" if scope else ""
                blk = k.params_block(dst=dst, src=src, nvec=nvec, counter=ctr if scope else 0)
                strided = 8 * dev.sm_count * 256 // threads
                for grid, label in ((tiles, "tile grid"), (strided, "8x256thr/SM tile-stride")):
                    if label != "tile grid" and (scope or v != 4):
                        continue
                    name = f"{label} {v} vec/thr x {threads}{sig} ({grid} CTAs)"
                    res[name] = timer.run(lambda i: blk.launch((grid,), (threads,), s), 40, 5)["median_us"]
                dst.fill(0)
                blk.launch((tiles,), (threads,), s)
                verify(name)
    for v in (1, 4):
        k = loader.load(dyn_ptx(v), device=dev, name=f"copy_dyn{v}.ptx")[f"copy_dyn{v}"]
        for grid, threads in ((dev.sm_count * 8, 256), (dev.sm_count * 2, 1024), (dev.sm_count, 1024)):
            blk = k.params_block(dst=dst, src=src, nvec=nvec, counter=ctr)
            name = f"atomic tile counter {v} vec/thr, {grid} x {threads}"
            res[name] = timer.run(lambda i: blk.launch((grid,), (threads,), s), 40, 5)["median_us"]
            dst.fill(0)
            blk.launch((grid,), (threads,), s)
            verify(name)
    ctr.free()
    print(f"copy shapes, results correct (first {check >> 20} MiB, counters reset): "
          f"{'yes' if not wrong else 'NO: ' + ', '.join(wrong)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", action="store_true",
                    help="copy GPU 0 -> GPU 1 over P2P, against cuMemcpyPeerAsync")
    ap.add_argument("--shapes", action="store_true", help="only the driver copy, grid-stride and the copy shapes")
    ap.add_argument("--scatter", action="store_true",
                    help="only the driver copy, the best copy shapes and the scatter shapes (precomputed destinations)")
    ap.add_argument("--rows", type=int, action="append", default=[],
                    help="rows of 14336 B to copy (default 32768; with --peer 1024 and 32768)")
    a = ap.parse_args()
    dev = driver.device()
    peer = None
    if a.peer:
        peer = driver.device(1)
        dev.enable_peer_access(peer)
        peer.enable_peer_access(dev)
        dev.activate()
    for rows in a.rows or ([1024, 32768] if a.peer else [32768]):
        if a.scatter:
            scatter_ceiling(dev, rows * 14336)
        else:
            ceiling(dev, peer, rows * 14336, a.shapes)
    return 0


def scatter_ceiling(dev, nbytes: int) -> None:
    """The driver copy, the tile copies that match it, and the scatter shapes, one run."""
    src = random_bytes(nbytes, np.random.default_rng(2))
    dst = driver.DeviceBuffer(nbytes)
    s = driver.Stream()
    timer = Timer(s)
    res = {"cuMemcpyDtoD": timer.run(lambda i: driver.memcpy_dtod(dst.ptr, src.ptr, nbytes, s), 40, 5)["median_us"]}
    k = loader.load(tile_ptx(1, None), device=dev, name="copy_tile1.ptx")["copy_tile1"]
    blk = k.params_block(dst=dst, src=src, nvec=nbytes // 16, counter=0)
    grid = nbytes // 16 // 128
    res[f"tile grid 1 vec/thr x 128 ({grid} CTAs)"] = timer.run(lambda i: blk.launch((grid,), (128,), s),
                                                                40, 5)["median_us"]
    dst.free()
    scatter_shapes(dev, s, timer, src, nbytes, res)
    report(res, "cuMemcpyDtoD", nbytes, None)
    src.free()
    s.close()


def ceiling(dev, peer, nbytes: int, only_shapes: bool = False) -> None:
    rng = np.random.default_rng(2)
    src = random_bytes(nbytes, rng)
    if peer is not None:
        peer.activate()
    dst = driver.DeviceBuffer(nbytes)
    dev.activate()
    s = driver.Stream()
    timer = Timer(s)
    if peer is None:
        ref = "cuMemcpyDtoD"
        res = {ref: timer.run(lambda i: driver.memcpy_dtod(dst.ptr, src.ptr, nbytes, s), 40, 5)["median_us"]}
    else:
        ref = "cuMemcpyPeerAsync"
        res = {ref: timer.run(lambda i: driver.memcpy_peer(dst.ptr, peer, src.ptr, dev, nbytes, s),
                              40, 5)["median_us"]}
    k = loader.load(COPY_PTX, device=dev, name="copy_v4.ptx")["copy_v4"]
    for grid, block in ((dev.sm_count * 4, 512), (dev.sm_count * 2, 1024), (dev.sm_count * 8, 256),
                        (dev.sm_count, 1024), (dev.sm_count // 2, 1024)):
        blk = k.params_block(dst=dst, src=src, nvec=nbytes // 16)
        res[f"sm copy v4x4 {grid}x{block}"] = timer.run(lambda i: blk.launch((grid,), (block,), s), 40, 5)["median_us"]
    shapes(dev, s, timer, dst, src, nbytes, res)
    if only_shapes:
        report(res, ref, nbytes, peer)
        for b in (src, dst):
            b.free()
        s.close()
        return
    kw = loader.load(WINDOW_PTX, device=dev, name="copy_v4_window.ptx")["copy_v4_window"]
    for grid, block in ((dev.sm_count, 1024), (dev.sm_count * 2, 512)):
        blk = kw.params_block(dst=dst, src=src, nvec=nbytes // 16)
        res[f"sm copy, CTA windows {grid}x{block}"] = timer.run(lambda i: blk.launch((grid,), (block,), s),
                                                               40, 5)["median_us"]
    rows = nbytes // 14336
    kt = loader.load(TABLE_PTX, device=dev, name="copy_table.ptx")["copy_table"]
    tab = driver.DeviceBuffer.from_array((dst.ptr + 14336 * np.arange(rows, dtype=np.uint64)).astype(np.uint64))
    ctr, flag = driver.DeviceBuffer(4, fill=0), driver.DeviceBuffer(4, fill=0)
    if 8 * rows <= dev.smem_optin:
        driver.set_max_dynamic_smem(kt.func, 8 * rows)
        for grid, block, signal in ((dev.sm_count, 1024, False), (dev.sm_count, 1024, True),
                                    (dev.sm_count * 2, 512, True)):
            blk = kt.params_block(table=tab, src=src, nvec=nbytes // 16, nv=14336 // 16, rows=rows,
                                  counter=ctr if signal else 0, flag=flag)
            name = f"table copy{' + CTA signal' if signal else ''} {grid}x{block}"
            res[name] = timer.run(lambda i: blk.launch((grid,), (block,), s, 8 * rows), 40, 5)["median_us"]
        dst.fill(0)
        blk.launch((dev.sm_count * 2,), (512,), s, 8 * rows)
        s.synchronize()
        check = min(nbytes, 1 << 24)
        ok = bool((dst.download(np.uint8, nbytes=check) == src.download(np.uint8, nbytes=check)).all())
        print(f"table copy result correct (first {check >> 20} MiB): {ok}; "
              f"flag {flag.download(np.uint32)[0]} (= grid {dev.sm_count * 2})")
    for b in (tab, ctr, flag):
        b.free()
    kb = loader.load(BULK_PTX, device=dev, name="copy_bulk.ptx")["copy_bulk"]
    for chunk in (4096, 8192, 16384):
        smem = 12 * chunk
        if smem > dev.smem_optin:
            continue
        driver.set_max_dynamic_smem(kb.func, smem)
        blk = kb.params_block(dst=dst, src=src, nchunks=nbytes // chunk, chunk=chunk)
        for per_sm in (1, 2, 4):
            if per_sm * smem > dev.smem_per_sm:
                continue
            grid = dev.sm_count * per_sm
            name = f"bulk copy {chunk // 1024}K x12 {grid} CTAs"
            res[name] = timer.run(lambda i: blk.launch((grid,), (32,), s, smem), 40, 5)["median_us"]
    dst.fill(0)
    blk = kb.params_block(dst=dst, src=src, nchunks=nbytes // 16384, chunk=16384)
    driver.set_max_dynamic_smem(kb.func, 12 * 16384)
    blk.launch((dev.sm_count,), (32,), s, 12 * 16384)
    s.synchronize()
    check = min(nbytes, 1 << 24)
    same = bool((dst.download(np.uint8, nbytes=check) == src.download(np.uint8, nbytes=check)).all())
    report(res, ref, nbytes, peer)
    print(f"bulk copy result correct (first {check >> 20} MiB): {same}")
    for b in (src, dst):
        b.free()
    s.close()


def report(res: dict, ref: str, nbytes: int, peer) -> None:
    base = res[ref]
    where = " GPU0 -> GPU1" if peer is not None else ""
    print(f"{nbytes} B{where}")
    for name, us in res.items():
        print(f"{name:<50} {us:8.1f} us  {nbytes / us / 1e3:7.1f} GB/s  {us / base:.3f}x  "
              f"({base / us:.3f} of {ref} bandwidth)")


if __name__ == "__main__":
    raise SystemExit(main())
