"""The numpy reference of the FP8 down-projection (DeepSeek-V3's recipe): e4m3 both ways,
the per-token activation quantiser, the scale layouts, the block-scaled grouped GEMM and
its error bound. Written from the formats' definitions, not from the kernels; numpy only.

Formats (DeepGEMM's SM90 layouts, which ``p3_quant_fp8`` and ``p3_gemm_fp8_send`` take):

- ``q``: e4m3 (OCP "E4M3FN": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no
  infinities, 0x7F/0xFF NaN, largest finite 448) as uint8 codes, ``(rows, K)``.
- activation scales: float32, one per (row, 128 columns of K), "TMA-aligned MN-major":
  scale ``(r, kb)`` at element ``kb * m_pad + r`` with ``m_pad = tma_aligned_rows(rows)``
  (rows rounded up to 4, so each column of scales starts 16-byte aligned). The elements
  ``rows .. m_pad-1`` of each column are padding (never read, never written).
- weights ``(E, N, K)`` e4m3 with float32 scales ``(E, N/128, K/128)``, C-contiguous
  (DeepGEMM's ``rhs`` and ``rhs_scales``).

The quantiser (DeepGEMM's ``per_token_cast_to_fp8``), per row and 128 columns, all in
float32 with IEEE round-to-nearest-even: ``amax = max |x|`` (NaN if any element is NaN),
``amax = max(amax, 1e-4)``, ``scale = amax / 448``, ``q = e4m3_satfinite(x * (448 / amax))``,
each division rounded as torch rounds DeepGEMM's code: ``amax / 448`` is ``amax * fl(1/448)``
(ATen divides by a scalar as a multiplication by its float32 reciprocal) and ``448 / amax`` is
``fl(1/amax) * 448`` (``Tensor.__rtruediv__`` is ``reciprocal() * other``). One rounding per
division instead would change the scale's last bit in about half of the blocks and the
multiplier's in a quarter, and so some codes.
What that gives on the edge blocks (``quantize`` returns it; the kernel writes the same
bits): an all-zero block: scale 1e-4/448, codes 0x00 (-0.0 elements give 0x80); a block
with a NaN: scale the canonical NaN 0x7FFFFFFF and every code 0x7F; a block with an
infinity (no NaN): scale +Inf, the infinite elements 0x7F (Inf * 0 is NaN), the finite
ones signed zeros (x * 0).
"""
from __future__ import annotations

import numpy as np

from ..abi.errors import ConfigError

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
BLOCK = 128                      # the recipe's scale granularity along K (and along N for weights)
AMAX_FLOOR = np.float32(1e-4)    # DeepGEMM's clamp of a block's amax
INV_448 = np.float32(1) / np.float32(E4M3_MAX)    # fl(1/448) = 0x3B124925
CANONICAL_NAN_F32 = np.uint32(0x7FFFFFFF)


# ---------------------------------------------------------------- e4m3 both ways

def e4m3_to_f32(codes) -> np.ndarray:
    """float32 values of e4m3 codes (uint8 array, any shape); 0x7F and 0xFF are NaN.
    Straight from the format: exponent field 0 is subnormal (m/8 * 2^-6), else
    (1 + m/8) * 2^(e-7)."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(c & 0x7F) == 0x7F] = np.nan
    return out


def f32_to_e4m3(x) -> np.ndarray:
    """e4m3 codes of float32 values, rounded to nearest even and saturated to +-448
    (PTX ``cvt.rn.satfinite.e4m3x2.f32``; CUDA's ``__nv_cvt_float_to_fp8(x,
    __NV_SATFINITE, __NV_E4M3)``): NaN -> 0x7F, +-Inf and |x| > 448 -> +-448 (0x7E/0xFE),
    |x| <= 2^-10 (half the smallest subnormal) -> a zero of x's sign."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    neg = np.signbit(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        fin = np.isfinite(a) & (a > 0)
        # the quantum of x's binade (subnormal binade below 2^-6): 8 steps per binade
        _, e2 = np.frexp(np.where(fin, a, 1.0))               # a = f * 2^e2, 0.5 <= f < 1: exact
        ex = np.maximum(np.where(fin, e2 - 1, 0).astype(np.float64), -6.0)
        quantum = np.exp2(ex - 3.0)
        steps = a / quantum                                  # exact: a power-of-two scaling
        m = np.floor(steps)
        frac = steps - m
        up = (frac > 0.5) | ((frac == 0.5) & (m % 2 == 1))  # ties to even
        m = m + up
        val = m * quantum                                    # the rounded magnitude
        m = np.where(fin, m, 0.0)
    code = np.zeros(x.shape, dtype=np.int64)
    # normal: val = (8 + mant) * 2^(e-3) with 8 <= m <= 16 (16 = next binade, mantissa 0)
    e_field = np.where(m >= 16, ex + 1, ex) + 7
    mant = np.where(m >= 16, 0, m - 8)
    normal = fin & (val >= 2.0 ** -6)
    code = np.where(normal, (e_field.astype(np.int64) << 3) | mant.astype(np.int64), code)
    sub = fin & (val < 2.0 ** -6)                            # m in 0..7 in the subnormal binade
    code = np.where(sub, m.astype(np.int64), code)
    code = np.where(fin & (val > E4M3_MAX), 0x7E, code)      # satfinite
    code = np.where(np.isinf(a), 0x7E, code)
    code = code | np.where(neg, 0x80, 0)
    code = np.where(np.isnan(x), E4M3_NAN, code)
    return code.astype(np.uint8)


