"""p3_gemm_send: the grouped bf16 GEMM with the send in its epilogue.

- C of the gated GEMM (send off) against a float64 reference of the same bf16 inputs,
  within |C - R| <= ulp_bf16(|R|) + K * 2**-23 * (|X| @ |W|^T) (the final rounding plus the
  fp32 accumulation bound. A bf16 x bf16 product is exact in fp32, so the kernel's only errors
  are its fp32 sum of K products, at most K * 2**-24 * sum|x w| in any order (the classical
  gamma_K bound), and the bf16 rounding of that sum: half an ulp of |C|, a whole ulp of |R|
  where the two straddle a power of two. The bound was first derived against an fp32
  reference, whose own sum adds a second K * 2**-24; against float64 that factor 2 is margin),
  rows outside every expert untouched (sentinel);
- the fused launch (send on) through the common harness ``run_send``: receive buffers
  (sentinel + guards), counts, row cache and diagnostics byte-identical to the oracle of
  that same C, which ``p3_scatter_send`` matches on the same case (also checked here);
- every edge family of p3send.oracle.cases (empty experts, one row, skewed, tile edges +-1, bad
  src_info, rank folding, ...), both tile heights, launched twice (self-resetting state);
- the route of docs/EMBEDDING.md (c): the same PTX linked with p3_send_rows.ptx by the
  driver's linker (cuLink) gives the same bytes;
- argument checking before any launch.
"""
from __future__ import annotations

import numpy as np
import pytest

from p3send import P3PeerSendConfig
from p3send.abi.errors import ConfigError
from p3send.cuda import driver
from p3send.ops.gemm import GroupedGemmSend
from p3send.oracle.cases import FAMILIES, send_case
from p3send.oracle.reference import bf16_to_f32, f32_to_bf16

from .conftest import fresh_seed
from .gemm_common import (assert_c_untouched_outside, assert_fused_equals_gated_then_scatter_send,
                          assert_linked_route_is_byte_exact, assert_send_off_writes_c_only, c_error, gated_then_fused,
                          hopper_or_skip, tile_edge_routing)
from .gemm_common import gated as _gated


@pytest.fixture(scope="module")
def hopper(dev):
    return hopper_or_skip(dev, GroupedGemmSend, "p3_gemm_send")


class GemmProblem:
    """A send case's routing with GEMM operands: n_cols = msg_bytes / 2, X (rows_total, K),
    W (E, N, K) random bf16; case.c becomes the gated GEMM's C (stride kept)."""

    launcher = GroupedGemmSend

    def __init__(self, family: str, seed: int, n_cols: int, k_dim: int):
        case = send_case(family, seed)
        pad = case.row_stride - case.msg_bytes
        case.msg_bytes = 2 * n_cols
        rng = np.random.default_rng(seed + 7)
        rows = case.c.shape[0]
        self.x = f32_to_bf16(rng.standard_normal((max(rows, 1), k_dim)).astype(np.float32))
        self.w = f32_to_bf16((rng.standard_normal((case.n_experts, n_cols, k_dim)) / np.sqrt(k_dim)).astype(np.float32))
        self.case, self.n_cols, self.k_dim, self.stride = case, n_cols, k_dim, 2 * n_cols + pad
        self.rows = max(rows, 1)

    def upload(self):
        """Device copies: x, w."""
        return [driver.DeviceBuffer.from_array(v) for v in (self.x, self.w)]

    def call(self, g: GroupedGemmSend, cfg, bufs, c, **kw):
        g(cfg, *bufs, self.case.expert_offsets.astype(np.int32), c, rows=self.rows, n_cols=self.n_cols,
          k_dim=self.k_dim, c_row_stride=self.stride, **kw)

    def reference(self):
        """float64 C and its bound, per row (rows outside every expert: NaN)."""
        off = self.case.expert_offsets
        x, w = bf16_to_f32(self.x).astype(np.float64), bf16_to_f32(self.w).astype(np.float64)
        ref = np.full((self.rows, self.n_cols), np.nan)
        mag = np.full_like(ref, np.nan)
        for e in range(self.case.n_experts):
            r0, r1 = int(off[e]), int(off[e + 1])
            ref[r0:r1] = x[r0:r1] @ w[e].T
            mag[r0:r1] = np.abs(x[r0:r1]) @ np.abs(w[e]).T
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 2.0 ** -126))) - 7)
        return ref, ulp + self.k_dim * 2.0 ** -23 * mag


