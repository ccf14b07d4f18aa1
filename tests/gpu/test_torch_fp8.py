"""The FP8 down-projection's torch custom ops on the GPU: ``torch.ops.p3send.quant_fp8`` bit for
bit the numpy reference; ``gemm_fp8`` within the derived bound and byte-identical to the
launcher's C; ``gemm_fp8_send`` (``TorchGemmFp8Send``) through the send harness, byte-identical
to the oracle of the launcher's C, itself checked against the float64 reference; the fake
implementations' shapes; arguments refused naming them."""
from __future__ import annotations

import numpy as np
import pytest

from p3send.abi.errors import ConfigError
from p3send.oracle import fp8

from .conftest import assert_send_exact, fresh_seed, run_send
from .test_gemm_fp8 import Fp8Problem, check_c, _gated, edge_rows

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ops(dev):
    if tuple(dev.cc) != (9, 0):
        pytest.skip("the FP8 GEMM needs sm_90")
    if not torch.cuda.is_available():
        pytest.skip("torch has no GPU")
    import p3send.torch as pt
    return pt


def _tensors(prob: Fp8Problem):
    dev = "cuda"
    a = torch.from_numpy(prob.qa).to(dev).view(torch.float8_e4m3fn)
    lay = fp8.tma_aligned_rows(prob.rows)
    s = torch.full((prob.k_dim // 128, lay), float("nan"), device=dev)
    s[:, :prob.rows] = torch.from_numpy(prob.sa.T.copy()).to(dev)
    b = torch.from_numpy(prob.qb).to(dev).view(torch.float8_e4m3fn)
    sb = torch.from_numpy(prob.sb).to(dev)
    off = torch.from_numpy(prob.case.expert_offsets.astype(np.int32)).to(dev)
    return a, s, b, sb, off


def test_quant_fp8_op_is_bit_exact(ops):
    rng = np.random.default_rng(fresh_seed("torch quant_fp8"))
    xb = edge_rows(rng, 21, 512)
    x = torch.from_numpy(xb.view(np.int16)).cuda().view(torch.bfloat16)
    q, s = torch.ops.p3send.quant_fp8(x)
    torch.cuda.synchronize()
    want_q, want_s = fp8.quantize(xb)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (4, 24)
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), want_q)
    assert np.array_equal(s.t()[:21].cpu().numpy().view(np.uint32), want_s.view(np.uint32))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fq, fs = torch.ops.p3send.quant_fp8(torch.empty(21, 512, dtype=torch.bfloat16, device="cuda"))
    assert fq.shape == q.shape and fs.shape == s.shape and fq.dtype == q.dtype


def test_gemm_fp8_op_equals_the_launcher(ops, dev):
    seed = fresh_seed("torch gemm_fp8")
    prob = Fp8Problem("masked_experts", seed, n_cols=256, k_dim=384, align=1)
    a, s, b, sb, off = _tensors(prob)
    c = torch.ops.p3send.gemm_fp8(a, s, b, sb, off, 128)
    torch.cuda.synchronize()
    ref = _gated(dev, prob, 128)            # the launcher, sentinel outside the experts' rows
    inside = ~np.isnan(fp8.grouped_gemm(prob.qa, prob.sa, prob.qb, prob.sb, prob.case.expert_offsets)[:, 0])
    got = ref.copy()
    got[inside, :2 * prob.n_cols] = c.view(torch.uint8).cpu().numpy()[inside]
    assert np.array_equal(got, ref), "torch.ops.p3send.gemm_fp8 differs from GroupedGemmFp8Send"
    check_c(prob, got)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = [torch.empty(tuple(t.shape), dtype=t.dtype, device="cuda") for t in (a, s, b, sb, off)]
        fc = torch.ops.p3send.gemm_fp8(*fake, 128)
    assert fc.shape == c.shape and fc.dtype == torch.bfloat16


class TorchSender:
    """run_send's sender interface over TorchGemmFp8Send (torch.ops.p3send.gemm_fp8_send)."""

    grid = 1

    def __init__(self, ops, prob: Fp8Problem):
        self.ops, self.prob, self.tensors = ops, prob, _tensors(prob)
        self.obj = None

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        self.obj = self.ops.TorchGemmFp8Send(case.n_experts, cfg, count_ptrs=count_ptrs, row_cache=row_cache,
                                             p3_control=p3_control)
        self.obj(*self.tensors, 64)
        torch.cuda.synchronize()

    @property
    def state(self):
        return self.obj.gemm.state

    def diagnostics(self):
        return self.obj.gemm.diagnostics()

    def close(self):
        self.obj.close()


def test_gemm_fp8_send_op_matches_the_oracle(ops, dev):
    seed = fresh_seed("torch gemm_fp8_send")
    prob = Fp8Problem("skewed", seed, n_cols=128, k_dim=256, align=1)
    c = _gated(dev, prob, 64)     # the launcher's C at the op's tile height: the oracle sends it
    check_c(prob, c)             # checked against the float64 reference first
    prob.case.c = c
    assert_send_exact(run_send(dev, prob.case, sender_factory=lambda case: TorchSender(ops, prob)))


def test_the_ops_refuse_bad_arguments(ops):
    with pytest.raises(ConfigError, match="x: expected a bf16"):
        torch.ops.p3send.quant_fp8(torch.zeros(4, 128, device="cuda"))
    a = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.ones(1, 128, device="cuda")
    b = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn, device="cuda")
    off = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    with pytest.raises(ConfigError, match=r"sb: expected float32 weight scales of shape \(2, 1, 1\)"):
        torch.ops.p3send.gemm_fp8(a, s, b, torch.ones(2, 1, 2, device="cuda"), off, 128)
