"""The FP8 down-projection on the GPU: the quantiser p3_quant_fp8 and the block-scaled grouped
GEMM p3_gemm_fp8_send with the send in its epilogue.

- the quantiser: bit for bit the numpy reference (p3send.oracle.fp8.quantize) on random rows
  with the edge blocks (all zeros, -0.0, NaN, +-Inf, subnormals, amax under the 1e-4 clamp,
  bf16's largest values), strided rows, the scales' padding untouched; the same codes and
  scales as DeepGEMM's torch recipe (per_token_cast_to_fp8) where torch is there;
- the gated GEMM's C against the float64 result of the dequantised inputs within the bound
  p3send.oracle.fp8.error_bound derives (and ||C - R|| / ||R|| under its sanity limit), rows
  outside every expert and the row padding untouched (sentinel);
- the fused launch (send on) through the common harness ``run_send``: receive buffers, counts,
  row cache and diagnostics byte-identical to the oracle of that same C, which p3_scatter_send
  matches on the same case; every edge family of p3send.oracle.cases, in the packed layout and
  in DeepGEMM's contiguous layout (spans at multiples of 128, padding rows owned by no rank),
  both tile heights, launched twice (self-resetting state);
- quantiser then GEMM: the scales the quantiser writes are the layout the GEMM reads;
- the linked route (cuLink) gives the same bytes; argument checking before any launch.
"""
from __future__ import annotations

import numpy as np
import pytest

from p3send import P3PeerSendConfig
from p3send.abi.errors import ConfigError
from p3send.abi.layout import SENTINEL
from p3send.cuda import driver
from p3send.ops.gemm_fp8 import GroupedGemmFp8Send
from p3send.ops.quant import QuantFp8, scale_layout
from p3send.oracle import fp8
from p3send.oracle.cases import FAMILIES, send_case
from p3send.oracle.reference import f32_to_bf16

from .conftest import fresh_seed
from .gemm_common import (assert_c_untouched_outside, assert_fused_equals_gated_then_scatter_send,
                          assert_linked_route_is_byte_exact, assert_send_off_writes_c_only, c_error, gated_then_fused,
                          hopper_or_skip, tile_edge_routing)
from .gemm_common import gated as _gated

SCALE_SENTINEL = np.uint32(0x7FBADBAD)     # a NaN no arithmetic writes: untouched padding shows


@pytest.fixture(scope="module")
def hopper(dev):
    return hopper_or_skip(dev, GroupedGemmFp8Send, "p3_gemm_fp8_send")


# ---------------------------------------------------------------- the quantiser

