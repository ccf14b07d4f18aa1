"""p3send from torch: launches on torch's streams (and any other stream
object), torch tensors as buffer arguments with dtype/device/size checks, the
``p3send::combine`` custom op under ``torch.cuda.graph`` with routing and data that
change between replays, a device-side gate that skips one rank's send, and one process
per rank over torch.distributed. Every round is checked against the oracle: receive
buffers byte for byte (0xAB sentinel, guards), the reduce within bf16 rounding."""
from __future__ import annotations

import socket
import statistics
import time

import numpy as np
import pytest

from p3send import ArrivalTimeout, ConfigError
from p3send.cuda import driver
from p3send.ops.combine import Combine
from p3send.ops.procs import run_ranks
from p3send.oracle.cases import check_world, world_case
from p3send.oracle.reference import f32_to_bf16
from tests.gpu.conftest import OK, WHY, fresh_seed

torch = pytest.importorskip("torch", reason="torch is not installed (p3send.torch is optional)")
pytestmark = pytest.mark.skipif(not (OK and torch.cuda.is_available()),
                                reason=f"no usable GPU for torch: {WHY if not OK else 'torch.cuda unavailable'}")

from p3send.torch import TorchCombine  # noqa: E402  (needs torch)

NOT_ARRIVED = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


# ---------------------------------------------------------------- helpers

class Inputs:
    """The runtime's own tensors for R ranks (rows fp32 'expert outputs' and bf16 rows,
    routing, top-k), refreshed in place from a world per step."""

    def __init__(self, R, T, K, L, H, max_rows):
        dev = "cuda"
        self.acts = torch.zeros((R, max_rows, H), dtype=torch.float32, device=dev)
        self.rows = torch.zeros((R, max_rows, H), dtype=torch.bfloat16, device=dev)
        self.expert_offsets = torch.zeros((R, L + 1), dtype=torch.int32, device=dev)
        self.range_table = torch.zeros((R, 2 * L * R), dtype=torch.int32, device=dev)
        self.src = torch.full((R, max_rows, 2), -1, dtype=torch.int32, device=dev)
        self.topk = torch.zeros((R, T, K), dtype=torch.int32, device=dev)
        self.w = torch.zeros((R, T, K), dtype=torch.float32, device=dev)

    def load(self, world, rng, *, rows_too: bool = True) -> None:
        """Write the world's routing and fresh fp32 activations; the world's C becomes
        the oracle's bf16 rounding of them (what the captured cast must produce)."""
        for r, d in enumerate(world.ranks):
            n = d.c.shape[0]
            vals = rng.standard_normal((n, world.hidden)).astype(np.float32)
            vals[vals == 0] = 1.0
            d.c = f32_to_bf16(vals)
            self.acts[r].zero_()
            self.acts[r, :n].copy_(torch.from_numpy(vals))
            if rows_too:
                self.rows[r, :n].copy_(torch.from_numpy(d.c.view(np.int16)).view(torch.bfloat16))
            self.expert_offsets[r].copy_(torch.from_numpy(d.expert_offsets.astype(np.int32)))
            self.range_table[r].copy_(torch.from_numpy(d.range_table.astype(np.int32)))
            self.src[r].fill_(-1)
            self.src[r, :n].copy_(torch.from_numpy(d.src_info.astype(np.int32)))
            self.topk[r].copy_(torch.from_numpy(d.topk_idx.astype(np.int32)))
            self.w[r].copy_(torch.from_numpy(d.weights.astype(np.float32)))
        torch.cuda.synchronize()

    def args(self):
        return self.rows, self.expert_offsets, self.range_table, self.src, self.topk, self.w


def bits(t):
    """bf16 tensor -> numpy uint16 bits."""
    return t.detach().view(torch.int16).cpu().numpy().view(np.uint16)


