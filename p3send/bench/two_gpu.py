"""Section ``two_gpu`` (7): the send over the peer link between two GPUs against
``cuMemcpyPeerAsync``, one way and both ways at once, and the cross-GPU signal latency on
clocks aligned by ``p3_pingpong`` (``clock_offset``)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..abi.config import rank_config
from ..abi.layout import encode_range_table
from ..cuda import driver
from ..cuda.loader import kernel
from ..ops.send import ScatterSend
from .data import random_bytes, split_even
from .latency import signal_latency
from .timing import Timer


def clock_offset(d0, d1, reps: int = 30) -> dict:
    """p3_pingpong between two GPUs: the one-way flag latency (half the best round trip)
    and GPU1's %globaltimer minus GPU0's at that round trip."""
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


def run(ctx, out: dict) -> None:
    """Section ``two_gpu``: sends from GPU0 into GPU1's receive buffer (and both ways at
    once) next to cuMemcpyPeerAsync of the same bytes, at the prefill and decode shapes, plus
    the cross-GPU signal latency on clocks aligned by p3_pingpong."""
    a, rng, torch = ctx.args, ctx.rng, ctx.torch
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
        off = np.concatenate([[0], np.cumsum(split_even(rows, a.experts))]).astype(np.int32)
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


def table(out: dict) -> str:
    if "two_gpu" not in out:
        return ""
    L = []
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
    return "\n".join(L)
