"""The dispatch's host side without a GPU: every bad argument of DispatchShape, Dispatch and
DispatchRank raises a P3SendError naming it before any CUDA call (the driver is replaced by
stand-ins that fail the test when touched); the shapes the kernels refuse on the device are
refused on the host first; a constructor that fails part-way frees everything it made and
``close`` finishes every step when one fails (a stand-in driver that records every
allocation and free and fails at the Nth); ``check`` reports a rejected launch as the cause
before the timeouts it leaves; and p3send.moe uses p3send.torch's device ordinal and handle
registry (on a stand-in torch module, so these run where torch is not installed)."""
from __future__ import annotations

import itertools
import math
import sys
import types

import numpy as np
import pytest

import p3send
from p3send.abi.errors import ConfigError, ConfigTypeError, CudaError, P3SendError
from p3send.cuda import driver
from p3send.ops import dispatch as dmod
from p3send.ops.dispatch import (Dispatch, DispatchError, DispatchRank, DispatchShape, DispatchTimeout,
                                 decode_record, record_init, release, step_error)
from p3send.ops.exchange import ExchangeTimeout
from p3send.oracle import cases

SHAPE = dict(n_ranks=2, n_local=2, top_k=2, max_tokens=4, hidden=64)
ARGS = dict(max_tokens=4, top_k=2, hidden=64, n_local_experts=2)


def refused(excinfo, name: str, kind: str) -> None:
    """The error is a P3SendError of ``kind`` ("type": also a TypeError; "value": a
    ValueError) one of whose problems starts with the argument's name."""
    e = excinfo.value
    assert isinstance(e, P3SendError), type(e)
    assert isinstance(e, TypeError if kind == "type" else ValueError), (type(e), str(e))
    problems = getattr(e, "problems", [str(e)])
    assert any(p.startswith(f"{name}:") for p in problems), (name, problems)


# ---------------------------------------------------------------- no CUDA before the checks

@pytest.fixture
def no_cuda(monkeypatch):
    """Every driver entry point the dispatch uses fails the test when called."""
    def touched(*a, **k):
        raise AssertionError("a CUDA call before the arguments were checked")
    for name in ("device", "DeviceBuffer", "Stream", "Event", "set_max_dynamic_smem", "ipc_get_handle",
                 "ipc_open_handle", "ipc_close", "pci_bus_id"):
        monkeypatch.setattr(driver, name, touched)
    monkeypatch.setattr(dmod, "kernel", touched)
    monkeypatch.setattr(dmod, "kernel_all", touched)


SHAPE_CASES = [
    # (id, overrides, argument named, kind)
    ("n_ranks=str", dict(n_ranks="2"), "n_ranks", "type"),
    ("n_ranks=True", dict(n_ranks=True), "n_ranks", "type"),
    ("n_ranks=np.True_", dict(n_ranks=np.True_), "n_ranks", "type"),
    ("n_ranks=2.0", dict(n_ranks=2.0), "n_ranks", "type"),
    ("n_ranks=9", dict(n_ranks=9), "n_ranks", "value"),
    ("n_ranks=0", dict(n_ranks=0), "n_ranks", "value"),
    ("n_local=None", dict(n_local=None), "n_local", "type"),
    ("n_local=0", dict(n_local=0), "n_local", "value"),
    ("n_local=129x8", dict(n_ranks=8, n_local=129), "n_local", "value"),
    ("top_k=str", dict(top_k="2"), "top_k", "type"),
    ("top_k=33", dict(top_k=33), "top_k", "value"),
    ("max_tokens=None", dict(max_tokens=None), "max_tokens", "type"),
    ("max_tokens=-5", dict(max_tokens=-5), "max_tokens", "value"),
    ("max_tokens=1.5", dict(max_tokens=1.5), "max_tokens", "type"),
    ("hidden=str", dict(hidden="64"), "hidden", "type"),
    ("hidden=0", dict(hidden=0), "hidden", "value"),
    ("hidden=12", dict(hidden=12), "hidden", "value"),
    ("hidden=2^19+8", dict(hidden=(1 << 19) + 8), "hidden", "value"),
    ("fp8 hidden=256", dict(payload="fp8", hidden=256), "hidden", "value"),
    ("payload=bf17", dict(payload="bf17"), "payload", "value"),
    ("payload=None", dict(payload=None), "payload", "type"),
    ("payload=list", dict(payload=["bf16"]), "payload", "type"),
    ("capacity=str", dict(capacity="8"), "capacity", "type"),
    ("capacity=-1", dict(capacity=-1), "capacity", "value"),
    ("capacity=2^30", dict(capacity=1 << 30), "capacity", "value"),
    ("align=3", dict(align=3), "align", "value"),
    ("align=8192", dict(align=8192), "align", "value"),
    ("align=True", dict(align=True), "align", "type"),
    ("expert_stride=-1", dict(expert_stride=-1), "expert_stride", "value"),
    ("expert_stride with align", dict(expert_stride=4, align=2), "expert_stride", "value"),
    ("expert_stride=str", dict(expert_stride="4"), "expert_stride", "type"),
    ("zero_padding=1", dict(zero_padding=1), "zero_padding", "type"),
    ("zero_padding=str", dict(zero_padding="yes"), "zero_padding", "type"),
    # what the kernels refuse on the device, refused here first
    ("tokens*top_k*ranks 2^31", dict(n_ranks=8, top_k=32, n_local=4, max_tokens=1 << 23, capacity=0),
     "max_tokens", "value"),
    ("stride*n_local 2^31", dict(n_local=2, expert_stride=1 << 30), "expert_stride", "value"),
]


