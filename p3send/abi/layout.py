"""Layout formulas and buffer helpers of the protocol (docs/ABI.md §5–6). Numpy only.

Shapes and dtypes are given on each helper; "absolute row" is a row index of the
expert-grouped L2 output C.
"""
from __future__ import annotations

import numpy as np

from .errors import ConfigError

#: Added to ``t_end`` in word0 of a range entry: the data-ready flag written by dispatch.
RANGE_READY_FLAG = 1024
#: A receive count holding this value has not arrived (u64 all-ones).
NOT_ARRIVED = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def recv_count_layout(e: int, rk: int, n_ranks: int) -> int:
    """Index of (local expert ``e``, source rank ``rk``) in a receive-count array."""
    return e * n_ranks + rk


def recv_buf_layout(src_idx: int, src_topk: int, byte_off: int, top_k: int, msg_bytes: int) -> int:
    """Byte offset of ``byte_off`` within slot (src_idx, src_topk) of a receive buffer."""
    return (src_idx * top_k + src_topk) * msg_bytes + byte_off


def recv_buf_bytes(max_tokens_per_rank: int, top_k: int, msg_bytes: int) -> int:
    """Size of one rank's receive buffer, (max_tokens_per_rank, top_k, msg_bytes) bytes."""
    return max_tokens_per_rank * top_k * msg_bytes


def recv_counts_len(n_local_experts: int, n_ranks: int) -> int:
    """Number of u64 receive counts per rank."""
    return n_local_experts * n_ranks


def encode_range_table(expert_offsets, counts, ready=True) -> np.ndarray:
    """Build the range table ("Region A") a dispatch would write.

    expert_offsets: int (n_experts+1,), non-decreasing absolute row offsets of each
    local expert. counts: int (n_experts, n_ranks), rows of expert e owned by rank rk;
    within an expert the ranks' ranges follow in rank order starting at
    ``expert_offsets[e]``. Returns int32 (n_experts*n_ranks*2,):
    ``[2*(e*n_ranks+rk)] = 1024 + t_end`` (without the 1024 if not ``ready``),
    ``[.. + 1] = count``.
    """
    off = np.asarray(expert_offsets, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.int64)
    n_experts, n_ranks = cnt.shape
    if off.shape != (n_experts + 1,):
        raise ConfigError(f"expert_offsets: expected shape ({n_experts + 1},), got {off.shape}", "range table")
    if (cnt < 0).any():
        raise ConfigError("counts: expected non-negative row counts", "range table")
    t_end = off[:-1, None] + np.cumsum(cnt, axis=1)
    if (t_end[:, -1] > off[1:]).any():
        bad = int(np.argmax(t_end[:, -1] > off[1:]))
        raise ConfigError(f"counts: expert {bad} owns {int(cnt[bad].sum())} rows but has "
                         f"{int(off[bad + 1] - off[bad])} in expert_offsets", "range table")
    table = np.empty((n_experts, n_ranks, 2), dtype=np.int64)
    table[..., 0] = t_end + (RANGE_READY_FLAG if ready else 0)
    table[..., 1] = cnt
    if table.max(initial=0) > np.iinfo(np.int32).max:
        raise ConfigError("range table: row indices exceed int32", "range table")
    return table.astype(np.int32).reshape(-1)


def decode_range_table(table, n_experts: int, n_ranks: int):
    """Inverse of ``encode_range_table`` as the send reads it.

    table: int32 (n_experts*n_ranks*2,). Returns int64 arrays ``lo, hi`` of shape
    (n_experts, n_ranks): rank rk owns absolute rows [lo, hi) of expert e. An entry
    without the ready flag decodes to hi = t_end - 1024, which owns nothing only while
    t_end < 1024: the flag is not a validity bit the send can test, so the table must
    be complete (dispatch done) before the send reads it.
    """
    t = np.asarray(table, dtype=np.int64).reshape(n_experts, n_ranks, 2)
    hi = t[..., 0] - RANGE_READY_FLAG
    lo = hi - t[..., 1]
    return lo, hi


#: The byte a receive buffer is filled with at allocation (and tests' sentinel): bytes
#: the send never wrote read back as 0xAB.
SENTINEL = 0xAB
