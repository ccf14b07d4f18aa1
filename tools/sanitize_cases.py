"""Small runs of every kernel, for compute-sanitizer (memcheck, racecheck). Exits non-zero
if any result is wrong; the sanitizer's own --error-exitcode reports memory errors."""
from __future__ import annotations

import sys

from p3send import ArrivalTimeout, P3PeerSendConfig, kernels
from p3send.cases import FAMILIES, check_world, epilogue_case, send_case, world_case
from p3send.combine import Combine
from tests.gpu.conftest import assert_send_exact, run_send


def main() -> int:
    from p3send import driver
    dev = driver.device()
    seen, _ = kernels.abi_echo(P3PeerSendConfig.disabled(), device=dev)
    assert seen == bytes(P3PeerSendConfig.disabled())
    for i, fam in enumerate(FAMILIES):
        case = send_case(fam, 1000 + i)
        if case.c.shape[0] > 400:
            continue  # keep the sanitizer run short
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 2), stamps=True, trace=True))
        print("send ok", case, flush=True)
    world = world_case(n_ranks=3, tokens=20, top_k=3, n_local=2, hidden=64, seed=7, masked=0.2)
    comb = Combine(3, max_tokens=24, top_k=3, hidden=64, n_local_experts=2, device=dev, guard=True,
                   timeout_ms=500, row_cache=True)
    comb.load_world(world)
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
    print("sanitize cases: all results correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
