"""What the GPU tests of the two grouped GEMMs share (tests/gpu/test_gemm.py: p3_gemm_send, bf16;
tests/gpu/test_gemm_fp8.py: p3_gemm_fp8_send; and their sanitize runs).

A problem is a send case (``case``) with the GEMM's operands: ``rows``, ``n_cols``, ``k_dim``,
``stride`` (bytes between rows of C), its launcher class (``launcher``), ``upload()`` (its
operands' device copies, in the launcher's argument order) and ``call(g, cfg, bufs, c, **kw)``
(one launch through ``g``). The helpers here take any such problem: the gated GEMM's C, the
fused launch as ``run_send``'s sender, the routing of the tile-edge cases, and the checks the
two kernels pass alike.
"""
from __future__ import annotations

import numpy as np
import pytest

from p3send import P3PeerSendConfig
from p3send.abi.errors import P3SendError
from p3send.abi.layout import SENTINEL, encode_range_table
from p3send.cuda import driver
from p3send.oracle.reference import bf16_to_f32

from .conftest import assert_send_exact, first_diff, run_send


def hopper_or_skip(dev, launcher, entry: str):
    """``dev`` when it is a Hopper GPU; else checks that ``launcher`` refuses it and skips."""
    if tuple(dev.cc) != (9, 0):
        with pytest.raises(P3SendError, match="Hopper-only"):
            launcher(1, device=dev)
        pytest.skip(f"{entry} needs sm_90; {dev.name} is sm_{dev.cc[0]}{dev.cc[1]} (refusal checked)")
    return dev


def gated(dev, prob, bm: int, linked: bool = False) -> np.ndarray:
    """The plain GEMM's C as uint8 (rows, stride), pre-filled with the sentinel."""
    c = driver.DeviceBuffer(prob.rows * prob.stride, fill=SENTINEL)
    bufs = prob.upload()
    g = prob.launcher(prob.case.n_experts, device=dev, linked=linked)
    try:
        prob.call(g, P3PeerSendConfig.disabled(), bufs, c, bm=bm)
        return c.download().reshape(prob.rows, prob.stride)
    finally:
        g.close()
        for b in [c, *bufs]:
            b.free()


