"""The shipped senders' NVSHMEM put path, host side, on the stand-in driver (no GPU, no NVSHMEM):
a launcher given an ``NvshmemTransport`` takes its kernel from the transport (the module linked
with the shim), sets FLAG_NVSHMEM (and FLAG_NVSHMEM_ALL), keeps the transport's block after its
sender state, and refuses what the put path cannot send before any launch.
"""
from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from p3send.abi.config import P3SendCtx, rank_config
from p3send.abi.errors import ConfigError
from p3send.abi.wire import FLAG_WIRE_FP8, wire_msg_bytes
from p3send.ops import nvshmem
from p3send.ops.send import FLAG_NVSHMEM, FLAG_NVSHMEM_ALL, FLAG_SIGNAL, EpilogueSend, ScatterSend
from tests.cpu.test_fp8_inputs import DEV, FakeBuffer, stand_in_kernel
from tests.cpu.test_fp8_inputs import gpu as gpu  # noqa: F401  (the stand-in driver fixture)

N_EXPERTS, ROWS, TOP_K, MAX_TOK = 3, 40, 2, 32
RECV_SYM, COUNTS_SYM = 0x7A00_0000_1000, 0x7A10_0000_0010


class FakeWorld:
    """What NvshmemTransport uses of an NvshmemWorld: rank, n_ranks, alloc, load (stand-ins)."""

    def __init__(self, rank=0, n_ranks=1):
        self.rank, self.n_ranks, self.device, self.loaded = rank, n_ranks, DEV, []

    def alloc(self, nbytes):
        buf = FakeBuffer(nbytes)
        buf.free = lambda: None
        return buf

    def ptr(self, addr, pe):
        return addr + 0x1000_0000 * (pe + 1) if pe != 1 else 0     # PE 1: reachable only by puts

    def load(self, sources, *, name):
        names = [n[: -len(".ptx")] for n, _ in sources]          # (file name, linked text) pairs
        self.loaded.append(names)
        return {n: stand_in_kernel(n) for n in names}


def transport(world, msg, **kw):
    return nvshmem.NvshmemTransport(world, recv=RECV_SYM, counts=COUNTS_SYM, msg_bytes=msg, staging_rows=ROWS,
                                    recv_bytes=MAX_TOK * TOP_K * msg, counts_bytes=8 * N_EXPERTS * world.n_ranks, **kw)


def cfg_for(msg, n_ranks=1, my_rank=0, p2p=1, max_tok=MAX_TOK):
    return rank_config(n_ranks=n_ranks, my_rank=my_rank, p2p_world_size=p2p, recv_bufs=[FakeBuffer(8)] * p2p,
                       top_k=TOP_K, msg_bytes=msg, max_tokens=max_tok, range_table=FakeBuffer(8 * N_EXPERTS * n_ranks),
                       src_info=FakeBuffer(8 * ROWS))


OFFSETS = np.array([0, 10, 25, ROWS], np.int32)


def block_words(g, state, n_experts=N_EXPERTS):
    return struct.unpack("<5Q", g.read(state.ptr + 40 * n_experts, nvshmem.BLOCK_BYTES))


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
@pytest.mark.parametrize("all_puts", [False, True])
def test_the_scatter_send_takes_the_linked_fp8_entry_and_the_flags_on_either_wire(gpu, wire, all_puts):
    msg = 1024 if wire == "bf16" else wire_msg_bytes(512, "fp8")
    w = FakeWorld()
    t = transport(w, msg, all_puts=all_puts)
    s = ScatterSend(N_EXPERTS, device=DEV, transport=t)
    c = FakeBuffer(ROWS * (msg if wire == "bf16" else 1024))
    blk = s.prepare(cfg_for(msg), c, OFFSETS, count_ptrs=[FakeBuffer(8 * N_EXPERTS)], wire=wire)
    assert blk.kernel is s.fp8_kernel() and blk.kernel.name == "p3_scatter_send_fp8"
    assert w.loaded == [["p3_scatter_send_fp8"]]         # through world.load: the shim linked in
    flags = blk.get("flags").value
    assert flags & FLAG_NVSHMEM and flags & FLAG_SIGNAL
    assert bool(flags & FLAG_NVSHMEM_ALL) == all_puts and bool(flags & FLAG_WIRE_FP8) == (wire == "fp8")
    assert blk.get("state_ptr").value == s.state.ptr and s.state.nbytes == 40 * N_EXPERTS + nvshmem.BLOCK_BYTES
    assert block_words(gpu, s.state) == (RECV_SYM, COUNTS_SYM, t.staging.ptr, ROWS, 1)   # PE 0 reachable
    assert not any(gpu.read(s.state.ptr, 40 * N_EXPERTS))     # the state proper: zero


