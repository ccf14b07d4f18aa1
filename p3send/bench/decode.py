"""Section ``decode`` (3): the decode round (8 ranks on this GPU, a CUDA-graph replay of
the sends and the waits/reduces) against the copy floor of its bytes and the round's
ceilings (``round_ceiling``), timed in turns with it."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..abi.layout import SENTINEL
from ..cuda import driver
from ..ops.combine import Combine
from ..oracle.cases import check_world, world_case, world_row_dst
from .baselines import REDUCE_VARIANTS, ROWS_VARIANTS, BaselineUnavailable, ReduceCeiling, RowsCopy
from .timing import Timer


def run(ctx, out: dict) -> None:
    """Section ``decode``: the round (a CUDA-graph replay) timed in turns with its ceilings,
    its copy floor (from the prefill section's copy bandwidth) and the host's cost per replay."""
    a, dev, rng = ctx.args, ctx.dev, ctx.rng
    world = world_case(n_ranks=a.ranks, tokens=a.decode_tokens, top_k=a.top_k, n_local=a.experts,
                       hidden=a.hidden, seed=int(rng.integers(1 << 31)))
    comb = Combine(a.ranks, max_tokens=a.decode_tokens, top_k=a.top_k, hidden=a.hidden,
                   n_local_experts=a.experts, device=dev, stamps=False, guard=True)
    comb.load(world)
    comb.round()                                  # verified path once before timing
    graph = comb.capture()
    timer = Timer(comb.origin, hold=True)
    fns = {"round": lambda i: graph.launch(comb.origin)}
    keep = []
    try:
        ceiling = round_ceiling(a, dev, comb, world, timer, keep)
        fns.update(ceiling.pop("fns"))
        turns = timer.interleaved(fns, rounds=a.iters, per_round=4, warmup=a.warmup)
        t = turns.pop("round")
        comb.check()
        ceiling["matches_round"] = ceiling.pop("check")()
        ceiling.update(turns)
    finally:
        for x in reversed(keep):
            x.free() if isinstance(x, driver.DeviceBuffer) else x.close()
    rows = sum(len(d.c) for d in world.ranks)
    msg = 2 * a.hidden
    moved = 2 * rows * msg + a.ranks * a.decode_tokens * (a.top_k + 1) * msg   # send r+w, reduce r+w
    floor_us = moved / (out["copy_TBps_rw"] * 1e12) * 1e6 if "copy_TBps_rw" in out else None
    host = []
    for _ in range(200):
        t0 = time.perf_counter()
        graph.launch(comb.origin)
        host.append((time.perf_counter() - t0) * 1e6)
    comb.origin.synchronize()
    comb.check()
    out["decode"] = {"round_us": t["median_us"], "bytes_moved": moved, "copy_floor_us": floor_us,
                     "round_over_floor": (t["median_us"] / floor_us) if floor_us else None,
                     "graph_replay_host_us": statistics.median(host), "rows": rows, "ceiling": ceiling}
    graph.close()
    comb.close()


def round_ceiling(a, dev, comb, world, timer, keep: list) -> dict:
    """The decode round's ceilings, for timing in turns with the round. "round ceiling": every
    rank's rows copied to their slots of the round's receive buffers by the scatter ceiling
    (destinations precomputed, one launch for all ranks, no signal), then the reduce ceiling
    over every rank's tokens (one launch, no wait) into buffers of its own. "round ceiling
    per rank, signalled": the round's structure with those kernels (per rank, on its stream,
    a signalled scatter ceiling of its rows, or the scatter then a publish kernel; after every
    rank's scatter, each rank's reduce), the scatter's shape and signal swept, then the
    reduce's. Before timing, each scatter's receive buffers (sentinel-filled) are checked
    byte for byte against the oracle. Returns the shapes found, "scatter_exact", "fns"
    (those, each half alone and the round's sends alone, for ``Timer.interleaved``) and
    "check" (after the timings: do the reduce ceilings' outputs equal the round's, byte for
    byte). Everything it creates goes to ``keep`` (the caller frees or closes it)."""
    def kept(x):
        keep.append(x)
        return x
    msg = 2 * a.hidden
    counts = [len(d.c) for d in world.ranks]
    allc = kept(driver.DeviceBuffer(sum(counts) * msg))
    at = 0
    for r in range(a.ranks):
        driver.memcpy_dtod(allc.ptr + at * msg, comb.c[r].ptr, counts[r] * msg, comb.origin)
        at += counts[r]
    bases = [comb.recv_ptr(p) for p in range(a.ranks)]
    row_dst = kept(driver.DeviceBuffer.from_array(np.concatenate([world_row_dst(world, r, bases)
                                                                  for r in range(a.ranks)])))
    outs = [kept(driver.DeviceBuffer(a.decode_tokens * msg)) for _ in range(a.ranks)]
    s = comb.origin
    R = range(a.ranks)
    first = np.concatenate([[0], np.cumsum(counts)])
    streams, sent = [kept(driver.Stream()) for _ in R], [kept(driver.Event(timing=False)) for _ in R]

    def reduce_of(k, ranks):
        return k.prepare([comb.recv_ptr(r) for r in ranks], [comb.topk_idx[r] for r in ranks],
                         [comb.weights[r] for r in ranks], [outs[r] for r in ranks], tokens=a.decode_tokens,
                         top_k=a.top_k, msg_bytes=msg, n_global=a.experts * a.ranks)

    def per_rank(ks, red, with_reduce=True):   # the round's structure, captured
        with driver.Graph.capture(s, streams) as cap:
            for r in R:
                ks[r].prepare(row_dst.ptr + 8 * int(first[r]), comb.c[r], counts[r], msg)(streams[r])
                sent[r].record(streams[r])
            for r in R if with_reduce else ():
                for p in R:
                    if p != r:
                        streams[r].wait(sent[p])
                reduce_of(red, [r])(streams[r])
        return kept(cap.graph)

    def fastest(options):   # {label: launch(stream)} -> (label, launch, {label: median})
        per = {k: timer.run(lambda i, f=f: f(s), a.iters, a.warmup)["median_us"] for k, f in options.items()}
        name = min(per, key=per.get)
        return name, options[name], {k: round(v, 2) for k, v in per.items()}

    def scatter_exact(launch):   # sentinel-filled receive buffers, the scatter alone, the oracle's bytes
        for r in R:
            comb.recv_alloc[r].fill(SENTINEL)
        launch(s)
        s.synchronize()
        return check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output, guard=comb.guard,
                           recv_bytes=comb.recv_bytes) or True
    try:
        def shape(v):
            return dict(threads=v[0], vpt=v[1], rows_per_cta=v[2] if len(v) > 2 else 1)
        rows_ks = {}
        for v in ROWS_VARIANTS:
            k = kept(RowsCopy(device=dev, **shape(v)))
            rows_ks[k.config] = (k.prepare(row_dst, allc, sum(counts), msg), v)
        rows_cfg, rows_l, rows_var = fastest({k: x[0] for k, x in rows_ks.items()})
        reds = {}
        for v in REDUCE_VARIANTS:
            k = ReduceCeiling(device=dev, threads=v[0], vpt=v[1])
            reds[k.config] = (k, reduce_of(k, R))
        red_cfg, red_l, red_var = fastest({k: x[1] for k, x in reds.items()})
        # per rank: the scatter's shape and signal swept with the fastest reduce, then the reduce's shape
        graphs, sets = {}, {}
        for v, sig in [(v, True) for v in ROWS_VARIANTS] + [(rows_ks[rows_cfg][1], "kernel")]:
            ks = [kept(RowsCopy(device=dev, signal=sig, **shape(v))) for _ in R]
            graphs[ks[0].config], sets[ks[0].config] = per_rank(ks, reds[red_cfg][0]).launch, ks
        sc_cfg, _, sc_var = fastest(graphs)
        graphs = {f"{sc_cfg}; reduce {k}": per_rank(sets[sc_cfg], x[0]).launch for k, x in reds.items()}
        per_rank_cfg, per_rank_l, red_var_rank = fastest(graphs)
        scatters = per_rank(sets[sc_cfg], None, with_reduce=False)
        sends = kept(comb.capture(receive=False))               # and the round's sends alone
        exact = {"one launch": scatter_exact(rows_l), "per rank": scatter_exact(scatters.launch)}
        comb.round()                                            # the round's bytes back in place
    except BaselineUnavailable as e:
        return {"skipped": str(e), "fns": {}, "check": lambda: None}

    def both(i):
        rows_l(s)
        red_l(s)

    def check():
        s.synchronize()
        return all(np.array_equal(outs[r].download(np.uint16), comb.output(r).reshape(-1)) for r in R)
    return {"scatter_config": rows_cfg, "scatter_variants": rows_var, "reduce_config": red_cfg,
            "reduce_variants": red_var, "per_rank_config": per_rank_cfg, "per_rank_scatter_variants": sc_var,
            "per_rank_reduce_variants": red_var_rank, "scatter_exact": exact, "check": check,
            "fns": {"round ceiling": both, "round ceiling: scatter": lambda i: rows_l(s),
                    "round ceiling: reduce": lambda i: red_l(s),
                    "round ceiling per rank, signalled": lambda i: per_rank_l(s),
                    "round ceiling per rank: the scatters": lambda i: scatters.launch(s),
                    "round: the sends": lambda i: sends.launch(s)}}


def table(out: dict) -> str:
    if "decode" not in out:
        return ""
    L = []
    d = out["decode"]
    floor = (f"copy floor {d['copy_floor_us']:.1f} us -> {d['round_over_floor']:.2f}x (target <= 1.15)"
             if d["copy_floor_us"] else "copy floor: needs the prefill section")
    L.append(f"\n3. decode round (graph replay): {d['round_us']:.1f} us, {floor}")
    c = d.get("ceiling", {})
    if "skipped" in c:
        L.append(f"   round ceiling: skipped ({c['skipped']})")
    elif "round ceiling" in c:
        fl = d["copy_floor_us"]
        for k, what in (("round ceiling", "one scatter launch for every rank's rows, then one reduce"),
                        ("round ceiling: scatter", ""), ("round ceiling: reduce", ""),
                        ("round ceiling per rank, signalled", "the round's structure: per rank a signalled "
                                                              "scatter, then per rank a reduce"),
                        ("round ceiling per rank: the scatters", ""), ("round: the sends", "")):
            x = c[k]["median_us"]
            L.append(f"   {k:<34} {x:7.1f} us" + (f"  {x / fl:.2f}x the floor" if fl and what else "")
                     + (f"  ({what})" if what else ""))
        L.append(f"   round / round ceiling    {d['round_us'] / c['round ceiling']['median_us']:.3f}x, "
                 f"/ per rank, signalled {d['round_us'] / c['round ceiling per rank, signalled']['median_us']:.3f}x"
                 f"   [scatter {c['scatter_config']}, reduce {c['reduce_config']}, per rank "
                 f"{c['per_rank_config']}; timed in turns with the round; scatters byte-exact: "
                 f"{c['scatter_exact']}; reduce outputs equal the round's: {c['matches_round']}]")
    return "\n".join(L)