class FusedSender:
    """run_send's sender interface over the problem's launcher with the send on."""

    def __init__(self, dev, prob, bm: int, linked: bool = False):
        self.prob, self.bm = prob, bm
        self.g = prob.launcher(prob.case.n_experts, device=dev, linked=linked)
        self.grid, self.state = self.g.grid, self.g.state
        self.bufs = prob.upload()

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        for _ in range(2):   # twice: the sender state resets itself, the counts are republished
            self.prob.call(self.g, cfg, self.bufs, c, bm=self.bm, count_ptrs=count_ptrs, row_cache=row_cache,
                           p3_control=p3_control, stream=stream)
            driver.device().synchronize()

    def diagnostics(self):
        d = self.g.diagnostics()
        return {k: (v // 2 if k != "rejected" else v) for k, v in d.items()}   # two launches

    def close(self):
        self.g.close()
        for b in self.bufs:
            b.free()


def c_error(prob, got: np.ndarray, ref: np.ndarray):
    """C of ``got`` (uint8 (rows, stride)) as float64 against the reference ``ref`` (rows outside
    every expert: NaN): (C, the rows inside an expert, |C - ref| on those rows)."""
    c = bf16_to_f32(got[:, :2 * prob.n_cols].copy().view(np.uint16)).astype(np.float64)
    inside = ~np.isnan(ref[:, 0])
    return c, inside, np.abs(c - ref)[inside]


def assert_c_untouched_outside(prob, got: np.ndarray, inside: np.ndarray) -> None:
    """The rows outside every expert and the row padding of C still hold the sentinel."""
    assert (got[~inside] == SENTINEL).all(), f"{prob.case}: rows outside every expert were written"
    assert (got[:, 2 * prob.n_cols:] == SENTINEL).all(), f"{prob.case}: the row padding of C was written"


def tile_edge_routing(prob, rows_per_expert, seed: int) -> int:
    """Re-route ``prob.case`` to experts of ``rows_per_expert`` rows each (packed), each split over
    the ranks at random (``seed``), with unique (token, k) slots; C zeroed. Returns the rows (the
    caller sets the operands for them)."""
    case = prob.case
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
    return rows


def gated_then_fused(dev, prob, bm: int, check_c) -> None:
    """The gated GEMM's C passes ``check_c(prob, c)``, and the fused launch's receive buffers,
    counts and diagnostics are the oracle's of that C."""
    c = gated(dev, prob, bm)
    check_c(prob, c)
    prob.case.c = c
    assert_send_exact(run_send(dev, prob.case, sender_factory=lambda cs: FusedSender(dev, prob, bm)))


def assert_fused_equals_gated_then_scatter_send(dev, prob, c: np.ndarray, bm: int, rng) -> None:
    """With the gated C ``c`` (checked by the caller): p3_scatter_send on it (row cache drawn from
    ``rng``) and the fused launch are each exact, and their receive buffers and counts equal."""
    prob.case.c = c
    row_cache = bool(rng.integers(2))
    ref_run = run_send(dev, prob.case, row_cache=row_cache)       # p3_scatter_send on that C
    assert_send_exact(ref_run)
    fused = run_send(dev, prob.case, row_cache=False, sender_factory=lambda case: FusedSender(dev, prob, bm))
    assert_send_exact(fused)
    for p, (a, b) in enumerate(zip(fused.recv, ref_run.recv)):
        assert np.array_equal(a, b), f"{prob.case}: peer {p}: fused and p3_scatter_send differ"
    for p, (a, b) in enumerate(zip(fused.counts, ref_run.counts)):
        assert np.array_equal(a, b), f"{prob.case}: peer {p}: counts differ"


def assert_linked_route_is_byte_exact(dev, prob, fused_bm: int, check_c) -> None:
    """docs/EMBEDDING.md (c): the PTX linked with p3_send_rows.ptx by cuLink, not inlined, gives
    the inlined module's gated C (bm 128), which passes ``check_c(prob, c)`` (the reference),
    and an exact fused send (``fused_bm``) of that C."""
    c = gated(dev, prob, 128)
    check_c(prob, c)
    assert np.array_equal(gated(dev, prob, 128, linked=True), c), "linked gated C differs from inlined"
    prob.case.c = c
    assert_send_exact(run_send(dev, prob.case,
                               sender_factory=lambda cs: FusedSender(dev, prob, fused_bm, linked=True)))


GUARD_ROWS = 4   # rows of C past its end, sentinel-filled: a write past the last row shows


def assert_send_off_writes_c_only(dev, prob, check_c) -> None:
    """p3_control < 0 with the send configured (MAX's gate): C, pre-filled with the sentinel
    and followed by GUARD_ROWS sentinel rows, is written as the reference says (``check_c(prob,
    c)``: within its bound, rows outside every expert and the row padding untouched), the guard
    rows are untouched, and no receive byte (guards included) or count changes."""
    rows, stride = prob.rows, prob.stride
    c = driver.DeviceBuffer((rows + GUARD_ROWS) * stride, fill=SENTINEL)
    # the host C only sizes the harness's oracle, which sends nothing with p3_control < 0
    prob.case.c = np.full((rows, stride), SENTINEL, np.uint8)
    try:
        r = run_send(dev, prob.case, p3_control=-1, c_obj=c, sender_factory=lambda cs: FusedSender(dev, prob, 128))
        got = c.download().reshape(rows + GUARD_ROWS, stride)
    finally:
        c.free()
    assert (got[rows:] == SENTINEL).all(), f"{prob.case}: the send-off launch wrote past the last row of C"
    check_c(prob, got[:rows])
    for p, recv in enumerate(r.recv):
        assert (recv == SENTINEL).all(), f"{prob.case}: peer {p} receive buffer: {first_diff(recv, r.want_recv[p])}"
    for p, counts in enumerate(r.counts):
        assert (counts == np.uint64(0xFFFF_FFFF_FFFF_FFFF)).all(), f"{prob.case}: peer {p} counts: {counts.tolist()}"
