"""The bench's baselines (p3send/bench/baselines.py: a Triton and a CUDA C++ scatter kernel
doing the send's job from the same inputs) write what the oracle says: every case family,
and a decode-size one-rank send with 8 receive buffers (guards, counts, state reset)."""
from __future__ import annotations

import pytest

from tests.gpu.conftest import OK, WHY, fresh_seed

pytestmark = pytest.mark.skipif(not OK, reason=f"no usable GPU: {WHY}")


def test_baselines_byte_exact(dev):
    from tests.gpu.baselines_check import Shape, check_baselines
    try:
        import torch
    except ImportError:
        torch = None
    out = check_baselines(dev, fresh_seed("baselines"), torch, shapes=(Shape("decode one rank", 128, sets=2),),
                          iters=3, warmup=1, passes=1)
    problems = {name: p for name, p in out["families"].items() if p}
    problems.update({f"decode one rank: {name}": p for name, p in out["decode one rank"]["check"].items() if p})
    assert out["families"], "no baseline was built"
    assert not problems, problems
    assert not out.get("errors"), out.get("errors")


def test_round_ceiling_kernels(dev):
    """The ceilings of p3send bench (sections 1, 1b, 3) do the send's and the round's work.
    The scatter ceiling, unsignalled, with the send protocol's signal (3 rows per CTA: its
    loop, a partial last CTA), followed by a publish kernel, and with release reductions,
    writes the oracle's receive buffers (sentinel elsewhere) from rows cut in 3 uneven chunks;
    the signalled one leaves its counters reset and flag q = its CTAs b with b % 32 == q, the
    publish kernel sets every flag, the reductions count every CTA once. The reduce ceiling
    (5 uneven chunks per row) equals the round's output (p3_recv_reduce) byte for byte, with
    masked slots of both kinds (-1 and n_experts * n_ranks)."""
    import numpy as np

    from p3send.abi.layout import SENTINEL
    from p3send.bench.baselines import BaselineUnavailable, ReduceCeiling, RowsCopy
    from p3send.cuda import driver
    from p3send.ops.combine import Combine
    from p3send.oracle.cases import world_case, world_recv_expected, world_row_dst
    world = world_case(n_ranks=4, tokens=48, top_k=6, n_local=3, hidden=2056, seed=fresh_seed("round ceiling"),
                       masked=0.1)
    msg, R, n_global = world.msg_bytes, world.n_ranks, world.n_local * world.n_ranks
    idx = world.ranks[0].topk_idx
    masked = np.argwhere(idx < 0)        # one masked slot written as the first id past the experts
    if len(masked):
        idx[tuple(masked[0])] = n_global
    comb = Combine(R, max_tokens=world.tokens, top_k=world.top_k, hidden=world.hidden, n_local_experts=world.n_local,
                   device=dev, stamps=False)
    bufs = []
    try:
        try:
            makers = {sig: RowsCopy(device=dev, threads=64, vpt=2, rows_per_cta=3 if sig is True else 1, signal=sig)
                      for sig in (False, True, "kernel", "red")}
            red = ReduceCeiling(device=dev, threads=32, vpt=2)
        except BaselineUnavailable as e:
            pytest.skip(f"the ceilings cannot be built here: {e}")
        comb.load(world)
        comb.round()
        s = comb.origin
        recv = [driver.DeviceBuffer(world.tokens * world.top_k * msg, fill=SENTINEL) for _ in range(R)]
        outs = [driver.DeviceBuffer(world.tokens * msg, fill=0xAB) for _ in range(R)]
        bufs += recv + outs
        base = np.array([b.ptr for b in recv], np.uint64)
        for signal, rows in makers.items():
            for b in recv:
                b.fill(SENTINEL)
            for r, d in enumerate(world.ranks):
                row_dst = driver.DeviceBuffer.from_array(world_row_dst(world, r, base))
                bufs.append(row_dst)
                if rows.state is not None:
                    rows.state.fill(0)
                launches = 1 if signal == "red" else 2   # twice: the signalled counters must reset themselves
                for _ in range(launches):
                    launch = rows.prepare(row_dst, comb.c[r], len(d.c), msg)
                    launch(s)
                s.synchronize()
                if not signal:
                    continue
                st = rows.state.download(np.uint8)
                done, flags = st[:128].view(np.uint32), st[128:].view(np.uint64)
                per_counter = np.bincount(np.arange(launch.grid) % 32, minlength=32)
                if signal == "red":
                    assert done.tolist() == per_counter.tolist(), (done, launch.grid)
                    continue
                assert not done.any(), f"signal={signal}: a counter was left set: {done}"
                want = [launch.grid] * 32 if signal == "kernel" else per_counter.tolist()
                assert flags.tolist() == want, (signal, flags, launch.grid)
            for r in range(R):
                want = world_recv_expected(world, r, np.full(world.tokens * world.top_k * msg, SENTINEL, np.uint8))
                assert np.array_equal(recv[r].download(np.uint8), want), f"rank {r}, signal={signal}"
            rows.close()
        red.prepare([comb.recv_ptr(r) for r in range(R)], comb.topk_idx, comb.weights, outs, tokens=world.tokens,
                    top_k=world.top_k, msg_bytes=msg, n_global=n_global)(s)
        s.synchronize()
        for r in range(R):
            assert np.array_equal(outs[r].download(np.uint16), comb.output(r).reshape(-1)), f"rank {r}"
    finally:
        for b in bufs:
            b.free()
        comb.close()
