"""Small runs of the FP8 kernels for compute-sanitizer (memcheck, racecheck): the quantiser on
edge blocks, and the FP8 grouped GEMM gated and fused at a reduced shape (both tile heights,
both kernels of 128-row tiles, both layouts, a full and a narrow column tile; on the FP8 wire
from the consumers' quantiser). Exits non-zero if a result is wrong; the
sanitizer's --error-exitcode reports memory errors and races.

    compute-sanitizer --tool memcheck --error-exitcode 99 python -m tests.gpu.sanitize_fp8
"""
from __future__ import annotations

import sys

import numpy as np

from p3send.oracle import fp8
from tests.gpu.gemm_common import gated_then_fused
from tests.gpu.test_gemm_fp8 import Fp8Problem, check_c, edge_rows, run_quant


def main() -> int:
    from p3send.cuda import driver
    dev = driver.device()
    xb = edge_rows(np.random.default_rng(5), 9, 384)
    q, s = run_quant(dev, xb)
    want_q, want_s = fp8.quantize(xb)
    assert np.array_equal(q, want_q) and np.array_equal(s[:, :9].T, want_s.view(np.uint32))
    print("quant ok", flush=True)
    # 384 columns: a 256-column tile (two mainloops, the consumers' turns) and a 128-column last one
    # 128-row tiles on both kernels (p3_gemm_fp8_send_wide, the default, and p3_gemm_fp8_send)
    for i, (family, bm, align, wide) in enumerate((("masked_experts", 128, 128, True), ("skewed", 64, 1, None),
                                                   ("skewed", 128, 1, False))):
        prob = Fp8Problem(family, 4242 + i, n_cols=384, k_dim=256, align=align, wide=wide)
        gated_then_fused(dev, prob, bm, check_c)
        print("gemm fp8 ok", prob.case, f"bm={bm} wide={wide}", flush=True)
    # the fused GEMM on the FP8 wire, its consumers quantising the fp32 sums (both kernels of
    # 128-row tiles): the slots within oracle.wire.requantised of the gated C's wire
    from tests.gpu.test_wire_send import gemm_fp8_wire_check
    for i, wide in enumerate((True, False)):
        prob = Fp8Problem("masked_experts", 4300 + i, n_cols=512, k_dim=256, align=128, wide=wide)
        gemm_fp8_wire_check(dev, prob, 128, check_c, fp8_source="fp32")
        print("gemm fp8 wire from fp32 ok", prob.case, f"wide={wide}", flush=True)
    print("sanitize fp8 cases: all results correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
