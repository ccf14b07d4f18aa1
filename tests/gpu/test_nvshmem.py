"""The optional NVSHMEM transport on one GPU: one PE (one rank) whose rows all go through the
NVSHMEM put path to itself, byte-exact against numpy with the counts exact, and timed against
the direct stores of the same bytes; then two PEs on the same GPU, if NVSHMEM allows it there.

The sender is tests/gpu/data/p3_nvshmem_put_rows.ptx, linked with the shim and
libnvshmem_device.a (p3send.ops.nvshmem.NvshmemWorld.load). Receive buffers are symmetric,
filled with the sentinel 0xAB inside guard regions; counts all-ones inside guard words.
Skips with the reason without a GPU or without the transport's wheels.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from p3send.cuda import driver
from p3send.cuda.nvshmem_link import NvshmemUnavailable
from p3send.ops import nvshmem
from p3send.ops.exchange import ProcessExchange
from p3send.ops.procs import run_ranks

from .conftest import GUARD, fresh_seed

# NVLink multicast stays off on these machines; one node: the unique id's socket on loopback.
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")

SENDER = Path(__file__).resolve().parent / "data" / "p3_nvshmem_put_rows.ptx"
ENTRY = "p3_nvshmem_put_rows"
SENTINEL, ALL_ONES = 0xAB, np.uint64(0xFFFF_FFFF_FFFF_FFFF)
COUNT_GUARD = 2          # u64 guard words each side of the counts
BLOCK = 256              # 8 warps, 8 pairs per CTA
PUT, DIRECT = 0, 1


def make_case(rng, n_rows: int, n_pairs: int, row_bytes: int, spare_slots: int = 37):
    """Rows (uint8 [n_rows, row_bytes]), each row's distinct slot, the pairs' first rows (some empty)."""
    src = rng.integers(0, 256, size=(n_rows, row_bytes), dtype=np.uint8)
    n_slots = n_rows + spare_slots
    slot = rng.permutation(n_slots)[:n_rows].astype(np.uint32)
    cuts = np.sort(rng.integers(0, n_rows + 1, size=n_pairs - 1))
    pair_start = np.concatenate([[0], cuts, [n_rows]]).astype(np.uint32)
    pair_start[n_pairs // 2] = pair_start[n_pairs // 2 + 1]    # at least one pair with no rows
    pair_start[1:] = np.maximum.accumulate(pair_start[1:])
    return src, slot, pair_start, n_slots


def expected(src, slot, pair_start, n_slots, row_bytes):
    recv = np.full(GUARD + n_slots * row_bytes + GUARD, SENTINEL, np.uint8)
    body = recv[GUARD:GUARD + n_slots * row_bytes].reshape(n_slots, row_bytes)
    body[slot] = src
    counts = np.full(len(pair_start) - 1 + 2 * COUNT_GUARD, ALL_ONES, np.uint64)
    counts[COUNT_GUARD:-COUNT_GUARD] = np.diff(pair_start).astype(np.uint64)
    return recv, counts


class Round:
    """One PE's receive side (symmetric) and a sender's inputs (plain device memory)."""

    def __init__(self, world, mod, case, row_bytes):
        self.world, self.kernel = world, mod[ENTRY]
        self.src, self.slot, self.pair_start, self.n_slots = case
        self.row_bytes, self.n_pairs = row_bytes, len(self.pair_start) - 1
        self.recv = world.alloc(GUARD + self.n_slots * row_bytes + GUARD)
        self.counts = world.alloc((self.n_pairs + 2 * COUNT_GUARD) * 8)
        self.d_src = driver.DeviceBuffer.from_array(self.src)
        self.d_slot = driver.DeviceBuffer.from_array(self.slot)
        self.d_pair = driver.DeviceBuffer.from_array(self.pair_start)
        self.stream = driver.Stream()

    def arm(self):
        self.recv.fill(SENTINEL)
        self.counts.fill(0xFF)

    def params(self, mode: int, pe: int, dest_recv: int, dest_counts: int):
        return self.kernel.params_block(src=self.d_src, dest=dest_recv + GUARD, counts=dest_counts + 8 * COUNT_GUARD,
                                        slot=self.d_slot, pair_start=self.d_pair, row_bytes=self.row_bytes,
                                        n_pairs=self.n_pairs, pe=pe, mode=mode)

    def grid(self):
        return ((self.n_pairs + BLOCK // 32 - 1) // (BLOCK // 32),)

    def read(self):
        return self.recv.download(), self.counts.download(np.uint64)

    def free(self):
        for b in (self.d_src, self.d_slot, self.d_pair):
            b.free()
        self.recv.free()
        self.counts.free()
        self.stream.close()


def check(got, want, what):
    (recv, counts), (want_recv, want_counts) = got, want
    bad = np.nonzero(recv != want_recv)[0]
    assert not len(bad), f"{what}: {len(bad)} receive bytes differ, first at {bad[0]}"
    assert np.array_equal(counts, want_counts), f"{what}: counts {counts.tolist()} != {want_counts.tolist()}"


@pytest.fixture(scope="module")
def world(dev):
    try:
        nvshmem.bindings()
    except NvshmemUnavailable as e:
        pytest.skip(f"no NVSHMEM transport here: {e}")
    w = nvshmem.NvshmemWorld(ProcessExchange(1).bind(0), device=dev)
    yield w
    w.finalize()


@pytest.fixture(scope="module")
def sender(world):
    return world.load([(SENDER.name, SENDER.read_text())], name=SENDER.name)


def test_one_pe_is_initialised_through_the_exchange(world):
    assert (world.rank, world.n_ranks) == (0, 1)
    assert (world.b.my_pe(), world.b.n_pes()) == (0, 1)


@pytest.mark.parametrize("n_rows, n_pairs, row_bytes", [(1, 2, 16), (300, 40, 14336), (97, 33, 1040)])
def test_rows_put_to_this_pe_are_byte_exact_with_exact_counts(world, sender, n_rows, n_pairs, row_bytes):
    rng = np.random.default_rng(fresh_seed(f"nvshmem self-put {n_rows}x{row_bytes}"))
    case = make_case(rng, n_rows, n_pairs, row_bytes)
    want = expected(*case, row_bytes)
    r = Round(world, sender, case, row_bytes)
    try:
        for mode, pe, recv, counts in ((PUT, 0, r.recv.ptr, r.counts.ptr),
                                       (DIRECT, 0, world.ptr(r.recv.ptr, 0), world.ptr(r.counts.ptr, 0))):
            r.arm()
            r.params(mode, pe, recv, counts).launch(r.grid(), (BLOCK,), r.stream)
            r.stream.synchronize()
            check(r.read(), want, "put" if mode == PUT else "direct")
    finally:
        r.free()


@pytest.mark.parametrize("n_pairs", [1024, 4096])
def test_the_self_put_round_is_within_2x_of_the_direct_store_round(world, sender, n_pairs):
    # 1024 pairs: 4 rows per warp on average; 4096: about one row per warp, 4x the warps in flight
    row_bytes, n_rows, reps = 14336, 4096, 20
    rng = np.random.default_rng(fresh_seed("nvshmem self-put timing"))
    case = make_case(rng, n_rows, n_pairs, row_bytes)
    want = expected(*case, row_bytes)
    r = Round(world, sender, case, row_bytes)
    try:
        blocks = {PUT: r.params(PUT, 0, r.recv.ptr, r.counts.ptr),
                  DIRECT: r.params(DIRECT, 0, world.ptr(r.recv.ptr, 0), world.ptr(r.counts.ptr, 0))}
        times = {PUT: [], DIRECT: []}
        start, end = driver.Event(), driver.Event()
        for i in range(3 + reps):             # interleaved; the first 3 of each warm up
            for mode in (PUT, DIRECT):
                start.record(r.stream)
                blocks[mode].launch(r.grid(), (BLOCK,), r.stream)
                end.record(r.stream)
                end.synchronize()
                if i >= 3:
                    times[mode].append(start.elapsed_ms(end) * 1e3)
        r.arm()                               # the timed rounds wrote the same bytes: check the last one
        blocks[PUT].launch(r.grid(), (BLOCK,), r.stream)
        r.stream.synchronize()
        check(r.read(), want, "put (timed shape)")
        put, direct = float(np.median(times[PUT])), float(np.median(times[DIRECT]))
        nbytes = n_rows * row_bytes
        print(f"[nvshmem] {n_rows} rows x {row_bytes} B ({nbytes / 1e6:.1f} MB), {n_pairs} pairs, "
              f"{r.grid()[0]} CTAs x {BLOCK}: put {put:.1f} us ({nbytes / put / 1e3:.0f} GB/s), direct "
              f"{direct:.1f} us ({nbytes / direct / 1e3:.0f} GB/s), put/direct {put / direct:.3f} "
              f"(median of {reps}; min put {min(times[PUT]):.1f}, min direct {min(times[DIRECT]):.1f})")
        assert put <= 2.0 * direct, f"the self-put round took {put / direct:.2f}x the direct-store round"
    finally:
        r.free()


# ---------------------------------------------------------------- two PEs on one GPU

def _two_pes(rank, exchange, job):
    """PE ``rank`` puts its rows into the other PE's symmetric buffer; each checks what it got."""
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    seed, n_rows, n_pairs, row_bytes = job
    dev = driver.device()
    cases = [make_case(np.random.default_rng(seed + pe), n_rows, n_pairs, row_bytes) for pe in range(2)]
    with nvshmem.NvshmemWorld(exchange, device=dev) as w:
        mod = w.load([(SENDER.name, SENDER.read_text())], name=SENDER.name)
        mine = Round(w, mod, cases[rank], row_bytes)      # my inputs; the buffers are symmetric
        mine.arm()
        w.barrier()
        other = 1 - rank
        reach = w.ptr(mine.recv.ptr, other)
        mine.params(PUT, other, mine.recv.ptr, mine.counts.ptr).launch(mine.grid(), (BLOCK,), mine.stream)
        mine.stream.synchronize()
        w.barrier()                                       # quiet + arrival: the other's puts landed here
        got = mine.read()
        # what landed here is the other PE's rows
        want = expected(*cases[other], row_bytes)
        check(got, want, f"PE {rank} from PE {other}")
        mine.free()
    return {"nvshmem_ptr_of_the_other_pe": bool(reach)}


def test_two_pes_on_one_gpu_put_to_each_other(dev):
    try:
        nvshmem.bindings()
    except NvshmemUnavailable as e:
        pytest.skip(f"no NVSHMEM transport here: {e}")
    seed = fresh_seed("nvshmem two PEs one GPU")
    outcomes = run_ranks(_two_pes, 2, (seed, 200, 24, 14336), devices=[dev.ordinal, dev.ordinal], timeout_s=60,
                          sync_timeout_s=30)
    for o in outcomes:
        print(f"[nvshmem] two PEs, rank {o.rank}: exit {o.exitcode}, value {o.value}, error {o.error}")
    refused = [o.error for o in outcomes if o.error and "NvshmemError" in o.error]
    if refused and not all(o.ok for o in outcomes):
        pytest.skip("NVSHMEM refused two PEs on one GPU: " + refused[0].splitlines()[0])
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
