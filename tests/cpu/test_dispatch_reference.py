"""The numpy dispatch reference against plain per-copy loops written here (validation,
layouts, capacity, errors, the expected buffers), and the case generators built on it
against pins of the bytes they returned before (the GPU tests compare against them)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from p3send.abi.errors import ConfigError
from p3send.abi.layout import SENTINEL, decode_range_table
from p3send.oracle import cases
from p3send.oracle import dispatch as dref


def slow_plan(topk, L, capacity, align=1, stride=0):
    """The dispatch by loops: per token, keep each in-range expert not seen before in the
    token; destination rows expert by expert, source by source, token by token."""
    R, E = len(topk), len(topk) * L
    K = topk[0].shape[1]
    kept = []
    errs = [dict(oor=[], dup=[], over=[], here=[]) for _ in range(R)]
    for s, tk in enumerate(topk):
        ks = []
        for t in range(tk.shape[0]):
            seen = set()
            for k in range(K):
                g = int(tk[t, k])
                if g == -1:
                    continue
                if g < -1 or g >= E:
                    errs[s]["oor"].append(t * K + k)
                elif g in seen:
                    errs[s]["dup"].append(t * K + k)
                else:
                    seen.add(g)
                    ks.append((t, k, g))
        kept.append(ks)
    out = []
    where = {}
    for d in range(R):
        start, rows, offs, table, stored = 0, [], [], [], []
        for e in range(L):
            g = d * L + e
            start = e * stride if stride else start
            offs.append(min(start, capacity))
            limit = min((e + 1) * stride, capacity) if stride else capacity
            n_e = 0
            for s in range(R):
                lo = None
                mine = [(t, k) for (t, k, gg) in kept[s] if gg == g]
                first = start + n_e
                for i, (t, k) in enumerate(mine):
                    r = first + i
                    if r < limit:
                        where[(s, t, k)] = (d, r)
                        rows.append((r, s, t, k))
                    else:
                        errs[s]["over"].append(g)
                        errs[d]["here"].append(e)
                lo = min(first, limit)
                hi = min(first + len(mine), limit)
                table.append((lo, hi))
                n_e += len(mine)
            stored.append(sum(hi - lo for lo, hi in table[-R:]))
            if not stride:
                start += -(-n_e // align) * align
        end = L * stride if stride else start
        offs.append(min(end, capacity))
        row_src = np.full((offs[-1], 3), -1, np.int64)
        for r, s, t, k in rows:
            row_src[r] = (s, t, k)
        out.append(dict(offs=offs, table=table, stored=stored, row_src=row_src))
    return out, where, errs


@pytest.mark.parametrize("family", cases.DISPATCH_FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_plan_is_the_per_copy_loop(family, seed):
    c = cases.dispatch_case(family, seed)
    p = c.plan
    R, L, K = c.n_ranks, c.n_local, c.top_k
    want, where, errs = slow_plan(c.topk, L, c.capacity, c.align, c.expert_stride)
    for d in range(R):
        dest, w = p.dest[d], want[d]
        assert dest.expert_offsets.tolist() == w["offs"], d
        lo, hi = decode_range_table(dest.range_table, L, R)
        assert [(int(a), int(b)) for a, b in zip(lo.reshape(-1), hi.reshape(-1))] == w["table"], d
        assert dest.expert_counts.tolist() == w["stored"], d
        assert np.array_equal(dest.row_src, w["row_src"]), d
    for s in range(R):
        src = p.src[s]
        for t in range(c.topk[s].shape[0]):
            for k in range(K):
                d, r = where.get((s, t, k), (-1, -1))
                assert (src.dst_rank[t, k], src.dst_row[t, k]) == (d, r), (s, t, k)
                assert src.topk_idx[t, k] == (int(c.topk[s][t, k]) if d >= 0 else -1)
        e, x = p.errors[s], errs[s]
        assert (e.out_of_range, e.out_of_range_key) == (len(x["oor"]), min(x["oor"], default=dref.NO_KEY))
        assert (e.duplicate, e.duplicate_key) == (len(x["dup"]), min(x["dup"], default=dref.NO_KEY))
        assert (e.overflow, e.overflow_expert) == (len(x["over"]), min(x["over"], default=dref.NO_KEY))
        assert (e.dropped_here, e.dropped_expert) == (len(x["here"]), min(x["here"], default=dref.NO_KEY))
    total = sum(t.shape[0] for t in c.topk)
    if family.startswith("overflow") and total:
        assert any(e.overflow for e in p.errors), "the family must overflow"
    elif not family.startswith("overflow"):
        assert not any(e.overflow for e in p.errors), "only the overflow families overflow"
    if family in ("errors", "int64") and total:
        assert sum(e.out_of_range + e.duplicate for e in p.errors)
    if family == "int64":
        assert all(t.dtype == np.int64 for t in c.topk) and any((np.abs(t) > 1 << 31).any() for t in c.topk)


def test_capacity_is_the_worst_case():
    """Every token of every rank picking min(K, L) experts of one rank: default_capacity rows
    arrive there and nothing overflows."""
    R, T, K, L = 4, 10, 6, 4
    tk = [np.tile(np.r_[np.arange(L), -np.ones(K - L, int)], (T, 1)).astype(np.int32) for _ in range(R)]
    cap = dref.default_capacity(R, T, K, L)
    assert cap == R * T * min(K, L)
    p = dref.plan(tk, L, capacity=cap)
    assert int(p.dest[0].expert_offsets[-1]) == cap and not any(e.any() for e in p.errors)
    assert dref.plan(tk, L, capacity=cap - 1).errors[0].dropped_here == 1


def test_expected_buffers_by_loops():
    rng = np.random.default_rng(5)
    R, L, K, nb = 3, 2, 3, 32
    tk = cases.random_topk(rng, R, (3, 12), K, L, masked=0.2)
    p = dref.plan(tk, L, align=4)
    payload = [rng.integers(0, 256, (t.shape[0], nb), dtype=np.uint8) for t in tk]
    cap = p.capacity
    for zero in (False, True):
        for d in range(R):
            base = np.full((cap, nb), SENTINEL, np.uint8)
            got = dref.expected_rows(p, d, payload, base, zero_padding=zero)
            gsi = dref.expected_src_info(p, d, np.full((cap, 2), -7, np.int32), zero_padding=zero)
            off = p.dest[d].expert_offsets
            for r in range(cap):
                if r < off[-1] and p.dest[d].row_src[r, 0] >= 0:
                    s, t, k = p.dest[d].row_src[r]
                    assert (got[r] == payload[s][t]).all() and gsi[r].tolist() == [t, k]
                    assert p.src[s].dst_rank[t, k] == d and p.src[s].dst_row[t, k] == r
                elif r < off[-1] and zero:
                    assert (got[r] == 0).all() and gsi[r].tolist() == [-1, -1]
                else:
                    assert (got[r] == SENTINEL).all() and gsi[r].tolist() == [-7, -7]


def test_refused_shapes():
    with pytest.raises(ConfigError, match="align"):
        dref.plan([np.zeros((2, 2), np.int32)], 2, align=3)
    with pytest.raises(ConfigError, match="topk_idx"):
        dref.plan([np.zeros((2, 2), np.int32), np.zeros((2, 3), np.int32)], 2)
    with pytest.raises(ConfigError, match="n_ranks"):
        dref.plan([np.zeros((1, 1), np.int32)] * 9, 1)


# ---------------------------------------------------------------- the generators, pinned

def _h(*arrs):
    m = hashlib.sha256()
    for a in arrs:
        a = np.ascontiguousarray(a)
        m.update(str(a.dtype).encode())
        m.update(str(a.shape).encode())
        m.update(a.tobytes())
    return m.hexdigest()[:16]


def _send_digest(c):
    return _h(np.array([c.n_ranks, c.p2p_world_size, c.top_k, c.msg_bytes, c.max_tokens_per_rank, c.my_rank]),
              c.expert_offsets, c.range_table, c.src_info, c.c) + ("" if c.acc is None else _h(c.acc))


def _world_digest(w):
    return _h(*[a for r in w.ranks for a in (r.topk_idx, r.weights, r.c, r.expert_offsets, r.range_table,
                                              r.src_info, r.row_src)])


# Recorded from the generators as they were before they were built on the dispatch
# reference (the GPU tests compare the kernels against these bytes).
PIN_WORLDS = [dict(n_ranks=4, tokens=64, top_k=4, n_local=4, hidden=256),
              dict(n_ranks=1, tokens=33, top_k=2, n_local=3, hidden=24),
              dict(n_ranks=3, tokens=17, top_k=1, n_local=2, hidden=8),
              dict(n_ranks=4, tokens=50, top_k=4, n_local=2, hidden=136, masked=0.3),
              dict(n_ranks=4, tokens=40, top_k=3, n_local=2, hidden=64, starve_rank=2),
              dict(n_ranks=8, tokens=31, top_k=8, n_local=4, hidden=64, skew=np.r_[np.full(4, 50.0), np.ones(28)]),
              dict(n_ranks=2, tokens=0, top_k=2, n_local=2, hidden=64)]
PINS = {
    "world 0 0": "9e773fbc5f9b7aab", "world 0 7": "79d51ca29dd3cec6", "world 0 123": "950d0bdd8c9e64a1",
    "world 1 0": "c2b0c83e82d65fe0", "world 1 7": "b25de9561aec118e", "world 1 123": "c1e27f96b57dd305",
    "world 2 0": "5ebeae5a43b0a710", "world 2 7": "5ff0e2ab6a3bf4f7", "world 2 123": "e27430a0a0c8543c",
    "world 3 0": "03c9545baca013eb", "world 3 7": "7ad09f91dd2109d6", "world 3 123": "3eb9939253155f3d",
    "world 4 0": "771de75979acfd7b", "world 4 7": "866219663be11e56", "world 4 123": "7e9e141a9e375c10",
    "world 5 0": "b6f7f50a934499da", "world 5 7": "2f72bf74cbc33219", "world 5 123": "8932dc9bafe2fb89",
    "world 6 0": "d3f017e175aa1a40", "world 6 7": "d3f017e175aa1a40", "world 6 123": "d3f017e175aa1a40",
    "send random 1": "f5b95505f9af71c3", "send random 2": "586702f3078c03e2", "send random 99": "588fc3109aeb1f14",
    "send zero_rows 1": "a0a9865f7bae1de6", "send zero_rows 2": "a4032b047517fbb8",
    "send zero_rows 99": "c1180c3dc9db692c", "send one_row 1": "28d5e34461e9928b",
    "send one_row 2": "5d4ef11489f5caec", "send one_row 99": "7e432f6c3793138c",
    "send batch_edges 1": "1fa5abcbcab0aa4a", "send batch_edges 2": "132c293ae61a056f",
    "send batch_edges 99": "da8a70e9de1105eb", "send row_edges 1": "1c1176a2e594649d",
    "send row_edges 2": "383d69374c0e7092", "send row_edges 99": "ed98eab55f3d0f4f",
    "send primes 1": "d01890b4f1650b10", "send primes 2": "1f6fe5549d71bf78", "send primes 99": "8b04d1d14e177869",
    "send skewed 1": "50e0ddfa70d243b3", "send skewed 2": "47ad42210e8ccdc0", "send skewed 99": "a250e44c6e20045c",
    "send masked_experts 1": "a5d9ce8e954c85ae", "send masked_experts 2": "7487f191f58187de",
    "send masked_experts 99": "25b31690836c9e53", "send starved_rank 1": "aee9970cf1891638",
    "send starved_rank 2": "76e244e210946495", "send starved_rank 99": "2c5dbf5fc433e167",
    "send all_to_rank0 1": "63df4b774502373d", "send all_to_rank0 2": "01e39d73dc9fce5e",
    "send all_to_rank0 99": "ac08813787e05992", "send modulo 1": "b3a89426ad70bdd5",
    "send modulo 2": "a49b3b67828126e3", "send modulo 99": "bf7df8b71387c90d",
    "send bad_src_info 1": "9de5c6e2852c4a9d", "send bad_src_info 2": "92e41b1f6751361d",
    "send bad_src_info 99": "09379774dd208b4f", "send unrouted 1": "97de74ee49b654f3",
    "send unrouted 2": "992d8696953779d6", "send unrouted 99": "33a3decbfc341aea",
    "send offset_base 1": "07cf4688cd5ac204", "send offset_base 2": "c3ba77994dd7d8f2",
    "send offset_base 99": "e284b5a6ba458d5a", "send many_experts 1": "cdedbd81cf8fc3b9",
    "send many_experts 2": "035a38e21d508c6c", "send many_experts 99": "d72e0a9252f04f86",
    "epi random 5": "14d38fd69adea9c509b00c938c633c61", "epi masked_experts 5": "2f1c86e2590df6481b09f65c8b08543b",
    "epi unrouted 5": "b60db88bc795c24109b00c938c633c61", "prefill 3": "4a723d6c8ad2e827",
    "prefill 4": "76278910cc0969d2",
}


@pytest.mark.parametrize("key", list(PINS))
def test_generators_return_the_pinned_bytes(key):
    kind, *rest = key.split()
    if kind == "world":
        got = _world_digest(cases.world_case(**PIN_WORLDS[int(rest[0])], seed=int(rest[1])))
    elif kind == "send":
        got = _send_digest(cases.send_case(rest[0], int(rest[1])))
    elif kind == "epi":
        got = _send_digest(cases.epilogue_case(rest[0], int(rest[1])))
    else:
        got = _h(*cases.prefill_routing(64, 8, 8, 32, np.random.default_rng(int(rest[0]))))
    assert got == PINS[key]


def test_world_routing_is_the_reference_plan():
    w = cases.world_case(n_ranks=4, tokens=30, top_k=3, n_local=2, hidden=8, seed=3, masked=0.2)
    p = dref.plan([r.topk_idx for r in w.ranks], w.n_local)
    for o, r in enumerate(w.ranks):
        assert np.array_equal(r.row_src, p.dest[o].row_src)
        assert np.array_equal(r.range_table, p.dest[o].range_table)
        assert np.array_equal(r.expert_offsets, p.dest[o].expert_offsets)
