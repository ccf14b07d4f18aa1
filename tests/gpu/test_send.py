"""p3_scatter_send against the oracle, byte for byte, on fresh seeds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p3send import ConfigError, P3PeerSendConfig
from p3send.abi.config import rank_config
from p3send.cuda import driver
from p3send.ops.send import ScatterSend
from p3send.oracle import reference as ref
from p3send.oracle.cases import FAMILIES, send_case
from tests.gpu.conftest import GUARD, assert_send_exact, fresh_seed, run_send


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("row_cache", [False, True], ids=["nocache", "cache"])
def test_family_byte_exact(dev, family, row_cache):
    for _ in range(3):
        case = send_case(family, fresh_seed(family))
        assert_send_exact(run_send(dev, case, row_cache=row_cache))


def test_random_cases_byte_exact(dev):
    for i in range(20):
        case = send_case("random", fresh_seed("random"))
        assert_send_exact(run_send(dev, case, row_cache=bool(i % 2)))


def test_cache_on_and_off_give_identical_bytes(dev):
    case = send_case("bad_src_info", fresh_seed("cache-on-off"))
    a, b = run_send(dev, case, row_cache=False), run_send(dev, case, row_cache=True)
    for p in range(case.p2p_world_size):
        assert np.array_equal(a.recv[p], b.recv[p]), f"{case}: peer {p}"


@pytest.mark.parametrize("family", ["row_edges", "many_experts"])
def test_budgeted_sms_byte_exact(dev, family):
    # few CTAs: a CTA's window spans many experts (its shared-memory slots e % 32 collide)
    case = send_case(family, fresh_seed("budget"))
    for n in (1, 2, 3, 8, dev.sm_count - 1):
        assert_send_exact(run_send(dev, case, num_sms=n))


@pytest.mark.parametrize("threads", [32, 64])
def test_small_send_table_path_edges(dev, threads):
    # Small sends (no row cache, <= 32 experts, rows <= 4 x blockDim) take the table path, the
    # rest the chunk path: rows at that edge -1/0/+1, a block smaller than the offsets and the
    # range table it stages, one CTA, and more CTAs than vectors (the idle ones leave early).
    seed = fresh_seed("table-edge")
    rng = np.random.default_rng(seed)
    edge = 4 * threads
    while True:
        case = send_case("random", int(rng.integers(1 << 32)))
        if case.expert_offsets[-1] - case.expert_offsets[0] > edge:
            break
    for rows in (edge - 1, edge, edge + 1, 1):
        off = np.minimum(case.expert_offsets, case.expert_offsets[0] + rows)
        cut = dataclasses.replace(case, expert_offsets=off)
        for n_sms in (1, 3, dev.sm_count):
            for row_cache in (False, True):
                assert_send_exact(run_send(dev, cut, threads=threads, num_sms=n_sms, row_cache=row_cache))


def test_stamps_only_when_a_row_is_stored(dev):
    # every row fails the bounds check: nothing is stored, so no CTA stamps (both paths)
    case = send_case("random", fresh_seed("no-store-stamps"))
    bad = case.src_info.copy()
    bad[:, 0] = case.max_tokens_per_rank
    case = dataclasses.replace(case, src_info=bad)
    for row_cache in (False, True):
        run = run_send(dev, case, stamps=True, row_cache=row_cache)
        assert_send_exact(run)
        assert (run.stamps == 0).all(), f"{case}: stamps without a stored row: {run.stamps[:4]}"


def test_disabled_and_negative_control_touch_nothing(dev):
    case = send_case("random", fresh_seed("gate"))
    for kw in ({"disabled": True}, {"p3_control": -1}, {"p3_control": -1, "row_cache": True}):
        run = run_send(dev, case, **kw)
        assert_send_exact(run)  # the oracle of a gated send is "nothing changes"
        assert all((r == 0xAB).all() for r in run.recv), f"{case} {kw}: a gated send wrote"


def test_stamps_and_trace_only_when_on(dev):
    case = send_case("skewed", fresh_seed("stamps"))
    on = run_send(dev, case, stamps=True, trace=True)
    assert_send_exact(on)
    used = on.stamps[:, 0] != 0
    assert used.any(), "no CTA recorded a first store"
    assert (on.stamps[used, 1] >= on.stamps[used, 0]).all(), f"last < first: {on.stamps[used][:4]}"
    assert (on.stamps[~used] == 0).all()
    assert on.trace[:, 3].sum() > 0 and (np.delete(on.trace, 3, axis=1) == 0).all(), "trace outside its slot"
    off = run_send(dev, case)
    assert off.stamps is None and off.trace is None  # nothing allocated, so nothing can be written


def test_poisoned_src_info_is_seen(dev):
    """A row whose src_info on the device points at another valid slot than the
    oracle's must show up as a mismatch: the comparison is able to fail."""
    case = send_case("random", fresh_seed("poison"))
    res = ref.resolve(_cfg_of(case), case.expert_offsets, case.range_table, case.src_info)
    stored = np.nonzero(res.peer >= 0)[0]
    if not len(stored):
        pytest.skip(f"{case}: no stored rows")
    r = int(stored[0])
    used = set(res.slot[res.peer == res.peer[r]].tolist())
    free = next(s for s in range(case.max_tokens_per_rank * case.top_k) if s not in used)
    poisoned = case.src_info.copy()
    poisoned[r] = (free // case.top_k, free % case.top_k)
    run = run_send(dev, case, src_info=poisoned)
    with pytest.raises(AssertionError, match="receive buffer"):
        assert_send_exact(run)


def _cfg_of(case) -> P3PeerSendConfig:
    return rank_config(n_ranks=case.n_ranks, my_rank=case.my_rank, p2p_world_size=case.p2p_world_size,
                       top_k=case.top_k, msg_bytes=case.msg_bytes, max_tokens=case.max_tokens_per_rank)


def test_stale_row_cache_never_writes_outside(dev):
    case = send_case("random", fresh_seed("stale-cache"))
    rows = case.c.shape[0]
    rng = np.random.default_rng(case.seed)
    wild = rng.integers(1 << 20, 1 << 40, rows, dtype=np.uint64) * np.uint64(16)   # garbage bases
    run = run_send(dev, case, row_cache=True, cache_init=wild)
    for p, got in enumerate(run.recv):
        assert (got[:GUARD] == 0xAB).all() and (got[-GUARD:] == 0xAB).all(), f"{case}: guard of peer {p} written"
    span = int(case.expert_offsets[-1] - case.expert_offsets[0])
    assert run.diag["dropped"] == span, f"{case}: every stale entry must be dropped: {run.diag}"


def test_device_rejects_a_bad_config_without_writing(dev):
    """A foreign launcher bypassing validate(): the kernel itself refuses the config."""
    case = send_case("one_row", fresh_seed("reject"))
    sender = ScatterSend(1, device=dev)
    recv = driver.DeviceBuffer(1 << 16, fill=0xAB)
    c = driver.DeviceBuffer.from_array(case.c)
    offs = driver.DeviceBuffer.from_array(case.expert_offsets.astype(np.int32))
    cfg = rank_config(n_ranks=9, p2p_world_size=1, top_k=1, msg_bytes=24, max_tokens=0,   # n_ranks 9, msg 24
                      recv_bufs=[recv] * 8)
    with pytest.raises(ConfigError, match="n_ranks"):
        sender.prepare(cfg, c, offs)
    sender.block.set(cfg=cfg, c_ptr=c, c_row_stride=24, expert_offsets=offs, state_ptr=sender.state,
                     diag_ptr=sender.diag, n_experts=1, flags=0, p3_control=0)
    s = driver.Stream()
    sender.launch(s)
    s.synchronize()
    assert sender.diagnostics()["rejected"]
    assert (recv.download() == 0xAB).all()
    for b in (recv, c, offs):
        b.free()
    sender.close()


def test_torch_tensors_as_inputs(dev):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    case = send_case("primes", fresh_seed("torch"))
    c = torch.from_numpy(case.c).cuda()          # C given as a torch tensor (__cuda_array_interface__)
    torch.cuda.synchronize()
    assert_send_exact(run_send(dev, case, c_obj=c))


class _TileOnGrid:
    """ScatterSend's tile launch (FLAG_TILE) on its own grid (``grid`` None) or forced onto
    ``grid`` CTAs, so that CTAs take several tiles (c, c+G, ...) of up to eight vectors per
    thread; a sender for ``run_send``'s ``sender_factory``."""

    def __init__(self, dev, case, grid: int, threads: int):
        self.s = ScatterSend(case.n_experts, device=dev, threads=threads)
        self.s.tile_launch, self.s.tile_threads = True, threads
        self.grid, self.state, self.g, self.threads = self.s.grid, self.s.state, grid, threads

    def __call__(self, cfg, c, case, *, stream, count_ptrs, row_cache, p3_control):
        blk = self.s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride,
                             count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control)
        assert blk.launch_shape[1] == self.threads, blk.launch_shape
        assert blk._objs["flags"].value & ScatterSend.FLAG_TILE, "the tile launch was not chosen"
        if self.g is not None:          # None: the launcher's own tile grid (one tile per CTA)
            blk.launch_shape = (self.g, self.threads, blk.launch_shape[2])
        s = stream or driver.Stream()
        self.s.launch(s, blk)

    def diagnostics(self):
        return self.s.diagnostics()

    def close(self):
        self.s.close()


