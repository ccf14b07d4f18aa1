"""Small runs of the FP8 wire's kernels for compute-sanitizer (memcheck, racecheck):
p3_scatter_send_fp8, p3_epilogue_send and the linked p3_send_rows on the FP8 wire, at a
reduced shape, byte for byte against the oracle, and the receive p3_recv_reduce_fp8
(``reduce_cases``; ``python -m tests.gpu.sanitize_wire reduce``: those alone). Exits non-zero if a result is wrong; the
sanitizer's --error-exitcode reports memory errors and races.

    compute-sanitizer --tool memcheck --error-exitcode 99 python -m tests.gpu.sanitize_wire
"""
from __future__ import annotations

import sys


def reduce_cases(dev) -> None:
    """The receive on the FP8 wire (p3_recv_reduce_fp8) over numpy-written slots: a plain
    reduce, the edge families, the unreduced mode and a missing pair's timeout
    (``python -m tests.gpu.sanitize_wire reduce``: these alone)."""
    from tests.gpu.test_wire_reduce import (assert_bits, check_clean, edge_problem, expected, make_problem,
                                            run_reduce)
    prob = make_problem(9400, n_ranks=4, n_local=2, tokens=12, top_k=5, hidden=1024)
    r = run_reduce(dev, prob, "fp8")
    check_clean(r, "reduce fp8")
    assert_bits(r["out"], expected(prob, r["slots"], "fp8"), "reduce fp8")
    prob_e, _ = edge_problem(9401)
    r = run_reduce(dev, prob_e, "fp8")
    check_clean(r, "reduce fp8 edges")
    assert_bits(r["out"], expected(prob_e, r["slots"], "fp8"), "reduce fp8 edges")
    check_clean(run_reduce(dev, prob, "fp8", unreduced=True), "reduce fp8 unreduced")
    from p3send.oracle.reference import slot_pairs
    pairs = slot_pairs(prob["topk"], prob["n_local"], prob["n_ranks"])
    pair = int(pairs[pairs >= 0][0])
    r = run_reduce(dev, prob, "fp8", missing=[pair], timeout_ms=20)
    assert r["rec"]["timeouts"] > 0 and r["missing"], r["rec"]
    print("reduce fp8 ok (plain, edges, unreduced, timeout)", flush=True)


def main() -> int:
    from p3send.cuda import driver
    from tests.gpu.conftest import assert_send_exact, run_send
    from tests.gpu.test_wire_send import (Fp8Epilogue, Fp8Scatter, LinkedFp8Consumer, fp8_case,
                                          fp8_epilogue_case)
    dev = driver.device()
    if sys.argv[1:] == ["reduce"]:
        reduce_cases(dev)
        print("sanitize wire cases (reduce): all results correct")
        return 0
    for i, family in enumerate(("masked_experts", "bad_src_info", "modulo")):
        case = fp8_case(family, 9100 + i, hidden=512 * (1 + i % 2), pad=8)
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 2), sender_factory=lambda c: Fp8Scatter(dev, c, 4)))
        print("scatter fp8 ok", case, flush=True)
        # a narrow launch: 2 warps of 4352 bytes, tiles of 4 x 512, several a warp, the stage refilled
        case = fp8_case(family, 9150 + i, hidden=1536, pad=0)
        assert_send_exact(run_send(dev, case, sender_factory=lambda c: Fp8Scatter(dev, c, 2, (64, 2 * 4352))))
        print("scatter fp8 narrow launch ok", case, flush=True)
        case = fp8_epilogue_case(family, 9200 + i, hidden=512)
        geometry = dict(bm=16, bn=256, num_stages=2, send_warps=1 if i % 2 else 0, epilogue_warps=2, grid=4)
        assert_send_exact(run_send(dev, case, sender_factory=lambda c: Fp8Epilogue(dev, c, **geometry)))
        print("epilogue fp8 ok", case, flush=True)
        case = fp8_case(family, 9300 + i, hidden=1024, pad=0)
        assert_send_exact(run_send(dev, case, sender_factory=lambda c: LinkedFp8Consumer(dev, c)))
        print("linked send_rows fp8 ok", case, flush=True)
    reduce_cases(dev)
    print("sanitize wire cases: all results correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
