"""The numpy reference of the dispatch (docs/PROTOCOL.md, "The dispatch"), written from
the protocol, not from the kernels: from every rank's ``topk_idx`` it gives, byte for
byte, what each rank's dispatch writes. Every routing generator of ``cases`` is built on
it, so the oracle of the combine and the dispatch kernels cannot drift apart.

Words. ``R`` ranks, ``L`` local experts per rank, ``E = R*L`` global experts; global
expert ``g`` lives on rank ``g // L`` as local expert ``g % L``. A *copy* is one
``(source rank s, token t, k)`` whose ``topk_idx[t, k]`` is kept: ``0 <= g < E`` and no
earlier ``k' < k`` of the same token names the same ``g``. Expert ``g`` of destination
``d`` receives the copies of every source in rank order, each source's in token order.

Checks, the same on the device (each one reported, never a write out of bounds):
- ``g == -1``: masked, no copy, no report;
- ``g < -1`` or ``g >= E``: **out of range**, reported (count and the first ``t*K+k``),
  treated as masked;
- ``g`` equal to an earlier kept ``g`` of the token: **duplicate**, reported, masked;
- a copy whose row would reach past the destination's capacity (or past its expert's
  block in the masked layout): **overflow**, reported by its source (count and the
  smallest global expert) and by its destination (count and the smallest local
  expert), never written; the combine treats it as masked.

Layouts of a destination's rows (``capacity`` rows in all):
- contiguous (``expert_stride == 0``): expert ``e`` starts at the sum of the previous
  experts' row counts, each rounded up to ``align`` (1: no padding);
- masked (``expert_stride > 0``): expert ``e`` starts at ``e * expert_stride``.
``expert_offsets[e]`` is expert e's start clamped to ``capacity``; rows between an
expert's last stored row and the next start are padding: outside the range table,
zeroed (data and scales) with ``src_info = (-1, -1)`` when ``zero_padding``, else never
written. Rows at or past ``expert_offsets[L]`` are never written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..abi.errors import ConfigError
from ..abi.layout import RANGE_READY_FLAG
from ..ops.dispatch import dispatch_capacity as default_capacity
from ..ops.dispatch import layout_problems

#: Errors the dispatch reports, in the order of its record (docs/KERNELS.md, p3_dispatch_count).
ERROR_KINDS = ("out_of_range", "duplicate", "overflow")
NO_KEY = (1 << 64) - 1      # "no first key" in the record (atom.min from all-ones)


@dataclass
class Errors:
    """What one rank's dispatch reports. Keys are ``t*top_k + k`` of the first (smallest)
    offending slot of this rank's tokens, or NO_KEY; ``overflow_expert``: the smallest global
    expert of this rank's dropped copies; ``dropped_here`` / ``dropped_expert``: copies for
    this rank's experts that did not fit, and the smallest such local expert."""
    out_of_range: int = 0
    out_of_range_key: int = NO_KEY
    duplicate: int = 0
    duplicate_key: int = NO_KEY
    overflow: int = 0
    overflow_expert: int = NO_KEY
    dropped_here: int = 0
    dropped_expert: int = NO_KEY

    def any(self) -> bool:
        return bool(self.out_of_range or self.duplicate or self.overflow or self.dropped_here)


@dataclass
class Destination:
    """One destination rank's outputs. ``row_src`` int64 (expert_offsets[-1], 3): (source
    rank, token, k) of each row, (-1, -1, -1) on padding rows; the rest int32."""
    expert_offsets: np.ndarray      # (L+1,)
    range_table: np.ndarray         # (L*R*2,), the combine's atomic_counter
    expert_counts: np.ndarray       # (L,) rows stored per local expert (a masked GEMM's counts)
    row_src: np.ndarray

    @property
    def src_info(self) -> np.ndarray:
        """int32 (rows, 2): (token, k) of each row as the combine reads it; -1 on padding rows."""
        return self.row_src[:, 1:].astype(np.int32)

    @property
    def data_rows(self) -> np.ndarray:
        """Indices of the rows that hold a copy."""
        return np.nonzero(self.row_src[:, 0] >= 0)[0]


@dataclass
class Source:
    """One source rank's routing: ``topk_idx`` int32 (T, K), the expert of each kept and stored
    copy, -1 elsewhere (what the combine's receive takes); ``dst_rank``/``dst_row`` int64 (T, K),
    where each copy lands (-1: none)."""
    topk_idx: np.ndarray
    dst_rank: np.ndarray
    dst_row: np.ndarray


