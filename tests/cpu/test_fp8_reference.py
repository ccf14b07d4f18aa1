"""p3send.oracle.fp8, the numpy reference of the FP8 recipe, against the formats' definitions:
e4m3 decoding of all 256 codes, rounding to nearest even with saturation against a brute-force
search over every finite value, DeepGEMM's quantiser on hand-computed blocks and against a
scalar re-implementation, the scale layouts, the block-scaled GEMM against explicit sums, and
the error bound against an emulation of a truncating 14-bit accumulator."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from p3send.oracle import fp8
from p3send.oracle.reference import f32_to_bf16


def f32(v: float) -> float:
    """v rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def spec_value(code: int) -> float:
    """The e4m3 (E4M3FN) value of a code, from the format's definition."""
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return float("nan")
    return s * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


FINITE = [c for c in range(0x7F)]                    # 0x00 .. 0x7E: the non-negative finite codes
VALUES = np.array([spec_value(c) for c in FINITE])


def nearest_even(x: float) -> int:
    """Brute force: the finite code nearest to x (ties: the even code), saturating at 448."""
    a = abs(x)
    if a != a:
        return 0x7F
    d = np.abs(VALUES - a)
    best = np.flatnonzero(d == d.min())
    c = int(best[0]) if len(best) == 1 else int(best[best % 2 == 0][0])
    if a > 448:
        c = 0x7E
    return c | (0x80 if np.signbit(x) else 0)


def test_decode_every_code():
    got = fp8.e4m3_to_f32(np.arange(256, dtype=np.uint8))
    for c in range(256):
        want = spec_value(c)
        if want != want:
            assert np.isnan(got[c]), hex(c)
        else:
            assert got[c] == want and np.signbit(got[c]) == bool(c & 0x80), (hex(c), got[c], want)
    assert got[0x7E] == 448 and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6 and got[0x38] == 1.0
    assert np.all(np.diff(got[:0x7F]) > 0), "the finite codes are not in increasing order"


def test_every_finite_code_round_trips():
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    assert np.array_equal(fp8.f32_to_e4m3(fp8.e4m3_to_f32(codes)), codes)


def test_midpoints_round_to_even_and_their_neighbours_do_not():
    mids = (VALUES[:-1] + VALUES[1:]) / 2                       # exact in float32
    xs = []
    for m in mids:
        m32 = np.float32(m)
        xs += [m32, np.nextafter(m32, np.float32(0)), np.nextafter(m32, np.float32(np.inf))]
    xs = np.array(xs, np.float32)
    xs = np.concatenate([xs, -xs])
    got = fp8.f32_to_e4m3(xs)
    want = np.array([nearest_even(float(v)) for v in xs], np.uint8)
    assert np.array_equal(got, want), [(float(v), hex(g), hex(w)) for v, g, w in zip(xs, got, want) if g != w][:5]