def edge_rows(rng, rows: int, k_dim: int) -> np.ndarray:
    """Random bf16 rows (uint16 bits) over many magnitudes, with edge blocks planted."""
    x = rng.standard_normal((rows, k_dim)).astype(np.float32)
    x *= np.exp2(rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    b = f32_to_bf16(x)
    nb = k_dim // 128
    blocks = b.reshape(rows, nb, 128)
    plant = [lambda v: v.fill(0),                                       # all zeros
             lambda v: v.fill(0x8000),                                  # all -0.0
             lambda v: v.__setitem__(rng.integers(128), 0x7FC0),        # one NaN
             lambda v: v.__setitem__(rng.integers(128), 0xFFC1),        # a negative NaN with payload
             lambda v: v.__setitem__(rng.integers(128), 0x7F80),        # +Inf
             lambda v: v.__setitem__(slice(0, 2), [0xFF80, 0x7F80]),    # -Inf and +Inf
             lambda v: v.__setitem__(slice(None), rng.integers(1, 0x80, 128) | (rng.integers(0, 2, 128) << 15)),
             lambda v: v.__setitem__(slice(None), f32_to_bf16(rng.uniform(-1e-5, 1e-5, 128).astype(np.float32))),
             lambda v: v.__setitem__(slice(None), 0x7F7F ^ (rng.integers(0, 2, 128) << 15))]   # bf16's largest
    for i, f in enumerate(plant):
        f(blocks[i % rows, (i * 7) % nb])
    return blocks.reshape(rows, k_dim).astype(np.uint16)


def run_quant(dev, xb: np.ndarray, *, x_pad: int = 0, q_pad: int = 0):
    """The quantiser's q (rows, K) codes and scales as uint32 bits (kb, m_pad), sentinel-filled
    before the launch; x and q rows padded by x_pad / q_pad bytes."""
    rows, k = xb.shape
    lay = scale_layout(rows, k)
    xs, qs = 2 * k + x_pad, k + q_pad
    xh = np.zeros((rows, xs), np.uint8)
    xh[:, :2 * k] = xb.view(np.uint8).reshape(rows, 2 * k)
    bufs = [driver.DeviceBuffer.from_array(xh), driver.DeviceBuffer(rows * qs, fill=SENTINEL),
            driver.DeviceBuffer.from_array(np.full(lay.m_pad * lay.kb, SCALE_SENTINEL, np.uint32))]
    try:
        QuantFp8(dev)(bufs[0], bufs[1], bufs[2], rows=rows, k_dim=k, x_row_stride=xs, q_row_stride=qs)
        q = bufs[1].download().reshape(rows, qs)
        s = bufs[2].download(np.uint32).reshape(lay.kb, lay.m_pad)
    finally:
        for b in bufs:
            b.free()
    assert (q[:, k:] == SENTINEL).all(), "the quantiser wrote q's row padding"
    return q[:, :k], s


@pytest.mark.parametrize("rows,k_dim,x_pad,q_pad", [(37, 384, 0, 0), (1, 128, 0, 0), (130, 2048, 32, 16)])
def test_quantiser_is_bit_exact(dev, rows, k_dim, x_pad, q_pad):
    rng = np.random.default_rng(fresh_seed(f"quant {rows}x{k_dim}"))
    xb = edge_rows(rng, rows, k_dim)
    q, s = run_quant(dev, xb, x_pad=x_pad, q_pad=q_pad)
    want_q, want_s = fp8.quantize(xb)
    bad = np.argwhere(q != want_q)
    assert not len(bad), f"{len(bad)} codes differ, first at {bad[0].tolist()}: got {q[tuple(bad[0])]:#04x}, " \
                         f"want {want_q[tuple(bad[0])]:#04x} (x bits {xb[tuple(bad[0])]:#06x})"
    got_s = s[:, :rows].T
    bad = np.argwhere(got_s != want_s.view(np.uint32))
    assert not len(bad), f"{len(bad)} scales differ, first at {bad[0].tolist()}: got {got_s[tuple(bad[0])]:#010x}, " \
                         f"want {want_s.view(np.uint32)[tuple(bad[0])]:#010x}"
    assert (s[:, rows:] == SCALE_SENTINEL).all(), "the quantiser wrote the scales' padding"


def test_quantiser_matches_deepgemms_torch_recipe(dev):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no GPU")
    rng = np.random.default_rng(fresh_seed("quant vs torch"))
    rows, k = 64, 1024
    x = rng.standard_normal((rows, k)).astype(np.float32) * np.exp2(rng.uniform(-10, 10, (rows, 1)))
    xb = f32_to_bf16(x.astype(np.float32))
    xb[3, :128] = 0                                                   # an all-zero block (the clamp)
    q, s = run_quant(dev, xb)
    xt = torch.from_numpy(xb.view(np.int16)).cuda().view(torch.bfloat16)
    xv = xt.view(rows, -1, 128)            # DeepGEMM's per_token_cast_to_fp8, as its tests write it
    amax = xv.abs().float().amax(dim=2).view(rows, -1).clamp(1e-4)
    tq = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(rows, k)
    ts = (amax / 448.0).view(rows, -1)
    assert np.array_equal(q, tq.view(torch.uint8).cpu().numpy())
    assert np.array_equal(s[:, :rows].T, ts.cpu().numpy().view(np.uint32))


def test_quantiser_refuses_bad_arguments(dev):
    qz = QuantFp8(dev)
    buf = driver.DeviceBuffer(1 << 16)
    try:
        with pytest.raises(ConfigError) as e:
            qz.prepare(buf, buf, buf, rows=4, k_dim=100)
        assert "k_dim: expected a positive multiple of 128, got 100" in str(e.value)
        small = driver.DeviceBuffer(4 * 4)
        with pytest.raises(ConfigError) as e:
            qz.prepare(buf, buf, small, rows=5, k_dim=256)
        assert "scales: expected at least 64 bytes (2 columns of 8 floats), got 16" in str(e.value)
        small.free()
        with pytest.raises(ConfigError) as e:
            qz.prepare(buf, buf, buf, rows=4, k_dim=256, x_row_stride=500)
        assert "x_row_stride: expected a multiple of 16 >= 512, got 500" in str(e.value)
    finally:
        buf.free()


# ---------------------------------------------------------------- the GEMM

class Fp8Problem:
    """A send case's routing with FP8 GEMM operands: n_cols = msg_bytes / 2; the activations
    bf16 random rows through the numpy quantiser, the weights random e4m3 codes with random
    block scales; ``align`` 128 re-lays the case in DeepGEMM's contiguous layout."""

    launcher = GroupedGemmFp8Send

    def __init__(self, family: str, seed: int, n_cols: int, k_dim: int, align: int = 1, wide: bool | None = None):
        if wide is not None:      # the kernel of 128-row tiles: p3_gemm_fp8_send_wide (True) or p3_gemm_fp8_send
            self.launcher = lambda n, **kw: GroupedGemmFp8Send(n, wide=wide, **kw)
        case = send_case(family, seed)
        if align > 1:
            case = fp8.contiguous_send_case(case, align)
        pad = case.row_stride - case.msg_bytes
        case.msg_bytes = 2 * n_cols
        rng = np.random.default_rng(seed + 7)
        self.rows = max(case.c.shape[0], 1)
        _, self.qa, self.sa, self.qb, self.sb = fp8.random_fp8_problem(rng, self.rows, case.n_experts, n_cols,
                                                                        k_dim)
        self.case, self.n_cols, self.k_dim, self.stride, self.align = case, n_cols, k_dim, 2 * n_cols + pad, align

    def upload(self):
        """Device copies: a, sa (MN-major, padding NaN: a reader of it shows), b, sb."""
        return [driver.DeviceBuffer.from_array(v) for v in
                (self.qa, fp8.scales_to_mn_major(self.sa), self.qb, self.sb)]

    def call(self, g: GroupedGemmFp8Send, cfg, bufs, c, **kw):
        g(cfg, *bufs, self.case.expert_offsets.astype(np.int32), c, rows=self.rows, n_cols=self.n_cols,
          k_dim=self.k_dim, c_row_stride=self.stride, expert_align=self.align, **kw)


def check_c(prob: Fp8Problem, got: np.ndarray) -> dict:
    """C within the derived bound of the float64 result, untouched outside; returns the
    observed error as fractions of the bound and the relative norm."""
    case = prob.case
    ref, bound = fp8.grouped_gemm(prob.qa, prob.sa, prob.qb, prob.sb, case.expert_offsets, with_bound=True)
    c, inside, err = c_error(prob, got, ref)
    bad = np.argwhere(~(err <= bound[inside]))
    if len(bad):
        at = tuple(bad[0])
        raise AssertionError(f"{case}: C off the bound at {len(bad)} elements, e.g. {bad[0].tolist()}: got "
                             f"{c[inside][at]}, want {ref[inside][at]} +- {bound[inside][at]}")
    rel = float(np.linalg.norm(err) / max(np.linalg.norm(ref[inside]), 1e-300)) if inside.any() else 0.0
    assert rel <= fp8.REL_NORM_LIMIT, f"{case}: ||C - R|| / ||R|| = {rel:.3g}"
    assert_c_untouched_outside(prob, got, inside)
    return {"max_err_over_bound": float((err / bound[inside]).max()) if err.size else 0.0, "rel_norm": rel}


#: (rows per tile, wide): the three kernels-and-tile heights the launcher runs: 128-row tiles on
#: p3_gemm_fp8_send_wide (the default) and on p3_gemm_fp8_send (wide=False), 64-row ones on
#: p3_gemm_fp8_send (either way)
TILES = [(128, True), (128, False), (64, None)]
TILE_IDS = ["bm128-wide", "bm128-384", "bm64"]


@pytest.mark.parametrize("bm,wide", TILES, ids=TILE_IDS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("align", [1, 128])
def test_fused_equals_gated_then_scatter_send(hopper, family, align, bm, wide):
    seed = fresh_seed(f"gemm fp8 {family} align {align} bm {bm} wide {wide}")
    rng = np.random.default_rng(seed)
    prob = Fp8Problem(family, seed, n_cols=128 * int(rng.integers(1, 4)), k_dim=128 * int(rng.integers(1, 4)),
                      align=align, wide=wide)
    c = _gated(hopper, prob, bm)
    err = check_c(prob, c)
    print(f"[fp8 error] {family} align={align} bm={bm} wide={wide}: {err}")
    assert_fused_equals_gated_then_scatter_send(hopper, prob, c, bm, rng)


@pytest.mark.parametrize("n_cols", [128, 384, 640])
@pytest.mark.parametrize("bm,wide", TILES, ids=TILE_IDS)
def test_narrow_last_column_tile(hopper, n_cols, bm, wide):
    """N an odd multiple of 128: the last tile of each row of 256-column tiles is 128 columns (one
    mainloop, 256-byte send segments) beside full ones; C (its row padding untouched) and the
    fused send exact."""
    seed = fresh_seed(f"gemm fp8 columns {n_cols} bm {bm} wide {wide}")
    rng = np.random.default_rng(seed)
    prob = Fp8Problem("skewed", seed, n_cols=n_cols, k_dim=256, align=128, wide=wide)
    c = _gated(hopper, prob, bm)
    check_c(prob, c)
    assert_fused_equals_gated_then_scatter_send(hopper, prob, c, bm, rng)


@pytest.mark.parametrize("rows_per_expert", [(63, 64, 65, 0, 127), (128, 129, 1, 255, 256, 257)])
@pytest.mark.parametrize("bm,wide", TILES, ids=TILE_IDS)
def test_tile_edges(hopper, rows_per_expert, bm, wide):
    """Experts ending one row before, at and after a tile boundary (both tile heights), packed."""
    seed = fresh_seed("gemm fp8 tile edges")
    prob = Fp8Problem("random", seed, n_cols=256, k_dim=256, wide=wide)
    rows = tile_edge_routing(prob, rows_per_expert, seed)
    _, prob.qa, prob.sa, prob.qb, prob.sb = fp8.random_fp8_problem(np.random.default_rng(seed + 1), rows,
                                                                    len(rows_per_expert), prob.n_cols, prob.k_dim)
    prob.rows = rows
    gated_then_fused(hopper, prob, bm, check_c)


def test_quantiser_feeds_the_gemm(hopper):
    """x bf16 -> p3_quant_fp8 -> p3_gemm_fp8_send equals the reference GEMM of the numpy
    quantiser's output: the scales' layout written is the layout read."""
    seed = fresh_seed("quant then gemm")
    rng = np.random.default_rng(seed)
    rows, k, n, e = 300, 512, 256, 3
    xb, _, _, qb, sb = fp8.random_fp8_problem(rng, rows, e, n, k)
    off = np.array([0, 128, 128, 300], np.int32)       # an empty expert, a partial last span
    lay = scale_layout(rows, k)
    x = driver.DeviceBuffer.from_array(xb)
    a = driver.DeviceBuffer(rows * k)
    sa = driver.DeviceBuffer.from_array(np.full(lay.m_pad * lay.kb, SCALE_SENTINEL, np.uint32))
    b, s = driver.DeviceBuffer.from_array(qb), driver.DeviceBuffer.from_array(sb)
    c = driver.DeviceBuffer(rows * 2 * n, fill=SENTINEL)
    g = GroupedGemmFp8Send(e, device=hopper)
    try:
        QuantFp8(hopper)(x, a, sa, rows=rows, k_dim=k)
        g(P3PeerSendConfig.disabled(), a, sa, b, s, off, c, rows=rows, n_cols=n, k_dim=k)
        got = c.download().reshape(rows, 2 * n)
    finally:
        g.close()
        for buf in (x, a, sa, b, s, c):
            buf.free()
    qa, sa_ref = fp8.quantize(xb)
    prob = Fp8Problem.__new__(Fp8Problem)
    prob.qa, prob.sa, prob.qb, prob.sb, prob.n_cols = qa, sa_ref, qb, sb, n
    prob.case = send_case("random", seed)
    prob.case.expert_offsets = off
    check_c(prob, got)


def test_linked_route_is_byte_exact(hopper):
    """docs/EMBEDDING.md (c): the PTX linked with p3_send_rows.ptx by cuLink, not inlined."""
    seed = fresh_seed("gemm fp8 linked")
    prob = Fp8Problem("masked_experts", seed, n_cols=256, k_dim=256, align=128)
    assert_linked_route_is_byte_exact(hopper, prob, 128, check_c)


def test_send_off_writes_c_only(hopper):
    """p3_control < 0: C is written and no receive byte or count changes (MAX's gate)."""
    seed = fresh_seed("gemm fp8 gate")
    prob = Fp8Problem("random", seed, n_cols=128, k_dim=128)
    assert_send_off_writes_c_only(hopper, prob, check_c)


def test_bad_arguments_are_refused_before_launch(hopper):
    g = GroupedGemmFp8Send(2, device=hopper)
    buf = driver.DeviceBuffer(1 << 20)
    try:
        off = np.array([0, 128, 256], np.int32)
        cfg = P3PeerSendConfig.disabled()
        common = dict(rows=256, n_cols=128, k_dim=128)

        def refused(*args, **kw) -> str:
            with pytest.raises(ConfigError) as e:
                g.prepare(cfg, *args, **{**common, **kw})
            return str(e.value)

        assert "n_cols: expected a positive multiple of 128 (and E*N < 2^31), got 200" in \
            refused(buf, buf, buf, buf, off, buf, n_cols=200)
        assert "k_dim: expected a positive multiple of 128, got 64" in refused(buf, buf, buf, buf, off, buf, k_dim=64)
        assert "c: expected the output C" in refused(buf, buf, buf, buf, off, None)
        msg = refused(buf, buf, buf, buf, np.array([0, 100, 256], np.int32), buf)
        assert "expected every expert to start at a multiple of 128" in msg and "expert 1 at row 100" in msg
        g.prepare(cfg, buf, buf, buf, buf, np.array([0, 100, 256], np.int32), buf, expert_align=1, **common)
        small = driver.DeviceBuffer(16)
        try:
            assert "sa: expected at least 1024 bytes (1 columns of 256 floats), got 16" in \
                refused(buf, small, buf, buf, off, buf)
            assert "sb: expected at least 32 bytes, got 16" in refused(buf, buf, buf, small, off, buf, n_cols=256,
                                                                       k_dim=256)
        finally:
            small.free()
        assert "bm: expected 64 or 128, got 32" in refused(buf, buf, buf, buf, off, buf, bm=32)
        on = P3PeerSendConfig.disabled()
        on.n_ranks = 1
        with pytest.raises(ConfigError) as e:
            g.prepare(on, buf, buf, buf, buf, off, p3_control=0, **common)
        assert "msg_bytes: expected 2*n_cols = 256" in str(e.value)
        with pytest.raises(ConfigError):
            GroupedGemmFp8Send(129, device=hopper)
    finally:
        g.close()
        buf.free()


def test_bad_tensor_arguments_name_the_argument(hopper):
    torch = pytest.importorskip("torch")
    g = GroupedGemmFp8Send(2, device=hopper)
    try:
        rows, k, n = 256, 256, 128
        a = torch.zeros(rows, k, dtype=torch.float8_e4m3fn, device="cuda")
        lay = scale_layout(rows, k)
        sa = torch.zeros(lay.kb, lay.m_pad, dtype=torch.float32, device="cuda").t()[:rows]   # MN-major view
        b = torch.zeros(2, n, k, dtype=torch.float8_e4m3fn, device="cuda")
        sb = torch.ones(2, n // 128, k // 128, dtype=torch.float32, device="cuda")
        off = np.array([0, 128, 256], np.int32)
        c = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        cfg = P3PeerSendConfig.disabled()
        g.prepare(cfg, a, sa, b, sb, off, c)                  # DeepGEMM's tensors, as they are
        with pytest.raises(ConfigError) as e:
            g.prepare(cfg, a.to(torch.bfloat16), sa.contiguous(), b, sb.transpose(1, 2), off, c)
        msg = str(e.value)
        assert "a: expected dtype float8_e4m3fn or uint8, got bfloat16" in msg
        assert "sa: expected float32 scales of shape (256, 2) in the TMA-aligned MN-major layout" in msg
        assert "sb: expected float32 weight scales of shape (2, 1, 2) (E, N/128, K/128)" in msg
    finally:
        g.close()
