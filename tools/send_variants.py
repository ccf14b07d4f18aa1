"""Maintainer experiment: time textual variants of p3_scatter_send side by side at the
prefill shape (one run, same inputs), to test performance hypotheses before changing
the shipped kernel. Variants are the shipped PTX with one change each; not shipped."""
from __future__ import annotations

import argparse
import re

import numpy as np

from p3send import P3PeerSendConfig, driver, kernels
from p3send.bench import Timer, _random_bytes, prefill_routing
from p3send.kernels import ScatterSend

BASE = (kernels.ptx_dir() / "p3_scatter_send.ptx").read_text()


def variants():
    v = {"baseline": (BASE, {})}
    v["no_signal"] = (BASE, {"signal": False})
    v["st.cs"] = (BASE.replace("st.global.v4.u32    [%u1]", "st.global.cs.v4.u32 [%u1]"), {})
    v["cp.async L2::256B"] = (BASE.replace("cp.async.cg.shared.global [", "cp.async.cg.shared.global.L2::256B ["), {})
    v["512thr x 2/SM"] = (BASE, {"threads": 512, "grid_mult": 2})
    v["gpu-scope fences"] = (re.sub(r"(fence\.acq_rel|st\.release)\.sys", r"\1.gpu", BASE), {})
    return v


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=40)
    a = ap.parse_args()
    dev = driver.device()
    rng = np.random.default_rng(1)
    hidden, top_k, ranks, experts = 7168, 8, 8, 32
    msg, rows = 2 * hidden, a.tokens * top_k
    off, table, src, _ = prefill_routing(a.tokens, ranks, top_k, experts, rng)
    c = _random_bytes(rows * msg, rng)
    recvs = [driver.DeviceBuffer(a.tokens * top_k * msg) for _ in range(ranks)]
    counts = [driver.DeviceBuffer(8 * experts * ranks, fill=0xFF) for _ in range(ranks)]
    rtab, srcb = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    offs = driver.DeviceBuffer.from_array(off)
    cfg = P3PeerSendConfig.disabled()
    cfg.atomic_counter, cfg.src_info_ptr = rtab.ptr, srcb.ptr
    cfg.recv_buf_ptrs = [recvs[p].ptr for p in range(8)]
    cfg.n_ranks = cfg.p2p_world_size = ranks
    cfg.top_k, cfg.msg_bytes, cfg.max_tokens_per_rank = top_k, msg, a.tokens
    s = driver.Stream()
    timer = Timer(s)
    dst = driver.DeviceBuffer(rows * msg)
    copy = timer.run(lambda i: driver.memcpy_dtod(dst.ptr, c.ptr, rows * msg, s), a.iters, 5)["median_us"]
    print(f"d2d copy: {copy:.1f} us")
    for name, (text, opt) in variants().items():
        threads = opt.get("threads", 1024)
        sender = ScatterSend(experts, device=dev, threads=threads)
        sender.k = kernels.load(text, device=dev, name=f"variant {name}")["p3_scatter_send"]
        driver.set_max_dynamic_smem(sender.k.func, sender.smem)
        sender.grid = dev.sm_count * opt.get("grid_mult", 1)
        blk = sender.prepare(cfg, c, offs, expert_offsets_host=off, rows_in_c=rows,
                             count_ptrs=counts if opt.get("signal", True) else None,
                             into=sender.k.params_block())
        t = timer.run(lambda i: sender.launch(s, blk), a.iters, 5)
        print(f"{name:<20} {t['median_us']:8.1f} us  {t['median_us'] / copy:.3f}x copy  "
              f"(min {t['min_us']:.1f}, regs {sender.k.num_regs})")
        sender.close()
    # signal latency (one-warp pair, kernels concurrent) of the fence-scope variants
    from p3send import bench
    orig = kernels.kernel
    for name in ("baseline", "gpu-scope fences"):
        k = kernels.load(variants()[name][0], device=dev, name=f"variant {name}")["p3_scatter_send"]
        kernels.kernel = lambda entry, device=None, k=k: k if entry == "p3_scatter_send" else orig(entry, device)
        try:
            lat = bench._latency(dev, msg, 1, 1, threads=32)
        finally:
            kernels.kernel = orig
        print(f"latency {name:<20} median {lat['median_us']:.2f} us, min {lat['min_us']:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