def test_random_values_over_every_binade():
    rng = np.random.default_rng(1234)
    mant = rng.uniform(1, 2, 20000)
    ex = rng.integers(-14, 11, 20000)
    xs = (mant * np.exp2(ex) * rng.choice([-1, 1], 20000)).astype(np.float32)
    got = fp8.f32_to_e4m3(xs)
    want = np.array([nearest_even(float(v)) for v in xs], np.uint8)
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(float(xs[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_saturation_nan_inf_and_zeros():
    xs = np.array([448, 449, 463.9, 464, 464.1, 480, 1e30, np.inf, -np.inf, -500, np.nan, -np.nan,
                   0.0, -0.0, 2.0 ** -10, -(2.0 ** -10), np.float32(2.0 ** -10) * np.float32(1.0000001),
                   1e-45, -1e-45], np.float32)
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F,
            0x00, 0x80, 0x00, 0x80, 0x01, 0x00, 0x80]
    assert fp8.f32_to_e4m3(xs).tolist() == want


# ---------------------------------------------------------------- the quantiser

def bits(values) -> np.ndarray:
    """bf16 bits of values exactly representable in bf16."""
    v = np.asarray(values, np.float32)
    b = (v.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal((b.astype(np.uint32) << 16).view(np.float32), v, equal_nan=True)
    return b


def scalar_quantize_block(vals: list[float]) -> tuple[list[int], int]:
    """One block by DeepGEMM's rule as torch evaluates it (scalar; each float32 operation
    rounded with struct): scale = amax * fl(1/448), multiplier fl(1/amax) * 448."""
    if any(v != v for v in vals):
        return [0x7F] * len(vals), 0x7FFFFFFF
    amax = max(max(abs(v) for v in vals), f32(1e-4))
    scale = f32(amax * f32(1 / 448)) if amax != float("inf") else float("inf")
    inv = f32(f32(1 / amax) * 448)                   # as torch evaluates 448.0 / amax
    codes = []
    for v in vals:
        y = v * inv                                  # Inf * 0 is NaN, as on the GPU
        codes.append(nearest_even(f32(y)) if y == y else 0x7F)
    return codes, struct.unpack("<I", struct.pack("<f", scale))[0]


def test_quantiser_hand_computed_blocks():
    one = np.zeros(128, np.float32)
    one[0], one[1], one[2] = 1.0, 0.5, -0.25
    q, s = fp8.quantize(bits(one)[None, :])
    assert s[0, 0] == np.float32(1.0) / np.float32(448)
    # amax 1: x * 448: 1 -> 448 (0x7E), 0.5 -> 224 = 1.75 * 2^7 (0x76), -0.25 -> -112 (0xEE)
    assert q[0, :3].tolist() == [0x7E, 0x76, 0xEE] and not q[0, 3:].any()
    zeros = np.zeros(128, np.float32)
    zeros[5] = -0.0
    q, s = fp8.quantize(bits(zeros)[None, :])
    assert s.view(np.uint32)[0, 0] == (np.float32(1e-4) * np.float32(f32(1 / 448))).view(np.uint32)
    assert q[0, 5] == 0x80 and not np.delete(q[0], 5).any()
    big = np.full(128, 448, np.float32)          # amax 448: x * 1 exactly
    q, s = fp8.quantize(bits(big)[None, :])
    assert s[0, 0] == 1.0 and (q == 0x7E).all()


def test_quantiser_nan_inf_and_tiny_blocks():
    x = np.ones((1, 512), np.float32)
    x[0, 3] = np.nan                                              # block 0: NaN
    x[0, 130], x[0, 131] = np.inf, -2.0                           # block 1: Inf
    x[0, 256:384] = 1e-6                                          # block 2: amax under the floor
    x[0, 384:512] = np.linspace(-3, 3, 128)                       # block 3: ordinary
    q, s = fp8.quantize(f32_to_bf16(x))
    su = s.view(np.uint32)[0]
    assert su[0] == 0x7FFFFFFF and (q[0, :128] == 0x7F).all()
    assert s[0, 1] == np.inf and q[0, 130] == 0x7F and q[0, 131] == 0x80 and (q[0, 132:256] == 0).all()
    assert s[0, 2] == np.float32(1e-4) * np.float32(f32(1 / 448))
    xb = (f32_to_bf16(x).astype(np.uint32) << 16).view(np.float32)
    for blk in (2, 3):
        codes, sbits = scalar_quantize_block([float(v) for v in xb[0, 128 * blk:128 * blk + 128]])
        assert q[0, 128 * blk:128 * blk + 128].tolist() == codes and su[blk] == sbits


def test_quantiser_matches_the_scalar_rule_on_random_rows():
    rng = np.random.default_rng(99)
    x = rng.standard_normal((6, 384)).astype(np.float32) * np.exp2(rng.uniform(-20, 20, (6, 1))).astype(np.float32)
    x[0, :128] *= 1e-30                                            # subnormal bf16 inputs, floor clamp
    xb = f32_to_bf16(x)
    q, s = fp8.quantize(xb)
    xf = (xb.astype(np.uint32) << 16).view(np.float32)
    for r in range(6):
        for blk in range(3):
            codes, sbits = scalar_quantize_block([float(v) for v in xf[r, 128 * blk:128 * blk + 128]])
            assert q[r, 128 * blk:128 * blk + 128].tolist() == codes, (r, blk)
            assert s.view(np.uint32)[r, blk] == sbits, (r, blk)


def test_quantiser_refuses_k_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize(np.zeros((2, 100), np.uint16))


# ---------------------------------------------------------------- layouts

def test_mn_major_scales_layout():
    assert [fp8.tma_aligned_rows(r) for r in (1, 4, 5, 8, 1023)] == [4, 4, 8, 8, 1024]
    s = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    flat = fp8.scales_to_mn_major(s)
    assert flat.shape == (3 * 8,)
    assert flat[8 * 2 + 4] == s[4, 2] and flat[1] == s[1, 0] and np.isnan(flat[5])
    assert np.array_equal(fp8.scales_from_mn_major(flat, 5, 3), s)


def test_contiguous_layout():
    off, m_idx = fp8.contiguous_layout([3, 0, 128, 129])
    assert off.tolist() == [0, 128, 128, 256, 512]
    assert m_idx[:4].tolist() == [0, 0, 0, -1] and (m_idx[128:256] == 2).all()
    assert (m_idx[256:385] == 3).all() and (m_idx[385:] == -1).all()


# ---------------------------------------------------------------- the GEMM and its bound

def test_grouped_gemm_against_explicit_sums():
    rng = np.random.default_rng(5)
    _, qa, sa, qb, sb = fp8.random_fp8_problem(rng, rows=7, n_experts=2, n_cols=128, k_dim=256)
    off = np.array([0, 3, 6])
    ref = fp8.grouped_gemm(qa, sa, qb, sb, off)
    va, vb = fp8.e4m3_to_f32(qa).astype(np.float64), fp8.e4m3_to_f32(qb).astype(np.float64)
    for r, e, n in ((0, 0, 0), (2, 0, 127), (3, 1, 5), (5, 1, 64)):
        want = sum(float(sa[r, k // 128]) * float(sb[e, n // 128, k // 128]) * va[r, k] * vb[e, n, k]
                   for k in range(256))
        assert abs(ref[r, n] - want) <= 1e-12 * max(1.0, abs(want))
    assert np.isnan(ref[6]).all()


def emulate_kernel(qa, sa, qb, sb, bits_kept: int = 14) -> np.ndarray:
    """A deliberately pessimistic model of the kernel on one expert (qb (N, K), sb (N/128,
    K/128)): each 128-wide k-block
    summed product by product with the running sum truncated (toward zero) to ``bits_kept``
    significant bits after every addition, then promoted T = fma(P, sa*sb, T) in float32, then
    rounded to bf16. Returns float64 values of the bf16 result."""
    va, vb = fp8.e4m3_to_f32(qa).astype(np.float64), fp8.e4m3_to_f32(qb).astype(np.float64)
    rows, k = va.shape
    n = vb.shape[0]
    sb_cols = np.repeat(np.asarray(sb, np.float32), 128, axis=0)       # (N, K/128)
    total = np.zeros((rows, n), np.float32)
    for kb in range(k // 128):
        p = np.zeros((rows, n))
        for j in range(128 * kb, 128 * kb + 128):
            p = p + va[:, j, None] * vb[None, :, j]
            _, ex = np.frexp(p)
            q = np.exp2(ex.astype(np.float64) - bits_kept)
            p = np.trunc(p / q) * q
        s = (sa[:, kb, None] * sb_cols[None, :, kb]).astype(np.float32)
        total = (p * s.astype(np.float64) + total.astype(np.float64)).astype(np.float32)   # one rounding: fma
    b = f32_to_bf16(total)
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_the_bound_holds_for_a_truncating_14_bit_accumulator_and_catches_a_wrong_scale():
    rng = np.random.default_rng(77)
    _, qa, sa, qb, sb = fp8.random_fp8_problem(rng, rows=8, n_experts=1, n_cols=128, k_dim=384)
    off = np.array([0, 8])
    ref, bound = fp8.grouped_gemm(qa, sa, qb, sb, off, with_bound=True)
    got = emulate_kernel(qa, sa, qb[0], sb[0])
    assert (np.abs(got - ref) <= bound).all()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < fp8.REL_NORM_LIMIT, rel
    wrong = sa.copy()
    wrong[:, 1] *= 2                             # one of the three k-blocks' activation scales doubled
    bad = emulate_kernel(qa, wrong, qb[0], sb[0])
    assert (np.abs(bad - ref) > bound).mean() > 0.5
    assert np.linalg.norm(bad - ref) / np.linalg.norm(ref) > 10 * fp8.REL_NORM_LIMIT


def test_the_wire_of_fp32_sums_is_requantised_of_their_bf16_wire_and_the_check_can_fail():
    """oracle.wire.requantised, the bound the GPU tests hold the FP8 GEMM's consumer-quantised
    wire to: on values over 60 binades with every edge block, encode_f32(y) is within it of
    encode(bf16(y)) (and equals it where y is a bf16 number), and a code two steps off, a scale
    off by 2^-7 or a NaN block's code not 0x7F are caught."""
    from p3send.oracle import wire
    rng = np.random.default_rng(5)
    y = rng.standard_normal((96, 1024)).astype(np.float32)
    y *= np.exp2(rng.uniform(-30, 30, (96, 8, 1))).repeat(128, axis=2).reshape(96, 1024).astype(np.float32)
    y[0, :128] = 0.0
    y[1, 5], y[2, 7], y[3, 9] = np.nan, np.inf, -np.inf
    y[4, :128] *= np.float32(1e-9)                              # under the amax clamp
    y[5, 3] = np.float32(3e38)                                  # a huge value: 1/amax subnormal
    b = f32_to_bf16(y)
    got, want = wire.encode_f32(y), wire.encode(b)
    assert wire.requantised(got, want, 1024) is None
    assert (got != want).any()                                  # the one rounding does change codes
    yb = (b.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(wire.encode_f32(yb), want)            # bf16 values: the same bytes
    bad = got.copy()
    r, c = np.argwhere((got[:, :1024] & 0x7F) < 0x70)[0]
    bad[r, c] += 2
    assert "code" in wire.requantised(bad, want, 1024)
    bad = got.copy()
    bad[6, 1024:1028] = np.frombuffer(np.float32(np.frombuffer(got[6, 1024:1028].tobytes(), "<f4")[0]
                                                 * (1 + 2 ** -7)).tobytes(), np.uint8)
    assert "scale" in wire.requantised(bad, want, 1024)
    bad = got.copy()
    bad[1, 0] = 0x00                                            # row 1's first block holds a NaN
    assert "code" in wire.requantised(bad, want, 1024)


def test_requantised_takes_no_nan_code_for_a_saturated_one():
    """0x7F (NaN) beside 0x7E (448) is not a neighbour: a stray NaN code in a block without a NaN
    is caught, and a NaN code missing where the reference has one too."""
    from p3send.oracle import wire
    y = np.full((1, 512), 1.0, np.float32)
    y[0, 0] = 448.0                                   # the block's amax: code 0x7E, multiplier 1
    want = wire.encode(f32_to_bf16(y))
    assert want[0, 0] == 0x7E and wire.requantised(want, want, 512) is None
    bad = want.copy()
    bad[0, 0] = 0x7F
    assert "code" in wire.requantised(bad, want, 512)
    assert "code" in wire.requantised(want, bad, 512)


def test_requantised_slots_compares_unowned_slots_exactly_and_owned_ones_within_the_bound():
    """oracle.wire.requantised_slots (the GPU tests' and the bench's check of receive buffers):
    owned slots requantised, an unowned (all-sentinel) slot or the tail written is caught."""
    from p3send.abi.layout import SENTINEL
    from p3send.oracle import wire
    rng = np.random.default_rng(7)
    y = rng.standard_normal((3, 512)).astype(np.float32)
    mb = 528
    want = np.full(5 * mb + 8, SENTINEL, np.uint8)
    got = want.copy()
    for slot, row in ((0, 0), (2, 1), (4, 2)):
        want[slot * mb:(slot + 1) * mb] = wire.encode(f32_to_bf16(y[row:row + 1]))[0]
        got[slot * mb:(slot + 1) * mb] = wire.encode_f32(y[row:row + 1])[0]
    assert wire.requantised_slots(got, want, 512) is None
    bad = got.copy()
    bad[mb + 3] = 0
    assert "unowned" in wire.requantised_slots(bad, want, 512)
    bad = got.copy()
    bad[-1] = 0
    assert "past the last slot" in wire.requantised_slots(bad, want, 512)
    bad = got.copy()
    bad[2 * mb:3 * mb] = SENTINEL                   # an owned slot never written
    assert wire.requantised_slots(bad, want, 512) is not None
