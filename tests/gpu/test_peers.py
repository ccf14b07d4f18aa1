"""The bench's fair peers (p3send/cli/peers.py: a Triton and a CUDA C++ scatter kernel
doing the send's job from the same inputs) write what the oracle says: every case family,
and a decode-size one-rank send with 8 receive buffers (guards, counts, state reset)."""
from __future__ import annotations

import pytest

from tests.gpu.conftest import OK, WHY, fresh_seed

pytestmark = pytest.mark.skipif(not OK, reason=f"no usable GPU: {WHY}")


def test_peers_byte_exact(dev):
    from tests.gpu.peers_check import Shape, check_peers
    try:
        import torch
    except ImportError:
        torch = None
    out = check_peers(dev, fresh_seed("peers"), torch, shapes=(Shape("decode one rank", 128, sets=2),),
                      iters=3, warmup=1, passes=1)
    problems = {name: p for name, p in out["families"].items() if p}
    problems.update({f"decode one rank: {name}": p for name, p in out["decode one rank"]["check"].items() if p})
    assert out["families"], "no peer was built"
    assert not problems, problems
    assert not out.get("errors"), out.get("errors")
