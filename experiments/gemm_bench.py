"""Maintainer experiment, not maintained (experiments/README.md): p3_gemm_send's C against an
fp32 reference, then the bench's GEMM section (p3send/bench/gemm.py) at the prefill and the
decode shapes. Needs torch.

    PYTHONPATH=. python experiments/gemm_bench.py [--iters 20] [--json out.json]

Error bound (per element of C, both operands bf16, so every product is exact in fp32):
    |C - R| <= ulp_bf16(|R|) + K * 2**-23 * (|X| @ |W|^T)
R is the fp32 (TF32 off) torch product of the same bf16 inputs. The first term is the
final bf16 rounding (half an ulp for round-to-nearest, a full ulp where |C| and |R| straddle
a power of two); the second bounds the accumulation error of two fp32 sums of K terms in
different orders, each at most K * 2**-24 * sum|x w| (the classical gamma_K bound).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p3send.bench import gemm as bench_gemm  # noqa: E402
from p3send.cuda import driver  # noqa: E402
from p3send.ops.gemm import GroupedGemmSend  # noqa: E402
from p3send.oracle.cases import prefill_routing  # noqa: E402


def check_c(torch, dev, tokens, a, rng, bm) -> dict:
    """C of the gated GEMM at one shape against the fp32 reference, within the bound."""
    E, N, K = a.experts, a.hidden, a.gemm_k
    off, _, _, _ = prefill_routing(tokens, a.ranks, a.top_k, E, rng)
    rows = tokens * a.top_k
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    c = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    gemm = GroupedGemmSend(E, device=dev)
    try:
        gemm(_disabled(), x, w, off, c, bm=bm)
    finally:
        gemm.close()
    torch.backends.cuda.matmul.allow_tf32 = False
    worst, ratio, exact, n = 0.0, 0.0, 0, 0
    for e in range(E):
        r0, r1 = int(off[e]), int(off[e + 1])
        if r0 == r1:
            continue
        xe, we = x[r0:r1].float(), w[e].float()
        ref = xe @ we.T
        mag = xe.abs() @ we.abs().T
        _, ex = torch.frexp(ref)
        ulp = torch.ldexp(torch.ones_like(ref), (ex - 8).clamp(min=-133))
        bound = ulp + K * 2.0 ** -23 * mag
        err = (c[r0:r1].float() - ref).abs()
        worst = max(worst, float(err.max()))
        ratio = max(ratio, float((err / bound).max()))
        exact += int((c[r0:r1] == ref.to(torch.bfloat16)).sum())
        n += ref.numel()
    nan = int(torch.isnan(c).sum())
    return {"rows": rows, "bm": bm, "max_abs_err": worst, "max_err_over_bound": ratio,
            "frac_equal_to_bf16_of_ref": exact / n, "nan_left": nan, "ok": ratio <= 1.0 and nan == 0}


def _disabled():
    from p3send.abi.config import P3PeerSendConfig
    return P3PeerSendConfig.disabled()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-linked", action="store_true")
    args = ap.parse_args()
    import torch
    seed = args.seed if args.seed is not None else int(time.time()) % (1 << 31)
    print(f"[seed] {seed}", flush=True)
    rng = np.random.default_rng(seed)
    dev = driver.device()
    a = SimpleNamespace(experts=32, hidden=7168, gemm_k=2048, ranks=8, top_k=8, tokens=4096, decode_tokens=128,
                        iters=args.iters, warmup=args.warmup)
    out = {"device": dev.name, "seed": seed, "correctness": []}
    for tokens, bm in ((a.decode_tokens, 64), (a.decode_tokens, 128), (a.tokens, 128)):
        r = check_c(torch, dev, tokens, a, rng, bm)
        out["correctness"].append(r)
        print("C vs fp32 reference:", r, flush=True)
    out["gemm"] = bench_gemm.measure(a, dev, rng, torch, linked=not args.no_linked)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(bench_gemm.table(out))
    ok = all(r["ok"] for r in out["correctness"]) and all(
        all(v["fused_equals_gated_then_scatter_send"].values()) for v in out["gemm"].values() if isinstance(v, dict)
        and "fused_equals_gated_then_scatter_send" in v)
    print("ALL CHECKS PASS" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
