"""The vectorised world generator and the reference reduce, against slow per-token and
per-row loops written here, and check_world's fast comparison against corrupted buffers."""
from __future__ import annotations

import numpy as np
import pytest

from p3send.abi.layout import SENTINEL, decode_range_table
from p3send.oracle import reference as ref
from p3send.oracle.cases import check_world, choose_experts, world_case, world_recv_expected, world_row_dst


@pytest.mark.parametrize("seed", range(40))
def test_choose_experts_is_the_per_token_choice_loop(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 40))
    k = int(rng.integers(1, min(n, 9) + 1))
    tokens = int(rng.integers(0, 80))
    p = rng.random(n) if seed % 2 else np.ones(n)
    if seed % 5 == 0:
        p[: n // 3] = 0                    # starved experts: more repeats, more draw-again rounds
    if np.count_nonzero(p) < k:
        return
    p = p / p.sum()
    a, b = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 1])
    got = choose_experts(a, p, tokens, k)
    want = [b.choice(n, size=k, replace=False, p=p) for _ in range(tokens)]
    assert np.array_equal(got, np.array(want, np.int64).reshape(tokens, k))
    assert a.random(4).tolist() == b.random(4).tolist()      # the stream is left where the loop leaves it


WORLDS = [dict(n_ranks=4, tokens=40, top_k=4, n_local=3, hidden=64),
          dict(n_ranks=1, tokens=9, top_k=2, n_local=3, hidden=8),
          dict(n_ranks=3, tokens=30, top_k=3, n_local=2, hidden=24, masked=0.3),
          dict(n_ranks=4, tokens=20, top_k=3, n_local=2, hidden=16, starve_rank=1),
          dict(n_ranks=2, tokens=0, top_k=2, n_local=2, hidden=16)]


@pytest.mark.parametrize("kw", WORLDS)
def test_world_invariants_against_a_per_row_loop(kw):
    w = world_case(seed=11, **kw)
    n, L, K = w.n_ranks, w.n_local, w.top_k
    for d in w.ranks:
        assert d.topk_idx.shape == (w.tokens, K) and d.weights.dtype == np.float32
        for row in d.topk_idx:                                  # distinct experts per token
            picked = row[row >= 0]
            assert len(set(picked.tolist())) == len(picked)
        if kw.get("starve_rank") is not None:
            assert not ((d.topk_idx // L) == kw["starve_rank"]).any()
    for o, d in enumerate(w.ranks):
        # the rows this owner must hold, in the required order, by a plain loop
        want = [(s, t, k) for e in range(L) for s in range(n) for t in range(w.tokens) for k in range(K)
                if w.ranks[s].topk_idx[t, k] == o * L + e]
        assert [tuple(r) for r in d.row_src.tolist()] == want
        lo, hi = decode_range_table(d.range_table, L, n)
        for e in range(L):
            for s in range(n):
                rows = [i for i, r in enumerate(want) if r[0] == s and w.ranks[s].topk_idx[r[1], r[2]] == o * L + e]
                assert (lo[e, s], hi[e, s]) == ((rows[0], rows[-1] + 1) if rows else (lo[e, s], lo[e, s]))
        assert d.expert_offsets[-1] == len(want) and (d.src_info == d.row_src[:, 1:]).all()
        vals = ref.bf16_to_f32(d.c)
        assert d.c.shape == (len(want), w.hidden) and np.isfinite(vals).all() and (vals != 0).all()


def test_world_row_dst_stores_what_world_recv_expected_says():
    """Rows stored at world_row_dst's addresses (receive buffers laid end to end in one host
    array) give every rank the buffer world_recv_expected builds."""
    w = world_case(n_ranks=3, tokens=20, top_k=3, n_local=2, hidden=24, seed=5, masked=0.2)
    size = w.tokens * w.top_k * w.msg_bytes
    mem = np.full(w.n_ranks * size, SENTINEL, np.uint8)
    bases = [r * size for r in range(w.n_ranks)]
    for o, d in enumerate(w.ranks):
        for row, at in enumerate(world_row_dst(w, o, bases).tolist()):
            mem[at:at + w.msg_bytes] = d.c[row].view(np.uint8)
    for r in range(w.n_ranks):
        want = world_recv_expected(w, r, np.full(size, SENTINEL, np.uint8))
        assert np.array_equal(mem[bases[r]:bases[r] + size], want), r


def test_reference_reduce_is_the_per_row_sum():
    w = world_case(n_ranks=3, tokens=12, top_k=3, n_local=2, hidden=16, seed=4, masked=0.25)
    m = w.msg_bytes
    for r, d in enumerate(w.ranks):
        recv = world_recv_expected(w, r, np.full(w.tokens * w.top_k * m, SENTINEL, np.uint8))
        got, bound = ref.reduce(recv, d.topk_idx, d.weights, w.n_local, w.n_ranks, m, with_bound=True)
        slots = recv.view(np.uint16).reshape(w.tokens, w.top_k, w.hidden)
        for t in range(w.tokens):
            for h in range(w.hidden):
                acc = mag = 0.0
                for k in range(w.top_k):
                    if d.topk_idx[t, k] >= 0:
                        x = float(np.frombuffer((int(slots[t, k, h]) << 16).to_bytes(4, "little"), np.float32)[0])
                        acc += float(d.weights[t, k]) * x
                        mag += abs(float(d.weights[t, k]) * x)
                assert got[t, h] == acc and bound[t, h] == mag


def test_check_world_finds_every_kind_of_corruption():
    w = world_case(n_ranks=3, tokens=10, top_k=3, n_local=2, hidden=16, seed=9, masked=0.3)
    m, g = w.msg_bytes, 32
    recv, out = {}, {}
    for r, d in enumerate(w.ranks):
        b = np.full(w.tokens * w.top_k * m + 2 * g, SENTINEL, np.uint8)
        b[g:-g] = world_recv_expected(w, r, b[g:-g])
        recv[r] = b
        out[r] = ref.f32_to_bf16(ref.reduce(b[g:-g], d.topk_idx, d.weights, w.n_local, w.n_ranks, m))
    assert check_world(w, recv.__getitem__, out.__getitem__, guard=g) == []
    owned = int(np.nonzero(w.ranks[0].topk_idx.reshape(-1) >= 0)[0][0])
    free = int(np.nonzero(w.ranks[2].topk_idx.reshape(-1) < 0)[0][0])
    cases = [(0, g + owned * m + 3, "slot"), (1, 0, "byte -32"), (1, len(recv[1]) - 1, "byte"),
             (2, g + free * m, f"slot {free}")]
    for r, i, where in cases:
        bad = {k: v.copy() for k, v in recv.items()}
        bad[r][i] ^= 0x5A
        problems = check_world(w, bad.__getitem__, out.__getitem__, guard=g)
        assert len(problems) == 1 and problems[0].startswith(f"rank {r}: receive buffer differs in 1 bytes")
        assert where in problems[0]
    wrong = {k: v.copy() for k, v in out.items()}
    wrong[1][0, 0] ^= 0x0100
    assert check_world(w, recv.__getitem__, wrong.__getitem__, guard=g)[0].startswith("rank 1: reduce outside")
