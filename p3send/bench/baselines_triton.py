"""The Triton scatter baseline's kernel (``baselines.TritonScatter``): the send's job as a
Triton program, compiled ahead of time for the driver seam. Imports Triton; only
``baselines.TritonScatter`` imports this module, when a Triton baseline is built."""
from __future__ import annotations

import functools

import triton
import triton.language as tl

VERSION = triton.__version__


@triton.jit
def pick8(i, a0, a1, a2, a3, a4, a5, a6, a7):
    return tl.where(i == 0, a0, tl.where(i == 1, a1, tl.where(i == 2, a2, tl.where(i == 3, a3, tl.where(
        i == 4, a4, tl.where(i == 5, a5, tl.where(i == 6, a6, a7)))))))


@triton.jit
def scatter_tl(c, off, table, src_info, state, diag,
               r0, r1, r2, r3, r4, r5, r6, r7, k0, k1, k2, k3, k4, k5, k6, k7,
               c_stride_w, n_ranks, p2p, top_k, msg_w, max_tokens, my_rank,
               n_experts, chunks, cta_vecs,
               BV: tl.constexpr, EP: tl.constexpr, SIGNAL: tl.constexpr):
    # program = (row, chunk); C and the receive buffers as int32 words, [BV, 4] = BV vectors
    pid = tl.program_id(0)
    ri = pid // chunks
    chunk = pid - ri * chunks
    row = tl.load(off) + ri
    q = tl.arange(0, 8)
    npeer = tl.minimum(n_ranks, p2p)
    if SIGNAL:
        if pid == 0:   # empty experts: 0 rows, nothing to order
            ee = tl.arange(0, EP)
            em = ee < n_experts
            empty = em & (tl.load(off + ee, mask=em, other=0) == tl.load(off + ee + 1, mask=em, other=0))
            kq = pick8(q, k0, k1, k2, k3, k4, k5, k6, k7)
            cp = (kq[None, :] + 8 * (ee[:, None] * n_ranks + my_rank)).to(tl.pointer_type(tl.int64))
            tl.store(cp, tl.zeros((EP, 8), tl.int64), mask=empty[:, None] & (q[None, :] < npeer))
    if row < tl.load(off + n_experts):
        nv = msg_w // 4
        vi = tl.arange(0, BV)
        v = chunk * cta_vecs + vi
        w = tl.arange(0, 4)
        vm = ((vi < cta_vecs) & (v < nv))[:, None] & (w[None, :] < 4)
        words = v[:, None] * 4 + w[None, :]
        x = tl.load(c + tl.multiple_of(row.to(tl.int64) * c_stride_w, 4) + words, mask=vm)
        # the row's expert: offsets <= row, minus one
        ee = tl.arange(0, EP)
        e = tl.sum((tl.load(off + ee, mask=ee <= n_experts, other=2147483647) <= row).to(tl.int32)) - 1
        # its rank: the first whose range [t_end - count, t_end) holds the row
        rm = q < n_ranks
        ent = table + 2 * (e * n_ranks + q)
        t_end = tl.load(ent, mask=rm, other=0) - 1024
        owns = rm & (t_end - tl.load(ent + 1, mask=rm, other=0) <= row) & (row < t_end)
        rank = tl.min(tl.where(owns, q, 8))
        si = tl.load(src_info + 2 * row.to(tl.int64))
        sk = tl.load(src_info + 2 * row.to(tl.int64) + 1)
        ok = (rank < 8) & (si >= 0) & (si < max_tokens) & (sk >= 0) & (sk < top_k)
        p = rank % p2p
        base = tl.multiple_of(pick8(p, r0, r1, r2, r3, r4, r5, r6, r7).to(tl.pointer_type(tl.int32)), 16)
        slot = tl.multiple_of((si.to(tl.int64) * top_k + sk) * msg_w, 4)
        tl.store(base + slot + words, x, mask=vm & ok)
        if chunk == 0:
            if not ok:
                tl.atomic_add(diag + tl.where(rank < 8, 0, 1), 1, sem="relaxed", scope="gpu")
        if SIGNAL:
            if (chunk == 0) & ok:
                tl.atomic_add(state + n_experts + 8 * e + p, 1, sem="relaxed", scope="gpu")
            tl.debug_barrier()   # every thread's stores before the release below
            total = (tl.load(off + e + 1) - tl.load(off + e)) * chunks
            old = tl.atomic_add(state + e, 1, sem="acq_rel", scope="gpu")
            if old == total - 1:   # the last program of expert e publishes its pairs
                pm = q < npeer
                n = tl.atomic_xchg(state + n_experts + 8 * e + q, tl.zeros((8,), tl.int32), mask=pm,
                                   sem="acquire", scope="gpu")
                kq = pick8(q, k0, k1, k2, k3, k4, k5, k6, k7)
                cp = (kq + 8 * (e * n_ranks + my_rank)).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(cp, n.to(tl.int64), mask=pm, sem="release", scope="gpu")
                tl.atomic_xchg(state + e, 0, sem="relaxed", scope="gpu")


#: scatter_tl's pointer and int32 parameters (the others are int64).
TL_PTRS = ("c", "off", "table", "src_info", "state", "diag")
TL_I32 = ("n_experts", "chunks", "cta_vecs")


@functools.cache
def compile_scatter(arch: int, bv: int, ep: int, signal: bool, num_warps: int):
    """Compile ``scatter_tl`` ahead of time (no torch, no Triton launcher): (cubin, name,
    shared bytes, num_warps, the non-constexpr parameter names in order, whether it needs
    scratch memory, which the launcher does not pass)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = [n for n in scatter_tl.arg_names if n not in ("BV", "EP", "SIGNAL")]
    sig = {n: "*i32" if n in TL_PTRS else "i32" if n in TL_I32 else "i64" for n in names}
    sig.update(BV="constexpr", EP="constexpr", SIGNAL="constexpr")
    attrs = {(scatter_tl.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("c", "off")}
    src = ASTSource(scatter_tl, sig, constexprs={"BV": bv, "EP": ep, "SIGNAL": signal}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1})
    md = k.metadata
    scratch = bool(getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0))
    return k.asm["cubin"], md.name, md.shared, md.num_warps, names, scratch
