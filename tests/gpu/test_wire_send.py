"""The FP8 wire's senders, byte for byte against p3send.oracle.wire.encode: p3_scatter_send_fp8
(bf16 rows of C), p3_epilogue_send (C = bf16 of the fp32 accumulators, quantised by
p3_send_rows on the way out), p3_send_rows linked by the driver's linker into an outside
kernel (tests/gpu/data/consumer.ptx), and the fused GEMMs. Receive buffers and counts are
sentinel-filled inside guard regions (tests.gpu.conftest.run_send); every case draws a fresh
printed seed; the values mix the edge blocks (all zeros, one huge value, bf16 subnormals,
NaN, +-Inf) with ordinary ones."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p3send import ConfigError
from p3send.abi.config import P3SendCtx, rank_config
from p3send.abi.wire import FLAG_WIRE_FP8, wire_msg_bytes
from p3send.cuda import driver, loader
from p3send.ops import send as send_ops
from p3send.ops.send import EpilogueSend, ScatterSend
from p3send.oracle import wire as wire_ref
from p3send.oracle.cases import SENTINEL, send_case
from p3send.oracle.reference import f32_to_bf16
from p3send.oracle import fp8
from tests.gpu.conftest import GUARD, assert_send_exact, fp8_requantised, fresh_seed, run_send

DATA = Path(__file__).parent / "data"
ROUTING = ("random", "zero_rows", "one_row", "masked_experts", "modulo", "bad_src_info", "unrouted",
           "offset_base", "many_experts", "skewed", "starved_rank")
KINDS = ("normal", "zero", "huge", "subnormal", "tiny", "nan", "inf")


def bf16_blocks(rng, rows: int, hidden: int, kinds=KINDS) -> np.ndarray:
    """bf16 bits (rows, hidden): each 128-column block one kind of ``kinds``."""
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    x *= np.exp2(rng.uniform(-20, 20, (rows, hidden // 128, 1))).repeat(128, axis=2).reshape(rows, hidden)
    bits = f32_to_bf16(x).reshape(rows, hidden // 128, 128)
    kind = rng.integers(0, len(kinds), (rows, hidden // 128))
    for k, name in enumerate(kinds):
        sel = kind == k
        n = int(sel.sum())
        if not n or name == "normal":
            continue
        blk = bits[sel]
        if name == "zero":
            blk[:] = np.where(rng.random(blk.shape) < 0.3, 0x8000, 0).astype(np.uint16)
        elif name == "huge":
            blk[np.arange(n), rng.integers(0, 128, n)] = rng.choice([0x7F7F, 0xFF7F, 0x7F00], n)
        elif name == "subnormal":
            blk[:] = rng.integers(0, 0x80, blk.shape, dtype=np.uint16) | (rng.integers(0, 2, blk.shape) << 15)
        elif name == "tiny":          # around e4m3's subnormals after scaling: many tiny codes, ties
            blk[:] = f32_to_bf16(rng.standard_normal(blk.shape).astype(np.float32) * np.float32(1e-3))
            blk[np.arange(n), 0] = f32_to_bf16(np.full(n, 1e-4 * 448 / 2, np.float32))
        elif name == "nan":
            blk[np.arange(n), rng.integers(0, 128, n)] = rng.choice([0x7FC0, 0xFFC1, 0x7F81], n)
        elif name == "inf":
            blk[np.arange(n), rng.integers(0, 128, n)] = rng.choice([0x7F80, 0xFF80], n)
        bits[sel] = blk
    return bits.reshape(rows, hidden)


def fp8_case(family: str, seed: int, hidden: int | None = None, kinds=KINDS, pad: int | None = None):
    """send_case's routing with bf16 rows of ``hidden`` columns (case.c_bf16, uint16) and the
    oracle's view: case.c = the FP8-wire bytes of every row, case.msg_bytes the wire's."""
    case = send_case(family, seed)
    rng = np.random.default_rng(seed + 7)
    hidden = hidden or 512 * int(rng.choice([1, 2, 3, 4]))
    rows = case.c.shape[0]
    bits = bf16_blocks(rng, rows, hidden, kinds)
    pad = int(rng.choice([0, 8, 64])) if pad is None else pad       # bf16 columns of row padding
    c = np.zeros((rows, hidden + pad), np.uint16)
    c[:, :hidden] = bits
    c[:, hidden:] = 0x7FC0                                            # NaN padding: must never be read
    case.c_bf16, case.hidden = c, hidden
    case.msg_bytes = wire_msg_bytes(hidden, "fp8")
    case.c = wire_ref.encode(bits) if rows else np.zeros((0, case.msg_bytes), np.uint8)
    case.name = f"fp8/{family}/h{hidden}"
    return case


class Fp8Scatter:
    """ScatterSend(wire="fp8") of case.c_bf16, as run_send's sender_factory."""

    def __init__(self, dev, case, num_sms=None, launch=None):
        self.s = ScatterSend(case.n_experts, device=dev, num_sms=num_sms)
        if launch:               # (threads, dynamic shared memory): another launch shape than p3send's
            self.s.FP8_THREADS, self.s.FP8_SMEM = launch
        self.grid, self.state = self.s.grid, self.s.state
        self.c = driver.DeviceBuffer.from_array(np.ascontiguousarray(case.c_bf16))

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control, same_gpu=False):
        self.s(cfg, self.c, case.expert_offsets.astype(np.int32), 2 * case.c_bf16.shape[1], count_ptrs=count_ptrs,
               row_cache=row_cache, p3_control=p3_control, stream=stream, wire="fp8", same_gpu=same_gpu)

    def diagnostics(self):
        return self.s.diagnostics()

    def close(self):
        self.s.close()
        self.c.free()


