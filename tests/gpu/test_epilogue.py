"""p3_epilogue_send (mailbox, named barriers, fp32 -> bf16) and the linkable send
functions, byte for byte against the oracle (C = bf16 of the accumulators)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from p3send.abi.config import P3SendCtx
from p3send.cuda import driver, loader
from p3send.ops import send as send_ops
from p3send.oracle.cases import FAMILIES, epilogue_case
from tests.gpu.conftest import assert_send_exact, fresh_seed, run_send

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("send_warps", [0, 1, 2, 4])
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_send_warps_and_stages(dev, send_warps, stages):
    for family in ("random", "masked_experts", "row_edges"):
        case = epilogue_case(family, fresh_seed(f"N={send_warps} S={stages} {family}"))
        geometry = dict(bm=stages * 4, bn=64, num_stages=stages, send_warps=send_warps, epilogue_warps=4)
        assert_send_exact(run_send(dev, case, row_cache=(stages % 2 == 0), epilogue=geometry))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family(dev, family):
    case = epilogue_case(family, fresh_seed(family))
    assert_send_exact(run_send(dev, case, row_cache=True, stamps=True, trace=True,
                               epilogue=dict(bm=32, bn=128, num_stages=4, send_warps=2, epilogue_warps=4)))


@pytest.mark.parametrize("grid", [None, 3])
def test_benchmark_geometries(dev, grid):
    """The geometries the benchmark times, with the launcher's grid and with a few CTAs
    (each then takes a long contiguous range of tiles), both signal scopes."""
    from p3send.bench.epilogue import EPILOGUE_GEOMETRIES
    for i, g in enumerate(EPILOGUE_GEOMETRIES):
        case = epilogue_case("random" if i % 2 else "many_experts", fresh_seed(f"bench geometry {i}"))
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 3 == 0), same_gpu=bool(i % 2),
                                   epilogue=dict(g, grid=grid) if grid else g))


def test_one_cta_many_tiles(dev):
    """One CTA walks every tile: the last drain of each tile is collected in the next."""
    case = epilogue_case("skewed", fresh_seed("one-cta"))
    for n in (0, 3):
        assert_send_exact(run_send(dev, case, epilogue=dict(bm=16, bn=64, num_stages=4, send_warps=n,
                                                            epilogue_warps=2, grid=1)))


def test_gated_send_runs_the_handshakes_and_writes_nothing(dev):
    case = epilogue_case("random", fresh_seed("gated"))
    for n in (0, 4):
        t0 = time.monotonic()
        run = run_send(dev, case, p3_control=-1, epilogue=dict(bm=16, bn=64, num_stages=2, send_warps=n))
        assert time.monotonic() - t0 < 30, "a gated epilogue must not hang"
        assert_send_exact(run)
        assert all((r == 0xAB).all() for r in run.recv)


def test_default_geometry_dsv3_rows(dev):
    case = epilogue_case("batch_edges", fresh_seed("default"))
    assert_send_exact(run_send(dev, case, epilogue={}))


class LinkedConsumer:
    """tests/gpu/data/consumer.ptx linked with ptx/p3_send_rows.ptx by the driver's
    linker: a runtime's own kernel calling p3send's device functions."""

    def __init__(self, dev, case):
        mod = loader.link([("consumer.ptx", (DATA / "consumer.ptx").read_text()), "p3_send_rows"],
                           device=dev, name="consumer+p3_send_rows")
        self.k = mod["consumer"]
        self.dev = dev
        self.n_experts, self.grid = case.n_experts, case.n_experts
        self.state = driver.DeviceBuffer(40 * case.n_experts, fill=0)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.ctx = driver.DeviceBuffer(104, fill=0)
        self.offsets = None

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        if self.offsets is None:
            self.offsets = driver.DeviceBuffer(4 * (case.n_experts + 1))
        sa = send_ops.send_args(cfg, case.expert_offsets.astype(np.int32), n_experts=self.n_experts,
                                ordinal=self.dev.ordinal, rows_cap=case.c.shape[0], count_ptrs=count_ptrs,
                                row_cache=row_cache, p3_control=p3_control, staging=self.offsets)
        assert not sa.problems, sa.problems
        offs, peers, flags = sa.expert_offsets, sa.count_ptrs, sa.flags
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = peers
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = offs, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, flags, p3_control
        self.ctx.upload(np.frombuffer(bytes(ctx), np.uint8))
        s = stream or driver.Stream()
        self.k.params_block(cfg=cfg, ctx=self.ctx, c_ptr=c, offsets=offs, msg_bytes=case.msg_bytes).launch(
            (self.grid,), (128,), s)
        s.synchronize()

    def diagnostics(self):
        return send_ops.read_diagnostics(self.diag, True)

    def close(self):
        for b in (self.state, self.diag, self.ctx, self.offsets):
            if b is not None:
                b.free()


@pytest.mark.parametrize("family", ["random", "bad_src_info", "modulo", "masked_experts"])
def test_linked_consumer_kernel(dev, family):
    case = epilogue_case(family, fresh_seed(f"linked {family}"))
    assert_send_exact(run_send(dev, case, row_cache=(family != "modulo"),
                               sender_factory=lambda c: LinkedConsumer(dev, c)))
