"""Sections ``prefill`` (1), ``decode_send`` (1b) and ``budget`` (2): one rank's send of
``tokens`` x top_k rows to 8 receive buffers on this GPU, against the device copy of the same
bytes, the baselines and ceilings (``baselines.time_baselines``), torch's ``index_copy_`` and,
for the budget, the send's time by SM budget."""
from __future__ import annotations

import numpy as np

from ..abi.config import rank_config
from ..abi.layout import encode_range_table
from ..cuda import driver
from ..ops.send import ScatterSend
from ..oracle.cases import prefill_routing
from .baselines import CudaScatter, TritonScatter, close_baselines, time_baselines
from .data import random_bytes
from .timing import Timer

#: The scatter baselines' result labels (the table compares the send with the faster).
SCATTER_BASELINES = (TritonScatter.label, CudaScatter.label)


def measure_send(a, dev, rng, torch, copy_stream: driver.Stream, tokens: int, *, budget: bool = False) -> dict:
    """One rank's send of ``tokens`` x top_k rows to 8 receive buffers on this GPU, next to
    the device copy of the same bytes, the baselines (a Triton and a CUDA C++ kernel doing
    the same job from the same inputs, and the plainest SM copy), the scatter ceilings,
    torch's index_copy_ and, with ``budget``, the SM-budget curve (under "budget"). Inputs
    rotate over enough sets to leave L2."""
    msg = 2 * a.hidden
    rows = tokens * a.top_k
    nbytes = rows * msg
    off, table, src, dst = prefill_routing(tokens, a.ranks, a.top_k, a.experts, rng)
    recv_bytes = tokens * a.top_k * msg
    sets = min(8, max(2, -(-4 * dev.l2_bytes // nbytes)))   # rotated inputs: >= 4x L2 of C (8 sets at most)
    cs = [random_bytes(nbytes, rng, torch) for _ in range(sets)]
    recvs = [[driver.DeviceBuffer(recv_bytes, fill=0xAB) for _ in range(a.ranks)] for _ in range(sets)]
    counts = [driver.DeviceBuffer(8 * a.experts * a.ranks, fill=0xFF) for _ in range(a.ranks)]
    table_buf, src_buf = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offsets = driver.DeviceBuffer.from_array(off)
    s = copy_stream
    # held (Timer.hold): a decode-size launch is shorter than the host's turn, and the
    # baselines' shape sweep includes two-launch contenders
    timer = Timer(s, hold=True)
    sender = ScatterSend(a.experts, device=dev)
    blocks, sends = [], []
    for i in range(sets):
        cfg = rank_config(n_ranks=a.ranks, recv_bufs=recvs[i][:a.ranks], top_k=a.top_k, msg_bytes=msg,
                          max_tokens=tokens, range_table=table_buf, src_info=src_buf)
        # every receiver is on this GPU: the .gpu-scope signal (FLAG_SCOPE_GPU), as the baselines use
        blocks.append(sender.prepare(cfg, cs[i], offsets, expert_offsets_host=off, count_ptrs=counts,
                                     rows_in_c=rows, same_gpu=True, into=sender.k.params_block()))
        sends.append(dict(cfg=cfg, c=cs[i], expert_offsets=offsets, expert_offsets_host=off, count_ptrs=counts,
                          rows_in_c=rows))

    def send(i):   # the signal is on (counts are overwritten; only receivers need them re-armed)
        sender.launch(s, blocks[i % sets])

    # Diagnostic: the same kernel and bytes with identity routing (row r -> slot r of one
    # buffer, in order) separates the cost of the scatter pattern from the kernel's own. It
    # reads and writes the copy's buffers (rotated alike: neither stays in L2).
    dsts = [driver.DeviceBuffer(nbytes) for _ in range(sets)]
    ident_table = driver.DeviceBuffer.from_array(encode_range_table(off, np.diff(off).reshape(-1, 1)))
    ident_src = driver.DeviceBuffer.from_array(np.stack([np.arange(rows) // a.top_k, np.arange(rows) % a.top_k],
                                                        1).astype(np.int32))
    ident_blocks = []
    for i in range(sets):
        icfg = rank_config(n_ranks=1, recv_bufs=[dsts[i]], top_k=a.top_k, msg_bytes=msg, max_tokens=tokens,
                           range_table=ident_table, src_info=ident_src)
        ident_blocks.append(sender.prepare(icfg, cs[i], offsets, expert_offsets_host=off, count_ptrs=counts[:1],
                                           rows_in_c=rows, same_gpu=True, into=sender.k.params_block()))
    # the scatter ceiling's destinations: row r -> its rank's receive buffer, slot (src_idx, src_topk)
    slot = (src[:, 0].astype(np.uint64) * np.uint64(a.top_k) + src[:, 1].astype(np.uint64)) * np.uint64(msg)
    row_dsts = [driver.DeviceBuffer.from_array(np.array([b.ptr for b in recvs[i]], np.uint64)[dst] + slot)
                for i in range(sets)]
    # its control: row r -> row r of the copy's destination (the same kernel, the copy's order)
    ident_dsts = [driver.DeviceBuffer.from_array(dsts[i].ptr + np.arange(rows, dtype=np.uint64) * np.uint64(msg))
                  for i in range(sets)]
    best = {}
    found, skipped = time_baselines(timer, sends, (dsts, cs, nbytes), n_experts=a.experts, dev=dev,
                                    iters=a.iters, warmup=a.warmup, ceiling=(row_dsts, cs, rows, msg, ident_dsts),
                                    best=best)
    # the table's figures: every contender's fastest shape timed in turns with the send
    fns = {"p3_scatter_send": send, "send_identity_routing": lambda i: sender.launch(s, ident_blocks[i % sets]),
           "d2d_copy": lambda i: driver.memcpy_dtod(dsts[i % sets].ptr, cs[i % sets].ptr, nbytes, s)}
    fns.update({k: fn for k, (fn, _) in best.items()})
    turns = timer.interleaved(fns, rounds=max(4, a.iters // 2), per_round=4, warmup=a.warmup)
    res = {k: dict(v, **{x: found[k][x] for x in ("config", "variant", "variants") if k in found})
           for k, v in turns.items()}
    close_baselines(kern for _, kern in best.values())
    for b in row_dsts + ident_dsts:
        b.free()
    for d in dsts:
        d.free()
    if torch is not None:
        ts = torch.cuda.ExternalStream(int(s))
        slots_total = a.ranks * tokens * a.top_k
        with torch.cuda.stream(ts):
            dst_t = [torch.empty((slots_total, msg), dtype=torch.uint8, device="cuda") for _ in range(sets)]
            src_t = [torch.as_tensor(cs[i], device="cuda").view(rows, msg) for i in range(sets)]
            idx = torch.as_tensor(dst.astype(np.int64) * (tokens * a.top_k) + src[:, 0].astype(np.int64) * a.top_k
                                  + src[:, 1], device="cuda")
        torch.cuda.synchronize()

        def index_copy(i):   # on the timed stream
            with torch.cuda.stream(ts):
                dst_t[i % sets].index_copy_(0, idx, src_t[i % sets])
        res["torch_index_copy_"] = timer.run(index_copy, a.iters, a.warmup)
        del dst_t, src_t, idx
    moved = 2 * nbytes
    for v in res.values():
        v["TBps_rw"] = moved / (v["median_us"] * 1e-6) / 1e12
    copy_us = res["d2d_copy"]["median_us"]
    sec = {"rows": rows, "msg_bytes": msg, "bytes": nbytes, "sets": sets, "results": res,
           "send_over_copy": res["p3_scatter_send"]["median_us"] / copy_us, "baselines_skipped": skipped}
    if "torch_index_copy_" in res:
        sec["index_copy_over_send"] = res["torch_index_copy_"]["median_us"] / res["p3_scatter_send"]["median_us"]
    if budget:
        curve = {}
        for n in [x for x in (8, 16, 32, 64) if x < dev.sm_count] + [dev.sm_count]:
            sender.set_num_sms(n)
            us = timer.run(send, a.iters // 2 + 5, a.warmup)["median_us"]
            curve[n] = {"median_us": us, "TBps_rw": moved / (us * 1e-6) / 1e12}
        sender.set_num_sms(None)
        sec["budget"] = curve
    sender.close()
    for b in cs + [x for r in recvs for x in r] + counts + [table_buf, src_buf, offsets, ident_table, ident_src]:
        b.free()
    return sec


def run_prefill(ctx, out: dict) -> None:
    """Section ``prefill``: the send at --tokens (with the budget curve when ``budget`` is asked too)."""
    sec = measure_send(ctx.args, ctx.dev, ctx.rng, ctx.torch, ctx.stream, ctx.args.tokens,
                       budget="budget" in ctx.only)
    if "budget" in sec:
        out["budget"] = sec.pop("budget")
    out["prefill"] = sec
    out["copy_TBps_rw"] = sec["results"]["d2d_copy"]["TBps_rw"]


def run_budget(ctx, out: dict) -> None:
    """Section ``budget``: measured by the prefill section's send (run here when it did not run)."""
    if "budget" not in out:
        run_prefill(ctx, out)


def run_decode_send(ctx, out: dict) -> None:
    """Section ``decode_send``: the same at --decode-tokens."""
    out["decode_send"] = measure_send(ctx.args, ctx.dev, ctx.rng, ctx.torch, ctx.stream, ctx.args.decode_tokens)


def _send_table(p: dict, title: str, target: float) -> str:
    L = [f"\n{title}: {p['rows']} rows x {p['msg_bytes']} B = {p['bytes'] / 1e6:.1f} MB, 8 receive buffers "
         f"on this GPU, inputs rotated over {p['sets']} sets (median us, TB/s counting read+write, / copy)"]
    copy_us = p["results"]["d2d_copy"]["median_us"]
    for k, v in p["results"].items():
        cfg = f"   [{v['config']}]" if "config" in v else ""
        L.append(f"   {k:<24} {v['median_us']:9.2f} us  {v['TBps_rw']:6.2f} TB/s  "
                 f"{v['median_us'] / copy_us:6.3f}x{cfg}")
    for k, why in p.get("baselines_skipped", {}).items():
        L.append(f"   {k:<24} skipped: {why}")
    scatter = [v["median_us"] for k, v in p["results"].items() if k in SCATTER_BASELINES]
    send_us = p["results"]["p3_scatter_send"]["median_us"]
    vs = f", best baseline / send {min(scatter) / send_us:.3f}x" if scatter else ""
    L.append(f"   send / copy              {p['send_over_copy']:.3f}x   (target <= {target}){vs}")
    if "index_copy_over_send" in p:
        L.append(f"   index_copy_ / send       {p['index_copy_over_send']:.2f}x")
    return "\n".join(L)


def table_prefill(out: dict) -> str:
    return _send_table(out["prefill"], "1. prefill send", 1.03) if "prefill" in out else ""


def table_decode_send(out: dict) -> str:
    return _send_table(out["decode_send"], "1b. one rank's decode-size send", 1.10) if "decode_send" in out else ""


def table_budget(out: dict) -> str:
    if "budget" not in out:
        return ""
    L = ["\n2. SM budget (send, prefill shape)"]
    for n, v in out["budget"].items():
        L.append(f"   {n:>4} SMs  {v['median_us']:9.1f} us  {v['TBps_rw']:6.2f} TB/s")
    return "\n".join(L)