@pytest.mark.parametrize("over, name, kind", [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES])
def test_every_bad_shape_argument_is_named(no_cuda, over, name, kind):
    with pytest.raises(P3SendError) as ei:
        DispatchShape(**{**SHAPE, **over})
    refused(ei, name, kind)


def test_a_bad_max_tokens_is_not_reported_as_a_capacity_the_caller_never_gave():
    with pytest.raises(ConfigError) as ei:
        DispatchShape(**{**SHAPE, "max_tokens": -5})
    assert ei.value.problems == ["max_tokens: expected >= 0, got -5"], ei.value.problems


def test_every_bad_argument_is_listed_at_once():
    with pytest.raises(ConfigTypeError) as ei:
        DispatchShape(n_ranks="2", n_local=0, top_k=None, max_tokens=-1, hidden="x", payload="no")
    named = {p.split(":")[0] for p in ei.value.problems}
    assert named == {"n_ranks", "n_local", "top_k", "max_tokens", "hidden", "payload"}, ei.value.problems


# p3_dispatch_send numbers a step's 16-byte vectors (rows and scales) in 31 bits: n_tokens*nvt < 2^31
@pytest.mark.parametrize("payload, hidden", [("bf16", 1 << 19), ("fp8", 1 << 20), ("fp8", 512 * 7)])
def test_a_step_of_more_than_2_31_vectors_is_refused_on_the_host(payload, hidden):
    x_bytes = 2 * hidden if payload == "bf16" else hidden
    nvt = (x_bytes + (0 if payload == "bf16" else 4 * (hidden // 128))) // 16
    most = ((1 << 31) - 1) // nvt                 # the largest max_tokens the kernel takes
    kw = dict(n_ranks=1, n_local=1, top_k=1, hidden=hidden, payload=payload, capacity=1)
    assert DispatchShape(max_tokens=most, **kw).max_tokens == most
    with pytest.raises(ConfigError) as ei:
        DispatchShape(max_tokens=most + 1, **kw)
    assert any(p.startswith("max_tokens:") and "2^31" in p for p in ei.value.problems), ei.value.problems


def test_a_default_capacity_past_2_30_rows_says_it_is_the_default():
    with pytest.raises(ConfigError) as ei:
        DispatchShape(n_ranks=8, n_local=8, top_k=8, max_tokens=1 << 24, hidden=8)
    (p,) = ei.value.problems
    assert p.startswith("capacity:") and "default" in p and str(1 << 30) in p, p


def test_numpy_integers_and_bools_are_taken_as_plain_values():
    sh = DispatchShape(np.int64(2), np.int32(2), np.int16(2), np.int64(4), np.int64(64), zero_padding=np.True_)
    assert sh == DispatchShape(**SHAPE, zero_padding=True)
    assert all(type(getattr(sh, f)) is int for f in ("n_ranks", "n_local", "top_k", "max_tokens", "hidden",
                                                     "capacity", "align", "expert_stride"))
    assert type(sh.zero_padding) is bool


def test_every_shape_the_gpu_tests_use_is_accepted():
    for family in cases.DISPATCH_FAMILIES:
        for seed in range(12):
            c = cases.dispatch_case(family, seed)
            sh = DispatchShape(c.n_ranks, c.n_local, c.top_k, c.max_tokens, c.hidden, c.payload, c.capacity,
                               c.align, c.expert_stride, c.zero_padding)
            assert sh.capacity == c.capacity and sh.zero_padding == c.zero_padding, (family, seed)
    c = cases.dispatch_case("masked", 5, n_ranks=4, tokens=24)
    assert DispatchShape(c.n_ranks, c.n_local, c.top_k, 24, c.hidden, capacity=c.capacity).capacity == c.capacity


def test_the_default_capacity_is_unchanged():
    for R, L, K, T, A, S in itertools.product((1, 3, 8), (1, 5), (1, 4, 8), (0, 7), (1, 16), (0,)):
        sh = DispatchShape(R, L, K, T, 64, align=A, expert_stride=S)
        assert sh.capacity == R * T * min(K, L) + L * (A - 1)
    assert DispatchShape(2, 3, 2, 4, 64, expert_stride=10).capacity == 30


TIMEOUTS = [("str", "5", "type"), ("None", None, "type"), ("bool", True, "type"), ("-1", -1, "value"),
            ("0", 0, "value"), ("nan", math.nan, "value"), ("inf", math.inf, "value"), ("1e8", 1e8, "value"),
            ("below 1 ns", 1e-7, "value")]


@pytest.mark.parametrize("value, kind", [t[1:] for t in TIMEOUTS], ids=[t[0] for t in TIMEOUTS])
def test_dispatch_refuses_a_bad_timeout_before_any_cuda_call(no_cuda, value, kind):
    with pytest.raises(P3SendError) as ei:
        Dispatch(2, timeout_ms=value, **ARGS)
    refused(ei, "timeout_ms", kind)


class Exchange:
    """A stand-in exchange of rank ``rank`` of ``n_ranks``: ``allgather`` answers for the
    peers with ``peer(p, obj)`` (default: the peer sends what this rank sent), ``barrier``
    with ``on_barrier``."""

    def __init__(self, rank=0, n_ranks=2, peer=None, on_barrier=None, on_allgather=None):
        self.rank, self.n_ranks = rank, n_ranks
        self.peer, self.on_barrier, self.on_allgather = peer, on_barrier, on_allgather
        self.barriers, self.gathered = 0, []

    def allgather(self, obj, timeout=None):
        self.gathered.append(obj)
        if self.on_allgather is not None:
            self.on_allgather(len(self.gathered))
        return [obj if p == self.rank else (self.peer(p, obj) if self.peer else obj) for p in range(self.n_ranks)]

    def barrier(self, timeout=None):
        self.barriers += 1
        if self.on_barrier is not None:
            self.on_barrier(self.barriers)


RANK_CASES = [
    ("rank=str", dict(rank="0"), "rank", "type"),
    ("rank=True", dict(rank=True), "rank", "type"),
    ("rank=2 of 2", dict(rank=2), "rank", "value"),
    ("rank=-1", dict(rank=-1), "rank", "value"),
    ("timeout_ms=-1", dict(timeout_ms=-1), "timeout_ms", "value"),
    ("timeout_ms=0", dict(timeout_ms=0), "timeout_ms", "value"),
    ("timeout_ms=str", dict(timeout_ms="x"), "timeout_ms", "type"),
    ("sync_timeout_s=str", dict(sync_timeout_s="x"), "sync_timeout_s", "type"),
    ("sync_timeout_s=0", dict(sync_timeout_s=0), "sync_timeout_s", "value"),
    ("sync_timeout_s=inf", dict(sync_timeout_s=math.inf), "sync_timeout_s", "value"),
    ("sync_timeout_s=bool", dict(sync_timeout_s=True), "sync_timeout_s", "type"),
    ("n_ranks=str", dict(n_ranks="2"), "n_ranks", "type"),
    ("n_local_experts=0", dict(n_local_experts=0), "n_local_experts", "value"),
    ("exchange of another rank", dict(exchange=Exchange(rank=1)), "exchange", "value"),
]


@pytest.mark.parametrize("over, name, kind", [c[1:] for c in RANK_CASES], ids=[c[0] for c in RANK_CASES])
def test_dispatch_rank_refuses_every_bad_argument_before_any_cuda_call(no_cuda, over, name, kind):
    kw = {"rank": 0, "n_ranks": 2, "exchange": Exchange(), **ARGS, **over}
    if kw["rank"] in (0, 1) and not isinstance(kw["rank"], bool) and name != "exchange":
        kw["exchange"] = Exchange(rank=kw["rank"], n_ranks=kw["n_ranks"])
    ex = kw["exchange"]
    with pytest.raises(P3SendError) as ei:
        DispatchRank(kw.pop("rank"), kw.pop("n_ranks"), kw.pop("exchange"), **kw)
    refused(ei, name, kind)
    assert not ex.gathered and not ex.barriers          # nothing collective began


def test_dispatch_names_n_local_experts_as_its_caller_wrote_it(no_cuda):
    with pytest.raises(ConfigError) as ei:
        Dispatch(2, max_tokens=4, top_k=2, hidden=64, n_local_experts=0)
    assert ei.value.problems == ["n_local_experts: expected >= 1, got 0"], ei.value.problems


# ---------------------------------------------------------------- a stand-in driver

class Ledger:
    """What the stand-in driver made and released; ``fail_alloc``: the allocation (0-based)
    that fails with CUDA_ERROR_OUT_OF_MEMORY; ``fail_free``: buffers whose free fails."""

    def __init__(self):
        self.live, self.freed, self.allocs = set(), [], 0
        self.fail_alloc, self.fail_free = None, set()
        self.streams, self.events, self.mapped, self.kernels = [], [], set(), 0
        self.fail_stream, self.fail_kernel, self.fail_ipc_open = None, None, None
        self.ptrs = itertools.count(0x7F00_0000_0000, 1 << 20)

    def leaks(self) -> list:
        return sorted(self.live) + [f"stream {i}" for i, s in enumerate(self.streams) if not s.closed] + \
            [f"event {i}" for i, e in enumerate(self.events) if not e.closed] + [f"mapping {p:#x}" for p in self.mapped]


def oom(call: str) -> CudaError:
    return CudaError(call, "CUDA_ERROR_OUT_OF_MEMORY", 2, "out of memory")


@pytest.fixture
def fake(monkeypatch):
    """Install the stand-in driver; returns its Ledger."""
    led = Ledger()

    class Buffer:
        def __init__(self, nbytes, *, fill=None, stream=None):
            n = led.allocs
            led.allocs += 1
            if led.fail_alloc == n:
                raise oom("cuMemAlloc")
            self.nbytes, self.ptr, self.index = int(nbytes), next(led.ptrs), n
            self.data = np.zeros(max(self.nbytes, 1), np.uint8)
            led.live.add(n)
            if fill is not None:
                self.fill(fill)

        def upload(self, arr, stream=None, offset=0):
            b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            self.data[offset:offset + b.size] = b

        def download(self, dtype=np.uint8, shape=None, offset=0, nbytes=None):
            nbytes = self.nbytes - offset if nbytes is None else nbytes
            out = self.data[offset:offset + nbytes].copy().view(dtype)
            return out if shape is None else out.reshape(shape)

        def fill(self, byte, stream=None, offset=0, nbytes=None):
            self.data[offset:offset + (self.nbytes - offset if nbytes is None else nbytes)] = byte

        def free(self):
            if self.index in led.fail_free:
                led.fail_free.discard(self.index)
                raise CudaError("cuMemFree", "CUDA_ERROR_INVALID_VALUE", 1)
            if self.index in led.live:
                led.live.discard(self.index)
                led.freed.append(self.index)

    class Closable:
        def __init__(self, *a, **k):
            self.closed = False

        def close(self):
            self.closed = True

        def synchronize(self):
            pass

        def record(self, stream):
            return self

        def wait(self, event):
            pass

    class Stream(Closable):
        def __init__(self, *a, **k):
            if led.fail_stream == len(led.streams):
                raise oom("cuStreamCreate")
            super().__init__()
            led.streams.append(self)

    class Event(Closable):
        def __init__(self, *a, **k):
            super().__init__()
            led.events.append(self)

    class Block:
        kernel = types.SimpleNamespace(params=[])      # no parameters: an all-ranks row is all zero

        def set(self, **values):
            pass

        def launch(self, *a, **k):
            pass

    class Kernel:
        func = None

        def params_block(self, **values):
            return Block()

    def kernel(entry, device=None):
        led.kernels += 1
        if led.fail_kernel == led.kernels - 1:
            raise CudaError("cuModuleLoadData", "CUDA_ERROR_INVALID_PTX", 218)
        return Kernel()

    def ipc_open_handle(handle):
        if led.fail_ipc_open == len(led.mapped):
            raise CudaError("cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_HANDLE", 400)
        ptr = next(led.ptrs)
        led.mapped.add(ptr)
        return ptr

    def kernel_all(entry, device=None, mode="param"):
        return kernel(entry + "_all", device), 512, 504

    dev = types.SimpleNamespace(ordinal=0, smem_optin=232448, sm_count=132, name="stand-in GPU",
                                activate=lambda: None)
    monkeypatch.setattr(driver, "DeviceBuffer", Buffer)
    monkeypatch.setattr(driver, "Stream", Stream)
    monkeypatch.setattr(driver, "Event", Event)
    monkeypatch.setattr(driver, "set_max_dynamic_smem", lambda func, n: None)
    monkeypatch.setattr(driver, "device", lambda ordinal=None: dev)
    monkeypatch.setattr(driver, "ipc_get_handle", lambda buf: b"h%x" % buf.ptr)
    monkeypatch.setattr(driver, "ipc_open_handle", ipc_open_handle)
    monkeypatch.setattr(driver, "ipc_close", lambda ptr: led.mapped.remove(ptr))
    monkeypatch.setattr(driver, "pci_bus_id", lambda ordinal: "0000:01:00.0")
    monkeypatch.setattr(dmod, "kernel", kernel)
    monkeypatch.setattr(dmod, "kernel_all", kernel_all)
    monkeypatch.setattr(driver, "occupancy", lambda func, block, smem=0: 1)
    led.dev = dev
    return led


def make_dispatch(**kw) -> Dispatch:
    return Dispatch(2, **{**ARGS, **kw})


@pytest.mark.parametrize("stacked", [False, True])
def test_dispatch_frees_everything_when_any_allocation_fails(fake, stacked):
    d = make_dispatch(stacked=stacked)                 # the positive control: counts the allocations
    total = fake.allocs
    assert total > 10 and fake.leaks()
    d.close()
    assert fake.leaks() == []
    for n in range(total):
        fake.fail_alloc, fake.allocs = n, 0
        with pytest.raises(CudaError, match="cuMemAlloc"):
            make_dispatch(stacked=stacked)
        assert fake.leaks() == [], f"allocation {n} failed: leaked {fake.leaks()}"


@pytest.mark.parametrize("what, n", [("kernel", 0), ("kernel", 4), ("stream", 1), ("stream", 2)])
def test_dispatch_frees_everything_when_a_kernel_load_or_stream_fails(fake, what, n):
    setattr(fake, f"fail_{what}", n)                  # kernel 4: rank 1's first; stream 2: the origin
    with pytest.raises(CudaError):
        make_dispatch()
    assert fake.leaks() == [] and (fake.allocs > 0) == (n > 0)     # kernel 0: before rank 0's first buffer


def test_set_tally_refuses_bad_arguments_by_name(fake):
    d = make_dispatch()
    try:
        for bad, kind in ((16, "value"), (48, "value"), (2048, "value"), ("32", "type"), (True, "type")):
            with pytest.raises(ConfigError) as ei:
                d.set_tally(True, bad)
            refused(ei, "threads", kind)
        with pytest.raises(ConfigError) as ei:
            d.set_tally("yes")
        refused(ei, "on", "type")
        d.set_tally(True, 32)
        assert all(rd.tally_mode is True and rd.tally_threads == 32 for rd in d.ranks)
    finally:
        d.close()


@pytest.mark.parametrize("tokens, tally, grid", [(0, False, 1), (1024, False, 1), (1025, True, 2), (2048, True, 2),
                                                 (2049, True, 3)])
def test_the_tally_path_is_taken_when_the_tokens_fill_more_than_one_count_cta(fake, monkeypatch, tokens, tally, grid):
    monkeypatch.setattr(driver, "pointer_ordinal", lambda addr: 0)      # the stand-in buffers are on GPU 0
    d = make_dispatch(max_tokens=2049)
    try:
        rd = d.ranks[0]
        assert rd.count_threads == 1024
        rd.set_inputs(x=np.zeros((tokens, 64), np.uint16), topk_idx=np.full((tokens, 2), -1, np.int32))
        assert (rd.tally, rd.tally_threads, rd.tally_grid) == (tally, 256, max(1, -(-tokens // 256)))
        rd.set_tally(None, 1024)                      # another chunk: refilled at once
        assert (rd.tally, rd.tally_grid) == (tally, grid)
        rd.set_tally(False)
        assert not rd.tally
    finally:
        d.close()


def test_dispatch_close_finishes_when_a_free_fails(fake):
    d = make_dispatch()
    fake.fail_free = {3}
    with pytest.raises(CudaError, match="cuMemFree"):
        d.close()
    assert sorted(fake.live) == [3]                   # only the one that failed
    assert all(s.closed for s in fake.streams) and all(e.closed for e in fake.events)


def test_release_runs_every_step_and_raises_the_first_failure():
    ran = []

    def step(i, fail=False):
        def f():
            ran.append(i)
            if fail:
                raise CudaError(f"call{i}", "CUDA_ERROR_UNKNOWN", 999)
        return f
    with pytest.raises(CudaError, match="call1"):
        release([step(0), step(1, True), step(2, True), step(3)])
    assert ran == [0, 1, 2, 3]
    during = ValueError("the constructor's own error")
    release([step(4, True), step(5)], during)          # not raised: noted on the constructor's error
    assert ran[-2:] == [4, 5] and "call4" in " ".join(during.__notes__)


def peer_of(shape=None):
    def peer(p, obj):
        if isinstance(obj, dict):
            return {**obj, "rank": p, "bus_id": f"0000:0{p + 2}:00.0", "shape": shape or obj["shape"]}
        return obj
    return peer


def make_rank(ex=None, **kw) -> DispatchRank:
    return DispatchRank(0, 2, ex or Exchange(peer=peer_of()), **{**ARGS, **kw})


def test_dispatch_rank_frees_everything_when_any_allocation_fails(fake):
    make_rank().close()
    total = fake.allocs
    assert fake.leaks() == []
    for n in range(total):
        fake.fail_alloc, fake.allocs = n, 0
        with pytest.raises(CudaError):
            make_rank()
        assert fake.leaks() == [], f"allocation {n} failed: leaked {fake.leaks()}"


def test_dispatch_rank_frees_everything_when_the_allgather_fails(fake):
    def late(n):
        raise ExchangeTimeout("allgather: rank 1 did not arrive within 60 s", ranks=[1])
    with pytest.raises(ExchangeTimeout):
        make_rank(Exchange(peer=peer_of(), on_allgather=late))
    assert fake.allocs and fake.leaks() == []


@pytest.mark.parametrize("n", [0, 3])
def test_dispatch_rank_frees_and_unmaps_when_an_ipc_open_fails(fake, n):
    fake.fail_ipc_open = n
    with pytest.raises(CudaError, match="cuIpcOpenMemHandle"):
        make_rank()
    assert fake.leaks() == []


def test_dispatch_rank_frees_and_unmaps_when_its_first_barrier_fails(fake):
    def late(n):
        raise ExchangeTimeout("barrier: rank 1 did not arrive", ranks=[1])
    with pytest.raises(ExchangeTimeout):
        make_rank(Exchange(peer=peer_of(), on_barrier=late))
    assert fake.leaks() == []


def test_dispatch_rank_frees_on_a_shape_mismatch(fake):
    other = DispatchShape(2, 2, 2, 8, 64)
    with pytest.raises(ConfigError, match="differs"):
        make_rank(Exchange(peer=peer_of(other)))
    assert fake.leaks() == []


def test_dispatch_rank_close_frees_its_buffers_when_the_barrier_fails(fake):
    ex = Exchange(peer=peer_of())
    me = make_rank(ex)
    assert fake.live and fake.mapped

    def late(n):
        raise ExchangeTimeout("barrier: rank 1 did not arrive", ranks=[1])
    ex.on_barrier = late
    with pytest.raises(ExchangeTimeout):
        me.close(sync=True)
    assert fake.leaks() == []
    me.close()                                          # closed: nothing more to do


def test_a_failing_with_block_keeps_its_own_error(fake):
    with pytest.raises(KeyError, match="the body's") as ei:
        with make_rank():
            fake.fail_free = {min(fake.live)}
            raise KeyError("the body's")
    assert "cuMemFree" in " ".join(ei.value.__notes__)            # the failed free is told, not raised
    assert len(fake.live) == 1 and not fake.mapped and all(s.closed for s in fake.streams)


# ---------------------------------------------------------------- check: the cause first

def write(rd, **fields):
    """Put a record on rank ``rd``'s device as its kernels would leave it."""
    rec = record_init()
    words = {name: i for i, name in enumerate(decode_record(rec))}
    for name, value in fields.items():
        rec[words[name]] = np.uint64(value)
    rd.diag.upload(rec)


def test_a_rejected_launch_is_reported_before_the_timeouts_it_caused(fake):
    d = make_dispatch()
    write(d.ranks[1], rejected=1)                      # rank 1's count kernel refused: it never counted
    write(d.ranks[0], count_timeouts=1, count_missing=0b10)
    d.ranks[0].state.fill(7)
    with pytest.raises(DispatchError) as ei:
        d.check()
    e = ei.value
    assert not isinstance(e, DispatchTimeout)
    assert e.rejected == {1: 1} and e.missing == [(0, 1, "counts")], (e.rejected, e.missing)
    assert e.problems[0].startswith("rank 1: p3_dispatch_count rejected its arguments") and "0x1" in e.problems[0]
    assert "rank 0" in e.problems[1] and "counts of rank 1" in e.problems[1], e.problems
    assert set(e.records) == {0, 1} and e.records[1]["rejected"] == 1
    assert not d.ranks[0].state.download().any()      # re-armed even though the error is not the timeout
    assert decode_record(d.ranks[1].diag.download(np.uint64))["rejected"] == 0     # the records reset
    d.check()                                          # and the next check is clean
    d.close()


def test_check_reads_each_record_once(fake, monkeypatch):
    d = make_dispatch()
    reads = []
    for rd in d.ranks:
        real = rd.record
        monkeypatch.setattr(rd, "record", lambda reset=True, real=real, r=rd.rank: reads.append(r) or real(reset))
    write(d.ranks[0], rejected=2)
    with pytest.raises(DispatchError):
        d.check()
    assert reads == [0, 1]
    d.close()


def test_timeouts_then_routing_errors_as_before(fake):
    d = make_dispatch()
    write(d.ranks[0], row_timeouts=1, row_missing=0b10, duplicate=1, duplicate_key=3)
    with pytest.raises(DispatchTimeout) as ei:
        d.check()
    assert ei.value.missing == [(0, 1, "rows")]
    write(d.ranks[1], overflow=2, overflow_expert=1)
    with pytest.raises(DispatchError) as ei:
        d.check()
    assert not ei.value.rejected and "rank 1:" in str(ei.value) and "did not fit" in str(ei.value)
    d.close()


def test_step_error_orders_the_causes():
    assert step_error({0: 0, 1: 0}, [], []) is None
    assert isinstance(step_error({}, [(0, 1, "rows")], ["rank 0: x"]), DispatchTimeout)
    e = step_error({0: 0, 1: 6}, [(0, 1, "rows")], ["rank 0: x"])
    assert isinstance(e, DispatchError) and e.rejected == {1: 6}
    assert e.problems[0].startswith("rank 1: p3_dispatch_send, p3_dispatch_wait rejected") and e.problems[-1] == \
        "rank 0: x"
    import pickle
    back = pickle.loads(pickle.dumps(e))
    assert back.rejected == e.rejected and back.missing == e.missing and str(back) == str(e)


def test_dispatch_rank_names_a_peer_that_rejected_its_launch(fake):
    ex = Exchange(peer=peer_of())
    me = make_rank(ex)
    ex.peer = lambda p, obj: (False, 2)                 # the peer's send refused: no rows, no flag
    write(me.rd, row_timeouts=1, row_missing=0b10)
    with pytest.raises(DispatchError) as ei:
        me.check()
    assert ei.value.rejected == {1: 2} and ei.value.missing == [(0, 1, "rows")]
    assert ei.value.problems[0].startswith("rank 1: p3_dispatch_send rejected")
    assert ex.gathered[-1] == (True, 0) and ex.barriers >= 3     # re-armed between two barriers
    write(me.rd)                                        # this rank fine, the peer's wait refused: its own
    ex.peer = lambda p, obj: (False, 4)
    me.check()
    write(me.rd, rejected=4)                            # this rank's own rejection
    ex.peer = lambda p, obj: (False, 0)
    with pytest.raises(DispatchError) as ei:
        me.check()
    assert ei.value.rejected == {0: 4}
    me.close()
    assert fake.leaks() == []


# ---------------------------------------------------------------- p3send.moe on p3send.torch (a stand-in torch)

class FakeTensor:
    def __init__(self, *shape, dtype=None, **kw):
        self.shape, self.dtype = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape, dtype

    def view(self, *a):
        return self

    def mul_(self, x):
        return self

    __mul__ = mul_

    def __getitem__(self, i):
        return FakeTensor(*self.shape[1:], dtype=self.dtype)

    def dim(self):
        return len(self.shape)


class TorchDevice:
    def __init__(self, spec, index=None):
        if isinstance(spec, TorchDevice):
            spec, index = spec.type, spec.index
        elif isinstance(spec, int):
            spec, index = "cuda", spec
        elif ":" in spec:
            spec, index = spec.split(":")[0], int(spec.split(":")[1])
        if spec not in ("cpu", "cuda", "meta"):
            raise RuntimeError(f"Expected one of cpu, cuda, meta device type at start of device string: {spec}")
        if index is not None and index < 0:
            raise RuntimeError(f"Device index must not be negative, got {index}")
        self.type, self.index = spec, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class _Torch(types.ModuleType):
    def __getattr__(self, name):          # any other dtype-like name torch.py may name at import
        if name.startswith("__"):
            raise AttributeError(name)
        return f"torch.{name}"


def fake_torch(current: int) -> types.ModuleType:
    """torch as far as p3send.torch and p3send.moe touch it on the host."""
    t = _Torch("torch")

    def custom_op(name, mutates_args=()):
        def wrap(fn):
            fn.register_fake = lambda f: f
            return fn
        return wrap
    t.library = types.SimpleNamespace(custom_op=custom_op)
    t.cuda = types.SimpleNamespace(current_device=lambda: current, init=lambda: None,
                                   current_stream=lambda *a: None, is_current_stream_capturing=lambda: False)
    t.device, t.Tensor = TorchDevice, FakeTensor
    for name in ("bfloat16", "float32", "int32", "int16", "int64", "float8_e4m3fn"):
        setattr(t, name, name)
    t.as_tensor = lambda obj, device=None: FakeTensor(*getattr(obj, "shape", (0,)))
    t.empty = t.zeros = t.randn = lambda *shape, **kw: FakeTensor(*shape, **kw)
    t.Generator = lambda device=None: types.SimpleNamespace(manual_seed=lambda s: None)
    return t


@pytest.fixture
def torch_mods(monkeypatch, fake):
    """(p3send.torch, p3send.moe) imported afresh over a stand-in torch whose current
    device is 3; sys.modules and the package's attributes are as they were afterwards."""
    monkeypatch.setitem(sys.modules, "torch", fake_torch(current=3))
    for name in ("p3send.torch", "p3send.moe"):
        monkeypatch.setitem(sys.modules, name, None)     # recorded, to be restored
        del sys.modules[name]
        monkeypatch.setattr(p3send, name.split(".")[1], None, raising=False)
    import p3send.moe as moe
    import p3send.torch as pt
    return pt, moe


def test_device_ordinal_maps_cuda_to_the_current_device_and_refuses_the_cpu(torch_mods):
    pt, _ = torch_mods
    assert [pt.device_ordinal(d) for d in (None, "cuda", "cuda:1", 2, TorchDevice("cuda"), TorchDevice("cuda:5"))] \
        == [3, 3, 1, 2, 3, 5]
    for bad in ("cpu", "meta", "gpu", -1):
        with pytest.raises(ConfigError) as ei:
            pt.device_ordinal(bad)
        assert ei.value.problems[0].startswith("device:"), ei.value.problems


def test_torch_dispatch_takes_the_current_device_for_cuda_and_refuses_the_cpu(torch_mods, fake, monkeypatch):
    _, moe = torch_mods
    seen = []

    def device(ordinal=None):
        seen.append(ordinal)
        return fake.dev
    monkeypatch.setattr(driver, "device", device)
    td = moe.TorchDispatch(2, device="cuda", combine=False, **ARGS)
    assert td.ordinal == 3 and seen[0] == 3
    td.close()
    before = fake.allocs
    with pytest.raises(ConfigError, match="device"):
        moe.TorchDispatch(2, device="cpu", combine=False, **ARGS)
    with pytest.raises(ConfigError, match="device"):
        moe.MoELayer(2, hidden=256, inter=64, n_experts=4, top_k=2, tokens=4, device="cpu")
    assert fake.allocs == before and fake.leaks() == []


def test_one_handle_registry_for_the_ops_of_torch_and_moe(torch_mods):
    pt, moe = torch_mods
    assert not hasattr(moe, "_objects") and not hasattr(moe, "_handles")
    other = object()
    h = pt.register(other)
    td = moe.TorchDispatch(2, combine=False, **ARGS)
    assert td.handle == h + 1                           # one counter
    assert pt.lookup(td.handle, moe.TorchDispatch) is td and pt.lookup(h) is other
    with pytest.raises(ConfigError, match="handle"):   # another op's object is not a dispatch
        moe.dispatch(h, *[None] * 10)
    td.close()
    assert pt.lookup(td.handle) is None
    pt.unregister(h)


def test_torch_dispatch_frees_its_dispatch_when_the_combine_fails(torch_mods, fake, monkeypatch):
    pt, moe = torch_mods

    def broken(*a, **k):
        raise oom("cuMemAlloc")
    monkeypatch.setattr(moe, "TorchCombine", broken)
    h = pt.register(None)
    with pytest.raises(CudaError):
        moe.TorchDispatch(2, **ARGS)
    assert fake.allocs and fake.leaks() == []
    assert pt.register(None) == h + 1                   # the failed one took no handle


@pytest.mark.parametrize("fail", ["combine 0", "gemm 0", "gemm 1", "weights"])
def test_moe_layer_frees_what_it_made_when_a_later_part_fails(torch_mods, fake, monkeypatch, fail):
    _, moe = torch_mods
    made = []

    def part(kind):
        class Part:
            def __init__(self, *a, **k):
                if fail == f"{kind} {sum(p.kind == kind for p in made)}":
                    raise oom("cuMemAlloc")
                self.kind, self.closed, self.cfgs, self.counts = kind, False, [None] * 2, None
                made.append(self)

            def bind(self, *a, **k):
                pass

            def prepare(self, *a, **k):
                return None

            def close(self):
                self.closed = True
        return Part

    def no_randn(*a, **k):
        raise oom("cuMemAlloc")
    monkeypatch.setattr(moe, "Combine", part("combine"))
    monkeypatch.setattr(moe, "GroupedGemmSend", part("gemm"))
    monkeypatch.setattr(moe.TorchDispatch, "attach", lambda self, x, topk_idx, scales=None: None)
    if fail == "weights":
        monkeypatch.setattr(sys.modules["torch"], "randn", no_randn)
    with pytest.raises(CudaError):
        moe.MoELayer(2, hidden=256, inter=64, n_experts=4, top_k=2, tokens=4)
    assert fake.allocs and fake.leaks() == []          # the dispatch's buffers
    assert [p.kind for p in made] == {"combine 0": [], "gemm 0": ["combine"], "gemm 1": ["combine", "gemm"],
                                      "weights": ["combine"]}[fail]
    assert all(p.closed for p in made), [(p.kind, p.closed) for p in made]


def test_moe_layer_close_closes_every_part_when_one_fails(torch_mods, fake, monkeypatch):
    _, moe = torch_mods
    closed = []

    class Part:
        def __init__(self, *a, **k):
            self.cfgs, self.counts, self.n = [None] * 2, None, len(closed)
            closed.append(False)

        def bind(self, *a, **k):
            pass

        def prepare(self, *a, **k):
            return None

        def close(self):
            closed[self.n] = True
            if self.n == 1:                             # the first GEMM's close fails
                raise oom("cuMemFree")
    monkeypatch.setattr(moe, "Combine", Part)
    monkeypatch.setattr(moe, "GroupedGemmSend", Part)
    monkeypatch.setattr(moe.TorchDispatch, "attach", lambda self, x, topk_idx, scales=None: None)
    layer = moe.MoELayer(2, hidden=256, inter=64, n_experts=4, top_k=2, tokens=4)
    with pytest.raises(CudaError, match="cuMemFree"):
        layer.close()
    assert closed == [True, True, True] and fake.leaks() == []


def test_moe_layer_refuses_arguments_of_the_wrong_type_by_name(torch_mods, fake):
    _, moe = torch_mods
    with pytest.raises(ConfigError) as ei:
        moe.MoELayer("2", hidden=256, inter=64, n_experts=4, top_k=2, tokens=4)
    assert ei.value.problems[0].startswith("n_ranks:") and fake.allocs == 0


@pytest.mark.parametrize("fused, align, want", [
    (True, 1, ("tally", "count", "send_quiet")),               # no padding to zero: no wait, no signal
    (True, 128, ("tally", "count", "send", "wait")),           # the wait zeroes the padding rows
    (False, 1, ("tally", "push", "layout", "send", "wait")),   # split: every wait on an earlier launch
    (False, 128, ("tally", "push", "layout", "send", "wait"))])
def test_the_all_ranks_step_launches(fake, fused, align, want):
    d = make_dispatch(fused=fused, align=align)
    try:
        assert d.all_parts() == want and not d.per_rank
        assert d.all.pdl                                       # PDL asked for; the driver may refuse it later
    finally:
        d.close()


def test_a_changed_rank_block_rebuilds_the_launch_rows_at_the_next_step(fake, monkeypatch):
    monkeypatch.setattr(driver, "pointer_ordinal", lambda addr: 0)
    d = make_dispatch()
    calls = []
    monkeypatch.setattr(d.all, "refresh", lambda: calls.append(1))
    monkeypatch.setattr(d.all, "launch", lambda stream, parts: calls.append(parts))
    try:
        d.enqueue()
        d.enqueue()                                            # nothing changed: no rebuild
        d.ranks[1].set_control(-1)
        d.enqueue()
        assert calls == [1, d.all_parts(), d.all_parts(), 1, d.all_parts()]
    finally:
        d.close()