def test_the_transport_refuses_what_its_put_path_cannot_send_before_any_launch(gpu):
    w = FakeWorld(rank=0, n_ranks=2)
    t = transport(w, 1024)
    s = ScatterSend(N_EXPERTS, device=DEV, transport=t)
    c = FakeBuffer(ROWS * 1040)
    with pytest.raises(ConfigError) as e:
        s.prepare(cfg_for(1040, n_ranks=1, max_tok=4 * MAX_TOK), c, np.array([0, 10, 25, ROWS + 1], np.int32),
                  count_ptrs=[FakeBuffer(8 * N_EXPERTS)], rows_in_c=ROWS + 1)
    msg = str(e.value)
    for want in ("cfg: n_ranks 1, my_rank 0: the transport's PEs are the ranks, expected n_ranks 2",
                 "msg_bytes: the transport's staging rows hold 1024 bytes, got 1040",
                 "msg_bytes: the bf16 wire through the transport (p3_scatter_send_fp8's 256-column tiles) needs a "
                 "multiple of 512, got 1040",
                 f"staging_rows: the send holds rows up to {ROWS + 1}, the transport stages {ROWS}",
                 f"recv: {MAX_TOK * TOP_K * 1024} bytes, the cfg's slots need {4 * MAX_TOK * TOP_K * 1040}"):
        assert want in msg, (want, msg)
    assert not [x for x in gpu.log if x[0] == "launch"]


def test_a_block_of_a_module_without_the_put_path_is_refused(gpu):
    w = FakeWorld()
    s = ScatterSend(N_EXPERTS, device=DEV, transport=transport(w, 1024))
    other = stand_in_kernel("p3_scatter_send_fp8").params_block()     # e.g. the default-loaded module's
    with pytest.raises(ConfigError, match=r"into: the NVSHMEM transport sends with its own p3_scatter_send_fp8"):
        s.prepare(cfg_for(1024), FakeBuffer(ROWS * 1024), OFFSETS, count_ptrs=[FakeBuffer(8 * N_EXPERTS)],
                  into=other)


def test_without_a_transport_no_flag_of_the_put_path_is_ever_set(gpu):
    s = ScatterSend(N_EXPERTS, device=DEV)
    for wire, msg in (("bf16", 1024), ("fp8", wire_msg_bytes(512, "fp8"))):
        blk = s.prepare(cfg_for(msg), FakeBuffer(ROWS * 1024), OFFSETS, count_ptrs=[FakeBuffer(8 * N_EXPERTS)],
                        wire=wire)
        assert not blk.get("flags").value & (FLAG_NVSHMEM | FLAG_NVSHMEM_ALL)
    assert s.state.nbytes == 40 * N_EXPERTS


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_the_epilogue_send_links_its_module_and_flags_its_ctx(gpu, wire, monkeypatch):
    import p3send.ops.send as send_mod
    monkeypatch.setattr(send_mod.driver, "occupancy", lambda func, threads, smem: 1, raising=False)
    n_cols = 512
    msg = wire_msg_bytes(n_cols, wire)
    w = FakeWorld()
    t = transport(w, msg, all_puts=True)
    s = EpilogueSend(N_EXPERTS, device=DEV, bn=512, transport=t)
    assert w.loaded == [["p3_epilogue_send"]] and s.k.name == "p3_epilogue_send"
    s.prepare(cfg_for(msg), FakeBuffer(ROWS * 4 * n_cols), n_cols, OFFSETS, count_ptrs=[FakeBuffer(8 * N_EXPERTS)],
              wire=wire)
    ctx = P3SendCtx.from_buffer_copy(gpu.read(s.ctx.ptr, 104))
    assert ctx.flags & FLAG_NVSHMEM and ctx.flags & FLAG_NVSHMEM_ALL and ctx.state_ptr == s.state.ptr
    assert block_words(gpu, s.state) == (RECV_SYM, COUNTS_SYM, t.staging.ptr, ROWS, 1)


