"""The grouped GEMMs' ``wire`` argument on the CPU (the stand-in driver of test_fp8_inputs):
with ``wire="fp8"`` and the send on, the launch's P3SendCtx carries ``FLAG_WIRE_FP8`` and
``cfg.msg_bytes`` must be the fp8 slot size of an N-column row (``abi.wire.wire_msg_bytes``),
N a multiple of 512; a bad ``msg_bytes``, N or ``wire`` is refused naming the argument before
any launch; the default stays the bf16 wire (no flag, msg_bytes = 2N). The GEMM kernels need
no change for it: the fp8 wire launches ``wire_kernel()``, whose appended p3_send_rows reads
the flag; the default kernel's p3_send_rows has no FP8 code (test_bf16_only_modules.py)."""
from __future__ import annotations

import pytest

from p3send.abi.config import P3SendCtx, rank_config
from p3send.abi.errors import ConfigError
from p3send.abi.wire import FLAG_WIRE_FP8, FLAG_WIRE_FP8_STAGED, wire_msg_bytes
from p3send.ops.gemm import GroupedGemmSend
from p3send.ops.gemm_fp8 import GroupedGemmFp8Send
from tests.cpu import test_fp8_inputs as stand_in
from tests.cpu.test_fp8_inputs import DEV, FakeBuffer, fp8_buffers

gpu = stand_in.gpu                      # the stand-in driver's fixture

N_RANKS, TOP_K, ROWS = 2, 2, 256


def send_cfg(msg_bytes: int):
    """A send-on config over stand-in receive buffers, range table and src_info."""
    max_tok = ROWS
    return rank_config(n_ranks=N_RANKS, recv_bufs=[FakeBuffer(max_tok * TOP_K * msg_bytes) for _ in range(N_RANKS)],
                       top_k=TOP_K, msg_bytes=msg_bytes, max_tokens=max_tok, range_table=FakeBuffer(4 * 2 * 2 * 2),
                       src_info=FakeBuffer(8 * ROWS))


def ctx_flags(blk) -> int:
    return P3SendCtx.from_buffer_copy(blk.device_args[:104]).flags


def fp8_gemm(n: int):
    g = GroupedGemmFp8Send(2, device=DEV)
    a, sa, b, sb, off, _ = fp8_buffers(rows=ROWS, k=128, n=n)
    return g, (a, sa, b, sb, off), dict(rows=ROWS, n_cols=n, k_dim=128)


def bf16_gemm(n: int):
    g = GroupedGemmSend(2, device=DEV)
    x, w, off = FakeBuffer(2 * ROWS * 64), FakeBuffer(2 * 2 * n * 64), FakeBuffer(4 * 3)
    return g, (x, w, off), dict(rows=ROWS, n_cols=n, k_dim=64)


GEMMS = {"fp8": fp8_gemm, "bf16": bf16_gemm}


def prepare(g, arrays, sizes, cfg, **kw):
    into = (g.wire_kernel() if kw.get("wire") == "fp8" else g.k).params_block()
    return g.prepare(cfg, *arrays, count_ptrs=[FakeBuffer(8 * 2 * N_RANKS) for _ in range(N_RANKS)], p3_control=0,
                     into=into, **sizes, **kw)


@pytest.mark.parametrize("gemm", sorted(GEMMS))
def test_fp8_wire_sets_the_flag_and_takes_the_fp8_slot_size(gpu, gemm):
    n = 512
    g, arrays, sizes = GEMMS[gemm](n)
    blk = prepare(g, arrays, sizes, send_cfg(wire_msg_bytes(n, "fp8")), wire="fp8")
    assert ctx_flags(blk) & FLAG_WIRE_FP8
    blk = prepare(g, arrays, sizes, send_cfg(2 * n))                      # the default: the bf16 wire
    assert not ctx_flags(blk) & FLAG_WIRE_FP8
    assert not ctx_flags(prepare(g, arrays, sizes, send_cfg(2 * n), wire="bf16")) & FLAG_WIRE_FP8


