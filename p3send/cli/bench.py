"""``p3send bench``: the send and the combine round against the hardware's ceilings and
the alternatives a user would pick, measured in ONE run on the GPU it finds.

Method (docs/PERF.md): device events around each iteration, medians over many
iterations after warm-up, inputs rotated among sets larger than L2, never zeros.
"""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from ..abi.config import P3PeerSendConfig, rank_config
from ..abi.layout import encode_range_table
from ..cuda import driver
from ..ops.recv import RecvReduce
from ..ops.send import EpilogueSend, ScatterSend


SECTIONS = ("prefill", "budget", "decode_send", "decode", "latency", "host", "epilogue", "gemm", "two_gpu")


def add_arguments(p) -> None:
    p.add_argument("--only", action="append", default=None,
                   choices=SECTIONS,
                   help="run only these sections (default: all)")
    p.add_argument("--tokens", type=int, default=4096, help="prefill tokens per rank (default 4096)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=32, help="local experts per rank")
    p.add_argument("--gemm-k", type=int, default=2048, help="K of the down-projection GEMM (gemm section)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default="p3send-bench.json", help="where to write the results")
    p.add_argument("--hold", action="store_true",
                   help="hold each timed loop's stream with a short kernel until every launch is enqueued "
                        "(no host launch gap can enter a timing; the send sections always do)")


# One thread that spins on %globaltimer for ``ns``: holds a stream while the host enqueues.
_HOLD_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry p3_bench_hold(.param .u64 ns)
{
    .reg .pred  %p;
    .reg .b64   %t, %end;
    ld.param.u64        %end, [ns];
    mov.u64             %t, %globaltimer;
    add.s64             %end, %end, %t;
WAIT:
    nanosleep.u32       1000;
    mov.u64             %t, %globaltimer;
    setp.lt.u64         %p, %t, %end;
    @%p bra             WAIT;
    ret;
}
"""


class Timer:
    """Event-timed iterations on one stream; median in microseconds.

    ``hold``: ``run`` first enqueues a one-thread kernel that holds the stream for 2 ms + 50
    us per iteration, so the host has enqueued every timed launch before the GPU reaches
    them and no event pair can include the host's launch path (``interleaved`` always
    holds)."""

    HOLD_NS, HOLD_NS_PER_ITER = 2_000_000, 50_000

    def __init__(self, stream: driver.Stream, *, hold: bool = False, device: driver.Device | None = None):
        self.s, self.hold, self.dev = stream, hold, device

    def run(self, fn, iters: int, warmup: int) -> dict:
        for i in range(warmup):
            fn(i)
        self.s.synchronize()
        starts = [driver.Event() for _ in range(iters)]
        ends = [driver.Event() for _ in range(iters)]
        if self.hold:
            self._hold(iters)
        for i in range(iters):
            starts[i].record(self.s)
            fn(i)
            ends[i].record(self.s)
        self.s.synchronize()
        us = [1000.0 * a.elapsed_ms(b) for a, b in zip(starts, ends)]
        for e in starts + ends:
            e.close()
        return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us), "n": iters}

    def _hold(self, launches: int) -> None:
        from ..cuda import loader
        k = loader.load(_HOLD_PTX, device=self.dev or driver.device(), name="bench hold")["p3_bench_hold"]
        k.params_block(ns=self.HOLD_NS + launches * self.HOLD_NS_PER_ITER).launch((1,), (1,), self.s)

    def interleaved(self, fns: dict, rounds: int, per_round: int, warmup: int) -> dict:
        """Every contender of ``fns`` (name -> fn(i)) timed in turns: ``rounds`` rounds of
        ``per_round`` launches each, the order shuffled every round (seeded), so slow drifts
        of the GPU (clocks, power, temperature) fall on every contender alike and no
        contender always follows the same one. Each
        round is held (as ``hold``) until all its launches are enqueued, so a short kernel's
        timing never includes the host's turn from one contender to the next. ``fn(i)`` gets
        the count of launches made before it (all contenders), so inputs rotated by ``i``
        were last touched as many launches ago whoever ran before. Returns name -> the
        median, min and max over all its launches."""
        import random
        shuffle = random.Random(0).shuffle
        names = list(fns)
        for n in names:
            for i in range(warmup):
                fns[n](i)
        self.s.synchronize()
        times = {n: [] for n in names}
        made = 0
        events = [(driver.Event(), driver.Event()) for _ in range(per_round * len(names))]
        for _ in range(rounds):
            order = list(names)
            shuffle(order)
            marks = []
            self._hold(len(events))
            for n in order:
                for _ in range(per_round):
                    e0, e1 = events[len(marks)]
                    e0.record(self.s)
                    fns[n](made)
                    made += 1
                    e1.record(self.s)
                    marks.append((n, e0, e1))
            self.s.synchronize()
            for n, e0, e1 in marks:
                times[n].append(1000.0 * e0.elapsed_ms(e1))
        for e0, e1 in events:
            e0.close()
            e1.close()
        return {n: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "n": len(v),
                    "interleaved": True} for n, v in times.items()}


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:  # torch is an optional comparison only
        return None


def random_bytes(nbytes: int, rng, torch=None, ordinal: int = 0) -> driver.DeviceBuffer:
    """A buffer of random non-zero bytes on GPU ``ordinal`` (made current), generated on the
    GPU when torch is there."""
    driver.device(ordinal)
    buf = driver.DeviceBuffer(nbytes)
    if torch is not None:
        t = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{ordinal}")
        torch.cuda.synchronize(ordinal)
        driver.device(ordinal)
        driver.memcpy_dtod(buf.ptr, t.data_ptr(), nbytes, driver.Stream(null=True))
        driver.device(ordinal).synchronize()
        del t
    else:
        chunk = 1 << 26
        for o in range(0, nbytes, chunk):
            n = min(chunk, nbytes - o)
            buf.upload(rng.integers(1, 256, n, dtype=np.uint8), offset=o)
    return buf


def prefill_routing(tokens: int, ranks: int, top_k: int, experts: int, rng):
    """One sender's rows at the prefill shape: tokens*top_k rows (the average a rank owns)
    grouped by local expert, each row owned by a random rank, unique (token, k) slots per
    rank. Returns expert_offsets, range_table, src_info (rows, 2), dst_rank (rows,)."""
    rows = tokens * top_k
    rank_of_row = rng.integers(0, ranks, rows)
    expert_of_row = rng.integers(0, experts, rows)
    order = np.lexsort((rank_of_row, expert_of_row))        # by expert, then rank
    rank_of_row, expert_of_row = rank_of_row[order], expert_of_row[order]
    counts = np.zeros((experts, ranks), np.int64)
    np.add.at(counts, (expert_of_row, rank_of_row), 1)
    off = np.concatenate([[0], np.cumsum(counts.sum(axis=1))]).astype(np.int32)
    src = np.empty((rows, 2), np.int32)
    for rk in range(ranks):
        mine = np.nonzero(rank_of_row == rk)[0]
        slots = rng.permutation(tokens * top_k)[: len(mine)]
        src[mine, 0], src[mine, 1] = slots // top_k, slots % top_k
    return off, encode_range_table(off, counts), src, rank_of_row


def bench_send(a, dev, rng, torch, copy_stream: driver.Stream, tokens: int, *, budget: bool = False) -> dict:
    """One rank's send of ``tokens`` x top_k rows to 8 receive buffers on this GPU, next to
    the device copy of the same bytes, the fair peers (a Triton and a CUDA C++ kernel doing
    the same job from the same inputs, and the plainest SM copy), torch's index_copy_ and,
    with ``budget``, the SM-budget curve. Inputs rotate over enough sets to leave L2."""
    msg = 2 * a.hidden
    rows = tokens * a.top_k
    nbytes = rows * msg
    off, table, src, dst = prefill_routing(tokens, a.ranks, a.top_k, a.experts, rng)
    recv_bytes = tokens * a.top_k * msg
    sets = min(8, max(2, -(-4 * dev.l2_bytes // nbytes)))   # rotated inputs: >= 4x L2 of C (8 sets at most)
    cs = [random_bytes(nbytes, rng, torch) for _ in range(sets)]
    recvs = [[driver.DeviceBuffer(recv_bytes, fill=0xAB) for _ in range(a.ranks)] for _ in range(sets)]
    counts = [driver.DeviceBuffer(8 * a.experts * a.ranks, fill=0xFF) for _ in range(a.ranks)]
    rtab, srcb = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offs = driver.DeviceBuffer.from_array(off)
    s = copy_stream
    # held (Timer.hold): a decode-size launch is shorter than the host's turn, and the peers'
    # shape sweep includes two-launch contenders
    timer = Timer(s, hold=True)
    sender = ScatterSend(a.experts, device=dev)
    blocks, sends = [], []
    for i in range(sets):
        cfg = rank_config(n_ranks=a.ranks, recv_bufs=recvs[i][:a.ranks], top_k=a.top_k, msg_bytes=msg,
                          max_tokens=tokens, range_table=rtab, src_info=srcb)
        # every receiver is on this GPU: the .gpu-scope signal (FLAG_SCOPE_GPU), as the peers use
        blocks.append(sender.prepare(cfg, cs[i], offs, expert_offsets_host=off, count_ptrs=counts,
                                     rows_in_c=rows, same_gpu=True, into=sender.k.params_block()))
        sends.append(dict(cfg=cfg, c=cs[i], expert_offsets=offs, expert_offsets_host=off, count_ptrs=counts,
                          rows_in_c=rows))

    def send(i):   # the signal is on (counts are overwritten; only receivers need them re-armed)
        sender.launch(s, blocks[i % sets])

    # Diagnostic: the same kernel and bytes with identity routing (row r -> slot r of one
    # buffer, in order) separates the cost of the scatter pattern from the kernel's own. It
    # reads and writes the copy's buffers (rotated alike: neither stays in L2).
    dsts = [driver.DeviceBuffer(nbytes) for _ in range(sets)]
    ident_tab = driver.DeviceBuffer.from_array(encode_range_table(off, np.diff(off).reshape(-1, 1)))
    ident_src = driver.DeviceBuffer.from_array(np.stack([np.arange(rows) // a.top_k, np.arange(rows) % a.top_k],
                                                        1).astype(np.int32))
    iblks = []
    for i in range(sets):
        icfg = rank_config(n_ranks=1, recv_bufs=[dsts[i]], top_k=a.top_k, msg_bytes=msg, max_tokens=tokens,
                           range_table=ident_tab, src_info=ident_src)
        iblks.append(sender.prepare(icfg, cs[i], offs, expert_offsets_host=off, count_ptrs=counts[:1],
                                    rows_in_c=rows, same_gpu=True, into=sender.k.params_block()))
    from .peers import close_peers, time_peers   # the fair peers; bench-only code
    # the scatter ceiling's destinations: row r -> its rank's receive buffer, slot (src_idx, src_topk)
    slot = (src[:, 0].astype(np.uint64) * np.uint64(a.top_k) + src[:, 1].astype(np.uint64)) * np.uint64(msg)
    row_dsts = [driver.DeviceBuffer.from_array(np.array([b.ptr for b in recvs[i]], np.uint64)[dst] + slot)
                for i in range(sets)]
    # its control: row r -> row r of the copy's destination (the same kernel, the copy's order)
    ident_dsts = [driver.DeviceBuffer.from_array(dsts[i].ptr + np.arange(rows, dtype=np.uint64) * np.uint64(msg))
                  for i in range(sets)]
    best = {}
    found, peers_skipped = time_peers(timer, sends, (dsts, cs, nbytes), n_experts=a.experts, dev=dev,
                                      iters=a.iters, warmup=a.warmup, ceiling=(row_dsts, cs, rows, msg, ident_dsts),
                                      best=best)
    # the table's figures: every contender's fastest shape timed in turns with the send
    fns = {"p3_scatter_send": send, "send_identity_routing": lambda i: sender.launch(s, iblks[i % sets]),
           "d2d_copy": lambda i: driver.memcpy_dtod(dsts[i % sets].ptr, cs[i % sets].ptr, nbytes, s)}
    fns.update({k: fn for k, (fn, _) in best.items()})
    turns = timer.interleaved(fns, rounds=max(4, a.iters // 2), per_round=4, warmup=a.warmup)
    res = {k: dict(v, **{x: found[k][x] for x in ("config", "variant", "variants") if k in found})
           for k, v in turns.items()}
    close_peers(peer for _, peer in best.values())
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
           "send_over_copy": res["p3_scatter_send"]["median_us"] / copy_us, "peers_skipped": peers_skipped}
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
    for b in cs + [x for r in recvs for x in r] + counts + [rtab, srcb, offs, ident_tab, ident_src]:
        b.free()
    return sec


def bench_prefill(a, dev, rng, torch, out: dict, copy_stream: driver.Stream) -> None:
    sec = bench_send(a, dev, rng, torch, copy_stream, a.tokens, budget="budget" in a.only)
    if "budget" in sec:
        out["budget"] = sec.pop("budget")
    out["prefill"] = sec
    out["copy_TBps_rw"] = sec["results"]["d2d_copy"]["TBps_rw"]


def bench_decode(a, dev, rng, out: dict) -> None:
    from ..ops.combine import Combine
    from ..oracle.cases import world_case
    world = world_case(n_ranks=a.ranks, tokens=a.decode_tokens, top_k=a.top_k, n_local=a.experts,
                       hidden=a.hidden, seed=int(rng.integers(1 << 31)))
    comb = Combine(a.ranks, max_tokens=a.decode_tokens, top_k=a.top_k, hidden=a.hidden,
                   n_local_experts=a.experts, device=dev, stamps=False, guard=True)
    comb.load_world(world)
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
    from ..abi.layout import SENTINEL
    from ..oracle.cases import check_world, world_row_dst
    from .peers import REDUCE_VARIANTS, ROWS_VARIANTS, PeerUnavailable, ReduceCeiling, RowsCopy

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
    except PeerUnavailable as e:
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


def signal_latency(send_dev, recv_dev, msg: int, rows: int, num_sms: int, reps: int = 60,
             threads: int = ScatterSend.THREADS, clock_offset_ns: float = 0.0) -> dict:
    """``rows`` rows of one expert to one rank; the receiver (one token, on ``recv_dev``,
    one warp per 512-byte unit of the row, so every warp is spinning on the count when it
    lands) starts first, then the sender (on ``send_dev``) runs. Latency = the latest
    moment a receiver warp observed the count - the latest last-store stamp of the
    sender's CTAs, in %globaltimer ns; ``clock_offset_ns`` (receiver clock - sender clock)
    aligns two GPUs' timers."""
    same = send_dev.ordinal == recv_dev.ordinal
    recv_dev.activate()
    recv = driver.DeviceBuffer(rows * msg, fill=0xAB)
    counts = driver.DeviceBuffer(8, fill=0xFF)
    topk = driver.DeviceBuffer.from_array(np.zeros((1, 1), np.int32))
    w = driver.DeviceBuffer.from_array(np.ones((1, 1), np.float32))
    outb = driver.DeviceBuffer(msg, fill=0)
    recvk = RecvReduce(device=recv_dev)                  # one warp per unit: no warp reduces before its wait
    rst = driver.DeviceBuffer(32 * recvk.max_ctas, fill=0)
    sa = driver.Stream()
    send_dev.activate()
    c = driver.DeviceBuffer.from_array(np.full((rows, msg), 7, np.uint8))
    rtab = driver.DeviceBuffer.from_array(encode_range_table([0, rows], [[rows]]))
    src = driver.DeviceBuffer.from_array(np.stack([np.arange(rows), np.zeros(rows)], 1).astype(np.int32))
    sender = ScatterSend(1, device=send_dev, num_sms=num_sms, threads=threads)
    sst = driver.DeviceBuffer(16 * sender.grid, fill=0)
    sb = driver.Stream()
    cfg = rank_config(n_ranks=1, recv_bufs=[recv], top_k=1, msg_bytes=msg, max_tokens=rows, range_table=rtab,
                      src_info=src, send_stamps=sst)
    sender.prepare(cfg, c, np.array([0, rows], np.int32), count_ptrs=[counts], same_gpu=same)
    recvk.prepare(cfg, recv, counts, topk, w, outb, n_tokens=1, n_experts=1, timeout_ns=int(1e9), stamps=rst)
    lat = []
    for i in range(reps):
        sst.fill(0)
        rst.fill(0)
        recvk.launch(sa)
        time.sleep(0.0002)                         # let the receiver start spinning first
        sender.launch(sb)
        sa.synchronize()
        sb.synchronize()
        s_last = int(sst.download(np.uint64).reshape(-1, 2)[:, 1].max())
        r_seen = int(rst.download(np.uint64).reshape(-1, 4)[:, 1].max())
        if i >= 10 and s_last and r_seen:
            lat.append((r_seen - clock_offset_ns - s_last) / 1000.0)
    timeouts = recvk.record()["timeouts"]
    res = {"median_us": statistics.median(lat) if lat else None, "min_us": min(lat) if lat else None,
           "n": len(lat), "timeouts": timeouts, "rows": rows, "msg_bytes": msg, "sms": sender.grid,
           "threads": threads, "recv_warps": 8 * recvk.grid,
           "scope": "gpu" if same else "sys"}
    for b in (recv, counts, c, rtab, src, topk, w, outb, sst, rst):
        b.free()
    sender.close()
    recvk.close()
    return res


def bench_latency(a, dev, out: dict) -> None:
    msg = 2 * a.hidden
    out["signal_latency"] = signal_latency(dev, dev, msg, 1, 1, threads=32)          # one warp owns the pair
    out["signal_latency_shared"] = signal_latency(dev, dev, msg, 4096, dev.sm_count)  # last-arriver path
    out["signal_latency_16B"] = signal_latency(dev, dev, 16, 1, 1, threads=32)        # the ordering alone
    # host overhead: launches from Python with a prebuilt parameter block (a gated send)
    sender = ScatterSend(1, device=dev)
    c = driver.DeviceBuffer(16)
    blk = sender.prepare(P3PeerSendConfig.disabled(), c, np.array([0, 0], np.int32))
    sb = driver.Stream()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        sender.launch(sb, blk)
    host_us = (time.perf_counter() - t0) / n * 1e6
    sb.synchronize()
    out["host"] = {"launch_us": host_us, "n": n}
    c.free()
    sender.close()


def bench_epilogue(a, dev, rng, torch, out: dict) -> None:
    """Fused (fp32 accumulator tiles -> bf16 in shared memory -> peers, one kernel) against
    unfused (torch converts fp32 -> bf16 C in global memory, then p3_scatter_send), same
    routing and bytes, prefill shape."""
    n_cols, rows = a.hidden, a.tokens * a.top_k
    msg = 2 * n_cols
    off, table, src, _ = prefill_routing(a.tokens, a.ranks, a.top_k, a.experts, rng)
    if torch is not None:
        acc_t = torch.randn((rows, n_cols), dtype=torch.float32, device="cuda")
        c_t = torch.empty((rows, n_cols), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        acc = acc_t
    else:
        acc = driver.DeviceBuffer.from_array(rng.standard_normal((rows, n_cols)).astype(np.float32))
    recvs = [driver.DeviceBuffer(a.tokens * a.top_k * msg) for _ in range(a.ranks)]
    counts = [driver.DeviceBuffer(8 * a.experts * a.ranks, fill=0xFF) for _ in range(a.ranks)]
    rtab, srcb = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offs = driver.DeviceBuffer.from_array(off)
    cfg = rank_config(n_ranks=a.ranks, recv_bufs=recvs[:a.ranks], top_k=a.top_k, msg_bytes=msg, max_tokens=a.tokens,
                      range_table=rtab, src_info=srcb)
    s = driver.Stream()
    timer = Timer(s, hold=a.hold)
    cache = driver.DeviceBuffer(8 * rows, fill=0)       # the row cache: zeroed before every launch
    cfg.row_base_ptr = cache.ptr
    # Every receiver is on this GPU, so both sides signal at .gpu scope (as Combine does).
    kw = dict(expert_offsets_host=off, count_ptrs=counts, same_gpu=True)
    res, geo = {}, {}
    for g in EPILOGUE_GEOMETRIES:
        fused = EpilogueSend(a.experts, device=dev, **g)
        fblk = fused.prepare(cfg, acc, n_cols, offs, rows_in_acc=rows, **kw)
        name = "fused bm{bm} bn{bn} S{num_stages} N{send_warps} E{epilogue_warps}".format(**g)
        res[name] = timer.run(lambda i, fused=fused, fblk=fblk: fused.launch(s, fblk), a.iters, a.warmup)
        geo[name] = {**g, "threads": fused.threads, "grid": fused.grid}
        fused.close()
    best = min(res, key=lambda k: res[k]["median_us"])
    # the best geometry with the row cache on (zeroed before every launch, as the protocol asks)
    fused = EpilogueSend(a.experts, device=dev, **{k: geo[best][k] for k in EPILOGUE_GEOMETRIES[0]})
    cblk = fused.prepare(cfg, acc, n_cols, offs, rows_in_acc=rows, row_cache=True, **kw)

    def cached(i):
        cache.fill(0, s)
        fused.launch(s, cblk)
    res[f"diagnostic: {best} + row cache"] = timer.run(cached, a.iters, a.warmup)
    fused.close()
    if torch is not None:
        sender = ScatterSend(a.experts, device=dev)
        sblk = sender.prepare(cfg, c_t, offs, rows_in_c=rows, **kw)
        ts = torch.cuda.ExternalStream(int(s))

        def unfused(i):
            with torch.cuda.stream(ts):
                c_t.copy_(acc_t)          # fp32 -> bf16, round to nearest even
            sender.launch(s, sblk)
        res["unfused convert+send"] = timer.run(unfused, a.iters, a.warmup)
        sender.close()

        def convert(i):
            with torch.cuda.stream(ts):
                c_t.copy_(acc_t)
        res["diagnostic: the convert alone"] = timer.run(convert, a.iters, a.warmup)
    moved = rows * n_cols * 4 + rows * msg
    for v in res.values():
        v["TBps_rw"] = moved / (v["median_us"] * 1e-6) / 1e12
    out["epilogue"] = {"rows": rows, "n_cols": n_cols, "geometries": geo, "best": best, "results": res}
    if "unfused convert+send" in res:
        out["epilogue"]["fused_over_unfused"] = res[best]["median_us"] / res["unfused convert+send"]["median_us"]
    for b in recvs + counts + [rtab, srcb, offs, cache]:
        b.free()


#: Geometries of p3_epilogue_send measured side by side (the first is EpilogueSend's default).
EPILOGUE_GEOMETRIES = (
    dict(bm=16, bn=1024, num_stages=2, send_warps=1, epilogue_warps=2),
    dict(bm=32, bn=1024, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=16, bn=1024, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=8, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=512, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=1024, num_stages=4, send_warps=1, epilogue_warps=1),
    dict(bm=32, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=8, bn=2048, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=2, bn=7168, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=1024, num_stages=2, send_warps=0, epilogue_warps=1),
    dict(bm=8, bn=1024, num_stages=2, send_warps=0, epilogue_warps=2),
    dict(bm=32, bn=1024, num_stages=4, send_warps=2, epilogue_warps=2),
    dict(bm=16, bn=1024, num_stages=2, send_warps=1, epilogue_warps=1),
    dict(bm=16, bn=2048, num_stages=2, send_warps=2, epilogue_warps=2),
    dict(bm=32, bn=512, num_stages=2, send_warps=1, epilogue_warps=3),
    dict(bm=64, bn=512, num_stages=4, send_warps=4, epilogue_warps=4),
)


def clock_offset(d0, d1, reps: int = 30) -> dict:
    """p3_pingpong between two GPUs: the one-way flag latency (half the best round trip)
    and GPU1's %globaltimer minus GPU0's at that round trip."""
    from ..cuda.loader import kernel
    d1.activate()
    k1 = kernel("p3_pingpong", d1)
    ping, out1, s1 = driver.DeviceBuffer(4, fill=0), driver.DeviceBuffer(24, fill=0), driver.Stream()
    d0.activate()
    k0 = kernel("p3_pingpong", d0)
    pong, out0, s0 = driver.DeviceBuffer(4, fill=0), driver.DeviceBuffer(24, fill=0), driver.Stream()
    best = None
    for _ in range(reps):
        for b in (ping, pong, out0, out1):
            b.fill(0)
        k1.params_block(ping_ptr=ping, pong_ptr=pong, out=out1, timeout_ns=int(1e9), role=1).launch((1,), (32,), s1)
        time.sleep(0.0002)
        k0.params_block(ping_ptr=ping, pong_ptr=pong, out=out0, timeout_ns=int(1e9), role=0).launch((1,), (32,), s0)
        s0.synchronize()
        s1.synchronize()
        t0, t3, to0 = (int(x) for x in out0.download(np.uint64))
        t1, _, to1 = (int(x) for x in out1.download(np.uint64))
        if not (to0 or to1) and (best is None or t3 - t0 < best[0]):
            best = (t3 - t0, t1 - (t0 + t3) / 2)
    for b in (ping, pong, out0, out1):
        b.free()
    return {"flag_one_way_us": best[0] / 2000.0, "offset_ns": best[1]} if best else {"error": "ping-pong timed out"}


def bench_two_gpus(a, rng, torch, out: dict) -> None:
    """Sends from GPU0 into GPU1's receive buffer (and both ways at once) next to
    cuMemcpyPeerAsync of the same bytes, at the prefill and decode shapes, plus the
    cross-GPU signal latency on clocks aligned by p3_pingpong."""
    if driver.device_count() < 2:
        out["two_gpu"] = {"skipped": "needs two GPUs"}
        return
    d0, d1 = driver.device(0), driver.device(1)
    if not (d0.can_access_peer(d1) and d1.can_access_peer(d0)):
        out["two_gpu"] = {"skipped": "the two GPUs cannot access each other"}
        return
    d0.enable_peer_access(d1)
    d1.enable_peer_access(d0)
    msg, res = 2 * a.hidden, {}
    for label, tokens in (("prefill", a.tokens), ("decode", a.decode_tokens)):
        rows = tokens * a.top_k
        nbytes = rows * msg
        off = np.concatenate([[0], np.cumsum(_split_even(rows, a.experts))]).astype(np.int32)
        side = []
        for me, dev in ((0, d0), (1, d1)):
            c = random_bytes(nbytes, rng, torch, me)
            dev.activate()
            side.append({"dev": dev, "c": c, "recv": driver.DeviceBuffer(nbytes, fill=0xAB),
                         "counts": driver.DeviceBuffer(8 * a.experts * 2, fill=0xFF), "stream": driver.Stream()})
        for me, peer in ((0, 1), (1, 0)):
            sd = side[me]
            sd["dev"].activate()
            owned = np.zeros((a.experts, 2), np.int64)
            owned[:, peer] = np.diff(off)                  # every row goes to the other GPU
            sd["keep"] = [driver.DeviceBuffer.from_array(encode_range_table(off, owned)),
                          driver.DeviceBuffer.from_array(np.stack([np.arange(rows) // a.top_k,
                                                                   np.arange(rows) % a.top_k], 1).astype(np.int32))]
            cfg = rank_config(n_ranks=2, my_rank=me, recv_bufs=[side[0]["recv"], side[1]["recv"]], top_k=a.top_k,
                              msg_bytes=msg, max_tokens=tokens, range_table=sd["keep"][0], src_info=sd["keep"][1])
            sd["sender"] = ScatterSend(a.experts, device=sd["dev"])
            sd["sender"].prepare(cfg, sd["c"], off, count_ptrs=[side[0]["counts"], side[1]["counts"]])
        s0, s1 = side[0]["stream"], side[1]["stream"]

        def op(me: int, send: bool) -> None:
            # GPU me's direction on its stream: the send, or the peer copy of the same bytes
            sd, far = side[me], side[1 - me]
            if send:
                sd["sender"].launch(sd["stream"])
            else:
                driver.memcpy_peer(far["recv"].ptr, far["dev"], sd["c"].ptr, sd["dev"], nbytes, sd["stream"])

        d0.activate()
        timer = Timer(s0, hold=a.hold, device=d0)
        one = {"p3_scatter_send 0->1": timer.run(lambda i: op(0, True), a.iters, a.warmup),
               "cuMemcpyPeerAsync 0->1": timer.run(lambda i: op(0, False), a.iters, a.warmup)}

        def both(send: bool, legs: list):
            # legs[i]: events around each GPU's own op (GPU0's pair, GPU1's pair), made beforehand
            def run(i):
                leg = legs[i]
                fork.record(s0)           # GPU1's half starts with GPU0's, GPU0 waits for it
                d1.activate()
                s1.wait(fork)
                leg[2].record(s1)
                op(1, send)
                leg[3].record(s1)
                join.record(s1)
                d0.activate()
                leg[0].record(s0)
                op(0, send)
                leg[1].record(s0)
                s0.wait(join)
            return run

        def legs_of(n: int) -> list:
            out = [[None] * 4 for _ in range(n)]
            for dev, k in ((d0, 0), (d1, 2)):
                dev.activate()
                for leg in out:
                    leg[k], leg[k + 1] = driver.Event(), driver.Event()
            d0.activate()
            return out

        def own_times(legs: list) -> dict:
            # each direction's own op time while the other runs (events on its own GPU)
            us = [[1000.0 * leg[k].elapsed_ms(leg[k + 1]) for leg in legs] for k in (0, 2)]
            for leg in legs:
                for e in leg:
                    e.close()
            t0, t1 = statistics.median(us[0]), statistics.median(us[1])
            return {"0->1_us": t0, "1->0_us": t1, "GBps": nbytes / (t0 * 1e-6) / 1e9 + nbytes / (t1 * 1e-6) / 1e9}
        d0.activate()
        fork = driver.Event(timing=False)
        d1.activate()
        join = driver.Event(timing=False)
        d0.activate()
        n = max(a.iters, a.warmup)
        legs = {True: legs_of(n), False: legs_of(n)}
        one["p3_scatter_send both ways"] = timer.run(both(True, legs[True]), a.iters, a.warmup)
        one["cuMemcpyPeerAsync both ways"] = timer.run(both(False, legs[False]), a.iters, a.warmup)
        own = {"send": own_times(legs[True]), "copy": own_times(legs[False])}
        for k, v in one.items():
            moved = nbytes * (2 if "both" in k else 1)
            v["GBps"] = moved / (v["median_us"] * 1e-6) / 1e9
        one["send_over_peer_copy_bw"] = one["p3_scatter_send 0->1"]["GBps"] / one["cuMemcpyPeerAsync 0->1"]["GBps"]
        one["both_send_over_peer_copy_bw"] = (one["p3_scatter_send both ways"]["GBps"]
                                              / one["cuMemcpyPeerAsync both ways"]["GBps"])
        one["both ways, own op times"] = own
        one["both_own_send_over_peer_copy_bw"] = own["send"]["GBps"] / own["copy"]["GBps"]
        res[label] = {"rows": rows, "bytes": nbytes, **one}
        for sd in side:
            sd["dev"].activate()
            sd["sender"].close()
            for b in [sd["c"], sd["recv"], sd["counts"], *sd["keep"]]:
                b.free()
    clock = clock_offset(d0, d1)
    res["clock"] = clock
    if "offset_ns" in clock:
        res["signal_latency"] = signal_latency(d0, d1, msg, 1, 1, threads=32, clock_offset_ns=clock["offset_ns"])
        res["signal_latency_16B"] = signal_latency(d0, d1, 16, 1, 1, threads=32, clock_offset_ns=clock["offset_ns"])
    out["two_gpu"] = res
    d0.activate()


def _split_even(total: int, parts: int) -> np.ndarray:
    base = np.full(parts, total // parts, np.int64)
    base[: total % parts] += 1
    return base


def table(out: dict) -> str:
    L = [f"p3send bench on {out['device']} ({out['sm_count']} SMs), {out['date']}"]
    for key, title, target in (("prefill", "1. prefill send", 1.03),
                               ("decode_send", "1b. one rank's decode-size send", 1.10)):
        if key not in out:
            continue
        p = out[key]
        L.append(f"\n{title}: {p['rows']} rows x {p['msg_bytes']} B = {p['bytes'] / 1e6:.1f} MB, 8 receive buffers "
                 f"on this GPU, inputs rotated over {p['sets']} sets (median us, TB/s counting read+write, / copy)")
        copy_us = p["results"]["d2d_copy"]["median_us"]
        for k, v in p["results"].items():
            cfg = f"   [{v['config']}]" if "config" in v else ""
            L.append(f"   {k:<24} {v['median_us']:9.2f} us  {v['TBps_rw']:6.2f} TB/s  "
                     f"{v['median_us'] / copy_us:6.3f}x{cfg}")
        for k, why in p.get("peers_skipped", {}).items():
            L.append(f"   {k:<24} skipped: {why}")
        peers = [v["median_us"] for k, v in p["results"].items() if k.endswith("scatter peer")]
        vs = f", best peer / send {min(peers) / p['results']['p3_scatter_send']['median_us']:.3f}x" if peers else ""
        L.append(f"   send / copy              {p['send_over_copy']:.3f}x   (target <= {target}){vs}")
        if "index_copy_over_send" in p:
            L.append(f"   index_copy_ / send       {p['index_copy_over_send']:.2f}x")
    if "budget" in out:
        L.append("\n2. SM budget (send, prefill shape)")
        for n, v in out["budget"].items():
            L.append(f"   {n:>4} SMs  {v['median_us']:9.1f} us  {v['TBps_rw']:6.2f} TB/s")
    if "decode" in out:
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
    if "signal_latency" in out:
        s, t = out["signal_latency"], out.get("signal_latency_shared")
        L.append(f"\n4. signal latency (last store -> observed, kernels concurrent): median {s['median_us']:.2f} us, "
                 f"min {s['min_us']:.2f} us over {s['n']} (1-row pair sent by one warp) (target <= 2)")
        if t:
            L.append(f"   {t['rows']}-row pair over {t['sms']} SMs x {t['threads']} threads (last-arriver path): "
                     f"median {t['median_us']:.2f} us, "
                     f"min {t['min_us']:.2f} us")
        if "signal_latency_16B" in out:
            u = out["signal_latency_16B"]
            L.append(f"   1-row pair of 16 B (the release/acquire alone): median {u['median_us']:.2f} us, "
                     f"min {u['min_us']:.2f} us")
    if "host" in out or "decode" in out:
        h, d = out.get("host", {}), out.get("decode", {})
        launch = f"{h['launch_us']:.2f} us per launch (prebuilt params)" if "launch_us" in h else \
            "per launch: needs the host section"
        replay = (f"{d['graph_replay_host_us']:.2f} us per graph replay of the decode round"
                  if "graph_replay_host_us" in d else "per graph replay: needs the decode section")
        L.append(f"\n5. host: {launch}, {replay} (target <= 10 us per launch)")
    if "epilogue" in out:
        e = out["epilogue"]
        L.append(f"\n6. in-epilogue send, prefill shape ({e['rows']} rows x {e['n_cols']} fp32 -> bf16 peers, "
                 f"8 ranks on this GPU, .gpu-scope signal; TB/s counts fp32 read + bf16 write)")
        for k, v in e["results"].items():
            L.append(f"   {k:<36} {v['median_us']:9.1f} us  {v['TBps_rw']:6.2f} TB/s")
        if "fused_over_unfused" in e:
            L.append(f"   best fused / unfused     {e['fused_over_unfused']:.3f}x   (target <= 0.70): {e['best']}")
            conv = e["results"]["diagnostic: the convert alone"]["median_us"]
            best = e["results"][e["best"]]["median_us"]
            L.append(f"   best fused / the convert alone (same bytes, no send)  {best / conv:.3f}x")
    if "two_gpu" in out:
        t = out["two_gpu"]
        if "skipped" in t:
            L.append(f"\n7. two GPUs: skipped ({t['skipped']})")
        else:
            L.append("\n7. two GPUs over the peer link (GB/s of payload)")
            for label in ("prefill", "decode"):
                r = t[label]
                L.append(f"   {label}: {r['rows']} rows, {r['bytes'] / 1e6:.1f} MB each way")
                for k in ("p3_scatter_send 0->1", "cuMemcpyPeerAsync 0->1", "p3_scatter_send both ways",
                          "cuMemcpyPeerAsync both ways"):
                    L.append(f"     {k:<30} {r[k]['median_us']:9.1f} us  {r[k]['GBps']:7.1f} GB/s")
                L.append(f"     send / peer copy bandwidth   {r['send_over_peer_copy_bw']:.3f} one way, "
                         f"{r['both_send_over_peer_copy_bw']:.3f} both ways (target >= 0.85)")
                if "both ways, own op times" in r:
                    o = r["both ways, own op times"]
                    L.append(f"     diagnostic, both ways, each GPU's own op (its events): send "
                             f"{o['send']['0->1_us']:.1f} / {o['send']['1->0_us']:.1f} us, copy "
                             f"{o['copy']['0->1_us']:.1f} / {o['copy']['1->0_us']:.1f} us -> "
                             f"{r['both_own_send_over_peer_copy_bw']:.3f}")
            c = t["clock"]
            if "flag_one_way_us" in c:
                L.append(f"   flag one way (p3_pingpong) {c['flag_one_way_us']:.2f} us; GPU1-GPU0 clock offset "
                         f"{c['offset_ns'] / 1000:.2f} us")
            if "signal_latency" in t:
                sl = t["signal_latency"]
                L.append(f"   signal latency GPU0 -> GPU1 (1-row pair, .sys scope): median {sl['median_us']:.2f} us, "
                         f"min {sl['min_us']:.2f} us (target <= 3)")
            if "signal_latency_16B" in t:
                sl = t["signal_latency_16B"]
                L.append(f"   signal latency GPU0 -> GPU1, 1-row pair of 16 B: median {sl['median_us']:.2f} us, "
                         f"min {sl['min_us']:.2f} us")
    if "gemm" in out:
        from .bench_gemm import table as gemm_table
        L.append(gemm_table(out))
    for k, v in out.get("extra", {}).items():
        L.append(f"\n{k}: {v}")
    return "\n".join(L)


def main(args) -> int:
    from .app import check_output_path
    from .demo import check_world_arguments
    check_world_arguments(args)            # the shape rules the GPU path applies, before any work
    check_output_path(args.json, "--json")
    ok, why = driver.available()
    if not ok:
        print(f"p3send bench: no usable GPU here ({why}); nothing to measure.")
        return 0
    args.only = args.only or list(SECTIONS)
    dev = driver.device()
    seed = args.seed if args.seed is not None else int(time.time())
    rng = np.random.default_rng(seed)
    torch = _torch()
    out = {"device": dev.name, "sm_count": dev.sm_count, "cc": dev.cc, "seed": seed,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args).copy()}
    out["args"].pop("func", None)
    s = driver.Stream()
    if "prefill" in args.only or "budget" in args.only:
        bench_prefill(args, dev, rng, torch, out, s)
    if "decode_send" in args.only:
        out["decode_send"] = bench_send(args, dev, rng, torch, s, args.decode_tokens)
    if "decode" in args.only:
        bench_decode(args, dev, rng, out)
    if "latency" in args.only or "host" in args.only:
        bench_latency(args, dev, out)
    if "epilogue" in args.only:
        bench_epilogue(args, dev, rng, torch, out)
    if "gemm" in args.only:
        from .bench_gemm import bench_gemm
        bench_gemm(args, dev, rng, torch, out)
    if "two_gpu" in args.only:
        bench_two_gpus(args, rng, torch, out)
    text = table(out)
    print(text)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    return 0