def verify_torch(tc, world, out, label):
    o = bits(out)
    problems = check_world(world, lambda r: tc.recv_view(r, with_guard=True), lambda r: o[r],
                           guard=tc.combine.guard, recv_bytes=tc.combine.recv_bytes)
    for r in range(world.n_ranks):
        if not (tc.counts_view(r) == NOT_ARRIVED).all():
            problems.append(f"rank {r}: counts not re-armed")
    assert not problems, f"{label} {world}:\n" + "\n".join(problems)


def worlds(seed, n, **shape):
    """n worlds of one shape with different routing (different seeds)."""
    return [world_case(**shape, seed=seed + i) for i in range(n)]


def routing_differs(a, b) -> bool:
    return any(not np.array_equal(x.expert_offsets, y.expert_offsets) or not np.array_equal(x.topk_idx, y.topk_idx)
               for x, y in zip(a.ranks, b.ranks))


def max_rows(ws) -> int:
    return max(d.c.shape[0] for w in ws for d in w.ranks)


# ---------------------------------------------------------------- (0) every kind of stream, no ownership

class CudaStreamProtocol:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def test_combine_round_on_any_stream_object(dev):
    """Combine.round on a torch stream, a torch ExternalStream, an object with
    __cuda_stream__, a raw int handle, a CUstream and (if installed) a cupy stream: every
    round exact, and the stream still usable afterwards (p3send never destroyed it)."""
    from cuda.bindings import driver as cu
    world = world_case(n_ranks=4, tokens=32, top_k=4, n_local=2, hidden=256, seed=fresh_seed("streams"))
    comb = Combine(4, max_tokens=32, top_k=4, hidden=256, n_local_experts=2, device=dev, guard=True)
    comb.load(world)
    ts = torch.cuda.Stream()
    kinds = {"torch.cuda.Stream": ts, "torch ExternalStream": torch.cuda.ExternalStream(ts.cuda_stream),
             "__cuda_stream__": CudaStreamProtocol(ts.cuda_stream), "int": int(ts.cuda_stream),
             "CUstream": cu.CUstream(ts.cuda_stream)}
    try:
        import cupy
        kinds["cupy"] = cupy.cuda.Stream(non_blocking=True)
    except ImportError:
        pass
    try:
        for name, s in kinds.items():
            comb.round(stream=s)
            problems = check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output,
                                   guard=comb.guard)
            assert not problems, f"stream {name}: " + "\n".join(problems)
            driver.as_stream(s).close()                       # non-owning: a no-op
            x = torch.ones(4, device="cuda")
            with torch.cuda.stream(ts):
                y = x + 1                                     # the torch stream still works
            ts.synchronize()
            assert y.sum().item() == 8.0
    finally:
        comb.close()


# ---------------------------------------------------------------- (1) side stream overlapping a matmul

