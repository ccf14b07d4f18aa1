"""The torch dispatch of one process per rank (``p3send.moe.TorchDispatchRank``), against
the numpy reference (``p3send.oracle.dispatch``) byte for byte: the receive arrays inside
sentinel-filled guards (0xAB), src_info, expert_offsets, the range table, the per-expert
counts and the checked topk_idx, read both from the rank's buffers and through the
tensors ``dispatch`` returns; then ``combine`` on those tensors (identity experts) against
the reference reduce (``check_world``: receive buffer byte for byte, the reduce within
bf16 rounding). Ranks sharing one GPU (the host-barrier path), bf16 with int64 ids and fp8
with scales, two steps with different routing on the same buffers; one rank alone (the
ops with no host synchronisation) eager and then replayed in a torch.cuda.graph with new
routing before each replay; bad tensors refused by name before any launch. Fresh seeds,
printed."""
from __future__ import annotations

import time

import numpy as np
import pytest

from p3send import ConfigError
from p3send.abi.layout import SENTINEL
from p3send.oracle import cases
from p3send.ops.procs import run_ranks
from tests.gpu.conftest import OK, WHY, fresh_seed
from tests.gpu.test_dispatch import expect, snap, step_problems

torch = pytest.importorskip("torch", reason="torch is not installed (p3send.torch is optional)")
pytestmark = pytest.mark.skipif(not (OK and torch.cuda.is_available()),
                                reason=f"no usable GPU for torch: {WHY if not OK else 'torch.cuda unavailable'}")

NOT_ARRIVED = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def bits(t):
    """bf16 tensor -> numpy uint16 bits."""
    return t.detach().view(torch.int16).cpu().numpy().view(np.uint16)


def steps_of(case, n: int) -> list:
    """``n`` steps of ``case``'s shape: the case, then redraws (new routing and tokens)."""
    return [case] + [cases.dispatch_redraw(case, case.seed + 1000 * i) for i in range(1, n)]


def write(c, rank, x, tk, w, sc) -> None:
    """Rank ``rank``'s inputs of step ``c`` into the same tensors, in place."""
    if c.payload == "fp8":
        x.view(torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(c.x[rank])))
        sc.copy_(torch.from_numpy(c.scales[rank]))
    else:
        x.view(torch.int16).copy_(torch.from_numpy(np.ascontiguousarray(c.x[rank]).view(np.int16)))
    tk.copy_(torch.from_numpy(c.topk[rank].astype(np.int64 if tk.dtype == torch.int64 else np.int32)))
    w.copy_(torch.from_numpy(c.weights[rank]))
    torch.cuda.synchronize()


def api_problems(c, rank, tdr, recv, h, want: dict, what: str) -> list:
    """The tensors ``dispatch`` returned hold what the rank's buffers and the reference hold."""
    rd, cap, out = tdr.dr.rd, max(c.capacity, 1), []
    fp8 = c.payload == "fp8"
    got = {"recv_x": (recv.view(torch.uint8) if fp8 else recv.view(torch.int16)).cpu().numpy().view(np.uint8)
           .reshape(cap, c.x_bytes),
           "src_info": h.src_info.cpu().numpy()}
    if fp8:
        got["recv_scales"] = h.recv_scales.cpu().numpy().view(np.uint8).reshape(cap, c.s_bytes)
    for name, g in got.items():
        if not np.array_equal(g, rd.view(name, rows=cap)):
            out.append(f"{c}{what}: rank {rank} {name}: the returned tensor is not the rank's buffer")
    for name, ref in (("expert_offsets", want["expert_offsets"]), ("range_table", want["range_table"]),
                      ("expert_counts", want["expert_counts"]), ("topk_idx", want["topk_out"])):
        g = getattr(h, name).cpu().numpy()
        if not np.array_equal(g, ref):
            out.append(f"{c}{what}: rank {rank} handle.{name}: got {g.tolist()[:40]}, want {ref.tolist()[:40]}")
    return out


def refused_problems(c, rank, tdr, x, tk, w, sc) -> list:
    """Bad tensors raise ConfigError naming the argument, and nothing is launched."""
    out = []
    f32 = torch.zeros(tuple(x.shape), dtype=torch.float32, device="cuda")
    bad = {"x float32": ((f32, tk, w, sc), ["x: expected dtype"]),
           "topk_idx on the CPU": ((x, tk.cpu(), w, sc), ["topk_idx: expected a tensor on cuda:", "got one on cpu"]),
           "topk_weights wrong shape": ((x, tk, torch.zeros((tk.shape[0], tk.shape[1] + 1), device="cuda"), sc),
                                        ["topk_weights: expected shape"]),
           "topk_idx float": ((x, tk.float(), w, sc), ["topk_idx: expected dtype torch.int32 or torch.int64"])}
    if c.payload == "fp8":
        bad["scales missing"] = ((x, tk, w, None), ["scales: expected a torch.Tensor"])
    else:
        bad["scales for bf16"] = ((x, tk, w, torch.zeros(1, device="cuda")), ["scales: expected None"])
    for name, (args, words) in bad.items():
        try:
            tdr.dispatch(*args)
            out.append(f"rank {rank} [{name}]: not refused")
        except ConfigError as e:
            msg = str(e)
            if not all(wd in msg for wd in words):
                out.append(f"rank {rank} [{name}]: {msg}")
            elif rank == 0:
                print(f"[{name}] {msg.splitlines()[0]} ...", flush=True)
    torch.cuda.synchronize()
    if not (tdr.dr.rd.view("recv_x") == SENTINEL).all():
        out.append(f"rank {rank}: recv_x touched by a refused dispatch")
    return out