@pytest.mark.parametrize("family", ["random", "zero_rows", "row_edges", "many_experts", "primes", "offset_base",
                                    "unrouted", "bad_src_info", "skewed", "masked_experts"])
def test_tile_launch_on_small_grids_byte_exact(dev, family):
    # the tile path with fewer CTAs than tiles (each CTA loops over tiles, up to 4 vectors per
    # thread), small and large blocks, stamps and trace folded onto the launcher's slots
    case = send_case(family, fresh_seed("tile-grid"))
    # (blocks up to 512: at 1024 threads and 16-byte rows the tile's shared memory, 128*B +
    # 8*(1 + ceil((8*B - 1) / nv)), passes 192 KiB and the launcher takes the persistent path)
    for grid, threads in ((None, 512), (None, 32), (1, 32), (3, 64), (7, 256), (2, 512)):
        run = run_send(dev, case, stamps=True, trace=True,
                       sender_factory=lambda c, g=grid, t=threads: _TileOnGrid(dev, c, g, t))
        assert_send_exact(run)


def test_default_launch_shapes(dev):
    # no budget, no row cache: the tile launch over the rows' vectors; a budget or the row
    # cache: the persistent launch (num_sms bounds the SMs the send occupies)
    case = send_case("primes", fresh_seed("shapes"))
    cfg = _cfg_of(case)
    c = driver.DeviceBuffer.from_array(case.c)
    cfg.atomic_counter = cfg.src_info_ptr = cfg.row_base_ptr = c.ptr   # prepared, never launched
    cfg.recv_buf_ptrs = [c.ptr] * 8
    for num_sms, row_cache, tile in ((None, False, True), (dev.sm_count, False, True), (5, False, False),
                                     (None, True, False)):
        s = ScatterSend(case.n_experts, device=dev, num_sms=num_sms)
        blk = s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride, row_cache=row_cache)
        rows = int(case.expert_offsets[-1] - case.expert_offsets[0])
        want = (-(-rows * (case.msg_bytes // 16) // (s.TILE_THREADS * s.TILE_VECTORS)), s.TILE_THREADS,
                s.tile_smem(cfg)) if tile else None                  # None: the persistent launch
        assert blk.launch_shape == want, (num_sms, row_cache, blk.launch_shape, want)
        assert bool(blk._objs["flags"].value & ScatterSend.FLAG_TILE) == tile
        assert s.grid == (num_sms or dev.sm_count)
        s.close()
    # tile_launch = False: the persistent launch; never with a budget
    s = ScatterSend(case.n_experts, device=dev)
    s.tile_launch = False
    assert s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride).launch_shape is None
    s.tile_launch = True
    assert s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride).launch_shape is not None
    s.set_num_sms(5)
    assert s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride).launch_shape is None
    s.close()
    c.free()


def test_tile_launch_with_short_shared_memory_is_rejected(dev):
    # a foreign launcher giving the tile mode less dynamic shared memory than the header's
    # formula: the kernel refuses (diag[2]) and writes nothing
    case = send_case("random", fresh_seed("tile-smem"))

    class Short(_TileOnGrid):
        def __call__(self, cfg, c, case, **kw):
            blk = self.s.prepare(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride,
                                 count_ptrs=kw["count_ptrs"], row_cache=kw["row_cache"], p3_control=kw["p3_control"])
            blk.launch_shape = (blk.launch_shape[0], self.threads, blk.launch_shape[2] - 8)
            s = kw["stream"] or driver.Stream()
            self.s.launch(s, blk)
            s.synchronize()
            self.rejected = self.s.diagnostics(reset=False)["rejected"]
            self.s.diag.fill(0)

    senders = []
    run = run_send(dev, case, sender_factory=lambda c: senders.append(Short(dev, c, None, 128)) or senders[-1])
    assert senders[0].rejected, "a short tile launch was not rejected"
    assert all((r == 0xAB).all() for r in run.recv), f"{case}: a rejected launch wrote"