def test_round_on_a_torch_side_stream_overlapping_a_matmul(dev):
    """The op on a torch side stream while a chain of matmuls runs on the main stream:
    the round completes (and is exact) while the main stream is still busy."""
    seed = fresh_seed("side_stream")
    R, T, K, L, H = 4, 48, 4, 3, 512
    ws = worlds(seed, 2, n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H)
    inp = Inputs(R, T, K, L, H, max_rows(ws))
    rng = np.random.default_rng(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16, generator=g)
    want = a.float() @ b.float()
    c = torch.empty_like(a)
    with TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, guard=True) as tc:
        inp.load(ws[0], rng)
        out = tc(*inp.args())                                 # binds the tensors (eager, main stream)
        torch.cuda.synchronize()
        tc.check()
        verify_torch(tc, ws[0], out, "first round")
        inp.load(ws[1], rng)                                  # new routing, same tensors
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for _ in range(20):                                   # tens of ms of matmuls on the main stream
            torch.matmul(a, b, out=c)
        with torch.cuda.stream(side):
            out = tc(*inp.args())                             # the whole round on the side stream
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        main_busy = not main.query()
        torch.cuda.synchronize()
        tc.check()
        verify_torch(tc, ws[1], out, "side stream")
        rel = ((c.float() - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-2, f"matmul on the main stream is off by {rel}"
        print(f"[side stream] main stream still busy when the round had finished: {main_busy}")
        assert main_busy, "the round did not overlap the matmuls (it waited for the main stream)"


# ---------------------------------------------------------------- (2) graph of a whole step, 20 routings

def test_graph_of_a_whole_step_with_new_routing_every_replay(dev):
    seed = fresh_seed("graph_routing")
    R, T, K, L, H = 8, 32, 4, 4, 512
    ws = worlds(seed, 21, n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H)
    assert all(routing_differs(ws[i], ws[i + 1]) for i in range(20)), "the routing must change every replay"
    inp = Inputs(R, T, K, L, H, max_rows(ws))
    rng = np.random.default_rng(seed)
    inp.load(ws[0], rng)
    with TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, guard=True) as tc:
        side = torch.cuda.Stream()                            # warm-up (torch's recipe), eager
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            inp.rows.copy_(inp.acts)
            out0 = tc(*inp.args())
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        tc.check()
        verify_torch(tc, ws[0], out0, "eager warm-up")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            inp.rows.copy_(inp.acts)                          # a torch op producing the rows (fp32 -> bf16)
            out = tc(*inp.args())                             # send, receive + reduce
            y = out.float() * 2.0                             # a torch op consuming the output
        for i in range(1, 21):
            inp.load(ws[i], rng, rows_too=False)              # new routing and data, in place
            g.replay()
            torch.cuda.synchronize()
            tc.check()
            verify_torch(tc, ws[i], out, f"replay {i}")
            assert torch.equal(y, out.float() * 2.0), f"replay {i}: the consumer did not see the output"
        g.reset()


# ---------------------------------------------------------------- (3) bad tensors: clear errors, no launch

def test_wrong_dtype_device_or_size_is_refused_before_any_launch(dev):
    seed = fresh_seed("bad_tensors")
    R, T, K, L, H = 2, 16, 2, 2, 64
    world = world_case(n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H, seed=seed)
    inp = Inputs(R, T, K, L, H, max_rows([world]))
    inp.load(world, np.random.default_rng(seed))
    with TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, guard=True) as tc:
        a = list(inp.args())
        cases = {
            "rows float32": (0, inp.rows.float(), ["c: expected dtype bfloat16"]),
            "topk_idx int64": (4, inp.topk.long(), ["topk_idx: expected dtype int32"]),
            "weights on the CPU": (5, inp.w.cpu(), ["weights: expected memory of GPU", "got cpu"]),
            "src_info too small": (3, inp.src[:, :1], ["src_info: expected at least"]),
            "range_table wrong shape": (2, inp.range_table[:, :3], ["range_table: expected shape"]),
        }
        for name, (i, bad, words) in cases.items():
            args = list(a)
            args[i] = bad
            with pytest.raises(ConfigError) as ei:
                tc(*args)
            msg = str(ei.value)
            assert all(w in msg for w in words), f"{name}: {msg}"
            print(f"[{name}] {msg.splitlines()[0]} ...")
        torch.cuda.synchronize()
        for r in range(R):                                    # nothing ran
            assert (tc.recv_view(r, with_guard=True) == 0xAB).all(), f"rank {r}: receive buffer touched"
            assert (tc.counts_view(r) == NOT_ARRIVED).all(), f"rank {r}: counts touched"
    # the launchers themselves
    from p3send.ops.recv import RecvReduce
    from p3send.ops.send import ScatterSend
    comb = Combine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, device=dev)
    try:
        comb.load(world)
        s = ScatterSend(L, device=dev)
        with pytest.raises(ConfigError, match="expert_offsets: expected dtype int32"):
            s.prepare(comb.cfgs[0], inp.rows[0], inp.expert_offsets[0].float())
        with pytest.raises(ConfigError, match="c: expected memory of GPU"):
            s.prepare(comb.cfgs[0], inp.rows[0].cpu(), inp.expert_offsets[0])
        rv = RecvReduce(device=dev)
        with pytest.raises(ConfigError, match="out: expected at least"):
            rv.prepare(comb.cfgs[0], comb.recv_ptr(0), comb.counts[0], inp.topk[0], inp.w[0],
                       torch.empty((T - 1, H), dtype=torch.bfloat16, device="cuda"), n_tokens=T, n_experts=L,
                       timeout_ns=10**9)
        s.close()
        rv.close()
    finally:
        comb.close()


