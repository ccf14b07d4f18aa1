"""Layout formulas and buffer helpers of the protocol (docs/ABI.md §5–6). Numpy only.

Shapes and dtypes are given on each helper; "absolute row" is a row index of the
expert-grouped L2 output C. Every helper checks its arguments: integers only (never a
float truncated, a bool or a str), non-negative where a negative is meaningless, indices
inside the range their neighbours give (``rk < n_ranks``), arrays of an integer dtype and
the documented shape. A bad argument raises a ``ConfigError`` naming it.
"""
from __future__ import annotations

import numpy as np

from .config import checked_flag, checked_int, describe_value
from .errors import ConfigError, ConfigTypeError

#: Added to ``t_end`` in word0 of a range entry: the data-ready flag written by dispatch.
RANGE_READY_FLAG = 1024
#: A receive count holding this value has not arrived (u64 all-ones).
NOT_ARRIVED = np.uint64(0xFFFF_FFFF_FFFF_FFFF)

_I32 = np.iinfo(np.int32)
_I64_MAX = (1 << 63) - 1


def _fits_i64(value: int, formula: str, what: str) -> int:
    # The formulas are Mojo Int arithmetic on the device: a result past 2**63 wraps there.
    if value > _I64_MAX:
        raise ConfigError([f"{formula}: expected at most {_I64_MAX} (a signed 64-bit Int), got {value}"], what)
    return value


def recv_count_layout(e, rk, n_ranks) -> int:
    """Index of (local expert ``e``, source rank ``rk``) in a receive-count array.

    Args:
        e: local expert, an integer >= 0.
        rk: source rank, an integer in 0..n_ranks-1.
        n_ranks: EP ranks, an integer >= 1.

    Returns:
        int: ``e * n_ranks + rk``, an index into the u64 (n_local_experts*n_ranks,) counts.

    Raises:
        ConfigTypeError: an argument is not an integer.
        ConfigError: an argument is out of its range.
    """
    what = "recv_count_layout argument"
    n = checked_int("n_ranks", n_ranks, lo=1, what=what)
    e = checked_int("e", e, lo=0, what=what)
    rk = checked_int("rk", rk, lo=0, hi=n - 1, why=f" (rk < n_ranks={n})", what=what)
    return _fits_i64(e * n + rk, "e*n_ranks + rk", what)


def recv_buf_layout(src_idx, src_topk, byte_off, top_k, msg_bytes) -> int:
    """Byte offset of ``byte_off`` within slot (src_idx, src_topk) of a receive buffer.

    Args:
        src_idx: token on the source rank, an integer >= 0.
        src_topk: its choice, an integer in 0..top_k-1.
        byte_off: byte within the slot, an integer in 0..msg_bytes-1.
        top_k: experts per token, an integer >= 1.
        msg_bytes: bytes per slot, an integer >= 1.

    Returns:
        int: ``(src_idx*top_k + src_topk)*msg_bytes + byte_off``, into the u8
        (max_tokens_per_rank, top_k, msg_bytes) receive buffer.

    Raises:
        ConfigTypeError: an argument is not an integer.
        ConfigError: an argument is out of its range, or the offset exceeds a 64-bit Int.
    """
    what = "recv_buf_layout argument"
    k = checked_int("top_k", top_k, lo=1, what=what)
    m = checked_int("msg_bytes", msg_bytes, lo=1, what=what)
    t = checked_int("src_idx", src_idx, lo=0, what=what)
    s = checked_int("src_topk", src_topk, lo=0, hi=k - 1, why=f" (src_topk < top_k={k})", what=what)
    b = checked_int("byte_off", byte_off, lo=0, hi=m - 1, why=f" (byte_off < msg_bytes={m})", what=what)
    return _fits_i64((t * k + s) * m + b, "src_idx*top_k*msg_bytes + src_topk*msg_bytes + byte_off", what)


