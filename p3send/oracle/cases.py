"""Case generators shared by tests, the demo and the benchmarks. Numpy only.

``send_case(family, seed)`` builds one rank's send (the single-rank scatter tests);
``world_case(...)`` builds a consistent EP world (dispatch routing of every rank, the
owners' C matrices, range tables and src_info) for whole combine rounds.
Every generator takes an explicit seed, so a failure prints what reproduces it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..abi.config import P3_MAX_RANKS
from ..abi.errors import ConfigError
from ..abi.layout import SENTINEL, encode_range_table
from . import dispatch as dispatch_ref
from .reference import f32_to_bf16

#: Vectors per lane per batch in p3_scatter_send (6 x 32 lanes x 16 B): msg_bytes around
#: multiples of this many bytes exercise the batch edges.
SEND_BATCH_BYTES = 6 * 32 * 16


@dataclass
class SendCase:
    """One rank's scatter-send. c: uint8 (rows_total, row_stride); rows outside
    [expert_offsets[0], expert_offsets[-1]) exist in C but belong to no expert."""
    name: str
    seed: int
    n_ranks: int
    p2p_world_size: int
    top_k: int
    msg_bytes: int
    max_tokens_per_rank: int
    my_rank: int
    expert_offsets: np.ndarray
    range_table: np.ndarray
    src_info: np.ndarray
    c: np.ndarray
    notes: str = ""
    acc: np.ndarray | None = None     # fp32 (rows_total, msg_bytes/2) for the epilogue send; c = bf16(acc)

    @property
    def n_experts(self) -> int:
        return len(self.expert_offsets) - 1

    @property
    def row_stride(self) -> int:
        return self.c.shape[1]

    def __str__(self):
        rows = int(self.expert_offsets[-1] - self.expert_offsets[0])
        return (f"{self.name}[seed={self.seed}: {self.n_experts} experts, {rows} rows, "
                f"n_ranks={self.n_ranks} p2p={self.p2p_world_size} top_k={self.top_k} msg={self.msg_bytes} "
                f"max_tok={self.max_tokens_per_rank}{' ' + self.notes if self.notes else ''}]")


FAMILIES = ("random", "zero_rows", "one_row", "batch_edges", "row_edges", "primes", "skewed",
            "masked_experts", "starved_rank", "all_to_rank0", "modulo", "bad_src_info", "unrouted",
            "offset_base", "many_experts")


def _split(rng, total, parts, skew=None):
    """Random non-negative integers summing to ``total``."""
    if parts == 1:
        return np.array([total])
    w = rng.random(parts) if skew is None else skew
    w = w / w.sum()
    out = np.floor(w * total).astype(np.int64)
    out[rng.integers(parts)] += total - out.sum()
    return out


def _assign_slots(rng, peer_of_row, n_peers, max_tokens, top_k):
    """Unique (src_idx, src_topk) per peer for every routed row."""
    si = np.full(len(peer_of_row), -1, dtype=np.int64)
    sk = np.full(len(peer_of_row), -1, dtype=np.int64)
    for p in range(n_peers):
        rows = np.nonzero(peer_of_row == p)[0]
        if len(rows) > max_tokens * top_k:
            raise ConfigError(f"peer {p} gets {len(rows)} rows but holds {max_tokens * top_k} slots", "send case")
        slots = rng.permutation(max_tokens * top_k)[: len(rows)]
        si[rows], sk[rows] = slots // top_k, slots % top_k
    return si, sk


def send_case(family: str = "random", seed: int | None = None) -> SendCase:
    """One rank's send of the given edge family (see FAMILIES), from ``seed``."""
    if family not in FAMILIES:
        raise ConfigError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}", "send case")
    seed = int(np.random.SeedSequence().entropy % (1 << 32)) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    n_ranks = int(rng.integers(1, P3_MAX_RANKS + 1))
    p2p, top_k = n_ranks, int(rng.integers(1, 9))
    msg = 16 * int(rng.integers(1, 300))
    n_exp = int(rng.integers(1, 9))
    rows_per_expert = rng.integers(0, 120, n_exp)
    r0, extra, stride_pad = 0, 0, 0
    rank_skew, notes = None, ""
    if family == "zero_rows":
        rows_per_expert[:] = 0
        r0 = int(rng.integers(0, 5))
    elif family == "one_row":
        n_exp, rows_per_expert = 1, np.array([1])
    elif family == "batch_edges":
        msg = SEND_BATCH_BYTES * int(rng.integers(1, 4)) + int(rng.choice([-16, 0, 16]))
    elif family == "row_edges":
        n_exp = 2
        rows_per_expert = np.array([int(rng.choice([31, 32, 33, 1023, 1024, 1025])), int(rng.choice([0, 1, 32]))])
    elif family == "primes":
        n_exp, n_ranks, top_k, msg = 7, 5, 3, 16 * 13
        p2p = n_ranks
        rows_per_expert = np.array([97, 101, 103, 107, 109, 113, 127])
    elif family == "skewed":
        n_exp = 6
        rows_per_expert = np.array([600, 3, 1, 0, 2, 5])
    elif family == "masked_experts":
        n_exp = 8
        rows_per_expert = rng.integers(1, 80, n_exp)
        rows_per_expert[[0, 3, 4, 7]] = 0
    elif family == "starved_rank":
        n_ranks = p2p = max(n_ranks, 2)
        rank_skew = np.ones(n_ranks)
        rank_skew[int(rng.integers(n_ranks))] = 0.0
        notes = "one rank gets no rows"
    elif family == "all_to_rank0":
        n_ranks = p2p = max(n_ranks, 2)
        rank_skew = np.zeros(n_ranks)
        rank_skew[0] = 1.0
    elif family == "modulo":
        n_ranks, p2p = 8, int(rng.integers(1, 8))
        notes = "ranks fold onto p2p peers"
    elif family == "many_experts":
        n_exp = int(rng.integers(40, 100))
        rows_per_expert = rng.integers(0, 8, n_exp)
        notes = "more than 32 experts, a few rows each"
    elif family == "offset_base":
        r0, extra, stride_pad = int(rng.integers(1, 50)), int(rng.integers(1, 20)), 16 * int(rng.integers(1, 4))
        notes = "C has rows before/after the experts and a padded row stride"
    rows = int(rows_per_expert.sum())
    counts = np.stack([_split(rng, int(n), n_ranks, rank_skew) for n in rows_per_expert]) \
        if n_exp else np.zeros((0, n_ranks), np.int64)
    # the dispatch's layout of these counts (the reference), from row r0 of C
    off, lo, hi, _ = dispatch_ref.layout(counts, capacity=rows, row0=r0)
    table = dispatch_ref.range_table_of(lo, hi)
    if family == "unrouted":
        # perturbation, holes: each rank's count is shortened, so trailing rows of each expert belong to nobody
        counts = np.maximum(counts - rng.integers(0, 4, counts.shape), 0)
        notes = "range table leaves holes"
        table = encode_range_table(off, counts)
    if family == "unrouted" and n_exp > 1:
        e = int(rng.integers(n_exp))
        t = table.reshape(n_exp, n_ranks, 2)
        t[e, :, 0] -= 1024  # this expert's data-ready flag is not set: nothing of it is routed
        notes += "; one expert not ready"
    rows_total = int(off[-1]) + extra
    # the owning rank of each row, as the send resolves it (docs/PROTOCOL.md §3)
    peer = np.full(rows_total, -1, dtype=np.int64)
    t = table.reshape(max(n_exp, 1) if n_exp else 0, n_ranks, 2).astype(np.int64)
    for e in range(n_exp):
        for rk in range(n_ranks):
            hi = t[e, rk, 0] - 1024
            lo = hi - t[e, rk, 1]
            for r in range(max(lo, off[e]), min(hi, off[e + 1])):
                if peer[r] < 0:
                    peer[r] = rk % p2p
    peer_rows = np.bincount(peer[peer >= 0], minlength=p2p)
    max_tok = int(max(1, -(-int(peer_rows.max(initial=0)) // top_k) + int(rng.integers(1, 9))))
    si, sk = _assign_slots(rng, peer, p2p, max_tok, top_k)
    src = np.stack([si, sk], axis=1).astype(np.int32)
    if family == "bad_src_info" and rows:
        bad = rng.choice(np.arange(r0, r0 + rows), size=max(1, rows // 5), replace=False)
        kinds = rng.integers(0, 5, len(bad))
        src[bad[kinds == 0]] = -1
        src[bad[kinds == 1], 0] = max_tok
        src[bad[kinds == 2], 1] = top_k
        src[bad[kinds == 3], 1] = -1
        src[bad[kinds == 4], 0] = np.iinfo(np.int32).max
        notes = f"{len(bad)} rows with out-of-range src_info"
    c = rng.integers(1, 256, size=(rows_total, msg + stride_pad), dtype=np.uint8)
    return SendCase(family, seed, n_ranks, p2p, top_k, msg, max_tok, int(rng.integers(n_ranks)),
                    off.astype(np.int32), table, src, c, notes)


def epilogue_case(family: str = "random", seed: int | None = None) -> SendCase:
    """``send_case``'s routing with fp32 accumulators: acc (rows_total, msg_bytes/2) random
    normal fp32, and c = bf16(acc) rounded to nearest even (what the epilogue must send)."""
    case = send_case(family, seed)
    rng = np.random.default_rng(case.seed + 1)
    acc = rng.standard_normal((case.c.shape[0], case.msg_bytes // 2)).astype(np.float32)
    acc[acc == 0] = 1.0
    case.acc = acc
    case.c = f32_to_bf16(acc).view(np.uint8).reshape(acc.shape[0], case.msg_bytes)
    case.name = f"epilogue/{family}"
    return case


# ---------------------------------------------------------------- whole EP worlds

@dataclass
class RankData:
    """Everything one rank owns in a combine round.

    Receiving side: topk_idx int32 (tokens, top_k) global expert ids (-1 masked),
    weights f32 (tokens, top_k). Sending side (as an expert owner): c uint16/bf16 bits
    (rows, hidden); expert_offsets int32 (n_local+1,); range_table int32; src_info int32
    (rows, 2); row_src int64 (rows, 3) = (source rank, token, k) of each row.
    """
    topk_idx: np.ndarray
    weights: np.ndarray
    c: np.ndarray = None
    expert_offsets: np.ndarray = None
    range_table: np.ndarray = None
    src_info: np.ndarray = None
    row_src: np.ndarray = field(default=None)


@dataclass
class World:
    seed: int
    n_ranks: int
    tokens: int
    top_k: int
    n_local: int
    hidden: int
    ranks: list

    @property
    def msg_bytes(self) -> int:
        return 2 * self.hidden

    def __str__(self):
        return (f"world[seed={self.seed}: {self.n_ranks} ranks x {self.tokens} tokens, top_k={self.top_k}, "
                f"{self.n_local} experts/rank, hidden={self.hidden}]")


def choose_experts(rng: np.random.Generator, p: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """int64 (tokens, top_k): each row ``top_k`` distinct experts drawn with probabilities
    ``p``; the values, and the stream left behind, of
    ``np.stack([rng.choice(len(p), size=top_k, replace=False, p=p) for _ in range(tokens)])``
    without a Python step per token.

    ``Generator.choice`` without replacement draws ``top_k`` uniforms, maps each through
    the normalised cdf, keeps the distinct picks in draw order and draws again for the
    rest with the picked experts' weights zeroed. Most tokens are done after their first
    ``top_k`` draws: those rows are read straight off one block of uniforms, and only a
    token whose first draws repeat an expert takes the draw-again path (``_choose_slow``).
    """
    out = np.empty((tokens, top_k), np.int64)
    if tokens == 0:
        return out
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    state = rng.bit_generator.state
    u = rng.random(tokens * top_k + tokens * top_k // 4 + 64)

    def scan(u):   # first-draw picks of every draw, and whether the top_k from draw i repeat
        first = cdf.searchsorted(u, side="right")
        win = np.sort(np.lib.stride_tricks.sliding_window_view(first, top_k), axis=1)
        return first, (win[:, 1:] == win[:, :-1]).any(axis=1)

    first, repeat = scan(u)
    t = pos = 0
    while t < tokens:
        left = tokens - t
        if len(repeat) < pos + top_k * left:       # rare: more draw-again rounds than expected
            u = np.concatenate([u, rng.random(top_k * left + 64)])
            first, repeat = scan(u)
        hit = repeat[pos:pos + top_k * left:top_k]
        j = int(np.argmax(hit)) if hit.any() else left
        out[t:t + j] = first[pos:pos + top_k * j].reshape(j, top_k)
        t, pos = t + j, pos + top_k * j
        if t < tokens:
            while True:
                row, used = _choose_slow(p, u[pos:], top_k)
                if row is not None:
                    break
                u = np.concatenate([u, rng.random(4 * top_k + 64)])
                first, repeat = scan(u)
            out[t], t, pos = row, t + 1, pos + used
    rng.bit_generator.state = state     # leave the stream exactly where the per-token loop would
    rng.random(pos)
    return out


def _choose_slow(p: np.ndarray, u: np.ndarray, top_k: int):
    """One token of ``Generator.choice(len(p), top_k, replace=False, p=p)`` from the
    uniforms ``u``: (the picks, uniforms used), or (None, 0) when ``u`` runs out."""
    w, found, used = p.copy(), [], 0
    while len(found) < top_k:
        m = top_k - len(found)
        if used + m > len(u):
            return None, 0
        x, used = u[used:used + m], used + m
        if found:
            w[found] = 0
        cdf = np.cumsum(w)
        cdf /= cdf[-1]
        new = cdf.searchsorted(x, side="right")
        _, first_at = np.unique(new, return_index=True)
        found += new[np.sort(first_at)].tolist()
    return np.array(found, np.int64), used


#: bf16 exponents of the world's C values: 2^-5 .. 2^2 (biased 122..129).
_C_EXP_LO, _C_EXP_BITS = 122, 3


def random_bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """uint16 bf16 bits of ``shape``: random sign and 7-bit mantissa, exponent uniform in
    2^-5..2^2, so every value is finite, non-zero and normal, and rows differ in nearly
    every element. Built from raw 64-bit draws (four values each)."""
    n = int(np.prod(shape))
    u = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 4), dtype=np.uint64, endpoint=True)
    u = u.view(np.uint16)[:n]
    e = u >> 7
    e &= (1 << _C_EXP_BITS) - 1
    e += _C_EXP_LO
    e <<= 7
    u &= 0x807F
    u |= e
    return u.reshape(shape)


def world_case(n_ranks=4, tokens=64, top_k=4, n_local=4, hidden=256, seed=None, *, masked=0.0,
               skew=None, starve_rank=None, fill=True) -> World:
    """A consistent EP world: each rank's tokens pick top_k distinct global experts
    (``masked`` fraction of slots set to -1; ``skew`` weights experts; ``starve_rank``
    owns experts no token picks); each owner's C rows are grouped by local expert, then
    by source rank (rank order within the expert, as the range table requires), then
    token, then k. C holds ``random_bf16`` values (finite, never zero) from a stream of
    its own per owner (``[seed, owner]``) unless ``fill`` is False.
    Vectorised: the default demo world (8 ranks x 512 tokens, hidden 7168) builds in
    about a second, nearly all of it C."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32)) if seed is None else int(seed)
    if seed < 0:
        raise ConfigError(f"seed: expected >= 0, got {seed}", "world")
    rng = np.random.default_rng(seed)
    n_global = n_ranks * n_local
    p = np.ones(n_global) if skew is None else np.asarray(skew, dtype=np.float64)
    if starve_rank is not None:
        p = p.copy()
        p[starve_rank * n_local:(starve_rank + 1) * n_local] = 0
    if top_k > np.count_nonzero(p):
        raise ConfigError(f"top_k: expected at most the {np.count_nonzero(p)} experts tokens may pick, got {top_k}",
                          "world")
    p = p / p.sum()
    ranks = []
    for _ in range(n_ranks):
        idx = choose_experts(rng, p, tokens, top_k)
        if masked:
            idx[rng.random(idx.shape) < masked] = -1
        w = rng.random((tokens, top_k)).astype(np.float32)
        ranks.append(RankData(idx.astype(np.int32), w))
    # The dispatch of these tokens (the reference): each owner's rows grouped by local
    # expert, then by source rank, then token (then k).
    plan = dispatch_ref.plan([r.topk_idx for r in ranks], n_local)
    for o, r in enumerate(ranks):
        dest = plan.dest[o]
        r.row_src, r.expert_offsets, r.range_table = dest.row_src, dest.expert_offsets, dest.range_table
        r.src_info = dest.src_info
    for o, r in enumerate(ranks):
        shape = (len(r.row_src), hidden)
        r.c = random_bf16(np.random.default_rng([seed, o]), shape) if fill else np.zeros(shape, np.uint16)
    return World(seed, n_ranks, tokens, top_k, n_local, hidden, ranks)


def world_recv_expected(world: World, rank: int, base: np.ndarray) -> np.ndarray:
    """rank's receive buffer after every owner's send: ``base`` (flat uint8, the
    pre-filled buffer) with slot (t, k) = the owner's C row for (rank, t, k)."""
    out = base.copy()
    m = world.msg_bytes
    view = out.reshape(-1, m)
    for r in world.ranks:
        mine = np.nonzero(r.row_src[:, 0] == rank)[0]
        slots = r.row_src[mine, 1] * world.top_k + r.row_src[mine, 2]
        view[slots] = r.c[mine].view(np.uint8).reshape(len(mine), m)
    return out


def world_row_dst(world: World, owner: int, bases) -> np.ndarray:
    """Where each of ``owner``'s C rows is stored, uint64 (rows,): ``bases[rank]`` (the receive
    buffer address of each rank) of the row's source rank plus its slot (token*top_k + k) *
    msg_bytes."""
    src = world.ranks[owner].row_src.astype(np.uint64)
    slot = src[:, 1] * np.uint64(world.top_k) + src[:, 2]
    return np.asarray(bases, np.uint64)[src[:, 0]] + slot * np.uint64(world.msg_bytes)


def world_counts_expected(world: World, rank: int) -> np.ndarray:
    """rank's receive counts after a round: [e*n_ranks + o] = rows owner o's local expert e sent to rank."""
    cnt = np.zeros(world.n_local * world.n_ranks, dtype=np.uint64)
    for o, r in enumerate(world.ranks):
        off = r.expert_offsets
        for e in range(world.n_local):
            cnt[e * world.n_ranks + o] = int((r.row_src[off[e]:off[e + 1], 0] == rank).sum())
    return cnt


def _recv_exact(world: World, rank: int, got: np.ndarray, guard: int, inner_len: int) -> bool:
    """True when ``got`` is exactly what ``world_recv_expected`` on a sentinel-filled buffer
    with ``guard`` sentinel bytes on each side gives, compared slot by slot without building it."""
    m = world.msg_bytes
    n_slots = inner_len // m
    inner = got[guard:guard + inner_len]
    if len(got) != inner_len + 2 * guard or (got[:guard] != SENTINEL).any() or \
            (got[guard + inner_len:] != SENTINEL).any() or (inner[n_slots * m:] != SENTINEL).any():
        return False
    view = inner[:n_slots * m].reshape(n_slots, m)
    owned = np.zeros(n_slots, bool)
    for d in world.ranks:
        mine = np.nonzero(d.row_src[:, 0] == rank)[0]
        slots = d.row_src[mine, 1] * world.top_k + d.row_src[mine, 2]
        if len(slots) and (slots.max() >= n_slots or not np.array_equal(view[slots], d.c[mine].view(np.uint8))):
            return False
        owned[slots] = True
    return not (view[~owned] != SENTINEL).any()


def check_world(world: World, recv_of, out_of, guard: int = 0, recv_bytes: int | None = None,
                ranks=None) -> list[str]:
    """Compare a finished round with the oracle. recv_of(r): rank r's receive buffer bytes
    (flat uint8, with ``guard`` sentinel bytes on each side); out_of(r): rank r's output,
    bf16 bits (tokens, hidden). Returns one line per problem (empty = verified):
    receive buffers byte for byte (unowned slots and guards must hold the sentinel), the
    reduce within bf16 rounding of the float64 reference. ``ranks``: check only these
    (default all; a process of a multi-process world checks its own)."""
    from ..oracle import reference as ref
    problems = []
    m = world.msg_bytes
    for r in (range(world.n_ranks) if ranks is None else ranks):
        got = recv_of(r)
        inner_len = len(got) - 2 * guard if recv_bytes is None else recv_bytes
        if not _recv_exact(world, r, got, guard, inner_len):    # the slow, exact account of what differs
            want = np.full(len(got), SENTINEL, np.uint8)
            want[guard:guard + inner_len] = world_recv_expected(world, r, want[guard:guard + inner_len])
            bad = np.nonzero(got != want)[0]
            i = int(bad[0])
            problems.append(f"rank {r}: receive buffer differs in {len(bad)} bytes, first at byte {i - guard} "
                            f"(slot {(i - guard) // m}): got {got[i]:#04x}, want {want[i]:#04x}")
            continue
        d = world.ranks[r]
        inner = got[guard:guard + inner_len]
        ref64, absmax = ref.reduce(inner, d.topk_idx, d.weights, world.n_local, world.n_ranks, m, with_bound=True)
        out = out_of(r)
        ok = ref.bf16_close(out, ref64, world.top_k, absmax)
        if not ok.all():
            t, h = (int(x) for x in np.argwhere(~ok)[0])
            problems.append(f"rank {r}: reduce outside bf16 rounding at {int((~ok).sum())} of {ok.size} values, "
                            f"first (token {t}, element {h}): got {float(ref.bf16_to_f32(out[t, h])):.6g}, "
                            f"want {ref64[t, h]:.6g}")
    return problems



# ---------------------------------------------------------------- dispatch steps

@dataclass
class DispatchCase:
    """One dispatch step of every rank: topk_idx (int32 or int64 (T_s, top_k)), the token
    rows ``x`` (bf16 bits uint16 (T_s, hidden), or e4m3 bytes uint8 (T_s, hidden) with fp32
    ``scales`` (T_s, hidden/128)), router ``weights`` f32 (T_s, top_k), the layout options and
    the reference ``plan`` (``p3send.oracle.dispatch``) of what every rank's dispatch writes."""
    name: str
    seed: int
    n_ranks: int
    n_local: int
    top_k: int
    hidden: int
    payload: str
    align: int
    expert_stride: int
    capacity: int
    zero_padding: bool
    topk: list
    x: list
    scales: list
    weights: list
    plan: object = None
    notes: str = ""
    gen: dict = field(default_factory=dict)     # random_topk's options, for dispatch_redraw

    @property
    def max_tokens(self) -> int:
        return max([t.shape[0] for t in self.topk] + [1])

    @property
    def x_bytes(self) -> int:
        return 2 * self.hidden if self.payload == "bf16" else self.hidden

    @property
    def s_bytes(self) -> int:
        return 0 if self.payload == "bf16" else 4 * (self.hidden // 128)

    def rows(self, s: int) -> np.ndarray:
        """Rank s's token rows as bytes, uint8 (T_s, x_bytes)."""
        return np.ascontiguousarray(self.x[s]).view(np.uint8).reshape(self.x[s].shape[0], self.x_bytes)

    def scale_rows(self, s: int) -> np.ndarray:
        """Rank s's scale rows as bytes, uint8 (T_s, s_bytes)."""
        return np.ascontiguousarray(self.scales[s]).view(np.uint8).reshape(self.scales[s].shape[0], self.s_bytes)

    def __str__(self):
        toks = [t.shape[0] for t in self.topk]
        return (f"dispatch/{self.name}[seed={self.seed}: {self.n_ranks} ranks x {toks} tokens, top_k={self.top_k}, "
                f"{self.n_local} experts/rank, hidden={self.hidden} {self.payload}, align={self.align} "
                f"stride={self.expert_stride} capacity={self.capacity} zero={self.zero_padding}"
                f"{' ' + self.notes if self.notes else ''}]")


DISPATCH_FAMILIES = ("random", "one_token", "no_tokens", "uneven", "masked", "all_masked", "empty_experts",
                     "skewed", "errors", "int64", "aligned", "masked_layout", "masked_layout_zero", "overflow",
                     "overflow_aligned", "overflow_masked", "top1", "fp8", "dsv3", "dsv3_fp8")


def random_topk(rng: np.random.Generator, n_ranks: int, tokens, top_k: int, n_local: int, *, masked=0.0,
                bad=0.0, dup=0.0, int64=False, p=None) -> list:
    """Per rank, topk_idx (T_s, top_k) of distinct experts drawn with probabilities ``p``
    (default uniform), then perturbed: a ``masked`` fraction of slots -1, a ``bad``
    fraction out of range (below -1 or >= the expert count; beyond int32 with ``int64``),
    and a ``dup`` fraction of tokens whose last choice repeats their first. ``tokens``: a
    count, or (lo, hi) drawn per rank. int32 arrays unless ``int64``."""
    E = n_ranks * n_local
    p = np.full(E, 1.0 / E) if p is None else np.asarray(p, np.float64) / np.sum(p)
    out = []
    for _ in range(n_ranks):
        n = int(tokens) if np.isscalar(tokens) else int(rng.integers(tokens[0], tokens[1] + 1))
        g = choose_experts(rng, p, n, top_k)
        u = rng.random(g.shape)
        g[u < masked] = -1
        sel = (u >= masked) & (u < masked + bad)
        g[sel] = rng.choice([-2, -7, E, E + 5, (1 << 40) if int64 else (1 << 30)], size=int(sel.sum()))
        if top_k > 1 and n:
            d = rng.random(n) < dup
            g[d, top_k - 1] = g[d, 0]
        out.append(g if int64 else g.astype(np.int32))
    return out


def dispatch_case(family: str = "random", seed: int | None = None, *, n_ranks: int | None = None,
                  tokens: int | None = None) -> DispatchCase:
    """One dispatch step of the given family (see DISPATCH_FAMILIES), from ``seed``, with
    its reference plan. Tokens: ``random_bf16`` rows (never zero); e4m3 rows random bytes.
    ``n_ranks``: this many ranks instead of a drawn count (the families that fix their own,
    uneven, empty_experts, skewed and dsv3*, may change it); ``tokens``: this many tokens on
    every rank instead of the family's count."""
    if family not in DISPATCH_FAMILIES:
        raise ConfigError(f"family: expected one of {', '.join(DISPATCH_FAMILIES)}, got {family!r}", "dispatch case")
    seed = int(np.random.SeedSequence().entropy % (1 << 32)) if seed is None else int(seed)
    rng = np.random.default_rng([seed, 29])
    n_tokens = tokens
    R = int(rng.integers(1, P3_MAX_RANKS + 1))
    R = R if n_ranks is None else int(n_ranks)
    L = int(rng.integers(1, 7))
    K = int(rng.integers(1, min(8, R * L) + 1))
    tokens = (1, 60)
    hidden, payload, align, stride, frac, zero = 8 * int(rng.integers(1, 65)), "bf16", 1, 0, None, None
    kw, notes = {}, ""
    if family == "one_token":
        tokens = 1
    elif family == "no_tokens":
        tokens = 0
    elif family == "uneven":
        R, tokens = max(R, 3), (0, 60)
    elif family == "masked":
        kw["masked"] = 0.4
    elif family == "all_masked":
        kw["masked"] = 1.0
    elif family == "empty_experts":
        R, L = max(R, 2), max(L, 4)
        K = min(K, R * L // 2)
        p = np.ones(R * L)
        p[rng.permutation(R * L)[: R * L // 2]] = 0.0
        kw["p"], notes = p, "half the experts get no token"
    elif family == "skewed":
        R, L, K = 8, 4, 8
        p = np.ones(R * L)
        p[:3] = 60.0
        kw["p"] = p
    elif family == "errors":
        K = max(K, 2) if R * L >= 2 else K
        kw.update(bad=0.05, dup=0.25)
    elif family == "int64":
        K = max(K, 2) if R * L >= 2 else K
        kw.update(bad=0.05, dup=0.2, int64=True)
    elif family == "aligned":
        align = int(rng.choice([2, 16, 128]))
    elif family in ("masked_layout", "masked_layout_zero"):
        stride, zero = -1, family.endswith("zero")      # a block just larger than the fullest expert (below)
    elif family == "overflow":
        frac = 0.3
    elif family == "overflow_aligned":
        align, frac = 8, 0.3
    elif family == "overflow_masked":
        stride = -2                                      # half the fullest expert (below)
    elif family == "top1":
        K = 1
    elif family == "fp8":
        payload, hidden = "fp8", 512 * int(rng.integers(1, 3))
    elif family in ("dsv3", "dsv3_fp8"):
        R, L, K, tokens, hidden = 8, 32, 8, 16, 7168
        if family == "dsv3_fp8":
            payload, align = "fp8", 128
    topk = random_topk(rng, R, tokens if n_tokens is None else n_tokens, K, L, **kw)
    T = max([t.shape[0] for t in topk] + [1])
    if family == "int64":
        _beyond_int32(rng, topk, R * L)
        notes = "int64 ids, some beyond int32"
    if stride < 0:
        full = int(dispatch_ref.plan(topk, L).counts.sum(axis=0).max(initial=0))
        stride = full + int(rng.integers(1, 20)) if stride == -1 else max(1, full // 2)
    cap = dispatch_ref.default_capacity(R, T, K, L, align=align, expert_stride=stride)
    if frac:
        cap = max(1, int(cap * frac * K / min(K, L) / R))
    zero = align > 1 if zero is None else zero
    case = DispatchCase(family, seed, R, L, K, hidden, payload, align, stride, cap, bool(zero), topk, [], [], [],
                        notes=notes, gen=kw)
    return _dispatch_fill(case, rng)


def _beyond_int32(rng, topk, n_experts):
    """One slot per rank set to an id that an int32 truncation would turn into a valid expert."""
    for t in topk:
        if t.size:
            t[int(rng.integers(t.shape[0])), int(rng.integers(t.shape[1]))] = (1 << 32) + int(rng.integers(n_experts))


def _dispatch_fill(case: DispatchCase, rng) -> DispatchCase:
    """The tokens, weights and plan of a case whose topk is drawn."""
    h, topk = case.hidden, case.topk
    if case.payload == "bf16":
        case.x = [random_bf16(rng, (t.shape[0], h)) for t in topk]
        case.scales = [None] * case.n_ranks
    else:
        case.x = [rng.integers(1, 256, (t.shape[0], h), dtype=np.uint8) for t in topk]
        case.scales = [rng.random((t.shape[0], h // 128), dtype=np.float32) + np.float32(0.5) for t in topk]
    case.weights = [rng.random(t.shape, dtype=np.float32) for t in topk]
    case.plan = dispatch_ref.plan(topk, case.n_local, capacity=case.capacity, align=case.align,
                                  expert_stride=case.expert_stride)
    return case


def dispatch_redraw(case: DispatchCase, seed: int) -> DispatchCase:
    """The next step of ``case``: the same shape, layout, capacity and token count per rank,
    new routing (drawn as ``case`` was) and new tokens, from ``seed``."""
    rng = np.random.default_rng([seed, 31])
    kw = dict(case.gen)
    topk = []
    for t in case.topk:
        one = random_topk(rng, case.n_ranks, t.shape[0], case.top_k, case.n_local, **kw)[0]
        topk.append(one.astype(t.dtype))
    if case.name == "int64":
        _beyond_int32(rng, topk, case.n_ranks * case.n_local)
    nxt = DispatchCase(case.name, seed, case.n_ranks, case.n_local, case.top_k, case.hidden, case.payload, case.align,
                       case.expert_stride, case.capacity, case.zero_padding, topk, [], [], [], notes=case.notes,
                       gen=kw)
    return _dispatch_fill(nxt, rng)


def dispatch_world(case: DispatchCase) -> World:
    """The combine round that follows ``case``'s dispatch when every expert is the identity
    (C = the dispatched rows, bf16 only): each owner's C rows, routing and row_src from the
    plan, each source's checked topk_idx (the kept and stored copies) and weights, so
    ``check_world`` gives the combine's expected bytes and reduce."""
    if case.payload != "bf16":
        raise ConfigError(f"payload: the identity round needs bf16 rows, got {case.payload}", "dispatch world")
    plan, ranks = case.plan, []
    for r in range(case.n_ranks):
        dest = plan.dest[r]
        rows = int(dest.expert_offsets[-1])
        c = np.zeros((rows, case.hidden), np.uint16)
        data = dest.data_rows
        for s in range(case.n_ranks):
            m = data[dest.row_src[data, 0] == s]
            c[m] = case.x[s][dest.row_src[m, 1]]
        ranks.append(RankData(plan.src[r].topk_idx, case.weights[r], c, dest.expert_offsets, dest.range_table,
                              dest.src_info, dest.row_src))
    return World(case.seed, case.n_ranks, case.max_tokens, case.top_k, case.n_local, case.hidden, ranks)


# --- bench routing

def prefill_routing(tokens: int, ranks: int, top_k: int, experts: int, rng: np.random.Generator):
    """One sender's rows at the prefill shape (the benchmark's routing): tokens*top_k rows
    (the average a rank owns) grouped by local expert, each row owned by a random rank,
    unique (token, k) slots per rank.

    Returns:
        expert_offsets (experts + 1,) int32; range_table (experts * ranks * 2,) int32 as
        ``encode_range_table`` lays it out; src_info (rows, 2) int32 (token, k); dst_rank
        (rows,) int64, the owning rank of each row.
    """
    rows = tokens * top_k
    rank_of_row = rng.integers(0, ranks, rows)
    expert_of_row = rng.integers(0, experts, rows)
    order = np.lexsort((rank_of_row, expert_of_row))        # by expert, then rank
    rank_of_row, expert_of_row = rank_of_row[order], expert_of_row[order]
    counts = np.zeros((experts, ranks), np.int64)
    np.add.at(counts, (expert_of_row, rank_of_row), 1)
    off, lo, hi, _ = dispatch_ref.layout(counts, capacity=rows)   # the dispatch's layout (the reference)
    src = np.empty((rows, 2), np.int32)
    for rk in range(ranks):
        mine = np.nonzero(rank_of_row == rk)[0]
        slots = rng.permutation(tokens * top_k)[: len(mine)]
        src[mine, 0], src[mine, 1] = slots // top_k, slots % top_k
    return off.astype(np.int32), dispatch_ref.range_table_of(lo, hi), src, rank_of_row