@pytest.mark.parametrize("family", ROUTING)
def test_scatter_fp8_byte_exact(dev, family):
    for row_cache in (False, True):
        case = fp8_case(family, fresh_seed(f"scatter fp8 {family} cache={row_cache}"))
        assert_send_exact(run_send(dev, case, row_cache=row_cache, stamps=True, trace=True,
                                   sender_factory=lambda c: Fp8Scatter(dev, c)))


def test_scatter_fp8_dsv3_hidden_and_budget(dev):
    """hidden 7168 (DeepSeek-V3), every SM and a 3-SM budget (long ranges per warp)."""
    for num_sms in (None, 3):
        case = fp8_case("random", fresh_seed(f"scatter fp8 7168 sms={num_sms}"), hidden=7168, pad=0)
        assert_send_exact(run_send(dev, case, sender_factory=lambda c: Fp8Scatter(dev, c, num_sms)))


# (warps, shared memory a CTA, hidden): the kernel's tile is the widest multiple of 256 columns
# dividing hidden whose 4 bf16 rows fit the warp's share less 256 bytes, at most 2048 (its
# header): W 256, 512, 1280, 1536, 2048 and 1792 here, one warp to p3send's 12, a share that is
# no multiple of 16
LAUNCH_SHAPES = ((1, 2304, 7168), (2, 2 * 4352, 1536), (4, 4 * 10496, 2560), (3, 3 * 14592, 1536),
                 (12, 12 * 16640, 2048), (5, 5 * 16640 + 40, 7168))


@pytest.mark.parametrize("warps,smem,hidden", LAUNCH_SHAPES)
def test_scatter_fp8_any_launch_shape_sends_the_same_bytes(dev, warps, smem, hidden):
    case = fp8_case("skewed", fresh_seed(f"scatter fp8 {warps} warps {smem} B h{hidden}"), hidden=hidden)
    assert_send_exact(run_send(dev, case, sender_factory=lambda c: Fp8Scatter(dev, c, 2, (32 * warps, smem))))


def test_scatter_fp8_one_row_every_edge_kind(dev):
    for kind in KINDS:
        case = fp8_case("one_row", fresh_seed(f"scatter fp8 one row {kind}"), kinds=(kind,))
        assert_send_exact(run_send(dev, case, sender_factory=lambda c: Fp8Scatter(dev, c)))


def test_scatter_fp8_gated_writes_nothing(dev):
    case = fp8_case("random", fresh_seed("scatter fp8 gated"))
    run = run_send(dev, case, p3_control=-1, sender_factory=lambda c: Fp8Scatter(dev, c))
    assert_send_exact(run)
    assert all((r == 0xAB).all() for r in run.recv)


