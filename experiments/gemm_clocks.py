"""Maintainer experiment, not maintained (experiments/README.md): is the FP8 GEMM's gap to
DeepGEMM (docs/PERF.md, "The FP8 down-projection") one of cycles or of clocks? Runs the gated
FP8 GEMM as GroupedGemmFp8Send launches it, any variants named with --ptx, and DeepGEMM's
contiguous GEMM at the bench's prefill and 8 x 4,096 shapes (section gemm_fp8's inputs), each
in bursts of back-to-back launches (--burst-ms), the contenders in turns (A B C A B C ...,
--turns times), while ``nvidia-smi`` samples the SM clock, the board power and the clock event
reasons every 20 ms. Per contender: the median time a launch (CUDA events around a burst,
over its launches), the median SM clock and power over the samples inside its bursts (the
first 100 ms of each burst left out: the clock settles), the cycles a launch (time x clock)
and the event reasons seen. Every contender's C is checked against the shipped kernel's
first (bit for bit for p3send's; DeepGEMM's largest difference is printed).

    PYTHONPATH=.:/tmp/dg DG_JIT_CACHE_DIR=/tmp/dg/cache DG_JIT_NVCC_COMPILER=/tmp/dg/nvcc \\
        python3 experiments/gemm_clocks.py [--shape prefill --shape 8x4096] [--ptx NAME=FILE:THREADS:SMEM]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile
import time

import numpy as np

from p3send.abi.config import rank_config
from p3send.bench.gemm_fp8 import SHAPES, _deep_gemm, gemm_inputs, rows_per_expert
from p3send.cuda import driver
from p3send.ops.gemm_fp8 import GroupedGemmFp8Send
from p3send.ops.quant import QuantFp8
from p3send.oracle import fp8 as ref8

N, K = 7168, 2048
QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu"
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal",
           0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


def inputs(torch, name: str, seed: int):
    """The section's inputs at ``name`` (gemm_inputs), A quantised by p3_quant_fp8."""
    rpe = rows_per_expert(name)
    off, m_idx = ref8.contiguous_layout(rpe)
    _, x, aq, sa, bw, sb = gemm_inputs(torch, seed, int(off[-1]), len(rpe), N, K)
    QuantFp8(driver.device())(x, aq, sa)
    torch.cuda.synchronize()
    return rpe, off, m_idx, aq, sa, bw, sb


def sampler(f) -> subprocess.Popen:
    """nvidia-smi writing a CSV line of QUERY into file ``f`` every 20 ms until terminated."""
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20"],
                            stdout=f, stderr=subprocess.DEVNULL)


