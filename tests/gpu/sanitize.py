"""Small runs of every kernel, for compute-sanitizer (memcheck, racecheck): the sends
(both persistent paths and the tile path), the combine round with a graph and a timeout,
the epilogue send and a linked consumer, the grouped GEMM at a reduced shape, and the
dispatch's kernels (``python -m tests.gpu.sanitize dispatch``: those alone; ``dispatch-quick``:
a reduced set of them). Exits non-zero if any result is wrong; the sanitizer's own
--error-exitcode reports memory errors.

    compute-sanitizer --tool memcheck --error-exitcode 99 python -m tests.gpu.sanitize
"""
from __future__ import annotations

import sys

from p3send import ArrivalTimeout, P3PeerSendConfig
from p3send.cuda import loader
from p3send.ops.combine import Combine
from p3send.oracle.cases import (
    FAMILIES,
    check_world,
    epilogue_case,
    send_case,
    world_case,
)
from tests.gpu.conftest import assert_send_exact, run_send
from tests.gpu.gemm_common import gated_then_fused
from tests.gpu.test_gemm import GemmProblem, check_c


def main() -> int:
    from p3send.cuda import driver
    from tests.gpu.test_dispatch import sanitize_cases as dispatch_cases
    dev = driver.device()
    quick = sys.argv[1:] == ["dispatch-quick"]     # a reduced set of the dispatch's cases, alone
    dispatch_cases(dev, quick)     # the dispatch kernels (alone: python -m tests.gpu.sanitize dispatch)
    if sys.argv[1:] in (["dispatch"], ["dispatch-quick"]):
        print("sanitize cases (dispatch): all results correct")
        return 0
    seen, _ = loader.abi_echo(P3PeerSendConfig.disabled(), device=dev)
    assert seen == bytes(P3PeerSendConfig.disabled())
    for i, fam in enumerate(FAMILIES):
        case = send_case(fam, 1000 + i)
        if case.c.shape[0] > 400:
            continue  # keep the sanitizer run short
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 2), stamps=True, trace=True))
        print("send ok", case, flush=True)
    from tests.gpu.test_send import _TileOnGrid
    # the tile path (also the default launch of the sends above without the row cache): CTAs
    # looping over tiles of up to 8 vectors per thread, or one tile each; empty experts
    for fam, grid, threads in (("masked_experts", 2, 64), ("one_row", None, 32), ("zero_rows", 3, 128)):
        case = send_case(fam, 2000 + threads)
        assert_send_exact(run_send(dev, case, stamps=True, trace=True,
                                   sender_factory=lambda c, g=grid, t=threads: _TileOnGrid(dev, c, g, t)))
        print("tile send ok", case, f"grid={grid} threads={threads}", flush=True)
    world = world_case(n_ranks=3, tokens=20, top_k=3, n_local=2, hidden=64, seed=7, masked=0.2)
    comb = Combine(3, max_tokens=24, top_k=3, hidden=64, n_local_experts=2, device=dev, guard=True,
                   timeout_ms=500, row_cache=True)
    comb.load(world)
    comb.round()
    g = comb.capture()
    for _ in range(3):
        g.launch(comb.origin)
    comb.origin.synchronize()
    comb.check()
    problems = check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output, guard=comb.guard)
    assert not problems, problems
    try:
        comb.round(skip_send={1})
        raise AssertionError("a dead rank did not time out")
    except ArrivalTimeout as e:
        print("timeout path ok:", str(e)[:120], flush=True)
    comb.round()
    g.close()
    comb.close()
    for n in (0, 2):   # the mailbox and named barriers: racecheck's main target
        case = epilogue_case("masked_experts", 77 + n)
        assert_send_exact(run_send(dev, case, row_cache=True, epilogue=dict(bm=16, bn=64, num_stages=4,
                                                                             send_warps=n, epilogue_warps=2)))
        print("epilogue ok", case, f"send_warps={n}", flush=True)
    from tests.gpu.test_epilogue import LinkedConsumer
    case = epilogue_case("random", 99)
    assert_send_exact(run_send(dev, case, row_cache=True, sender_factory=lambda c: LinkedConsumer(dev, c)))
    print("linked consumer ok", case, flush=True)
    # the grouped GEMM (sm_90a): the gated GEMM's C within its bound, the fused send
    # byte-exact to the oracle of that C, for a few edge families and both tile heights
    for i, (family, bm) in enumerate((("masked_experts", 128), ("skewed", 64), ("modulo", 128))):
        prob = GemmProblem(family, 4242 + i, n_cols=256, k_dim=128)
        gated_then_fused(dev, prob, bm, check_c)
        print("gemm ok", prob.case, f"bm={bm}", flush=True)
    print("sanitize cases: all results correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