def _raw_launch(dev, case, cfg_msg, entry_flags, entry="p3_scatter_send_fp8", threads=None, smem=None):
    """Launch an entry with p3_scatter_send's parameters directly (no host check), in p3send's
    launch shape or (threads, smem); returns (receive buffer bytes, diag)."""
    # sized for the larger of the two slot sizes: a kernel that failed to refuse stays in the buffer
    rbytes = case.max_tokens_per_rank * case.top_k * max(cfg_msg, case.msg_bytes)
    recv = driver.DeviceBuffer(rbytes + 2 * GUARD, fill=0xAB)
    c = driver.DeviceBuffer.from_array(np.ascontiguousarray(case.c_bf16))
    rtab = driver.DeviceBuffer.from_array(case.range_table.astype(np.int32))
    src = driver.DeviceBuffer.from_array(case.src_info.astype(np.int32))
    offs = driver.DeviceBuffer.from_array(case.expert_offsets.astype(np.int32))
    state = driver.DeviceBuffer(40 * case.n_experts, fill=0)
    diag = driver.DeviceBuffer(16, fill=0)
    try:
        cfg = rank_config(n_ranks=1, my_rank=0, p2p_world_size=1, recv_bufs=[recv.ptr + GUARD], top_k=case.top_k,
                          msg_bytes=cfg_msg, max_tokens=case.max_tokens_per_rank, range_table=rtab, src_info=src)
        k = loader.kernel(entry, dev)
        smem = smem or (ScatterSend.FP8_SMEM if entry.endswith("fp8") else 192 * 1024)
        threads = threads or (ScatterSend.FP8_THREADS if entry.endswith("fp8") else 1024)
        driver.set_max_dynamic_smem(k.func, smem)
        blk = k.params_block(cfg=cfg, count_ptrs=[0] * 8, c_ptr=c, c_row_stride=2 * case.c_bf16.shape[1],
                             expert_offsets=offs, state_ptr=state, diag_ptr=diag, n_experts=case.n_experts,
                             flags=entry_flags, p3_control=0)
        s = driver.Stream()
        blk.launch((4,), (threads,), s, smem)
        s.synchronize()
        return recv.download(), send_ops.read_diagnostics(diag, False)
    finally:
        for b in (recv, c, rtab, src, offs, state, diag):
            b.free()


def test_devices_refuse_a_wrong_wire_without_writing(dev):
    """p3_scatter_send refuses FLAG_WIRE_FP8; p3_scatter_send_fp8 refuses a msg_bytes that is
    no FP8 row (here the bf16 row's) and a launch without the flag: diag[2], nothing written."""
    case = fp8_case("random", fresh_seed("device refusals"), hidden=512, pad=0)
    case.n_ranks = 1
    for entry, msg, flags in (("p3_scatter_send", case.msg_bytes, FLAG_WIRE_FP8),
                              ("p3_scatter_send_fp8", 2 * case.hidden, FLAG_WIRE_FP8),
                              ("p3_scatter_send_fp8", case.msg_bytes, 0)):
        got, diag = _raw_launch(dev, case, msg, flags, entry)
        assert diag["rejected"], f"{entry} msg={msg} flags={flags}: not rejected"
        assert (got == 0xAB).all(), f"{entry} msg={msg} flags={flags}: wrote into the receive buffer"
    # too little shared memory for a warp (2304 bytes: the ctx, acct, mbarrier and a 4 x 256
    # tile), or a partial warp: refused, nothing written; 2304 bytes a warp is enough
    for threads, smem, refused in ((128, 4 * 2304 - 16, True), (48, 2 * 2304, True), (128, 4 * 2304, False)):
        got, diag = _raw_launch(dev, case, case.msg_bytes, FLAG_WIRE_FP8, threads=threads, smem=smem)
        assert diag["rejected"] == refused, f"{threads} threads, {smem} B: rejected {diag['rejected']}"
        if refused:
            assert (got == 0xAB).all(), f"{threads} threads, {smem} B: wrote into the receive buffer"


