"""Maintainer experiment, not maintained (experiments/README.md): the shipped p3_scatter_send
in launch shapes its launcher does not use by default, or another version of its PTX, timed
one after another on the same inputs (sequentially, not in turns: compare within one run).

    python3 experiments/send_variants.py                       # prefill shape, 8 ranks on one GPU
    python3 experiments/send_variants.py --variant tile         # only the shapes naming "tile"
    python3 experiments/send_variants.py --tokens 128 --sets 8  # decode-size send, C rotated past L2
    python3 experiments/send_variants.py --tokens 128 --sets 8 --rotate-recv   # ... and the receive buffers
    python3 experiments/send_variants.py --ptx old=OLD.ptx      # another p3_scatter_send.ptx beside the shipped
    python3 experiments/send_variants.py --peer --tokens 128    # decode shape, GPU 0 -> GPU 1
    python3 experiments/send_variants.py --decode               # one-GPU decode round: SM shares, receive CTAs
    python3 experiments/send_variants.py --decode --recv-ptx F  # ... with another p3_recv_reduce.ptx

The textual variants of the kernels measured in docs/PERF.md and not kept were built by
earlier versions of this script (tools/send_variants.py; PERF.md names the commits)."""
from __future__ import annotations

import argparse

import numpy as np

from p3send.abi.config import rank_config
from p3send.abi.layout import encode_range_table
from p3send.bench.data import random_bytes
from p3send.bench.timing import Timer
from p3send.cuda import driver, loader
from p3send.ops.send import ScatterSend
from p3send.oracle.cases import prefill_routing

BASE = (loader.ptx_dir() / "p3_scatter_send.ptx").read_text()


def shapes() -> dict:
    """NAME -> launch options of the shipped kernel: "tile" (the tile launch), "tile_threads"
    and "TILE_VECTORS" (its CTA shape), "signal" (False: no counts), "threads" and "grid"."""
    v = {"baseline": {"tile": True}, "tile, no signal": {"tile": True, "signal": False}}
    for thr, vec in ((128, 4), (128, 2), (256, 4), (256, 8), (256, 2), (64, 8), (512, 2), (128, 1)):
        v[f"tile {vec} vec/thr x {thr}"] = {"tile": True, "tile_threads": thr, "TILE_VECTORS": vec}
    v["tile 4 vec/thr x 256, no signal"] = {"tile": True, "tile_threads": 256, "TILE_VECTORS": 4, "signal": False}
    v["persistent 132 x 1024 (num_sms = all, no tiles)"] = {}
    v["persistent, no signal"] = {"signal": False}
    return v