# ---------------------------------------------------------------- layouts

def tma_aligned_rows(rows: int) -> int:
    """Rows of one column of activation scales: ``rows`` rounded up to 4 (16 bytes of
    float32, the tensor-map stride alignment; DeepGEMM's ``get_tma_aligned_size``)."""
    return -(-int(rows) // 4) * 4


def scales_to_mn_major(s: np.ndarray) -> np.ndarray:
    """Row-major ``(rows, K/128)`` scales -> the flat float32 MN-major buffer
    (``K/128 * m_pad`` elements; padding NaN, so a reader of padding shows)."""
    rows, kb = s.shape
    mp = tma_aligned_rows(rows)
    out = np.full((kb, mp), np.nan, np.float32)
    out[:, :rows] = np.asarray(s, np.float32).T
    return out.reshape(-1)


def scales_from_mn_major(flat: np.ndarray, rows: int, kb: int) -> np.ndarray:
    """The MN-major buffer -> row-major ``(rows, K/128)`` scales (padding dropped)."""
    mp = tma_aligned_rows(rows)
    return np.asarray(flat, np.float32).reshape(kb, mp)[:, :rows].T.copy()


def contiguous_layout(rows_per_expert, align: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """DeepGEMM's contiguous layout: each expert's rows start at a multiple of ``align``.
    Returns (expert_offsets int32 (E+1,): the start of each expert's span, its last entry
    the total; m_indices int32 (rows,): the expert of each row, -1 for the padding at the
    end of each span). The spans are what p3send's ``expert_offsets`` describe; a range
    table covering only the real rows leaves the padding rows unrouted (never sent)."""
    rpe = np.asarray(rows_per_expert, dtype=np.int64)
    spans = -(-rpe // align) * align
    off = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
    m_idx = np.full(int(off[-1]), -1, np.int32)
    for e, n in enumerate(rpe):
        m_idx[off[e]:off[e] + n] = e
    return off.astype(np.int32), m_idx


# ---------------------------------------------------------------- the quantiser

def quantize(x_bf16_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepGEMM's per-token quantiser of bf16 activations ``(rows, K)`` (uint16 bits, K a
    multiple of 128). Returns (q uint8 (rows, K) e4m3 codes, scales float32 (rows, K/128),
    row-major; ``scales_to_mn_major`` gives the kernel's layout). Every operation is the
    float32 one, rounded to nearest even; the module docstring says what the edge blocks give."""
    bits = np.asarray(x_bf16_bits, dtype=np.uint16)
    return quantize_f32((bits.astype(np.uint32) << 16).view(np.float32))


def quantize_f32(x_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` of float32 values ``(rows, K)`` (the FP8 GEMM's consumers quantise their
    fp32 sums so, with ``FLAG_WIRE_FP8_STAGED``): the same rule and edge blocks."""
    x = np.asarray(x_f32, dtype=np.float32)
    rows, k = x.shape
    if k % BLOCK:
        raise ConfigError([f"K: expected a multiple of {BLOCK}, got {k}"], "FP8 quantiser reference")
    x = x.reshape(rows, k // BLOCK, BLOCK)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nan_block = np.isnan(x).any(axis=2)
        amax = np.where(nan_block, np.float32(0), np.abs(x).max(axis=2, initial=np.float32(0)))
        amax = np.maximum(amax, AMAX_FLOOR).astype(np.float32)
        scale = (amax * INV_448).astype(np.float32)
        inv = ((np.float32(1) / amax).astype(np.float32) * np.float32(E4M3_MAX)).astype(np.float32)
        y = (x * inv[:, :, None]).astype(np.float32)
    q = f32_to_e4m3(y)
    q[nan_block] = E4M3_NAN
    scale = scale.view(np.uint32).copy()
    scale[nan_block] = CANONICAL_NAN_F32
    return q.reshape(rows, k), scale.view(np.float32)


# ---------------------------------------------------------------- the GEMM and its bound

#: The tensor cores' FP8 accumulation keeps about 14 significant bits (DeepSeek-V3 report,
#: section 3.3.2), with truncation: each addition inside one wgmma chain may lose up to
#: 2^-13 of the magnitudes it adds.
U_TENSOR = 2.0 ** -13
U_F32 = 2.0 ** -24
U_BF16 = 2.0 ** -8


#: A sanity limit on ||C_gpu - C|| / ||C|| over a whole output (not a bound): the bf16
#: rounding alone gives ~0.0016 on random data, a model accumulator truncating to 14 bits
#: ~0.0027, one truncating to 12 bits ~0.010; a scale off by 2 in one of 16 k-blocks ~0.25.
REL_NORM_LIMIT = 2.0 ** -6


def dequantize(q: np.ndarray, scales: np.ndarray, block_rows: int) -> np.ndarray:
    """float64 values of e4m3 codes ``(..., R, K)`` times their scales ``(..., R/block_rows,
    K/128)`` (``block_rows`` 1 for activations, 128 for weights)."""
    v = e4m3_to_f32(q).astype(np.float64)
    s = np.repeat(np.repeat(np.asarray(scales, np.float64), block_rows, axis=-2), BLOCK, axis=-1)
    return v * s[..., : v.shape[-2], :]


def grouped_gemm(qa, sa, qb, sb, expert_offsets, *, with_bound: bool = False):
    """The float64 result of the block-scaled grouped GEMM on the dequantised inputs:
    ``C[r] = (qa[r] * sa[r]) @ (qb[e] * sb[e])^T`` for the rows r of expert e
    (``expert_offsets[e] <= r < expert_offsets[e+1]``). qa uint8 (rows, K), sa float32
    (rows, K/128) row-major, qb uint8 (E, N, K), sb float32 (E, N/128, K/128). Rows outside
    every expert are NaN.

    with_bound: also return the bound ``error_bound`` puts on |C_gpu - C| per element."""
    off = np.asarray(expert_offsets, dtype=np.int64)
    rows, k = qa.shape
    n = qb.shape[1]
    out = np.full((rows, n), np.nan)
    mag = np.full((rows, n), np.nan) if with_bound else None
    a = dequantize(qa, sa, 1)
    for e in range(len(off) - 1):
        r0, r1 = int(off[e]), int(off[e + 1])
        if r1 <= r0:
            continue
        b = dequantize(qb[e], sb[e], BLOCK)
        out[r0:r1] = a[r0:r1] @ b.T
        if with_bound:
            mag[r0:r1] = np.abs(a[r0:r1]) @ np.abs(b).T
    if not with_bound:
        return out
    return out, error_bound(out, mag, k)


def error_bound(ref: np.ndarray, mag: np.ndarray, k_dim: int, promote_every: int = BLOCK) -> np.ndarray:
    """The largest |C_gpu - C| the recipe allows per element, C the exact result ``ref``,
    ``mag`` = sum over k of |a_k * b_k| (dequantised; ``grouped_gemm(with_bound=True)``).

    The kernel sums each 128-wide k-block of e4m3 products in the tensor cores (the
    products are exact; ``promote_every`` products per chain, each addition losing at most
    ``U_TENSOR`` of the block's magnitude), then promotes: ``T = fma(P, sa * sb, T)`` in
    float32 (two roundings per block: the scale product and the fma), and rounds T to
    bf16 once. So, per element, with M = mag and KB = K/128 blocks::

        E = (promote_every * U_TENSOR + (KB + 3) * U_F32) * M      (accumulation)
        |C_gpu - C| <= E + U_BF16 * (|C| + E)                     (the final rounding)

    At 128 products per promotion the first term is 2^-6 M: loose against a typical
    element (|C| ~ M / sqrt(K)), tight against a wrong scale, row or expert (tests draw
    scales spread over 2^-4 .. 2^4 so those miss by far more)."""
    kb = -(-int(k_dim) // BLOCK)
    e = (promote_every * U_TENSOR + (kb + 3) * U_F32) * np.asarray(mag)
    return e + U_BF16 * (np.abs(ref) + e)


def random_fp8_problem(rng: np.random.Generator, rows: int, n_experts: int, n_cols: int, k_dim: int,
                       scale_spread: float = 4.0):
    """Random FP8 operands as a runtime would hold them: activations drawn as bf16 and put
    through ``quantize`` (so their scales are the quantiser's), weights as random e4m3 codes
    (finite, both signs, subnormals included) with block scales 2^U(-spread, spread) / 448.
    Returns (x_bf16_bits (rows, K), qa, sa (rows, K/128), qb (E, N, K), sb (E, N/128, K/128))."""
    xf = rng.standard_normal((rows, k_dim)).astype(np.float32)
    xf *= np.exp2(rng.uniform(-scale_spread, scale_spread, (rows, 1))).astype(np.float32)
    from .reference import f32_to_bf16
    xb = f32_to_bf16(xf)
    qa, sa = quantize(xb)
    qb = rng.integers(0, 256, (n_experts, n_cols, k_dim), dtype=np.uint8)
    qb[(qb & 0x7F) == 0x7F] = 0x7E                        # no NaN codes in weights
    sb = (np.exp2(rng.uniform(-scale_spread, scale_spread,
                              (n_experts, n_cols // BLOCK, k_dim // BLOCK))) / E4M3_MAX).astype(np.float32)
    return xb, qa, sa, qb, sb


def contiguous_send_case(case, align: int = BLOCK):
    """A copy of a ``cases.send_case`` re-laid in DeepGEMM's contiguous layout: every expert's
    span starts at a multiple of ``align`` and ends in padding rows that no rank owns (its
    range-table entries shifted with the span, so each rank keeps its rows), src_info of the
    padding (-1, -1). Rows before the first expert and after the last keep their count. The
    send's result is the original's (the same slots and counts), plus the padding rows
    counted as unrouted."""
    import copy

    off = np.asarray(case.expert_offsets, dtype=np.int64)
    n_exp = len(off) - 1
    start = -(-int(off[0]) // align) * align
    spans = -(-np.diff(off) // align) * align
    new_off = start + np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
    tail = case.c.shape[0] - int(off[-1])
    rows_total = int(new_off[-1]) + tail
    out = copy.copy(case)
    rng = np.random.default_rng(case.seed + 3)
    c = rng.integers(1, 256, size=(rows_total, case.c.shape[1]), dtype=np.uint8)
    src = np.full((rows_total, 2), -1, np.int32)
    c[: off[0]], src[: off[0]] = case.c[: off[0]], case.src_info[: off[0]]
    for e in range(n_exp):
        n = int(off[e + 1] - off[e])
        c[new_off[e]:new_off[e] + n] = case.c[off[e]:off[e + 1]]
        src[new_off[e]:new_off[e] + n] = case.src_info[off[e]:off[e + 1]]
    if tail:
        c[new_off[-1]:], src[new_off[-1]:] = case.c[off[-1]:], case.src_info[off[-1]:]
    table = np.asarray(case.range_table, np.int64).reshape(n_exp, case.n_ranks, 2).copy() if n_exp else \
        np.zeros((0, case.n_ranks, 2), np.int64)
    table[:, :, 0] += (new_off[:-1] - off[:-1])[:, None]
    out.expert_offsets, out.c, out.src_info = new_off.astype(np.int32), c, src
    out.range_table = table.reshape(-1).astype(np.int32)
    out.name = f"{case.name}/contiguous{align}"
    return out