def recv_buf_bytes(max_tokens_per_rank, top_k, msg_bytes) -> int:
    """Size of one rank's receive buffer, (max_tokens_per_rank, top_k, msg_bytes) bytes.

    Args:
        max_tokens_per_rank: tokens, an integer >= 0.
        top_k: slots per token, an integer >= 0.
        msg_bytes: bytes per slot, an integer >= 0.

    Returns:
        int: the product, in bytes.

    Raises:
        ConfigTypeError: an argument is not an integer.
        ConfigError: an argument is negative, or the size exceeds a 64-bit Int.
    """
    what = "recv_buf_bytes argument"
    t = checked_int("max_tokens_per_rank", max_tokens_per_rank, lo=0, what=what)
    k = checked_int("top_k", top_k, lo=0, what=what)
    m = checked_int("msg_bytes", msg_bytes, lo=0, what=what)
    return _fits_i64(t * k * m, "max_tokens_per_rank*top_k*msg_bytes", what)


def recv_counts_len(n_local_experts, n_ranks) -> int:
    """Number of u64 receive counts per rank.

    Args:
        n_local_experts: experts per rank, an integer >= 0.
        n_ranks: EP ranks, an integer >= 0.

    Returns:
        int: ``n_local_experts * n_ranks``.

    Raises:
        ConfigTypeError: an argument is not an integer.
        ConfigError: an argument is negative.
    """
    what = "recv_counts_len argument"
    e = checked_int("n_local_experts", n_local_experts, lo=0, what=what)
    n = checked_int("n_ranks", n_ranks, lo=0, what=what)
    return _fits_i64(e * n, "n_local_experts*n_ranks", what)