def test_launchers_refuse_a_wrong_msg_bytes_before_launch(dev):
    case = fp8_case("random", fresh_seed("host refusals"), hidden=1024, pad=0)
    recv = driver.DeviceBuffer(1 << 16)
    try:
        for msg in (2 * 1024, wire_msg_bytes(1024, "fp8") + 16):
            cfg = rank_config(n_ranks=1, my_rank=0, p2p_world_size=1, recv_bufs=[recv.ptr], top_k=1, msg_bytes=msg,
                              max_tokens=4)
            s = ScatterSend(case.n_experts, device=dev)
            c = driver.DeviceBuffer.from_array(np.ascontiguousarray(case.c_bf16))
            try:
                with pytest.raises(ConfigError, match="msg_bytes"):
                    s.prepare(cfg, c, case.expert_offsets.astype(np.int32), wire="fp8", hidden=1024)
                e = EpilogueSend(case.n_experts, device=dev, bn=512)
                acc = driver.DeviceBuffer(4 * 1024 * max(case.c_bf16.shape[0], 1))
                try:
                    with pytest.raises(ConfigError, match="msg_bytes"):
                        e.prepare(cfg, acc, 1024, case.expert_offsets.astype(np.int32), wire="fp8")
                finally:
                    e.close()
                    acc.free()
            finally:
                s.close()
                c.free()
        e = EpilogueSend(1, device=dev, bn=64)
        cfg = rank_config(n_ranks=1, my_rank=0, p2p_world_size=1, recv_bufs=[recv.ptr], top_k=1,
                          msg_bytes=wire_msg_bytes(512, "fp8"), max_tokens=4)
        acc = driver.DeviceBuffer(4 * 512)
        with pytest.raises(ConfigError, match="bn"):
            e.prepare(cfg, acc, 512, np.array([0, 1], np.int32), wire="fp8")
        e.close()
        acc.free()
    finally:
        recv.free()


# ---------------------------------------------------------------- p3_epilogue_send

class Fp8Epilogue:
    """EpilogueSend(wire="fp8") of case.acc (fp32), as run_send's sender_factory."""

    def __init__(self, dev, case, **geometry):
        self.s = EpilogueSend(case.n_experts, device=dev, **geometry)
        self.grid, self.state = self.s.grid, self.s.state
        self.acc = driver.DeviceBuffer.from_array(np.ascontiguousarray(case.acc))

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        self.s(cfg, self.acc, case.hidden, case.expert_offsets.astype(np.int32), count_ptrs=count_ptrs,
               row_cache=row_cache, p3_control=p3_control, stream=stream, wire="fp8")

    def diagnostics(self):
        return self.s.diagnostics()

    def close(self):
        self.s.close()
        self.acc.free()


def fp8_epilogue_case(family: str, seed: int, hidden: int | None = None):
    """fp8_case with fp32 accumulators: acc = the bf16 values plus noise below bf16's last
    bit (so the kernel's rounding to bf16 matters), C = bf16(acc) and its wire bytes. No
    subnormal blocks here (the scatter and linked cases cover the quantiser on those)."""
    case = fp8_case(family, seed, hidden, kinds=tuple(k for k in KINDS if k != "subnormal"), pad=0)
    rng = np.random.default_rng(seed + 11)
    bits = case.c_bf16[:, :case.hidden]
    acc = (bits.astype(np.uint32) << 16).view(np.float32).copy()
    finite = np.isfinite(acc) & (np.abs(acc) < 1e38)
    noise = rng.integers(0, 1 << 16, acc.shape, dtype=np.uint32)
    acc_bits = acc.view(np.uint32)
    acc_bits[finite] |= noise[finite]
    case.acc = acc
    bits = f32_to_bf16(acc)
    case.c_bf16 = bits
    case.c = wire_ref.encode(bits) if len(bits) else case.c
    case.name = f"fp8-epilogue/{family}/h{case.hidden}"
    return case