def check_c(prob: GemmProblem, got: np.ndarray) -> None:
    case = prob.case
    ref, bound = prob.reference()
    c, inside, err = c_error(prob, got, ref)
    bad = np.argwhere(err > bound[inside])
    assert not len(bad), (f"{case}: C off the bound at {len(bad)} elements, e.g. row {bad[0].tolist()}: "
                          f"got {c[inside][tuple(bad[0])]}, want {ref[inside][tuple(bad[0])]} "
                          f"+- {bound[inside][tuple(bad[0])]}")
    assert_c_untouched_outside(prob, got, inside)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_equals_gated_then_scatter_send(hopper, family):
    seed = fresh_seed(f"gemm {family}")
    rng = np.random.default_rng(seed)
    bm = int(rng.choice([64, 128]))
    prob = GemmProblem(family, seed, n_cols=256 * int(rng.integers(1, 3)), k_dim=64 * int(rng.integers(1, 4)))
    if prob.case.n_experts > 128:
        pytest.skip("more than 128 experts")
    c = _gated(hopper, prob, bm)
    check_c(prob, c)
    assert_fused_equals_gated_then_scatter_send(hopper, prob, c, bm, rng)


@pytest.mark.parametrize("rows_per_expert", [(63, 64, 65, 0, 127), (128, 129, 1, 255, 256, 257)])
@pytest.mark.parametrize("bm", [64, 128])
def test_tile_edges(hopper, rows_per_expert, bm):
    """Experts ending one row before, at and after a tile boundary (both tile heights)."""
    seed = fresh_seed("gemm tile edges")
    prob = GemmProblem("random", seed, n_cols=512, k_dim=128)
    rows = tile_edge_routing(prob, rows_per_expert, seed)
    rng2 = np.random.default_rng(seed + 1)
    prob.x = f32_to_bf16(rng2.standard_normal((rows, prob.k_dim)).astype(np.float32))
    prob.w = f32_to_bf16((rng2.standard_normal((len(rows_per_expert), prob.n_cols, prob.k_dim)) / 8).astype(np.float32))
    prob.rows = rows
    gated_then_fused(hopper, prob, bm, check_c)


def test_linked_route_is_byte_exact(hopper):
    """docs/EMBEDDING.md (c): the PTX linked with p3_send_rows.ptx by cuLink, not inlined."""
    seed = fresh_seed("gemm linked")
    prob = GemmProblem("masked_experts", seed, n_cols=256, k_dim=128)
    assert_linked_route_is_byte_exact(hopper, prob, 64, check_c)


def test_send_off_writes_c_only(hopper):
    """p3_control < 0: C is written and no receive byte or count changes (MAX's gate)."""
    seed = fresh_seed("gemm gate")
    prob = GemmProblem("random", seed, n_cols=256, k_dim=64)
    assert_send_off_writes_c_only(hopper, prob, check_c)


def test_bad_arguments_are_refused_before_launch(hopper):
    g = GroupedGemmSend(2, device=hopper)
    x = driver.DeviceBuffer(2 * 64 * 64)
    try:
        off = np.array([0, 10, 20], np.int32)
        cfg = P3PeerSendConfig.disabled()
        with pytest.raises(ConfigError) as e:
            g.prepare(cfg, x, x, off, x, rows=64, n_cols=200, k_dim=64)
        assert "n_cols: expected a positive multiple of 256 (and E*N < 2^31), got 200" in str(e.value)
        with pytest.raises(ConfigError) as e:
            g.prepare(cfg, x, x, off, x, rows=64, n_cols=256, k_dim=96)
        assert "k_dim: expected a positive multiple of 64, got 96" in str(e.value)
        with pytest.raises(ConfigError) as e:
            g.prepare(cfg, x, x, off, None, rows=64, n_cols=256, k_dim=64)
        assert "c: expected the output C" in str(e.value)
        with pytest.raises(ConfigError) as e:
            g.prepare(cfg, x, x, np.array([0, 10, 80], np.int32), x, rows=64, n_cols=256, k_dim=64, bm=32)
        msg = str(e.value)
        assert "rows up to 80 but the input holds 64 rows" in msg and "bm: expected 64 or 128, got 32" in msg
        on = P3PeerSendConfig.disabled()
        on.n_ranks = 1
        with pytest.raises(ConfigError) as e:
            g.prepare(on, x, x, off, rows=64, n_cols=256, k_dim=64, p3_control=0)
        assert "msg_bytes: expected 2*n_cols = 512" in str(e.value)
        with pytest.raises(ConfigError):
            GroupedGemmSend(129, device=hopper)
    finally:
        g.close()
        x.free()