@pytest.mark.parametrize("kw, match", [
    (dict(recv=0), r"recv: expected a SymmetricBuffer or a 16-byte aligned symmetric address, got 0"),
    (dict(counts=COUNTS_SYM + 8), r"counts: expected a SymmetricBuffer or a 16-byte aligned symmetric address"),
    (dict(staging_rows=0), r"staging_rows: expected an integer >= 1, got 0"),
    (dict(msg_bytes=True), r"msg_bytes: expected an integer >= 1, got True"),
    (dict(recv_bytes=0), r"recv_bytes: expected None or an integer >= 1, got 0"),
    (dict(counts_bytes="64"), r"counts_bytes: expected None or an integer >= 1, got '64'"),
    (dict(recv_bytes=None), r"recv_bytes: expected the bytes behind the address 0x7a0000001000 \(required with an "
                            r"address"),
    (dict(counts_bytes=None), r"counts_bytes: expected the bytes behind the address"),
])
def test_bad_transport_arguments_are_refused_by_name(gpu, kw, match):
    args = dict(recv=RECV_SYM, counts=COUNTS_SYM, msg_bytes=1024, staging_rows=ROWS, recv_bytes=4096,
                counts_bytes=64) | kw
    with pytest.raises(ConfigError, match=match):
        nvshmem.NvshmemTransport(FakeWorld(), **args)


def test_a_size_beyond_the_symmetric_buffer_is_refused(gpu):
    """recv_bytes bounds what problems() lets a cfg's slots need: it may narrow a
    SymmetricBuffer's own size, never widen it."""
    buf = nvshmem.SymmetricBuffer.__new__(nvshmem.SymmetricBuffer)
    buf.ptr, buf.nbytes = RECV_SYM, 4096
    args = dict(counts=COUNTS_SYM, counts_bytes=64, msg_bytes=1024, staging_rows=ROWS)
    with pytest.raises(ConfigError, match=r"recv_bytes: expected at most the SymmetricBuffer's 4096 bytes, got 4097"):
        nvshmem.NvshmemTransport(FakeWorld(), recv=buf, recv_bytes=4097, **args)
    assert nvshmem.NvshmemTransport(FakeWorld(), recv=buf, recv_bytes=2048, **args).recv_bytes == 2048
    assert nvshmem.NvshmemTransport(FakeWorld(), recv=buf, **args).recv_bytes == 4096


def test_the_block_is_the_documented_layout():
    t = nvshmem.NvshmemTransport.__new__(nvshmem.NvshmemTransport)
    t.recv, t.counts, t.staging, t.staging_rows = 1 << 40, 2 << 40, SimpleNamespace(ptr=3 << 40), 77
    t.tile_src_mask = 0b101
    assert struct.unpack("<5Q", t.block()) == (1 << 40, 2 << 40, 3 << 40, 77, 0b101)


def test_the_tile_source_mask_names_the_pes_stores_reach_unless_every_row_is_staged(gpu):
    w = FakeWorld(rank=0, n_ranks=4)
    assert transport(w, 1024).tile_src_mask == 0b1101          # PE 1 only by puts: staged
    assert transport(w, 1024, stage_all=True).tile_src_mask == 0


def test_the_bench_section_renders_its_results_and_its_skip():
    from p3send.bench import nvshmem as bench_nv
    assert bench_nv.table({}) == ""
    assert "skipped (no NVSHMEM transport here" in bench_nv.table({"nvshmem": {"skipped": "no NVSHMEM transport here"}})
    side = lambda us: {"median_us": us, "min_us": us, "max_us": us, "n": 8, "interleaved": True}  # noqa: E731
    r = {"rows": 4096, "msg_bytes": 14336, "bytes": 4096 * 14336, "equal_to_direct": {"put": True, "linked": True},
         "put": side(90.0), "linked": side(60.0), "direct": side(45.0), "put_over_direct": 2.0,
         "put_over_linked_direct": 1.5}
    text = bench_nv.table({"nvshmem": {"bf16": r, "fp8": {"skipped": "hidden 7000"}}})
    assert "self-put (FLAG_NVSHMEM_ALL)" in text and "put / direct 2.000 (target <= 2)" in text
    assert "fp8: skipped (hidden 7000)" in text