@pytest.mark.parametrize("family", ["random", "masked_experts", "modulo", "bad_src_info", "one_row", "zero_rows"])
def test_epilogue_fp8_byte_exact(dev, family):
    for i, geometry in enumerate((dict(bm=16, bn=512, num_stages=2, send_warps=1, epilogue_warps=2),
                                  dict(bm=32, bn=128, num_stages=4, send_warps=2, epilogue_warps=4),
                                  dict(bm=8, bn=1024, num_stages=2, send_warps=0, epilogue_warps=4))):
        case = fp8_epilogue_case(family, fresh_seed(f"epilogue fp8 {family} {i}"))
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 2), sender_factory=lambda c: Fp8Epilogue(dev, c,
                                                                                                        **geometry)))


# ---------------------------------------------------------------- p3_send_rows linked into an outside kernel

class LinkedFp8Consumer:
    """tests/gpu/data/consumer.ptx + ptx/p3_send_rows.ptx through the driver's linker, the
    consumer staging bf16 tiles of C (its msg_bytes parameter: the bf16 row, 2*hidden) and
    ctx.flags carrying FLAG_WIRE_FP8."""

    def __init__(self, dev, case):
        mod = loader.link([("consumer.ptx", (DATA / "consumer.ptx").read_text()), "p3_send_rows"],
                          device=dev, name="consumer+p3_send_rows")
        self.k, self.dev = mod["consumer"], dev
        self.n_experts, self.grid = case.n_experts, max(case.n_experts, 1)
        self.state = driver.DeviceBuffer(40 * case.n_experts, fill=0)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.ctx = driver.DeviceBuffer(104, fill=0)
        self.offsets = driver.DeviceBuffer(4 * (case.n_experts + 1))
        self.c = driver.DeviceBuffer.from_array(np.ascontiguousarray(case.c_bf16))

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        sa = send_ops.send_args(cfg, case.expert_offsets.astype(np.int32), n_experts=self.n_experts,
                                ordinal=self.dev.ordinal, rows_cap=case.c.shape[0], count_ptrs=count_ptrs,
                                row_cache=row_cache, p3_control=p3_control, staging=self.offsets, wire="fp8",
                                hidden=case.hidden)
        assert not sa.problems, sa.problems
        assert sa.flags & FLAG_WIRE_FP8
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = sa.count_ptrs
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = sa.expert_offsets, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, sa.flags, p3_control
        self.ctx.upload(np.frombuffer(bytes(ctx), np.uint8))
        s = stream or driver.Stream()
        self.k.params_block(cfg=cfg, ctx=self.ctx, c_ptr=self.c, offsets=sa.expert_offsets,
                            msg_bytes=2 * case.hidden).launch((self.grid,), (128,), s)
        s.synchronize()

    def diagnostics(self):
        return send_ops.read_diagnostics(self.diag, True)

    def close(self):
        for b in (self.state, self.diag, self.ctx, self.offsets, self.c):
            b.free()


@pytest.mark.parametrize("family", ["random", "bad_src_info", "modulo", "masked_experts", "one_row"])
def test_linked_send_rows_fp8(dev, family):
    case = fp8_case(family, fresh_seed(f"linked fp8 {family}"), pad=0)
    assert_send_exact(run_send(dev, case, row_cache=(family != "modulo"),
                               sender_factory=lambda c: LinkedFp8Consumer(dev, c)))


# ---------------------------------------------------------------- the fused GEMMs