@pytest.mark.parametrize("gemm", sorted(GEMMS))
def test_fp8_wire_refuses_a_bf16_slot_size_naming_msg_bytes_before_any_launch(gpu, gemm):
    n = 512
    g, arrays, sizes = GEMMS[gemm](n)
    gpu.log.clear()
    with pytest.raises(ConfigError, match=rf"msg_bytes: expected {wire_msg_bytes(n, 'fp8')} .*fp8 wire, got {2 * n}"):
        prepare(g, arrays, sizes, send_cfg(2 * n), wire="fp8")
    with pytest.raises(ConfigError, match=rf"msg_bytes: expected 2\*n_cols = {2 * n} \(bf16 rows\), got "
                                          rf"{wire_msg_bytes(n, 'fp8')}"):
        prepare(g, arrays, sizes, send_cfg(wire_msg_bytes(n, "fp8")))
    assert not [e for e in gpu.log if e[0] == "launch"]


@pytest.mark.parametrize("gemm", sorted(GEMMS))
def test_fp8_wire_needs_whole_512_column_multiples_and_a_known_format(gpu, gemm):
    n = 256                                                               # a multiple of both BNs, not of 512
    g, arrays, sizes = GEMMS[gemm](n)
    with pytest.raises(ConfigError, match=r"n_cols: expected a positive multiple of 512 for the fp8 wire"):
        prepare(g, arrays, sizes, send_cfg(264), wire="fp8")
    with pytest.raises(ConfigError, match=r"wire: expected 'bf16' or 'fp8', got 'int8'"):
        prepare(g, arrays, sizes, send_cfg(2 * n), wire="int8")


def test_the_wire_is_not_read_with_the_send_off(gpu):
    g, arrays, sizes = fp8_gemm(128)
    c = FakeBuffer(ROWS * 2 * 128)
    blk = g.prepare(send_cfg(2 * 128), *arrays, c, **sizes, wire="fp8")   # p3_control < 0: C is written
    assert blk.get("c_ptr").value == c.ptr


def test_the_fp8_gemm_quantises_its_fp32_sums_at_128_row_tiles(gpu):
    """FLAG_WIRE_FP8_STAGED (the consumers quantise, the send warps copy) on the fp8 wire at
    128-row tiles by default and with fp8_source="fp32"; not with "bf16", not at 64-row tiles
    (there the send warps quantise the staged bf16 tile), never on the bf16 wire or for the BF16
    GEMM; "fp32" at 64 rows and an unknown source are refused naming fp8_source, before any launch."""
    n = 512
    cfg8 = send_cfg(wire_msg_bytes(n, "fp8"))
    g, arrays, sizes = fp8_gemm(n)
    assert ctx_flags(prepare(g, arrays, sizes, cfg8, wire="fp8", bm=128)) & FLAG_WIRE_FP8_STAGED
    assert ctx_flags(prepare(g, arrays, sizes, cfg8, wire="fp8", bm=128, fp8_source="fp32")) & FLAG_WIRE_FP8_STAGED
    got = ctx_flags(prepare(g, arrays, sizes, cfg8, wire="fp8", bm=128, fp8_source="bf16"))
    assert got & FLAG_WIRE_FP8 and not got & FLAG_WIRE_FP8_STAGED
    got = ctx_flags(prepare(g, arrays, sizes, cfg8, wire="fp8", bm=64))
    assert got & FLAG_WIRE_FP8 and not got & FLAG_WIRE_FP8_STAGED
    assert not ctx_flags(prepare(g, arrays, sizes, send_cfg(2 * n), bm=128)) & FLAG_WIRE_FP8_STAGED
    gpu.log.clear()
    with pytest.raises(ConfigError, match=r"fp8_source: 'fp32' needs 128-row tiles .*got bm 64"):
        prepare(g, arrays, sizes, cfg8, wire="fp8", bm=64, fp8_source="fp32")
    with pytest.raises(ConfigError, match=r"fp8_source: expected 'fp32' or 'bf16', got 'fp16'"):
        prepare(g, arrays, sizes, cfg8, wire="fp8", fp8_source="fp16")
    assert not [e for e in gpu.log if e[0] == "launch"]
    g16, arrays16, sizes16 = bf16_gemm(n)
    assert not ctx_flags(prepare(g16, arrays16, sizes16, cfg8, wire="fp8")) & FLAG_WIRE_FP8_STAGED
