"""p3_gemm_send: the grouped bf16 GEMM with the send in its epilogue.

- C of the gated GEMM (send off) against a float64 reference of the same bf16 inputs,
  within |C - R| <= ulp_bf16(|R|) + K * 2**-23 * (|X| @ |W|^T) (the final rounding plus the
  fp32 accumulation bound; derivation in experiments/gemm_bench.py), rows outside every expert
  untouched (sentinel);
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
from p3send.abi.errors import ConfigError, P3SendError
from p3send.abi.layout import SENTINEL
from p3send.cuda import driver
from p3send.ops.gemm import GroupedGemmSend
from p3send.oracle.cases import FAMILIES, send_case
from p3send.oracle.reference import bf16_to_f32, f32_to_bf16

from .conftest import assert_send_exact, fresh_seed, run_send


@pytest.fixture(scope="module")
def hopper(dev):
    if tuple(dev.cc) != (9, 0):
        with pytest.raises(P3SendError, match="Hopper-only"):
            GroupedGemmSend(1, device=dev)
        pytest.skip(f"p3_gemm_send needs sm_90; {dev.name} is sm_{dev.cc[0]}{dev.cc[1]} (refusal checked)")
    return dev


class GemmProblem:
    """A send case's routing with GEMM operands: n_cols = msg_bytes / 2, X (rows_total, K),
    W (E, N, K) random bf16; case.c becomes the gated GEMM's C (stride kept)."""

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


def _gated(dev, prob: GemmProblem, bm: int, linked: bool = False) -> np.ndarray:
    """The plain GEMM's C as uint8 (rows, stride), pre-filled with the sentinel."""
    c = driver.DeviceBuffer(prob.rows * prob.stride, fill=SENTINEL)
    x, w = driver.DeviceBuffer.from_array(prob.x), driver.DeviceBuffer.from_array(prob.w)
    g = GroupedGemmSend(prob.case.n_experts, device=dev, linked=linked)
    try:
        g(P3PeerSendConfig.disabled(), x, w, prob.case.expert_offsets.astype(np.int32), c, rows=prob.rows,
          n_cols=prob.n_cols, k_dim=prob.k_dim, c_row_stride=prob.stride, bm=bm)
        return c.download().reshape(prob.rows, prob.stride)
    finally:
        g.close()
        for b in (c, x, w):
            b.free()