@dataclass
class Plan:
    """The dispatch of one step: per source (``src[s]``) and per destination (``dest[d]``)."""
    n_ranks: int
    n_local: int
    top_k: int
    capacity: int
    align: int
    expert_stride: int
    counts: np.ndarray              # int64 (R, E): kept copies of source s for global expert g
    src: list
    dest: list
    errors: list = field(default_factory=list)   # Errors per rank

    @property
    def n_experts(self) -> int:
        return self.n_ranks * self.n_local


def keep_mask(topk_idx: np.ndarray, n_experts: int):
    """(kept, out_of_range, duplicate), bool (T, K) each, for one source's ``topk_idx``."""
    g = np.asarray(topk_idx).astype(np.int64)
    if g.ndim != 2:
        raise ConfigError(f"topk_idx: expected a 2-D (tokens, top_k) array, got shape {g.shape}", "dispatch")
    in_range = (g >= 0) & (g < n_experts)
    oor = (g < -1) | (g >= n_experts)
    dup = np.zeros_like(in_range)
    for k in range(1, g.shape[1]):
        dup[:, k] = in_range[:, k] & (in_range[:, :k] & (g[:, :k] == g[:, k:k + 1])).any(axis=1)
    return in_range & ~dup, oor, dup


def expert_starts(sizes: np.ndarray, *, align: int = 1, expert_stride: int = 0) -> np.ndarray:
    """int64 (L+1,): the unclamped start of each local expert and the end, from its row
    count ``sizes`` int (L,)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if expert_stride:
        return np.arange(len(sizes) + 1, dtype=np.int64) * expert_stride
    padded = -(-sizes // align) * align
    return np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)


def layout(counts: np.ndarray, *, capacity: int, align: int = 1, expert_stride: int = 0, row0: int = 0):
    """One destination's layout from the counts of its experts.

    counts: int (L, R), rows of local expert e from source rank s. Returns
    (expert_offsets int64 (L+1,), lo int64 (L, R), hi int64 (L, R), limit int64 (L,)):
    source s's rows of expert e are [lo, hi) (clamped, so hi - lo is what is stored) and
    no row of e reaches ``limit[e]``. ``row0`` shifts every row (a C with rows before the
    experts)."""
    cnt = np.asarray(counts, dtype=np.int64)
    start = expert_starts(cnt.sum(axis=1), align=align, expert_stride=expert_stride)
    n = cnt.shape[0]
    limit = np.minimum(start[1:], capacity) if expert_stride else np.full(n, capacity, np.int64)
    lo = start[:-1, None] + np.cumsum(cnt, axis=1) - cnt
    hi = lo + cnt
    lo, hi = np.minimum(lo, limit[:, None]), np.minimum(hi, limit[:, None])
    off = np.minimum(start, capacity)
    return off + row0, lo + row0, hi + row0, limit + row0


def range_table_of(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The range table ("Region A") of a layout, int32 (L*R*2,): word0 = 1024 + hi, word1 = hi - lo."""
    t = np.stack([hi + RANGE_READY_FLAG, hi - lo], axis=-1)
    if t.size and t.max() > np.iinfo(np.int32).max:
        raise ConfigError("range table: row indices exceed int32", "dispatch")
    return t.astype(np.int32).reshape(-1)


