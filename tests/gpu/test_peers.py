"""The bench's fair peers (p3send/cli/peers.py: a Triton and a CUDA C++ scatter kernel
doing the send's job from the same inputs) write what the oracle says: every case family,
and a decode-size one-rank send with 8 receive buffers (guards, counts, state reset)."""
from __future__ import annotations

import pytest

from tests.gpu.conftest import OK, WHY, fresh_seed

pytestmark = pytest.mark.skipif(not OK, reason=f"no usable GPU: {WHY}")


def test_peers_byte_exact(dev):
    from tests.gpu.peers_check import Shape, check_peers
    try:
        import torch
    except ImportError:
        torch = None
    out = check_peers(dev, fresh_seed("peers"), torch, shapes=(Shape("decode one rank", 128, sets=2),),
                      iters=3, warmup=1, passes=1)
    problems = {name: p for name, p in out["families"].items() if p}
    problems.update({f"decode one rank: {name}": p for name, p in out["decode one rank"]["check"].items() if p})
    assert out["families"], "no peer was built"
    assert not problems, problems
    assert not out.get("errors"), out.get("errors")


def test_round_ceiling_kernels(dev):
    """The decode round's ceiling (p3send bench, section 3) does the round's work: the scatter
    ceiling, without a signal, with its own and followed by a publish kernel, writes the
    oracle's receive buffers (sentinel elsewhere), the signalled one leaves its counters reset
    with one flag per counter, the publish kernel sets every flag; the
    reduce ceiling's outputs equal the round's (p3_recv_reduce) byte for byte, masked slots
    included. The signalled one copies 3 rows per CTA (its loop, with a partial last CTA)."""
    import numpy as np

    from p3send.abi.layout import SENTINEL
    from p3send.cli.peers import ReduceCeiling, RowsCopy
    from p3send.cuda import driver
    from p3send.ops.combine import Combine
    from p3send.oracle.cases import world_case, world_recv_expected
    world = world_case(n_ranks=4, tokens=48, top_k=6, n_local=3, hidden=264, seed=fresh_seed("round ceiling"),
                       masked=0.1)
    msg, R = world.msg_bytes, world.n_ranks
    comb = Combine(R, max_tokens=world.tokens, top_k=world.top_k, hidden=world.hidden, n_local_experts=world.n_local,
                   device=dev, stamps=False)
    bufs = []
    try:
        comb.load_world(world)
        comb.round()
        s = comb.origin
        recv = [driver.DeviceBuffer(world.tokens * world.top_k * msg, fill=SENTINEL) for _ in range(R)]
        outs = [driver.DeviceBuffer(world.tokens * msg, fill=0xAB) for _ in range(R)]
        bufs += recv + outs
        for signal in (False, True, "kernel"):
            rows = RowsCopy(device=dev, threads=64, vpt=2, rows_per_cta=3 if signal else 1, signal=signal)
            for b in recv:
                b.fill(SENTINEL)
            for r, d in enumerate(world.ranks):
                src = d.row_src.astype(np.uint64)
                base = np.array([b.ptr for b in recv], np.uint64)
                row_dst = driver.DeviceBuffer.from_array(base[src[:, 0]] + (src[:, 1] * np.uint64(world.top_k)
                                                                            + src[:, 2]) * np.uint64(msg))
                bufs.append(row_dst)
                for _ in range(2):   # twice: the signalled counters must have reset themselves
                    launch = rows.prepare(row_dst, comb.c[r], len(d.c), msg)
                    launch(s)
                s.synchronize()
                if signal:
                    st = rows.state.download(np.uint8)
                    assert not st[:128].any(), "the signalled scatter ceiling left a counter set"
                    grid = launch.grid
                    got = st[128:].view(np.uint64).tolist()
                    if signal == "kernel":   # the publish kernel: every flag = the copy's grid
                        assert got == [grid] * 32, got
                    else:
                        n = min(grid, 32)
                        assert got[:n] == [(grid - q + 31) // 32 for q in range(n)], got
            for r in range(R):
                want = world_recv_expected(world, r, np.full(world.tokens * world.top_k * msg, SENTINEL, np.uint8))
                assert np.array_equal(recv[r].download(np.uint8), want), f"rank {r}, signal={signal}"
            rows.close()
        red = ReduceCeiling(device=dev, threads=32, vpt=2)
        red.prepare([comb.recv_ptr(r) for r in range(R)], comb.topk_idx, comb.weights, outs, tokens=world.tokens,
                    top_k=world.top_k, msg_bytes=msg, n_global=world.n_local * R)(s)
        s.synchronize()
        for r in range(R):
            assert np.array_equal(outs[r].download(np.uint16), comb.output(r).reshape(-1)), f"rank {r}"
    finally:
        for b in bufs:
            b.free()
        comb.close()