class FusedSender:
    """run_send's sender interface over GroupedGemmSend with the send on."""

    def __init__(self, dev, prob: GemmProblem, bm: int, linked: bool = False):
        self.prob, self.bm = prob, bm
        self.g = GroupedGemmSend(prob.case.n_experts, device=dev, linked=linked)
        self.grid, self.state = self.g.grid, self.g.state
        self.x, self.w = driver.DeviceBuffer.from_array(prob.x), driver.DeviceBuffer.from_array(prob.w)

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        p = self.prob
        for _ in range(2):   # twice: the sender state resets itself, the counts are republished
            self.g(cfg, self.x, self.w, case.expert_offsets.astype(np.int32), c, rows=p.rows, n_cols=p.n_cols,
                   k_dim=p.k_dim, c_row_stride=p.stride, bm=self.bm, count_ptrs=count_ptrs, row_cache=row_cache,
                   p3_control=p3_control, stream=stream)
            driver.device().synchronize()

    def diagnostics(self):
        d = self.g.diagnostics()
        return {k: (v // 2 if k != "rejected" else v) for k, v in d.items()}   # two launches

    def close(self):
        self.g.close()
        self.x.free()
        self.w.free()


def _check_c(prob: GemmProblem, got: np.ndarray) -> None:
    case = prob.case
    ref, bound = prob.reference()
    c = bf16_to_f32(got[:, :2 * prob.n_cols].copy().view(np.uint16)).astype(np.float64)
    inside = ~np.isnan(ref[:, 0])
    err = np.abs(c - ref)[inside]
    bad = np.argwhere(err > bound[inside])
    assert not len(bad), (f"{case}: C off the bound at {len(bad)} elements, e.g. row {bad[0].tolist()}: "
                          f"got {c[inside][tuple(bad[0])]}, want {ref[inside][tuple(bad[0])]} "
                          f"+- {bound[inside][tuple(bad[0])]}")
    outside = got[~inside]
    assert (outside == SENTINEL).all(), f"{case}: rows outside every expert were written"
    pad = got[:, 2 * prob.n_cols:]
    assert (pad == SENTINEL).all(), f"{case}: the row padding of C was written"


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_equals_gated_then_scatter_send(hopper, family):
    seed = fresh_seed(f"gemm {family}")
    rng = np.random.default_rng(seed)
    bm = int(rng.choice([64, 128]))
    prob = GemmProblem(family, seed, n_cols=256 * int(rng.integers(1, 3)), k_dim=64 * int(rng.integers(1, 4)))
    if prob.case.n_experts > 128:
        pytest.skip("more than 128 experts")
    c = _gated(hopper, prob, bm)
    _check_c(prob, c)
    prob.case.c = c
    row_cache = bool(rng.integers(2))
    ref_run = run_send(hopper, prob.case, row_cache=row_cache)       # p3_scatter_send on that C
    assert_send_exact(ref_run)
    fused = run_send(hopper, prob.case, row_cache=False, sender_factory=lambda case: FusedSender(hopper, prob, bm))
    assert_send_exact(fused)
    for p, (a, b) in enumerate(zip(fused.recv, ref_run.recv)):
        assert np.array_equal(a, b), f"{prob.case}: peer {p}: fused and p3_scatter_send differ"
    for p, (a, b) in enumerate(zip(fused.counts, ref_run.counts)):
        assert np.array_equal(a, b), f"{prob.case}: peer {p}: counts differ"


@pytest.mark.parametrize("rows_per_expert", [(63, 64, 65, 0, 127), (128, 129, 1, 255, 256, 257)])
@pytest.mark.parametrize("bm", [64, 128])
def test_tile_edges(hopper, rows_per_expert, bm):
    """Experts ending one row before, at and after a tile boundary (both tile heights)."""
    seed = fresh_seed("gemm tile edges")
    prob = GemmProblem("random", seed, n_cols=512, k_dim=128)
    case = prob.case
    from p3send.abi.layout import encode_range_table
    rpe = np.array(rows_per_expert)
    off = np.concatenate([[0], np.cumsum(rpe)]).astype(np.int32)
    n_ranks = case.n_ranks
    counts = np.zeros((len(rpe), n_ranks), np.int64)
    rng = np.random.default_rng(seed)
    for e, n in enumerate(rpe):
        cut = np.sort(rng.integers(0, n + 1, n_ranks - 1))
        counts[e] = np.diff(np.concatenate([[0], cut, [n]]))
    rows = int(off[-1])
    top_k = case.top_k
    max_tok = -(-rows // top_k) + 1
    slots = rng.permutation(max_tok * top_k)[:rows]
    case.expert_offsets, case.range_table = off, encode_range_table(off, counts)
    case.p2p_world_size, case.max_tokens_per_rank = n_ranks, max_tok
    case.src_info = np.stack([slots // top_k, slots % top_k], 1).astype(np.int32)
    case.c = np.zeros((rows, prob.stride), np.uint8)
    rng2 = np.random.default_rng(seed + 1)
    prob.x = f32_to_bf16(rng2.standard_normal((rows, prob.k_dim)).astype(np.float32))
    prob.w = f32_to_bf16((rng2.standard_normal((len(rpe), prob.n_cols, prob.k_dim)) / 8).astype(np.float32))
    prob.rows = rows
    c = _gated(hopper, prob, bm)
    _check_c(prob, c)
    case.c = c
    assert_send_exact(run_send(hopper, case, sender_factory=lambda cs: FusedSender(hopper, prob, bm)))


def test_linked_route_is_byte_exact(hopper):
    """docs/EMBEDDING.md (c): the PTX linked with p3_send_rows.ptx by cuLink, not inlined."""
    seed = fresh_seed("gemm linked")
    prob = GemmProblem("masked_experts", seed, n_cols=256, k_dim=128)
    c = _gated(hopper, prob, 128)
    assert np.array_equal(_gated(hopper, prob, 128, linked=True), c), "linked gated C differs from inlined"
    prob.case.c = c
    assert_send_exact(run_send(hopper, prob.case, sender_factory=lambda cs: FusedSender(hopper, prob, 64, linked=True)))


def test_send_off_writes_c_only(hopper):
    """p3_control < 0: C is written and no receive byte or count changes (MAX's gate)."""
    seed = fresh_seed("gemm gate")
    prob = GemmProblem("random", seed, n_cols=256, k_dim=64)
    prob.case.c = _gated(hopper, prob, 128)
    r = run_send(hopper, prob.case, p3_control=-1, sender_factory=lambda cs: FusedSender(hopper, prob, 128))
    for got in r.recv:
        assert (got == SENTINEL).all()
    for got in r.counts:
        assert (got == np.uint64(0xFFFF_FFFF_FFFF_FFFF)).all()


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