def plan(topk_idx: list, n_local: int, *, capacity: int | None = None, align: int = 1,
         expert_stride: int = 0) -> Plan:
    """Where every copy of every rank's tokens goes, and what every rank's dispatch writes.

    topk_idx: one int32 or int64 array (T_s, K) per rank (tokens may differ between ranks;
    K must not). capacity: rows per destination (default ``default_capacity`` of the
    largest T_s). Raises ConfigError for a shape the dispatch refuses."""
    R = len(topk_idx)
    if R < 1:
        raise ConfigError("topk_idx: expected one array per rank, got none", "dispatch")
    K = int(np.asarray(topk_idx[0]).shape[1]) if np.asarray(topk_idx[0]).ndim == 2 else -1
    T_max = max(int(np.asarray(t).shape[0]) for t in topk_idx)
    if capacity is None:
        capacity = default_capacity(R, T_max, max(K, 1), n_local, align=align, expert_stride=expert_stride)
    problems = layout_problems(R, n_local, K, capacity=capacity, align=align, expert_stride=expert_stride)
    if any(np.asarray(t).ndim != 2 or np.asarray(t).shape[1] != K for t in topk_idx):
        problems.append(f"topk_idx: expected (tokens, {K}) on every rank, got "
                        f"{[np.asarray(t).shape for t in topk_idx]}")
    if problems:
        raise ConfigError(problems, "dispatch")
    L, E = n_local, R * n_local
    errors = [Errors() for _ in range(R)]
    kept = []
    counts = np.zeros((R, E), np.int64)
    for s, tk in enumerate(topk_idx):
        g = np.asarray(tk).astype(np.int64)
        ok, oor, dup = keep_mask(g, E)
        er = errors[s]
        for kind, m in (("out_of_range", oor), ("duplicate", dup)):
            if m.any():
                setattr(er, kind, int(m.sum()))
                setattr(er, kind + "_key", int(np.flatnonzero(m.reshape(-1))[0]))
        flat = np.flatnonzero(ok.reshape(-1))          # kept copies in (t, k) order
        gf = g.reshape(-1)[flat]
        order = np.argsort(gf, kind="stable")          # by expert; within one, by token
        p = np.empty(len(flat), np.int64)
        first = np.searchsorted(gf[order], gf[order])  # index of each expert's first copy
        p[order] = np.arange(len(flat)) - first
        counts[s] = np.bincount(gf, minlength=E)
        kept.append((ok, flat, gf, p))
    dest = []
    first_row = np.zeros((R, L, R), np.int64)      # [d, e, s]: source s's first row of (d, e), unclamped
    limit = np.zeros((R, L), np.int64)
    for d in range(R):
        cnt = counts[:, d * L:(d + 1) * L].T              # (L, R)
        off, lo, hi, limit[d] = layout(cnt, capacity=capacity, align=align, expert_stride=expert_stride)
        start = expert_starts(cnt.sum(axis=1), align=align, expert_stride=expert_stride)
        first_row[d] = start[:-1, None] + np.cumsum(cnt, axis=1) - cnt
        stored = (hi - lo).sum(axis=1)
        lost = cnt.sum(axis=1) - stored
        if lost.any():
            errors[d].dropped_here = int(lost.sum())
            errors[d].dropped_expert = int(np.flatnonzero(lost)[0])
        row_src = np.full((int(off[-1]), 3), -1, np.int64)
        dest.append(Destination(off.astype(np.int32), range_table_of(lo, hi), stored.astype(np.int32), row_src))
    src = []
    for s, (ok, flat, gf, p) in enumerate(kept):
        T = ok.shape[0]
        d, e = gf // L, gf % L
        row = first_row[d, e, s] + p
        fits = row < limit[d, e]
        dst_rank = np.full(T * K, -1, np.int64)
        dst_row = np.full(T * K, -1, np.int64)
        dst_rank[flat[fits]], dst_row[flat[fits]] = d[fits], row[fits]
        tk32 = np.full(T * K, -1, np.int32)
        tk32[flat[fits]] = gf[fits]
        if (~fits).any():
            errors[s].overflow = int((~fits).sum())
            errors[s].overflow_expert = int(gf[~fits].min())
        for dd in range(R):
            m = fits & (d == dd)
            dest[dd].row_src[row[m]] = np.stack([np.full(int(m.sum()), s), flat[m] // K, flat[m] % K], axis=1)
        src.append(Source(tk32.reshape(T, K), dst_rank.reshape(T, K), dst_row.reshape(T, K)))
    return Plan(R, L, K, int(capacity), align, expert_stride, counts, src, dest, errors)



def padding_rows(dest: Destination) -> np.ndarray:
    """Indices of the padding rows of a destination: below ``expert_offsets[-1]``, holding no copy."""
    return np.nonzero(dest.row_src[:, 0] < 0)[0]


def expected_rows(plan: Plan, d: int, payload: list, base: np.ndarray, *, zero_padding: bool) -> np.ndarray:
    """Destination ``d``'s row buffer after the dispatch of ``payload``.

    payload: per source rank, uint8 (T_s, row_bytes): the bytes each token sends (its bf16
    or e4m3 row, or its scale row). base: uint8 (capacity, row_bytes), the buffer before.
    Returns a copy of ``base`` with every copy's row written, and the padding rows zero
    when ``zero_padding``."""
    out = np.array(base, dtype=np.uint8, copy=True)
    rs = plan.dest[d].row_src
    for s in range(plan.n_ranks):
        m = np.nonzero(rs[:, 0] == s)[0]
        if len(m):
            out[m] = np.asarray(payload[s], dtype=np.uint8)[rs[m, 1]]
    if zero_padding:
        out[padding_rows(plan.dest[d])] = 0
    return out


def expected_src_info(plan: Plan, d: int, base: np.ndarray, *, zero_padding: bool) -> np.ndarray:
    """Destination ``d``'s src_info int32 (capacity, 2) after the dispatch: (token, k) on the
    rows holding a copy, (-1, -1) on padding rows when ``zero_padding``, ``base`` elsewhere."""
    out = np.array(base, dtype=np.int32, copy=True).reshape(-1, 2)
    dest = plan.dest[d]
    rows = dest.data_rows
    out[rows] = dest.row_src[rows, 1:]
    if zero_padding:
        out[padding_rows(dest)] = -1
    return out