class WireFusedSender:
    """A GEMM problem's launcher with the send on and ``wire="fp8"`` (its own C buffer: C is
    not written with the send on), launched twice (the state resets itself), as
    run_send's sender."""

    def __init__(self, dev, prob, bm: int, **kw):
        self.prob, self.bm, self.kw = prob, bm, kw
        self.g = prob.launcher(prob.case.n_experts, device=dev)
        self.grid, self.state = self.g.grid, self.g.state
        self.bufs = prob.upload()
        self.c = driver.DeviceBuffer(prob.rows * prob.stride, fill=0xAB)

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        for _ in range(2):
            self.prob.call(self.g, cfg, self.bufs, self.c, bm=self.bm, count_ptrs=count_ptrs, row_cache=row_cache,
                           p3_control=p3_control, stream=stream, wire="fp8", **self.kw)
            driver.device().synchronize()

    def diagnostics(self):
        d = self.g.diagnostics()
        return {k: (v // 2 if k != "rejected" else v) for k, v in d.items()}

    def close(self):
        self.g.close()
        for b in [*self.bufs, self.c]:
            b.free()


def gemm_fp8_wire_check(dev, prob, bm: int, check_c, fp8_source: str | None = "bf16",
                        exact: bool | None = None) -> None:
    """The gated GEMM's bf16 C passes ``check_c`` (within its bound of the numpy reference; None:
    not checked), and the fused GEMM on the FP8 wire sends oracle.wire.encode of that C: exact
    with ``fp8_source`` "bf16" (the GEMM stages C as bf16 and the send quantises that tile),
    with "fp32" (the FP8 GEMM's consumers quantise their fp32 sums, of which C is the bf16
    rounding) within ``oracle.wire.requantised`` of it (``exact``: exact anyway)."""
    from tests.gpu.gemm_common import gated
    c = gated(dev, prob, bm)
    if check_c is not None:
        check_c(prob, c)
    bits = np.ascontiguousarray(c[:, :2 * prob.n_cols]).view(np.uint16)
    prob.case.c = wire_ref.encode(bits)
    prob.case.msg_bytes = wire_msg_bytes(prob.n_cols, "fp8")
    kw = {} if fp8_source is None else {"fp8_source": fp8_source}
    run = run_send(dev, prob.case, sender_factory=lambda cs: WireFusedSender(dev, prob, bm, **kw))
    if exact is None:
        exact = fp8_source == "bf16" or (fp8_source is None and bm == 64)
    assert_send_exact(run, None if exact else fp8_requantised(prob.n_cols, prob.case.msg_bytes))
    if not exact:   # how many codes the one rounding changed (printed: pytest -s)
        differ = sum(int((g != w).sum()) for g, w in zip(run.recv, run.want_recv))
        sent = sum(int((~(w[GUARD:-GUARD].reshape(-1, prob.case.msg_bytes) == SENTINEL).all(axis=1)).sum())
                   for w in run.want_recv)
        print(f"[fp8 wire from fp32] {prob.case}: {sent} slots sent, bytes differing from the bf16 C's wire {differ}")
        # the consumers' quantiser ran (a launcher that left the flag off sends C's wire exactly):
        # about 2% of the codes of random sums change: none of 8,192 changing has a chance below 1e-70
        if sent * prob.n_cols >= 16 * 512:
            assert differ, f"{prob.case}: {sent} slots, every byte the bf16 C's wire: not quantised from the sums"


def _hopper_or_skip(dev):
    if tuple(dev.cc) != (9, 0):
        pytest.skip(f"the fused GEMMs need sm_90; {dev.name} is sm_{dev.cc[0]}{dev.cc[1]}")


@pytest.mark.parametrize("family", ["random", "masked_experts", "bad_src_info", "modulo", "one_row"])
def test_bf16_gemm_fp8_wire(dev, family):
    _hopper_or_skip(dev)
    from tests.gpu.test_gemm import GemmProblem, check_c
    for bm in (128, 64):
        prob = GemmProblem(family, fresh_seed(f"bf16 gemm fp8 wire {family} bm={bm}"), n_cols=512 * (1 + bm % 3),
                           k_dim=128)
        gemm_fp8_wire_check(dev, prob, bm, check_c, fp8_source=None, exact=True)   # the send warps quantise C


@pytest.mark.parametrize("family", ["random", "masked_experts", "bad_src_info", "modulo", "one_row"])
def test_fp8_gemm_fp8_wire(dev, family):
    _hopper_or_skip(dev)
    from tests.gpu.test_gemm_fp8 import Fp8Problem, check_c
    # 128-row tiles on p3_gemm_fp8_send_wide (the default) and on p3_gemm_fp8_send, each with the
    # consumers quantising the fp32 sums (the default) and the send warps the bf16 tile; 64-row ones
    for bm, align, wide, source in ((128, 128, None, None), (128, 128, False, "fp32"), (128, 128, None, "bf16"),
                                    (128, 128, False, "bf16"), (64, 1, None, None)):
        prob = Fp8Problem(family, fresh_seed(f"fp8 gemm fp8 wire {family} bm={bm} wide={wide} from={source}"),
                          n_cols=512 * (1 + (family == "random")), k_dim=256, align=align, wide=wide)
        gemm_fp8_wire_check(dev, prob, bm, check_c, fp8_source=source)


def exact_fp8_problem(family: str, seed: int, wide):
    """An Fp8Problem whose fp32 sums are bf16 numbers (so C loses nothing in bf16 and the wire of
    the sums is exactly ``oracle.wire.encode`` of C): A and B codes of 0 and +-1, K 256 (|a . b| <=
    256, an integer: 8 significant bits), scales powers of two constant along K (per row, per
    weight block); among the rows all-zero ones (the amax clamp), 2^90 and 2^-110 ones (huge;
    tiny, under the clamp), NaN ones and +Inf ones (an all-Inf first block, NaN where a row's
    k-block sums to 0)."""
    from tests.gpu.test_gemm_fp8 import Fp8Problem
    prob = Fp8Problem(family, seed, n_cols=1024, k_dim=256, align=128, wide=wide)
    rng = np.random.default_rng(seed + 3)
    e, n, k = prob.qb.shape

    def pick(shape):                                         # codes of 0, 1, -1
        return rng.choice(np.array([0x00, 0x38, 0xB8], np.uint8), shape, p=[0.5, 0.25, 0.25])
    prob.qa, prob.qb = pick(prob.qa.shape), pick((e, n, k))
    row_exp = rng.integers(-20, 20, prob.rows).astype(np.float64)
    kind = rng.integers(0, 8, prob.rows)
    # the +Inf rows' A all +1 and every expert's first 128 weight rows all +1: each k-block's sum
    # there is 128 (no 0 * Inf), so those rows' first block is all +Inf (scale +Inf, codes 0x7F)
    prob.qa[kind == 5] = 0x38
    prob.qb[:, :128, :] = 0x38
    row_scale = np.exp2(row_exp)
    row_scale[kind == 1] = 0.0
    row_scale[kind == 2] = 2.0 ** 90
    row_scale[kind == 3] = 2.0 ** -110
    row_scale[kind == 4] = np.nan
    row_scale[kind == 5] = np.inf
    prob.sa = np.repeat(row_scale[:, None], k // 128, axis=1).astype(np.float32)
    blk = np.exp2(rng.integers(-6, 6, (e, n // 128))).astype(np.float32)
    prob.sb = np.repeat(blk[:, :, None], k // 128, axis=2)
    return prob


@pytest.mark.parametrize("family", ["random", "skewed", "one_row"])
@pytest.mark.parametrize("wide", [None, False])
def test_fp8_gemm_fp8_wire_from_fp32_exact(dev, family, wide):
    """Sums that bf16 holds exactly: the consumers' quantiser sends exactly oracle.wire.encode of
    C (every edge block: zeros, huge, tiny, NaN, Inf), and C is the exact product."""
    _hopper_or_skip(dev)
    from tests.gpu.gemm_common import gated
    prob = exact_fp8_problem(family, fresh_seed(f"fp8 gemm exact sums {family} wide={wide}"), wide)
    c = gated(dev, prob, 128)
    got = np.ascontiguousarray(c[:, :2 * prob.n_cols]).view(np.uint16)
    a = fp8.e4m3_to_f32(prob.qa).astype(np.float64)
    b = fp8.e4m3_to_f32(prob.qb).astype(np.float64)
    off = prob.case.expert_offsets
    with np.errstate(invalid="ignore", over="ignore"):
        for x in range(len(off) - 1):
            lo, hi = int(off[x]), int(off[x + 1])
            if hi > lo:
                dots = a[lo:hi] @ b[x].T                                        # integers, |.| <= 256
                want = dots * prob.sa[lo:hi, :1].astype(np.float64) * np.repeat(prob.sb[x, :, 0], 128)[None, :]
                fin = np.isfinite(prob.sa[lo:hi, 0])
                have = (got[lo:hi][fin].astype(np.uint32) << 16).view(np.float32)   # bf16 values: -0 == +0
                assert np.array_equal(have, want[fin].astype(np.float32)), \
                    f"{prob.case}: C of expert {x} is not the exact product"
    gemm_fp8_wire_check(dev, prob, 128, None, fp8_source="fp32", exact=True)