# ---------------------------------------------------------------- (4) a device-side gate skips a send

def test_a_gated_off_send_times_out_is_named_then_the_next_replay_is_exact(dev):
    seed = fresh_seed("gate")
    R, T, K, L, H = 4, 24, 3, 3, 128
    victim = 2
    ws = worlds(seed, 4, n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H)
    inp = Inputs(R, T, K, L, H, max_rows(ws))
    rng = np.random.default_rng(seed)
    gate = torch.ones(R, dtype=torch.int32, device="cuda")
    with TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, guard=True, timeout_ms=200,
                      gated=True) as tc:
        with pytest.raises(ConfigError, match="gate: a device-side gate needs CUDA graph capture"):
            tc(*inp.args(), gate=gate)                        # eager: refused before any launch
        inp.load(ws[0], rng)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tc(*inp.args(), gate=gate)
        g.replay()                                            # every gate open
        torch.cuda.synchronize()
        tc.check()
        verify_torch(tc, ws[0], out, "gates open")

        inp.load(ws[1], rng)
        gate[victim] = 0                                      # a device write: no host value decides
        t0 = time.monotonic()
        g.replay()
        torch.cuda.synchronize()
        with pytest.raises(ArrivalTimeout) as ei:
            tc.check()                                        # names the pairs, re-arms the counts
        assert time.monotonic() - t0 < 5.0
        want = {(r, e, victim) for r in range(R) for e in range(L)}
        assert set(ei.value.missing) == want, f"missing {sorted(ei.value.missing)}, want {sorted(want)}"
        assert f"rank(s) [{victim}]" in str(ei.value)
        for r in range(R):
            assert (tc.counts_view(r) == NOT_ARRIVED).all(), f"rank {r}: not re-armed by the host"

        for i in (2, 3):                                      # the gate open again: exact, new routing
            gate[victim] = 1
            inp.load(ws[i], rng)
            g.replay()
            torch.cuda.synchronize()
            tc.check()
            verify_torch(tc, ws[i], out, f"after the gated replay ({i})")
        g.reset()


# ---------------------------------------------------------------- (5) one process per rank, torch.distributed

