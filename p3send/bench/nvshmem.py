"""Section ``nvshmem``: the NVSHMEM transport's put path of the shipped scatter send on one GPU.
One PE (one rank, ``n_ranks`` 1) sends the prefill shape's rows of C (at most ROWS) to itself with every row by
NVSHMEM puts (``FLAG_NVSHMEM_ALL``: staged, put, counts by signals; ``ScatterSend(transport=...)``,
p3_scatter_send_fp8 linked with the shim), timed in turns against the direct stores of the default
module of the same wire (bf16: p3_scatter_send, fp8: p3_scatter_send_fp8) and of the linked module
(``FLAG_NVSHMEM`` alone: the one rank is in its own domain). The put round's receive bytes and
counts are checked equal to the direct round's. Skipped with the reason without the transport's
wheels (``pip install 'p3send[nvshmem]'``). docs/SCALING.md section 5.
"""
from __future__ import annotations

import numpy as np

from ..abi.config import rank_config
from ..abi.wire import wire_msg_bytes
from ..cuda import driver
from ..oracle import dispatch as dispatch_ref
from .data import random_bytes, split_even
from .timing import Timer

WIRES = ("bf16", "fp8")
ROWS = 4096


def _measure(ctx, world, wire: str) -> dict:
    from ..ops import nvshmem
    from ..ops.send import ScatterSend
    a, rng = ctx.args, ctx.rng
    hidden, top_k, n_exp = a.hidden, a.top_k, a.experts
    if hidden % 512:
        return {"skipped": f"hidden {hidden}: the put path's scatter sends whole 512-column blocks"}
    # at most ROWS rows: two receive buffers and two stagings fit NVSHMEM's default 1 GiB heap
    rows, msg = min(a.tokens * top_k, ROWS), wire_msg_bytes(hidden, wire)
    counts = split_even(rows, n_exp)[:, None]
    off, lo, hi, _ = dispatch_ref.layout(counts, capacity=rows)
    max_tok = -(-rows // top_k)
    slots = rng.permutation(max_tok * top_k)[:rows]
    keep = []

    def dev_buf(arr):
        keep.append(driver.DeviceBuffer.from_array(np.ascontiguousarray(arr)))
        return keep[-1]
    rtab = dev_buf(dispatch_ref.range_table_of(lo, hi))
    src = dev_buf(np.stack([slots // top_k, slots % top_k], axis=1).astype(np.int32))
    c = random_bytes(rows * 2 * hidden, rng, ctx.torch, ctx.dev.ordinal)
    keep.append(c)
    off = off.astype(np.int32)
    rbytes, n_slots = max_tok * top_k * msg, n_exp
    sides, keep_sym = {}, []
    try:
        for name, all_puts in (("put", True), ("linked", False), ("direct", None)):
            if all_puts is None:
                recv, cnt = driver.DeviceBuffer(rbytes), driver.DeviceBuffer(8 * n_slots)
                keep += [recv, cnt]
                s = ScatterSend(n_exp, device=ctx.dev)
                bufs, cptrs = [recv.ptr], [cnt.ptr]
            else:
                recv, cnt = world.alloc(rbytes), world.alloc(8 * n_slots)
                keep_sym += [recv, cnt]
                t = nvshmem.NvshmemTransport(world, recv=recv, counts=cnt, msg_bytes=msg, staging_rows=rows,
                                             all_puts=all_puts)
                s = ScatterSend(n_exp, device=ctx.dev, transport=t)
                bufs, cptrs = world.recv_buf_ptrs(recv, 1)[:1], world.recv_buf_ptrs(cnt, 1)[:1]
            cfg = rank_config(n_ranks=1, my_rank=0, p2p_world_size=1, recv_bufs=bufs, top_k=top_k, msg_bytes=msg,
                              max_tokens=max_tok, range_table=rtab, src_info=src)
            blk = s.prepare(cfg, c, off, 2 * hidden, count_ptrs=cptrs, wire=wire)
            sides[name] = (s, blk, recv, cnt)
        got = {}
        for name, (s, blk, recv, cnt) in sides.items():
            recv.fill(0xAB)
            cnt.fill(0xFF)
            s.launch(ctx.stream, blk)
            ctx.stream.synchronize()
            got[name] = (recv.download(), cnt.download(np.uint64))
        checks = {name: bool(np.array_equal(got[name][0], got["direct"][0]) and
                             np.array_equal(got[name][1], got["direct"][1])) for name in ("put", "linked")}
        timer = Timer(ctx.stream, device=ctx.dev)
        fns = {name: (lambda i, s=s, blk=blk: s.launch(ctx.stream, blk)) for name, (s, blk, _, _) in sides.items()}
        turns = timer.interleaved(fns, rounds=max(4, a.iters // 2), per_round=4, warmup=a.warmup)
        res = {"rows": rows, "msg_bytes": msg, "bytes": rows * msg, "equal_to_direct": checks}
        for name in fns:
            res[name] = turns[name]
        res["put_over_direct"] = res["put"]["median_us"] / res["direct"]["median_us"]
        res["put_over_linked_direct"] = res["put"]["median_us"] / res["linked"]["median_us"]
        return res
    finally:
        for s, _, _, _ in sides.values():
            s.close()
            if s.transport is not None:
                s.transport.close()
        for b in keep + keep_sym:
            b.free()


def run(ctx, out: dict) -> None:
    """Section ``nvshmem`` (see the module's docstring)."""
    from ..cuda.nvshmem_link import NvshmemUnavailable
    from ..ops import nvshmem
    from ..ops.exchange import ProcessExchange
    try:
        nvshmem.bindings()
    except NvshmemUnavailable as e:
        out["nvshmem"] = {"skipped": f"no NVSHMEM transport here: {e}"}
        return
    world = nvshmem.NvshmemWorld(ProcessExchange(1).bind(0), device=ctx.dev)
    try:
        out["nvshmem"] = {wire: _measure(ctx, world, wire) for wire in WIRES}
    except nvshmem.NvshmemError as e:          # e.g. a symmetric heap too small for the shape
        out["nvshmem"] = {"skipped": str(e)}
    finally:
        world.finalize()
        ctx.dev.activate()


def table(out: dict) -> str:
    if "nvshmem" not in out:
        return ""
    t = out["nvshmem"]
    if "skipped" in t:
        return f"\n11. NVSHMEM put path: skipped ({t['skipped']})"
    L = ["\n11. NVSHMEM put path, one PE: every row of the prefill send by puts to itself (timed in turns)"]
    for wire in WIRES:
        r = t[wire]
        if "skipped" in r:
            L.append(f"   {wire}: skipped ({r['skipped']})")
            continue
        L.append(f"   {wire}: {r['rows']} rows x {r['msg_bytes']} B ({r['bytes'] / 1e6:.1f} MB); the same bytes as "
                 f"the direct stores: put {r['equal_to_direct']['put']}, linked {r['equal_to_direct']['linked']}")
        for name, label in (("put", "self-put (FLAG_NVSHMEM_ALL)"), ("linked", "linked module, direct stores"),
                            ("direct", "default module, direct stores")):
            us = r[name]["median_us"]
            L.append(f"     {label:<32} {us:9.1f} us  {r['bytes'] / us / 1e3:7.1f} GB/s")
        L.append(f"     put / direct {r['put_over_direct']:.3f} (target <= 2), put / linked direct "
                 f"{r['put_over_linked_direct']:.3f}")
    return "\n".join(L)