def run_decode(a, dev) -> None:
    from p3send.ops.combine import Combine
    from p3send.oracle.cases import world_case
    world = world_case(n_ranks=8, tokens=128, top_k=8, n_local=32, hidden=7168, seed=1)
    n = dev.sm_count
    for share, recv_ctas in ((None, None), (n // 4, None), (n, None), (n, n // 8), (n, n // 4), (n, n),
                             (None, 4 * n), (n, 4 * n)):
        comb = Combine(8, max_tokens=128, top_k=8, hidden=7168, n_local_experts=32, device=dev,
                       stamps=False, num_sms=share)
        if a.send_ptx:   # another version of p3_scatter_send.ptx
            k = loader.load(open(a.send_ptx).read(), device=dev, name="send variant")["p3_scatter_send"]
            driver.set_max_dynamic_smem(k.func, ScatterSend.SMEM_PER_THREAD * ScatterSend.THREADS)
            for snd in comb.senders:
                snd.k, snd.block = k, k.params_block()
        for r in comb.receivers:
            r.max_ctas = recv_ctas or r.max_ctas
            if a.recv_ptx:   # another version of p3_recv_reduce.ptx
                r.k = loader.load(open(a.recv_ptx).read(), device=dev)["p3_recv_reduce"]
                r.block = r.k.params_block()
        comb.load(world)
        for r, snd in enumerate(comb.senders):   # the rows known on the host: the tile grid's size
            snd.tile_launch = True
            snd.prepare(comb.cfgs[r], comb.c[r], comb.expert_offsets[r], count_ptrs=[comb.counts[p] for p in range(8)],
                        rows_in_c=comb.max_rows, same_gpu=True, expert_offsets_host=world.ranks[r].expert_offsets)
        comb.round()
        times = {}
        for label, kw in (("round", {}), ("sends only", {"receive": False})):
            graph = comb.capture(**kw)
            times[label] = Timer(comb.origin).run(lambda i: graph.launch(comb.origin), 4 * a.iters, 10)["median_us"]
            graph.close()
        comb.round()
        snd0 = comb.senders[0]
        shape = snd0.block.launch_shape or (snd0.grid, snd0.threads, snd0.smem)
        print(f"decode: send SMs/rank {comb.senders[0].grid:>3} (launch {shape[0]} x {shape[1]}), "
              f"receive CTAs/rank {comb.receivers[0].grid:>3}: "
              f"round {times['round']:.1f} us, sends only {times['sends only']:.1f} us")
        comb.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (rows = tokens x 8)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=8, help="receiving ranks (one buffer each, on this GPU)")
    ap.add_argument("--sets", type=int, default=1, help="copies of C read in turn (8 x 14.7 MB leaves L2)")
    ap.add_argument("--rotate-recv", action="store_true", help="with --sets: as many receive-buffer sets, in turn")
    ap.add_argument("--peer", action="store_true",
                    help="send from GPU 0 into GPU 1 (every row remote) against cuMemcpyPeerAsync")
    ap.add_argument("--decode", action="store_true", help="one-GPU decode round: SM shares, receive CTAs")
    ap.add_argument("--recv-ptx", default=None, help="with --decode: this version of p3_recv_reduce.ptx")
    ap.add_argument("--send-ptx", default=None, help="with --decode: this version of p3_scatter_send.ptx")
    ap.add_argument("--variant", action="append", default=[], help="only shapes naming this (and the baseline)")
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE[@GRIDxTHREADS]",
                    help="also time FILE, another version of p3_scatter_send.ptx, as NAME (GRID 0: the launcher's)")
    a = ap.parse_args()
    dev = driver.device()
    if a.decode:
        run_decode(a, dev)
        return 0
    rng = np.random.default_rng(1)
    hidden, top_k, ranks, experts = 7168, 8, a.ranks, 32
    msg, rows = 2 * hidden, a.tokens * top_k
    # --sets N: N copies of C, launch i reading copy i mod N (as the bench rotates its inputs past L2)
    cs = [random_bytes(rows * msg, rng) for _ in range(a.sets)]
    keep = []
    if a.peer:
        peer = driver.device(1)
        dev.enable_peer_access(peer)
        peer.enable_peer_access(dev)
        ranks = 2
        off = np.concatenate([[0], np.cumsum(np.full(experts, rows // experts))]).astype(np.int32)
        owned = np.zeros((experts, 2), np.int64)
        owned[:, 1] = np.diff(off)
        table = encode_range_table(off, owned)
        src = np.stack([np.arange(rows) // top_k, np.arange(rows) % top_k], 1).astype(np.int32)
        peer.activate()
        far = [driver.DeviceBuffer(rows * msg), driver.DeviceBuffer(8 * experts * ranks, fill=0xFF)]
        dev.activate()
        near = [driver.DeviceBuffer(rows * msg), driver.DeviceBuffer(8 * experts * ranks, fill=0xFF)]
        recv_ptrs, counts = [near[0].ptr, far[0].ptr], [near[1], far[1]]
        keep += near + far
    else:
        off, table, src, _ = prefill_routing(a.tokens, ranks, top_k, experts, rng)
        recvs = [driver.DeviceBuffer(a.tokens * top_k * msg) for _ in range(ranks * (a.sets if a.rotate_recv else 1))]
        counts = [driver.DeviceBuffer(8 * experts * ranks, fill=0xFF) for _ in range(ranks)]
        recv_ptrs = [b.ptr for b in recvs[:ranks]]
        keep += recvs + counts
    table_buf, src_buf = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offsets = driver.DeviceBuffer.from_array(off)
    cfg = rank_config(n_ranks=ranks, recv_bufs=recv_ptrs, top_k=top_k, msg_bytes=msg, max_tokens=a.tokens,
                      range_table=table_buf, src_info=src_buf)
    # --rotate-recv: launch i also writes receive-buffer set i mod sets (as the bench does)
    cfgs = [cfg] + [rank_config(n_ranks=ranks, recv_bufs=[b.ptr for b in recvs[j * ranks:(j + 1) * ranks]],
                                top_k=top_k, msg_bytes=msg, max_tokens=a.tokens, range_table=table_buf,
                                src_info=src_buf)
                    for j in range(1, a.sets if a.rotate_recv and not a.peer else 1)]
    s = driver.Stream()
    timer = Timer(s)
    if a.peer:
        ref_name = "cuMemcpyPeerAsync"
        ref = timer.run(lambda i: driver.memcpy_peer(far[0].ptr, peer, cs[i % a.sets].ptr, dev, rows * msg, s),
                        a.iters, 5)["median_us"]
    else:
        ref_name = "d2d copy"
        dst = driver.DeviceBuffer(rows * msg)
        keep.append(dst)
        ref = timer.run(lambda i: driver.memcpy_dtod(dst.ptr, cs[i % a.sets].ptr, rows * msg, s), a.iters,
                        5)["median_us"]
    print(f"{rows} rows x {msg} B{' GPU0 -> GPU1' if a.peer else ''}: {ref_name} {ref:.1f} us")
    todo = {name: (BASE, opt) for name, opt in shapes().items()}
    for spec in a.ptx:
        name, _, rest = spec.partition("=")
        path, _, shape = rest.partition("@")      # NAME=FILE[@GRIDxTHREADS] (GRID 0: the launcher's own)
        opt = {"tile": True}
        if shape:
            g, t = (int(x) for x in shape.split("x"))
            opt = {"threads": t, **({"grid": g} if g else {})}
        todo[name] = (open(path).read(), opt)
        todo[name + ", no signal"] = (todo[name][0], {**opt, "signal": False})
    for name, (text, opt) in todo.items():
        if a.variant and name != "baseline" and not any(v in name for v in a.variant):
            continue
        threads = opt.get("threads", 1024)
        sender = ScatterSend(experts, device=dev, threads=threads)
        if text is not BASE:
            sender.k = loader.load(text, device=dev, name=f"variant {name}")["p3_scatter_send"]
            driver.set_max_dynamic_smem(sender.k.func, max(sender.smem, 192 * 1024))
        sender.tile_launch = bool(opt.get("tile"))
        for attr in ("tile_threads", "TILE_VECTORS"):
            if attr in opt:
                setattr(sender, attr, opt[attr])
        blks = [sender.prepare(cfgs[j % len(cfgs)], cc, offsets, expert_offsets_host=off, rows_in_c=rows,
                               count_ptrs=counts if opt.get("signal", True) else None,
                               into=sender.k.params_block()) for j, cc in enumerate(cs)]
        if not opt.get("tile") or "grid" in opt:   # the persistent kernel's shapes; tile shapes keep the launcher's
            for b in blks:
                b.launch_shape = (opt.get("grid", dev.sm_count), threads, sender.smem)
        t = timer.run(lambda i: sender.launch(s, blks[i % a.sets]), a.iters, 5)
        g, thr, sm = blks[0].launch_shape or (sender.grid, sender.threads, sender.smem)
        print(f"{name:<24} {t['median_us']:8.1f} us  {t['median_us'] / ref:.3f}x {ref_name}  "
              f"(min {t['min_us']:.1f}, regs {sender.k.num_regs}, grid {g} x {thr}, smem {sm})")
        sender.close()
    for b in keep + cs + [table_buf, src_buf, offsets]:
        b.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
