"""GPU tier: skipped with the driver's reason where no usable GPU exists.

``run_send`` is the one harness every scatter-send test uses: receive buffers and
counts pre-filled with a sentinel inside guard regions, the kernel launched through
the typed launcher, everything read back whole, and the oracle's expectation built
from the same inputs.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import pytest

from p3send import P3PeerSendConfig
from p3send.abi.config import rank_config
from p3send.cuda import driver
from p3send.ops.send import EpilogueSend, ScatterSend
from p3send.oracle import reference as ref
from p3send.oracle import wire as wire_ref
from p3send.oracle.cases import SENTINEL

OK, WHY = driver.available()
GUARD = 4096


@pytest.fixture(scope="session")
def dev():
    if not OK:
        pytest.skip(f"no usable GPU: {WHY}")
    return driver.device()


def fresh_seed(label: str = "") -> int:
    seed = secrets.randbits(32)
    print(f"[seed] {label} seed={seed}")
    return seed


def first_diff(got: np.ndarray, want: np.ndarray, msg_bytes: int | None = None) -> str:
    bad = np.nonzero(got != want)[0]
    if not len(bad):
        return "identical"
    i = int(bad[0])
    where = f"byte {i}" if msg_bytes is None else f"byte {i} (guarded offset; slot {(i - GUARD) // msg_bytes})"
    return f"{len(bad)} bytes differ, first at {where}: got {got[i]:#04x}, want {want[i]:#04x}"


@dataclass
class SendRun:
    case: object
    cfg: P3PeerSendConfig
    recv: list           # per peer, uint8 with guards
    want_recv: list
    counts: list         # per peer, uint64 with 2 guard words each side
    want_counts: list
    cache: np.ndarray | None
    want_cache: np.ndarray | None
    diag: dict
    res: object
    stamps: np.ndarray | None
    trace: np.ndarray | None
    state: np.ndarray


def fp8_requantised(hidden: int, msg_bytes: int):
    """assert_send_exact's recv_check for the FP8 wire of fp32 values when the oracle's rows are
    the wire of their bf16 rounding (the FP8 GEMM's consumers quantise its fp32 sums): guards
    and unowned slots (the oracle's all-sentinel ones) exact, every owned slot
    ``oracle.wire.requantised`` of the oracle's."""
    def check(got: np.ndarray, want: np.ndarray) -> str | None:
        if not (np.array_equal(got[:GUARD], want[:GUARD]) and np.array_equal(got[-GUARD:], want[-GUARD:])):
            return "a guard byte was written"
        return wire_ref.requantised_slots(got[GUARD:-GUARD], want[GUARD:-GUARD], hidden)
    return check


def run_send(dev, case, *, row_cache=False, signal=True, stamps=False, trace=False, p3_control=0,
             disabled=False, src_info=None, cache_init=None, num_sms=None, threads=None, stream=None, c_obj=None,
             epilogue: dict | None = None, sender_factory=None, same_gpu=False) -> SendRun:
    """Run ``case`` through p3_scatter_send once and return GPU bytes and oracle bytes.

    ``src_info`` replaces the case's src_info on the device only (the oracle keeps the
    case's); ``cache_init`` pre-fills the row cache (uint64 per row); ``c_obj`` supplies C as
    any device array object (e.g. a torch tensor) instead of an upload of ``case.c``;
    ``epilogue`` runs p3_epilogue_send (EpilogueSend options) on ``case.acc`` instead;
    ``sender_factory(case)`` supplies any other sender: callable as
    ``sender(cfg, c, case, stream=, count_ptrs=, row_cache=, p3_control=)``, with ``grid``,
    ``state``, ``diagnostics()`` and ``close()`` like the launchers. ``same_gpu`` signals at
    .gpu scope (every receiver of these tests is on this GPU)."""
    n_peers = case.p2p_world_size
    rbytes = case.max_tokens_per_rank * case.top_k * case.msg_bytes
    n_slots = case.n_experts * case.n_ranks
    keep = []

    def buf(nbytes, fill=None, data=None):
        b = driver.DeviceBuffer(nbytes, fill=fill) if data is None else driver.DeviceBuffer.from_array(data)
        keep.append(b)
        return b

    recv = [buf(rbytes + 2 * GUARD, SENTINEL) for _ in range(n_peers)]
    counts = [buf(8 * (n_slots + 4), 0xFF) for _ in range(n_peers)]
    c = buf(0, data=case.c) if c_obj is None else c_obj
    rtab = buf(0, data=case.range_table.astype(np.int32))
    src = buf(0, data=(case.src_info if src_info is None else src_info).astype(np.int32))
    rows_total = case.c.shape[0]
    cache = buf(8 * max(rows_total, 1), 0) if row_cache else None
    if cache is not None and cache_init is not None:
        cache.upload(np.asarray(cache_init, dtype=np.uint64))
    if sender_factory is not None:
        sender = sender_factory(case)
    elif epilogue is None:
        sender = ScatterSend(case.n_experts, device=dev, num_sms=num_sms, **({"threads": threads} if threads else {}))
    else:
        sender = EpilogueSend(case.n_experts, device=dev, **epilogue)
        acc = buf(0, data=case.acc)
    st = buf(16 * sender.grid, 0) if stamps else None
    tr = buf(8 * 16 * sender.grid, 0) if trace else None

    cfg = P3PeerSendConfig.disabled() if disabled else rank_config(
        n_ranks=case.n_ranks, my_rank=case.my_rank, p2p_world_size=case.p2p_world_size,
        recv_bufs=[recv[p].ptr + GUARD for p in range(n_peers)], top_k=case.top_k, msg_bytes=case.msg_bytes,
        max_tokens=case.max_tokens_per_rank, range_table=rtab, src_info=src, row_base=cache, send_stamps=st,
        trace=tr, trace_slot=3)
    count_ptrs = [counts[p].ptr + 16 for p in range(n_peers)] if signal and not disabled else None
    try:
        common = dict(stream=stream, count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control)
        if sender_factory is not None:
            sender(cfg, c, case, **common)
        elif epilogue is None:
            sender(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride, same_gpu=same_gpu, **common)
        else:
            sender(cfg, acc, case.msg_bytes // 2, case.expert_offsets.astype(np.int32), same_gpu=same_gpu, **common)
        driver.device().synchronize()
        got_recv = [b.download() for b in recv]
        got_counts = [b.download(np.uint64) for b in counts]
        got_cache = cache.download(np.uint64) if cache is not None else None
        diag = sender.diagnostics()
        state = sender.state.download(np.uint32)
        got_st = st.download(np.uint64).reshape(-1, 2) if st is not None else None
        got_tr = tr.download(np.uint64).reshape(-1, 16) if tr is not None else None
    finally:
        sender.close()
        for b in keep:
            b.free()

    # the oracle, on the same inputs
    want_recv = [np.full(rbytes + 2 * GUARD, SENTINEL, np.uint8) for _ in range(n_peers)]
    inner = [w[GUARD:GUARD + rbytes] for w in want_recv]
    want_counts = [np.full(n_slots + 4, np.uint64(0xFFFF_FFFF_FFFF_FFFF), np.uint64) for _ in range(n_peers)]
    res = ref.send(cfg, case.c, case.expert_offsets, case.range_table, case.src_info, inner,
                   p3_control=p3_control)
    if count_ptrs is not None and p3_control >= 0:
        ref.signal(cfg, res, case.n_experts, [w[2:2 + n_slots] for w in want_counts])
    want_cache = None
    if row_cache:
        want_cache = ref.expected_row_cache(cfg, res, case.expert_offsets) if p3_control >= 0 and not disabled \
            else np.zeros(rows_total, np.uint64)
    return SendRun(case, cfg, got_recv, want_recv, got_counts, want_counts, got_cache, want_cache, diag, res,
                   got_st, got_tr, state)


def assert_send_exact(run: SendRun, recv_check=None) -> None:
    """Whole buffers (guards included), counts, row cache, diagnostics and state; each receive
    buffer equal to the oracle's, or, with ``recv_check(got, want)``, what it returns None for
    (else its message)."""
    case = run.case
    for p, (got, want) in enumerate(zip(run.recv, run.want_recv)):
        if recv_check is None:
            assert np.array_equal(got, want), \
                f"{case}: peer {p} receive buffer: {first_diff(got, want, case.msg_bytes)}"
        else:
            msg = recv_check(got, want)
            assert msg is None, f"{case}: peer {p} receive buffer: {msg}"
    for p, (got, want) in enumerate(zip(run.counts, run.want_counts)):
        assert np.array_equal(got, want), f"{case}: peer {p} counts: got {got.tolist()}, want {want.tolist()}"
    if run.want_cache is not None:
        bad = np.nonzero(run.cache != run.want_cache)[0]
        assert not len(bad), f"{case}: row cache differs at rows {bad[:8].tolist()}"
    assert run.diag["dropped"] == run.res.dropped, f"{case}: dropped {run.diag} vs oracle {run.res.dropped}"
    assert run.diag["unrouted"] == run.res.unrouted, f"{case}: unrouted {run.diag} vs oracle {run.res.unrouted}"
    assert not run.diag["rejected"], f"{case}: config rejected on the device"
    assert not run.state.any(), f"{case}: sender state not self-reset: {run.state.tolist()}"