def torch_dispatch_rank_job(rank, ex, job):
    """Child entry (module level: spawn pickles it): this rank's TorchDispatchRank, the
    refusals, then ``job['steps']`` steps (dispatch, combine, check) each verified; with
    ``job['graph']`` the steps after the first are replays of one captured step."""
    from p3send.moe import TorchDispatchRank
    from p3send.oracle.cases import check_world
    torch.cuda.set_device(0)
    case = cases.dispatch_case(job["family"], job["seed"], n_ranks=ex.n_ranks)
    fp8 = case.payload == "fp8"
    T, K, H = case.topk[rank].shape[0], case.top_k, case.hidden
    x = torch.zeros((T, H), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn) if fp8 else \
        torch.zeros((T, H), dtype=torch.bfloat16, device="cuda")
    tk = torch.zeros((T, K), dtype=torch.int64 if job["int64"] else torch.int32, device="cuda")
    w = torch.zeros((T, K), dtype=torch.float32, device="cuda")
    sc = torch.zeros((T, H // 128), dtype=torch.float32, device="cuda") if fp8 else None
    problems, sync, graph = [], None, None
    with TorchDispatchRank(ex, max_tokens=case.max_tokens, top_k=K, hidden=H, n_local_experts=case.n_local,
                           payload=case.payload, capacity=case.capacity, align=case.align,
                           expert_stride=case.expert_stride, zero_padding=case.zero_padding, guard=True) as tdr:
        sync, rd = tdr.dr.sync, tdr.dr.rd
        rd.src_info_alloc.fill(SENTINEL)      # the sentinel shows every src_info entry the kernels write
        problems += refused_problems(case, rank, tdr, x, tk, w, sc)
        before = [snap(rd)]
        for i, c in enumerate(steps_of(case, job["steps"])):
            what = f" step {i}"
            write(c, rank, x, tk, w, sc)
            if tdr.tr is not None:            # unowned slots keep the last step's bytes: the sentinel again
                tdr.tr.inner.recv.fill(SENTINEL)
            if job["graph"] and i > 0:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        g_recv, g_h = tdr.dispatch(x, tk, w, sc)
                        g_out = tdr.combine(g_recv, g_h) if tdr.tr is not None else None
                graph.replay()
                recv, h, out = g_recv, g_h, g_out
                what += " (graph replay)"
            else:
                recv, h = tdr.dispatch(x, tk, w, sc)
                out = tdr.combine(recv, h) if tdr.tr is not None else None
            tdr.check()                       # waits for the stream; raises what the device found
            got = [snap(rd)]
            want = expect(c, before, rd.guard, ranks=[rank])
            problems += step_problems(c, got, want, what, [rank])
            problems += api_problems(c, rank, tdr, recv, h, want[0], what)
            before = got
            if out is not None:
                o = bits(out)
                problems += [f"{c}{what}: {p}" for p in
                             check_world(cases.dispatch_world(c), lambda r: tdr.tr.recv_view(with_guard=True),
                                         lambda r: o, guard=tdr.tr.inner.guard, ranks=[rank])]
                if not (tdr.tr.counts_view() == NOT_ARRIVED).all():
                    problems.append(f"{c}{what}: rank {rank} combine counts not re-armed")
            tdr.barrier()                     # every rank has read its buffers before the next step's pushes
        if graph is not None:
            recv = h = out = g_recv = g_h = g_out = None   # no tensor over the freed buffers outlives them
            graph.reset()
    return {"problems": problems, "sync": sync}


def run_job(job, n: int, want_sync: bool) -> None:
    print(f"[torch dispatch ranks] {n} processes, {cases.dispatch_case(job['family'], job['seed'], n_ranks=n)}")
    t0 = time.monotonic()
    out = run_ranks(torch_dispatch_rank_job, n, job, timeout_s=240)
    assert time.monotonic() - t0 < 240
    for o in out:
        assert o.ok, f"rank {o.rank}: {o.error}"
        assert not o.value["problems"], f"rank {o.rank}:\n" + "\n".join(o.value["problems"])
        assert o.value["sync"] == want_sync, f"rank {o.rank}: sync {o.value['sync']}, want {want_sync}"


@pytest.mark.parametrize("family,int64", [("masked", True), ("fp8", False)])
def test_ranks_sharing_a_gpu_dispatch_then_combine_two_routings(family, int64):
    """4 processes on one GPU: the host-barrier path (DispatchRank.step, TorchRank.step)."""
    run_job(dict(family=family, seed=fresh_seed(f"torch ranks/{family}"), int64=int64, steps=2, graph=False), 4,
            want_sync=True)


def test_one_rank_ops_without_host_sync_eager_then_graph_replays_with_new_routing():
    """One rank: the ops with no host synchronisation (DispatchRank.enqueue, the combine op),
    one eager step, then 4 replays of one captured step with new routing written in place."""
    run_job(dict(family="masked", seed=fresh_seed("torch rank/graph"), int64=True, steps=5, graph=True), 1,
            want_sync=False)