def samples(path: str) -> list[tuple[float, float, float, int]]:
    """(epoch seconds, SM MHz, W, reasons bitmask) of every parseable line."""
    out = []
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        p = [v.strip() for v in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(p[1]), float(p[2]), int(p[3], 16)))
        except (ValueError, IndexError):
            continue
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=[s for s in SHAPES if s != "decode"])
    ap.add_argument("--ptx", action="append", default=[], metavar="NAME=FILE:THREADS:SMEM",
                    help="a variant of p3_gemm_fp8_send (inlined, at its launch shape)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--burst-ms", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    a = ap.parse_args()
    import torch
    dev = driver.device()
    s = driver.Stream()
    ts = torch.cuda.ExternalStream(int(s))
    dg, why = _deep_gemm()
    print(f"seed {a.seed}; {dev.name}; DeepGEMM: {'present' if dg else why}")
    for name in a.shape or ["prefill", "8x4096"]:
        rpe, off, m_idx, aq, sa, bw, sb = inputs(torch, name, a.seed)
        E, rows, real = len(rpe), int(off[-1]), int(rpe.sum())
        offsets = driver.DeviceBuffer.from_array(off)
        recv = driver.DeviceBuffer(16 * N)
        cfg = rank_config(n_ranks=1, recv_bufs=[recv], top_k=1, msg_bytes=2 * N, max_tokens=8)
        fns, cs, closers = {}, {}, []
        gems = [("p3send wide (shipped)", GroupedGemmFp8Send(E, device=dev)),
                ("p3send 384 threads (shipped)", GroupedGemmFp8Send(E, device=dev, wide=False))]
        for spec in a.ptx:
            vname, rest = spec.split("=", 1)
            path, thr, smem = rest.rsplit(":", 2)
            gems.append((vname, GroupedGemmFp8Send(E, device=dev, variant_ptx=open(path).read(),
                                                   variant_shape=(int(thr), int(smem)))))
        for label, g in gems:
            closers.append(g)
            c = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            blk = g.prepare(cfg, aq, sa, bw, sb, offsets, c, bm=128, expert_offsets_host=off, into=g.k.params_block())
            fns[label] = lambda g=g, blk=blk: g.launch(s, blk)
            cs[label] = c
        if dg is not None:
            d = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
            mi = torch.from_numpy(m_idx).cuda()

            def dgc(d=d, mi=mi):
                with torch.cuda.stream(ts):
                    dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((aq, sa), (bw, sb), d, mi)
            fns["DeepGEMM contiguous"] = dgc
            cs["DeepGEMM contiguous"] = d
        for fn in fns.values():
            fn()
        s.synchronize()
        torch.cuda.synchronize()
        ref = cs["p3send wide (shipped)"]
        real_rows = torch.from_numpy(np.flatnonzero(m_idx >= 0)).cuda()
        for label, c in cs.items():
            if label.startswith("DeepGEMM"):
                diff = (c[real_rows].float() - ref[real_rows].float()).abs().max().item()
                print(f"{name}: {label}: largest |C - p3send's C| over the real rows {diff:.3g}")
            else:
                same = torch.equal(c[real_rows].view(torch.int16), ref[real_rows].view(torch.int16))
                print(f"{name}: {label}: C equal to the shipped wide kernel's on the real rows: {same}")
        # launches a burst: from one timed launch of each
        per = {}
        for label, fn in fns.items():
            e0, e1 = driver.Event(), driver.Event()
            e0.record(s)
            for _ in range(5):
                fn()
            e1.record(s)
            s.synchronize()
            per[label] = max(1, int(a.burst_ms * 1000 / (200.0 * e0.elapsed_ms(e1))))
            e0.close()
            e1.close()
        log_f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
        log = log_f.name
        smi = sampler(log_f)
        time.sleep(0.5)
        spans = {k: [] for k in fns}
        times = {k: [] for k in fns}
        try:
            for _ in range(a.turns):
                for label, fn in fns.items():
                    e0, e1 = driver.Event(), driver.Event()
                    s.synchronize()
                    t0 = time.time()
                    e0.record(s)
                    for _ in range(per[label]):
                        fn()
                    e1.record(s)
                    s.synchronize()
                    spans[label].append((t0 + 0.1, time.time()))
                    times[label].append(1000.0 * e0.elapsed_ms(e1) / per[label])
                    e0.close()
                    e1.close()
                    time.sleep(0.2)
        finally:
            time.sleep(0.1)
            smi.terminate()
            smi.wait()
            log_f.close()
        sm = samples(log)
        print(f"\n{name}: {real} real rows ({rows} with padding), {E} experts, N {N}, K {K}; {a.turns} turns of "
              f"~{a.burst_ms:.0f} ms bursts; {len(sm)} nvidia-smi samples")
        print(f"   {'contender':<32} {'us/launch':>10} {'TFLOP/s':>8} {'SM MHz':>7} {'W':>6} {'Mcycles':>8}  reasons")
        base = None
        for label in fns:
            inside = [x for x in sm if any(t0 <= x[0] <= t1 for t0, t1 in spans[label])]
            us = statistics.median(times[label])
            mhz = statistics.median(x[1] for x in inside) if inside else float("nan")
            w = statistics.median(x[2] for x in inside) if inside else float("nan")
            bits = 0
            for x in inside:
                bits |= x[3]
            why = ", ".join(v for k, v in REASONS.items() if bits & k) or "none"
            cyc = us * mhz / 1e6
            base = base or (us, cyc)
            print(f"   {label:<32} {us:10.1f} {2.0 * real * N * K / us / 1e6:8.1f} {mhz:7.0f} {w:6.0f} {cyc:8.3f}  "
                  f"{why}; time / first {us / base[0]:.3f}, cycles / first {cyc / base[1]:.3f}; "
                  f"bursts {' '.join(f'{t:.1f}' for t in times[label])}")
        for g in closers:
            g.close()
        offsets.free()
        recv.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