def torch_rank_job(rank, _exchange, job):
    import torch
    import torch.distributed as dist

    from p3send.torch import TorchRank
    R, T, K, L, H, seed, port, rounds = (job[k] for k in ("R", "T", "K", "L", "H", "seed", "port", "rounds"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    torch.cuda.set_device(0)
    ws = worlds(seed, rounds, n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H)
    mr = max_rows(ws)
    rows = torch.zeros((mr, H), dtype=torch.bfloat16, device="cuda")
    expert_offsets = torch.zeros((L + 1,), dtype=torch.int32, device="cuda")
    range_table = torch.zeros((2 * L * R,), dtype=torch.int32, device="cuda")
    src = torch.full((mr, 2), -1, dtype=torch.int32, device="cuda")
    topk = torch.zeros((T, K), dtype=torch.int32, device="cuda")
    w = torch.zeros((T, K), dtype=torch.float32, device="cuda")
    problems, sync_sends = [], None
    tr = TorchRank(max_tokens=T, top_k=K, hidden=H, n_local_experts=L, max_rows=mr, guard=True)
    try:
        sync_sends = tr.inner.sync_sends
        side = torch.cuda.Stream()
        for i, world in enumerate(ws):
            d = world.ranks[rank]
            n = d.c.shape[0]
            rows[:n].copy_(torch.from_numpy(d.c.view(np.int16)).view(torch.bfloat16))
            expert_offsets.copy_(torch.from_numpy(d.expert_offsets.astype(np.int32)))
            range_table.copy_(torch.from_numpy(d.range_table.astype(np.int32)))
            src[:n].copy_(torch.from_numpy(d.src_info.astype(np.int32)))
            topk.copy_(torch.from_numpy(d.topk_idx.astype(np.int32)))
            w.copy_(torch.from_numpy(d.weights.astype(np.float32)))
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                out = tr.step(rows, expert_offsets, range_table, src, topk, w)
            o = bits(out)
            problems += [f"round {i}: {p}" for p in
                         check_world(world, lambda r: tr.recv_view(with_guard=True), lambda r: o,
                                     guard=tr.inner.guard, ranks=[rank])]
            if not (tr.counts_view() == NOT_ARRIVED).all():
                problems.append(f"round {i}: counts not re-armed")
            tr.barrier()                                      # peers read before the next round's sends
    finally:
        tr.close()
        dist.destroy_process_group()
    return {"problems": problems, "sync_sends": sync_sends}


def test_one_process_per_rank_with_torch_distributed_and_changing_routing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = dict(R=3, T=24, K=3, L=2, H=256, seed=fresh_seed("torch_ranks"), port=port, rounds=4)
    ws = worlds(job["seed"], job["rounds"], n_ranks=3, tokens=24, top_k=3, n_local=2, hidden=256)
    assert all(routing_differs(ws[i], ws[i + 1]) for i in range(len(ws) - 1))
    out = run_ranks(torch_rank_job, job["R"], job, timeout_s=240)
    for o in out:
        assert o.ok, f"rank {o.rank}: {o.error}"
        assert not o.value["problems"], f"rank {o.rank}:\n" + "\n".join(o.value["problems"])
        assert o.value["sync_sends"], "ranks sharing a GPU must barrier between send and receive"


# ---------------------------------------------------------------- cost of the op over the launcher path

def test_torch_op_graph_replay_costs_within_5_percent_of_combine(dev):
    """Decode round, 8 ranks x 128 tokens, top-8, 32 experts/rank, hidden 7168: a graph
    replay of the torch op vs a replay of Combine's own graph (both without stamps),
    interleaved batches, medians."""
    seed = fresh_seed("cost")
    R, T, K, L, H = 8, 128, 8, 32, 7168
    world = world_case(n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H, seed=seed)
    mr = max_rows([world])
    comb = Combine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, device=dev, stamps=False, max_rows=mr)
    comb.load(world)
    inp = Inputs(R, T, K, L, H, mr)
    inp.load(world, np.random.default_rng(seed))
    tc = TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, max_rows=mr)
    try:
        g_comb = comb.capture()
        stream = torch.cuda.Stream()
        tc(*inp.args())
        torch.cuda.synchronize()
        tc.check()
        g_torch = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_torch):
            out = tc(*inp.args())
        n = 20

        def timed(run):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                e0.record()
                for _ in range(n):
                    run()
                e1.record()
            e1.synchronize()
            return 1000.0 * e0.elapsed_time(e1) / n

        def comb_replay():
            g_comb.launch(stream)

        for _ in range(3):                                    # warm both
            timed(comb_replay)
            timed(g_torch.replay)
        a, b = [], []
        for _ in range(15):
            a.append(timed(comb_replay))
            b.append(timed(g_torch.replay))
        torch.cuda.synchronize()
        comb.check()
        tc.check()
        verify_torch(tc, world, out, "timed replays")
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"\n[cost] decode round {R} ranks x {T} tokens, top-{K}, {L} experts/rank, hidden {H}: "
              f"Combine graph replay {ta:.1f} us, torch op graph replay {tb:.1f} us, ratio {tb / ta:.3f} "
              f"(min {min(a):.1f} / {min(b):.1f} us)")
        assert tb <= 1.05 * ta, f"the torch op costs {tb:.1f} us against {ta:.1f} us"
        g_comb.close()
    finally:
        tc.close()
        comb.close()
