"""Layout formulas (docs/ABI.md §6) and the range table ("Region A", docs/ABI.md §5)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p3send.abi.layout import (
    NOT_ARRIVED,
    RANGE_READY_FLAG,
    decode_range_table,
    encode_range_table,
    recv_buf_bytes,
    recv_buf_layout,
    recv_count_layout,
    recv_counts_len,
)


def test_formulas_by_hand():
    assert recv_count_layout(2, 3, n_ranks=8) == 19
    assert recv_count_layout(0, 0, n_ranks=8) == 0
    # DeepSeek-V3 rows: token 3, 3rd choice, byte 16 of a 14336-byte slot, top-8.
    assert recv_buf_layout(3, 2, 16, top_k=8, msg_bytes=14336) == (3 * 8 + 2) * 14336 + 16 == 372752
    assert recv_buf_bytes(128, 8, 14336) == 14_680_064
    assert recv_counts_len(32, 8) == 256
    assert RANGE_READY_FLAG == 1024 and NOT_ARRIVED == np.uint64(2**64 - 1)


@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([16, 32, 48]))
def test_recv_buf_layout_tiles_the_buffer(max_tokens, top_k, msg_bytes):
    # Every (token, choice, byte) has its own byte and together they fill the buffer.
    offs = [recv_buf_layout(t, k, b, top_k, msg_bytes)
            for t in range(max_tokens) for k in range(top_k) for b in range(msg_bytes)]
    assert offs == list(range(recv_buf_bytes(max_tokens, top_k, msg_bytes)))


@given(st.integers(1, 5), st.integers(1, 8))
def test_recv_count_layout_is_a_bijection(n_experts, n_ranks):
    idx = [recv_count_layout(e, rk, n_ranks) for e in range(n_experts) for rk in range(n_ranks)]
    assert idx == list(range(recv_counts_len(n_experts, n_ranks)))


def test_encode_range_table_by_hand():
    # expert 0: rows [0, 5): rank 0 owns [0,2), rank 1 [2,5); expert 1: rows [5, 9): rank 0 [5,6).
    table = encode_range_table([0, 5, 9], [[2, 3], [1, 0]])
    assert table.dtype == np.int32
    assert table.tolist() == [1024 + 2, 2, 1024 + 5, 3, 1024 + 6, 1, 1024 + 6, 0]
    assert encode_range_table([0, 5, 9], [[2, 3], [1, 0]], ready=False).tolist() == [2, 2, 5, 3, 6, 1, 6, 0]


@st.composite
def dispatches(draw):
    n_experts, n_ranks = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    counts = np.array(draw(st.lists(st.lists(st.integers(0, 40), min_size=n_ranks, max_size=n_ranks),
                                    min_size=n_experts, max_size=n_experts)))
    slack = draw(st.lists(st.integers(0, 5), min_size=n_experts, max_size=n_experts))
    offsets = np.concatenate([[0], np.cumsum(counts.sum(axis=1) + slack)])
    return offsets, counts


@given(dispatches())
def test_range_table_round_trip(d):
    offsets, counts = d
    n_experts, n_ranks = counts.shape
    lo, hi = decode_range_table(encode_range_table(offsets, counts), n_experts, n_ranks)
    assert (hi - lo == counts).all()
    assert (lo[:, 0] == offsets[:-1]).all()            # each expert starts at its offset
    assert (lo[:, 1:] == hi[:, :-1]).all()             # ranks follow in rank order, no gaps
    assert (hi[:, -1] <= offsets[1:]).all()


@given(dispatches())
def test_range_table_resolves_like_the_send(d):
    # docs/PROTOCOL.md §3, rank lookup: the first rank whose [lo, hi) holds row r owns it; the rest of the
    # expert's rows (the slack) have no destination.
    offsets, counts = d
    n_experts, n_ranks = counts.shape
    lo, hi = decode_range_table(encode_range_table(offsets, counts), n_experts, n_ranks)
    for e in range(n_experts):
        want = np.repeat(np.arange(n_ranks), counts[e]).tolist()
        want += [None] * int(offsets[e + 1] - offsets[e] - len(want))
        got = [next((rk for rk in range(n_ranks) if lo[e, rk] <= r < hi[e, rk]), None)
               for r in range(offsets[e], offsets[e + 1])]
        assert got == want


def test_unready_entries_decode_below_the_flag():
    table = encode_range_table([0, 3000], [[2000]], ready=False)
    lo, hi = decode_range_table(table, 1, 1)
    assert hi[0, 0] == 2000 - RANGE_READY_FLAG   # not "owns nothing": the table must be complete
    lo, hi = decode_range_table(encode_range_table([0, 10], [[5]], ready=False), 1, 1)
    assert hi[0, 0] < 0   # small tables: an unready entry owns no row


def test_range_table_errors():
    with pytest.raises(ValueError, match=r"expert_offsets: expected shape \(3,\), got \(2,\)"):
        encode_range_table([0, 5], [[1], [1]])
    with pytest.raises(ValueError, match="counts: expected non-negative"):
        encode_range_table([0, 5], [[-1]])
    with pytest.raises(ValueError, match="expert 1 owns 7 rows but has 4"):
        encode_range_table([0, 5, 9], [[2, 3], [4, 3]])
    with pytest.raises(ValueError, match="exceed int32"):
        encode_range_table([0, 2**31 - 1], [[2**31 - 1]])     # rows fit, rows + the ready flag do not
    with pytest.raises(ValueError, match=r"expert_offsets: expected int32 row offsets 0\.\.2147483647, got 2147483648"):
        encode_range_table([0, 2**31], [[2**31 - 1]])
