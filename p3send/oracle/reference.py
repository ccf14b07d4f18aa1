"""The numpy oracle of the protocol (docs/PROTOCOL.md §3, §4, §6), written from the
protocol, not from the kernels. Tests compare the GPU's bytes against it; it imports only numpy and the ABI.

Conventions: a receive buffer is a flat uint8 array of ``max_tokens_per_rank * top_k *
msg_bytes`` bytes; receive counts are uint64 arrays of ``n_experts * n_ranks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..abi.config import P3PeerSendConfig
from ..abi.errors import ConfigError
from ..abi.layout import NOT_ARRIVED, decode_range_table, recv_count_layout


@dataclass
class SendOutcome:
    """What a send did: per absolute row, the p2p peer and slot it was stored to (or -1)."""
    peer: np.ndarray          # int64 (rows,), -1 = not stored
    slot: np.ndarray          # int64 (rows,), slot index src_idx*top_k + src_topk, -1 = not stored
    dropped: int = 0          # rows failing the src_info bounds check
    unrouted: int = 0         # rows owned by no rank
    pair_rows: np.ndarray = field(default=None)  # int64 (n_experts, 8): rows of expert e stored to peer p


def resolve(cfg: P3PeerSendConfig, expert_offsets, range_table, src_info) -> SendOutcome:
    """Where each absolute row of ``[off[0], off[-1])`` goes (docs/PROTOCOL.md §3: rank lookup and bounds check).

    expert_offsets: int (n_experts+1,); range_table: int32 (n_experts*n_ranks*2,);
    src_info: int32 (rows_total, 2) indexed by absolute row. Rows outside the experts'
    span get peer -1. Raises ValueError when two stored rows would land on one slot of
    one peer (the result would depend on store order).
    """
    off = np.asarray(expert_offsets, dtype=np.int64)
    n_exp, n_ranks = len(off) - 1, int(cfg.n_ranks)
    src = np.asarray(src_info, dtype=np.int64).reshape(-1, 2)
    rows_total = src.shape[0]
    peer = np.full(rows_total, -1, dtype=np.int64)
    slot = np.full(rows_total, -1, dtype=np.int64)
    out = SendOutcome(peer, slot, pair_rows=np.zeros((n_exp, 8), dtype=np.int64))
    if n_exp < 1 or off[-1] <= off[0]:
        return out
    lo, hi = decode_range_table(range_table, n_exp, n_ranks)
    rows = np.arange(off[0], off[-1])
    e = np.searchsorted(off, rows, side="right") - 1           # expert of each row
    owns = (lo[e] <= rows[:, None]) & (rows[:, None] < hi[e])  # (rows, n_ranks)
    routed = owns.any(axis=1)
    dst_rank = np.argmax(owns, axis=1)                          # the first rank whose range holds the row
    si, sk = src[rows, 0], src[rows, 1]
    ok = (si >= 0) & (si < cfg.max_tokens_per_rank) & (sk >= 0) & (sk < cfg.top_k)
    store = routed & ok
    out.unrouted = int((~routed).sum())
    out.dropped = int((routed & ~ok).sum())
    p = dst_rank % cfg.p2p_world_size
    peer[rows[store]] = p[store]
    slot[rows[store]] = si[store] * cfg.top_k + sk[store]
    np.add.at(out.pair_rows, (e[store], p[store]), 1)
    key = peer[rows[store]] * (cfg.max_tokens_per_rank * cfg.top_k + 1) + slot[rows[store]]
    if len(np.unique(key)) != len(key):
        raise ConfigError("two rows are routed to the same slot of the same peer: the bytes would "
                         "depend on store order; fix the routing (src_info)", "routing")
    return out


def send(cfg: P3PeerSendConfig, c: np.ndarray, expert_offsets, range_table, src_info, recv: list,
         *, p3_control: int = 0) -> SendOutcome:
    """Apply the scatter-send to host copies of the receive buffers (in place).

    c: uint8 (rows_total, >= msg_bytes), row r = absolute row r; recv: list indexed by p2p
    rank of flat uint8 receive buffers. Unowned slots keep their bytes.
    """
    n_exp = len(expert_offsets) - 1
    if p3_control < 0 or cfg.n_ranks <= 0:
        return SendOutcome(np.full(len(c), -1), np.full(len(c), -1), pair_rows=np.zeros((max(n_exp, 0), 8), np.int64))
    res = resolve(cfg, expert_offsets, range_table, src_info)
    m = cfg.msg_bytes
    for p in range(min(cfg.n_ranks, cfg.p2p_world_size)):
        rows = np.nonzero(res.peer == p)[0]
        if len(rows):
            view = recv[p].reshape(-1, m)
            view[res.slot[rows]] = c[rows, :m]
    return res


def expected_row_cache(cfg: P3PeerSendConfig, res: SendOutcome, expert_offsets) -> np.ndarray:
    """The row cache after one launch over a zeroed cache: uint64 (rows_total,): 1 for rows
    of the experts' span resolved to no destination, the destination base
    recv_buf_ptrs[peer] + slot*msg_bytes for stored rows, 0 outside the span."""
    off = np.asarray(expert_offsets, dtype=np.int64)
    cache = np.zeros(len(res.peer), dtype=np.uint64)
    if cfg.n_ranks <= 0 or off[-1] <= off[0]:
        return cache
    span = np.arange(off[0], off[-1])
    cache[span] = 1
    st = span[res.peer[span] >= 0]
    bufs = np.array(list(cfg.recv_buf_ptrs), dtype=np.uint64)
    cache[st] = bufs[res.peer[st]] + (res.slot[st] * cfg.msg_bytes).astype(np.uint64)
    return cache


def signal(cfg: P3PeerSendConfig, res: SendOutcome, n_experts: int, counts: list) -> None:
    """The arrival signal (docs/PROTOCOL.md §4): for every local expert e and p2p peer p that
    receives (p < min(n_ranks, p2p_world_size)), peer p's count at
    recv_count_layout(e, my_rank) becomes the number of rows of e stored to p (0 too).
    counts: list indexed by p2p rank of uint64 arrays, updated in place."""
    for p in range(min(cfg.n_ranks, cfg.p2p_world_size)):
        for e in range(n_experts):
            counts[p][recv_count_layout(e, cfg.my_rank, cfg.n_ranks)] = np.uint64(res.pair_rows[e, p])


# ---------------------------------------------------------------- bf16 and the reduce

def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bits (NaN stays NaN)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), rounded)


def slot_pairs(topk_idx: np.ndarray, n_experts: int, n_ranks: int) -> np.ndarray:
    """recv_count_layout of the pair that fills each slot (t, k); -1 for masked slots.
    topk_idx: int (n_tokens, top_k) global expert ids (owner rank = id // n_experts)."""
    g = np.asarray(topk_idx, dtype=np.int64)
    valid = (g >= 0) & (g < n_experts * n_ranks)
    pair = (g % n_experts) * n_ranks + g // n_experts
    return np.where(valid, pair, -1)


def reduce(recv: np.ndarray, topk_idx, weights, n_experts: int, n_ranks: int, msg_bytes: int, *,
           with_bound: bool = False):
    """float64 reference of out[t] = sum over unmasked k, in k order, of w[t,k] * slot(t,k),
    shape (n_tokens, msg_bytes//2). recv: flat uint8 receive buffer; weights: f32
    (n_tokens, top_k). Masked slots are never read (they may hold anything).
    with_bound: return (out, sum over unmasked k of |w[t,k] * slot(t,k)|), the scale of the
    fp32 accumulation error bound ``bf16_close`` takes."""
    g = np.asarray(topk_idx)
    n_tokens, top_k = g.shape
    slots = recv[: n_tokens * top_k * msg_bytes].view(np.uint16).reshape(n_tokens, top_k, msg_bytes // 2)
    valid = slot_pairs(g, n_experts, n_ranks) >= 0
    w = np.where(valid, np.asarray(weights, dtype=np.float32), np.float32(0)).astype(np.float64)
    out = np.zeros(slots.shape[::2])
    bound = np.zeros_like(out) if with_bound else None
    term = np.empty_like(out)
    for k in range(top_k):      # one slot column at a time: no (tokens, top_k, hidden) float64 temporaries
        x = bf16_to_f32(slots[:, k])
        if not valid[:, k].all():
            x[~valid[:, k]] = 0.0
        np.multiply(x, w[:, k, None], out=term)    # exact: a bf16 times an fp32 fits a float64
        out += term
        if with_bound:
            bound += np.abs(term, out=term)
    return (out, bound) if with_bound else out


def fma_f32(a, b, c) -> np.ndarray:
    """``fl32(a * b + c)`` with ONE rounding (the IEEE fma of float32, PTX ``fma.rn.f32``),
    elementwise. The product of two float32 is exact in float64; the sum is rounded to odd
    in float64 (TwoSum gives the error; an inexact even result moves one ulp toward it), and
    rounding that to nearest even float32 is the single correct rounding (53 >= 24 + 2 bits).
    NaN and infinities propagate as the fma's do."""
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        odd = (s.view(np.uint64) & np.uint64(1)) == 1
        fix = np.isfinite(s) & np.isfinite(err) & (err != 0) & ~odd
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def bf16_slot_values(recv: np.ndarray, n_tokens: int, top_k: int, hidden: int) -> np.ndarray:
    """float32 (n_tokens, top_k, hidden): the bf16 wire's slot values of a flat uint8
    receive buffer, as the reduce reads them. (The FP8 wire's: ``oracle.wire.decode`` of the
    (n_tokens*top_k, msg_bytes) rows, reshaped; this module stays below the FP8 oracle.)"""
    mb = 2 * hidden
    rows = np.asarray(recv, np.uint8)[: n_tokens * top_k * mb]
    return bf16_to_f32(np.ascontiguousarray(rows).view(np.uint16)).reshape(n_tokens, top_k, hidden)


def reduce_bits(values: np.ndarray, topk_idx, weights, n_experts: int, n_ranks: int) -> np.ndarray:
    """The reduce's output BIT FOR BIT, bf16 bits uint16 (n_tokens, hidden), for either wire:
    per token, ``acc = +0``, then for k = 0 .. 4*ceil(top_k/4)-1 in order ``acc =
    fma_f32(w, x, acc)`` with (w, x) = (weights[t, k], slot value) for an unmasked slot and
    (0, 0) for a masked one or k >= top_k (the kernel's k loop is 4 wide; such a term adds
    +0, which changes no sum: one that starts at +0 is never -0), then one
    round-to-nearest-even to bf16.

    Args:
        values: float32 (n_tokens, top_k, hidden), the slot values as the reduce reads them:
            ``bf16_slot_values`` (bf16 wire) or ``oracle.wire.decode`` of the slots (FP8 wire:
            e4m3 value times its block's scale, one float32 rounding).
        topk_idx: int (n_tokens, top_k) global expert ids (masked: < 0 or >= n_experts*n_ranks).
        weights: float32 (n_tokens, top_k).
        n_experts, n_ranks: local experts per rank, ranks.

    Every unmasked slot is taken as arrived. NaN outputs are NaN here; their bits are the
    hardware's (compare NaN as a class)."""
    g = np.asarray(topk_idx)
    n_tokens, top_k = g.shape
    x = np.asarray(values, np.float32)
    valid = slot_pairs(g, n_experts, n_ranks) >= 0
    w = np.where(valid, np.asarray(weights, dtype=np.float32), np.float32(0)).astype(np.float32)
    acc = np.zeros((n_tokens, x.shape[-1]), np.float32)
    zero = np.zeros_like(acc)
    for k in range(-(-top_k // 4) * 4):
        if k < top_k:
            xk = np.where(valid[:, k, None], x[:, k], np.float32(0))
            acc = fma_f32(w[:, k, None], xk, acc)
        else:
            acc = fma_f32(zero, zero, acc)
    return f32_to_bf16(acc)


def bf16_close(out_bits: np.ndarray, ref64: np.ndarray, top_k: int, absmax: np.ndarray) -> np.ndarray:
    """Boolean mask: each bf16 output within rounding of the float64 reference: half a
    bf16 ulp of the reference plus the fp32 accumulation error bound (top_k * 2^-24 *
    sum|w*x|, given per token row as ``absmax``)."""
    out = bf16_to_f32(out_bits).astype(np.float64)
    ulp = np.maximum(np.abs(ref64), 1e-30) * 2.0 ** -8
    tol = ulp + top_k * 2.0 ** -23 * absmax
    return np.abs(out - ref64) <= tol


def arrived_all(counts: np.ndarray) -> bool:
    return bool((np.asarray(counts) != NOT_ARRIVED).all())