def _int_array(name: str, value, ndim: int, what: str) -> np.ndarray:
    """``value`` as an int64 array of ``ndim`` dimensions, refused unless its values are
    integers: an integer numpy dtype or Python ints (never a float truncated, a bool)."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:   # ragged lists, ints past 64 bits
        raise ConfigError([f"{name}: expected a {ndim}-D array of integers, got {describe_value(value)} "
                           f"({' '.join(str(e).split())[:80]})"], what) from None
    if a.dtype.kind not in "iu":
        # np.asarray([]) is float64: an empty list holds no non-integer.
        if not (a.size == 0 and a.dtype.kind == "f" and not isinstance(value, np.ndarray)):
            shown = describe_value(value) if a.dtype.kind in "OUSV" else \
                f"{a.dtype} values (e.g. {_example(a)})" if a.size else f"an empty {a.dtype} array"
            raise ConfigTypeError([f"{name}: expected integers (an integer dtype or Python ints), got {shown}"],
                                  what)
    if a.ndim != ndim:
        raise ConfigError([f"{name}: expected a {ndim}-D array, got shape {a.shape}"], what)
    if a.dtype == np.uint64 and a.size and int(a.max()) > _I64_MAX:
        raise ConfigError([f"{name}: expected values that fit int64, got {int(a.max())}"], what)
    return a.astype(np.int64)


def _example(a: np.ndarray) -> str:
    """A value of the non-integer array ``a`` that shows why: the first non-integral one."""
    flat = a.reshape(-1)
    if a.dtype.kind == "f":
        odd = flat[~np.isfinite(flat) | (flat != np.trunc(np.nan_to_num(flat)))]
        flat = odd if odd.size else flat
    return repr(flat[0].item())


def _first(mask: np.ndarray) -> str:
    """The index of the first True of ``mask``, as ``[i]`` or ``[i, j]``."""
    return "[" + ", ".join(str(int(i)) for i in np.argwhere(mask)[0]) + "]"


def encode_range_table(expert_offsets, counts, ready=True) -> np.ndarray:
    """Build the range table ("Region A") a dispatch would write.

    Within an expert the ranks' ranges follow in rank order starting at
    ``expert_offsets[e]``.

    Args:
        expert_offsets: integers (n_experts+1,), non-decreasing absolute row offsets of
            each local expert, in 0..2**31-1 (int32 on the device).
        counts: integers (n_experts, n_ranks), n_ranks >= 1: rows of expert e owned by
            rank rk, each >= 0; together at most the expert's rows.
        ready: a bool: add the ready flag (1024) to ``t_end``.

    Returns:
        np.ndarray: int32 (n_experts*n_ranks*2,): ``[2*(e*n_ranks+rk)] = 1024 + t_end``
        (without the 1024 if not ``ready``), ``[.. + 1] = count``.

    Raises:
        ConfigTypeError: an array of non-integers (1.5, bools, strings), or ``ready`` not
            a bool.
        ConfigError: a wrong shape, a negative or decreasing offset, a negative count, an
            expert given more rows than it has, or entries that exceed int32.
    """
    what = "range table"
    off = _int_array("expert_offsets", expert_offsets, 1, what)
    cnt = _int_array("counts", counts, 2, what)
    ready = checked_flag("ready", ready, what=what)
    n_experts, n_ranks = cnt.shape
    if n_ranks < 1:
        raise ConfigError([f"counts: expected shape (n_experts, n_ranks) with n_ranks >= 1, got {cnt.shape}"], what)
    if off.shape != (n_experts + 1,):
        raise ConfigError([f"expert_offsets: expected shape ({n_experts + 1},), got {off.shape} (one offset more "
                           f"than the experts of counts {cnt.shape})"], what)
    if ((off < 0) | (off > _I32.max)).any():
        bad = (off < 0) | (off > _I32.max)
        raise ConfigError([f"expert_offsets: expected int32 row offsets 0..{_I32.max}, got {int(off[bad][0])} "
                           f"at {_first(bad)}"], what)
    if (np.diff(off) < 0).any():
        i = int(np.argmax(np.diff(off) < 0))
        raise ConfigError([f"expert_offsets: expected non-decreasing offsets, got {int(off[i])} at [{i}] then "
                           f"{int(off[i + 1])} at [{i + 1}]"], what)
    if ((cnt < 0) | (cnt > _I32.max)).any():
        bad = (cnt < 0) | (cnt > _I32.max)
        kind = "non-negative row counts" if (cnt < 0).any() else f"row counts up to {_I32.max}"
        raise ConfigError([f"counts: expected {kind}, got {int(cnt[bad][0])} at {_first(bad)}"], what)
    t_end = off[:-1, None] + np.cumsum(cnt, axis=1)     # int64: no overflow from int32 inputs
    if (t_end[:, -1] > off[1:]).any():
        bad = int(np.argmax(t_end[:, -1] > off[1:]))
        owns, has = int(cnt[bad].sum()), int(off[bad + 1] - off[bad])
        raise ConfigError([f"counts: expert {bad} owns {owns} rows but has {has} in expert_offsets "
                           f"(expected at most {has} in counts[{bad}], got {owns})"], what)
    table = np.empty((n_experts, n_ranks, 2), dtype=np.int64)
    table[..., 0] = t_end + (RANGE_READY_FLAG if ready else 0)
    table[..., 1] = cnt
    if table.max(initial=0) > _I32.max:
        raise ConfigError([f"expert_offsets: entries up to {int(table.max())} (rows + the ready flag) "
                           f"exceed int32 ({_I32.max})"], what)
    return table.astype(np.int32).reshape(-1)


def decode_range_table(table, n_experts, n_ranks):
    """Inverse of ``encode_range_table`` as the send reads it.

    An entry without the ready flag decodes to hi = t_end - 1024, which owns nothing only
    while t_end < 1024: the flag is not a validity bit the send can test, so the table
    must be complete (dispatch done) before the send reads it.

    Args:
        table: integers (n_experts*n_ranks*2,) in the int32 range (the device's int32 table).
        n_experts: local experts, an integer >= 0.
        n_ranks: EP ranks, an integer >= 1.

    Returns:
        tuple[np.ndarray, np.ndarray]: int64 ``lo, hi`` of shape (n_experts, n_ranks):
        rank rk owns absolute rows [lo, hi) of expert e.

    Raises:
        ConfigTypeError: ``table`` of non-integers, or a count not an integer.
        ConfigError: a count out of range, ``table`` of another shape, or values
            outside int32.
    """
    what = "range table"
    e = checked_int("n_experts", n_experts, lo=0, what=what)
    n = checked_int("n_ranks", n_ranks, lo=1, what=what)
    t = _int_array("table", table, 1, what)
    if t.shape != (e * n * 2,):
        raise ConfigError([f"table: expected shape ({e * n * 2},) (n_experts={e} x n_ranks={n} x 2), "
                           f"got {t.shape}"], what)
    if t.size and (t.min() < _I32.min or t.max() > _I32.max):
        raise ConfigError([f"table: expected int32 entries, got values {int(t.min())}..{int(t.max())}"], what)
    t = t.reshape(e, n, 2)
    hi = t[..., 0] - RANGE_READY_FLAG
    lo = hi - t[..., 1]
    return lo, hi


#: The byte a receive buffer is filled with at allocation (and tests' sentinel): bytes
#: the send never wrote read back as 0xAB.
SENTINEL = 0xAB
