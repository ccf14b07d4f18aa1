"""Sections ``latency`` (4) and ``host`` (5): the arrival signal's latency (last store ->
observed by a spinning receiver, %globaltimer stamps) and the host's cost per launch.
``signal_latency`` also serves the two-GPU section."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ..abi.config import P3PeerSendConfig, rank_config
from ..abi.layout import encode_range_table
from ..cuda import driver
from ..ops.recv import RecvReduce
from ..ops.send import ScatterSend


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
    table_buf = driver.DeviceBuffer.from_array(encode_range_table([0, rows], [[rows]]))
    src = driver.DeviceBuffer.from_array(np.stack([np.arange(rows), np.zeros(rows)], 1).astype(np.int32))
    sender = ScatterSend(1, device=send_dev, num_sms=num_sms, threads=threads)
    sst = driver.DeviceBuffer(16 * sender.grid, fill=0)
    sb = driver.Stream()
    cfg = rank_config(n_ranks=1, recv_bufs=[recv], top_k=1, msg_bytes=msg, max_tokens=rows, range_table=table_buf,
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
    for b in (recv, counts, c, table_buf, src, topk, w, outb, sst, rst):
        b.free()
    sender.close()
    recvk.close()
    return res


def run_latency(ctx, out: dict) -> None:
    """Section ``latency``: the signal latency on this GPU, for a 1-row pair sent by one warp,
    a 4,096-row pair over every SM (the last-arriver path) and a 1-row pair of 16 bytes."""
    msg, dev = 2 * ctx.args.hidden, ctx.dev
    out["signal_latency"] = signal_latency(dev, dev, msg, 1, 1, threads=32)          # one warp owns the pair
    out["signal_latency_shared"] = signal_latency(dev, dev, msg, 4096, dev.sm_count)  # last-arriver path
    out["signal_latency_16B"] = signal_latency(dev, dev, 16, 1, 1, threads=32)        # the ordering alone


def run_host(ctx, out: dict) -> None:
    """Section ``host``: the host's cost per launch from Python with a prebuilt parameter
    block (a gated send: nothing to move)."""
    sender = ScatterSend(1, device=ctx.dev)
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


def table_latency(out: dict) -> str:
    if "signal_latency" not in out:
        return ""
    s, t = out["signal_latency"], out.get("signal_latency_shared")
    L = [f"\n4. signal latency (last store -> observed, kernels concurrent): median {s['median_us']:.2f} us, "
         f"min {s['min_us']:.2f} us over {s['n']} (1-row pair sent by one warp) (target <= 2)"]
    if t:
        L.append(f"   {t['rows']}-row pair over {t['sms']} SMs x {t['threads']} threads (last-arriver path): "
                 f"median {t['median_us']:.2f} us, min {t['min_us']:.2f} us")
    if "signal_latency_16B" in out:
        u = out["signal_latency_16B"]
        L.append(f"   1-row pair of 16 B (the release/acquire alone): median {u['median_us']:.2f} us, "
                 f"min {u['min_us']:.2f} us")
    return "\n".join(L)


def table_host(out: dict) -> str:
    """The host's costs: per launch (this section) and per graph replay (the decode section's)."""
    if "host" not in out and "decode" not in out:
        return ""
    h, d = out.get("host", {}), out.get("decode", {})
    launch = (f"{h['launch_us']:.2f} us per launch (prebuilt params)" if "launch_us" in h
              else "per launch: needs the host section")
    replay = (f"{d['graph_replay_host_us']:.2f} us per graph replay of the decode round"
              if "graph_replay_host_us" in d else "per graph replay: needs the decode section")
    return f"\n5. host: {launch}, {replay} (target <= 10 us per launch)"
