"""The launchers' argument checks and launch bookkeeping on the CPU, with a stand-in for the
driver (``FakeGPU``: memory, streams whose queued work runs at synchronization points,
events, launches that read their tensor maps when they run):

- a kernel parameter outside its type's range, or not an integer, is refused naming the
  kernel and the parameter (never wrapped), and the launchers' own values stay in range;
- the quantiser and the FP8 GEMM refuse buffers smaller than their kernels read or write
  (an explicit row stride included), naming the argument, before any driver call;
- the array helpers live once, in ``p3send.ops.args``;
- calling a grouped GEMM again while earlier calls are queued never rewrites what a queued
  launch reads; a repeated call launches with no upload and no host wait;
- a one-shot call's temporary stream is closed when the launch raises.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from p3send.abi.config import P3PeerSendConfig
from p3send.abi.errors import ConfigError, ConfigTypeError, CudaError
from p3send.cuda import driver, ptxdoc
from p3send.cuda.loader import Kernel, ParamBlock, ptx_dir
from p3send.ops import args as args_mod
from p3send.ops import gemm as gemm_mod
from p3send.ops import quant as quant_mod
from p3send.ops import send as send_mod
from p3send.ops.gemm_fp8 import GroupedGemmFp8Send
from p3send.ops.quant import QuantFp8
from p3send.ops.send import ScatterSend

DEV = SimpleNamespace(ordinal=0, cc=(9, 0), name="stand-in H200", sm_count=132, smem_optin=232448)


# ---------------------------------------------------------------- the stand-in driver

class FakeGPU:
    """Device memory, a log of what reached the "driver", the streams made."""

    def __init__(self):
        self.mem: dict[int, bytearray] = {}
        self.next = 0x7F00_0000_0000
        self.log: list = []
        self.streams: list = []
        self.launch_error = None
        self.handles = itertools.count(0x1000)

    def alloc(self, n: int) -> int:
        base = self.next
        self.next += (max(n, 1) + 0xFFFF) & ~0xFFFF
        self.mem[base] = bytearray(max(n, 1))
        return base

    def _at(self, addr: int, n: int):
        for base, m in self.mem.items():
            if base <= addr and addr + n <= base + len(m):
                return m, addr - base
        raise AssertionError(f"access of {n} bytes at {addr:#x} outside every allocation")

    def write(self, addr: int, data: bytes) -> None:
        m, off = self._at(addr, len(data))
        m[off:off + len(data)] = data

    def read(self, addr: int, n: int) -> bytes:
        m, off = self._at(addr, n)
        return bytes(m[off:off + n])

    def run_all(self) -> None:
        for s in self.streams:
            s.run()


class FakeStream:
    gpu: FakeGPU

    def __init__(self, null: bool = False):
        self.handle = next(self.gpu.handles)
        self.queue, self.ran, self.closed, self.capture = [], [], False, False
        self.gpu.streams.append(self)

    def run(self) -> None:
        while self.queue:
            self.queue.pop(0)()

    def synchronize(self) -> None:
        self.gpu.log.append(("stream_sync", self.handle))
        self.run()

    def wait(self, event) -> None:
        self.gpu.log.append(("wait", self.handle))
        if event.stream is not None:
            event.stream.run()        # later work here follows the event's: modelled as done

    def capturing(self) -> bool:
        return self.capture

    def close(self) -> None:
        self.closed = True

    def __int__(self):
        return self.handle


class FakeEvent:
    gpu: FakeGPU

    def __init__(self, timing: bool = True):
        self.stream = None

    def record(self, stream):
        self.stream = stream
        return self

    def synchronize(self) -> None:
        self.gpu.log.append(("event_sync", None if self.stream is None else self.stream.handle))
        if self.stream is not None:
            self.stream.run()

    def close(self) -> None:
        pass


class FakeBuffer:
    gpu: FakeGPU

    def __init__(self, nbytes: int, *, fill=None, stream=None):
        self.nbytes, self.ordinal = int(nbytes), 0
        self.ptr = self.gpu.alloc(self.nbytes)

    def upload(self, arr, stream=None, offset: int = 0) -> None:
        data = np.ascontiguousarray(arr).tobytes()
        addr = self.ptr + offset
        if stream is None:
            # cuMemcpyHtoD is not ordered after work queued on non-blocking streams: it may land
            # first; the cuCtxSynchronize after it then runs whatever was queued
            self.gpu.write(addr, data)
            self.gpu.log += [("upload", addr, "sync"), ("ctx_sync", None)]
            self.gpu.run_all()
        else:
            self.gpu.log.append(("upload", addr, stream.handle))
            stream.queue.append(lambda: self.gpu.write(addr, data))
            stream.synchronize()

    def fill(self, byte, stream=None, offset: int = 0, nbytes=None) -> None:
        n = self.nbytes - offset if nbytes is None else nbytes
        self.gpu.write(self.ptr + offset, bytes([byte & 0xFF]) * n)

    def free(self) -> None:
        pass

    def __int__(self):
        return self.ptr


def fake_tensor_map(dtype, addr, dims, box, *, strides=None, swizzle=128, l2_promotion=256) -> bytes:
    """128 bytes that start with the map's address (what a launch that reads it shows)."""
    tail = hashlib.sha256(repr((dtype, tuple(dims), tuple(box), strides, swizzle)).encode()).digest() * 4
    return (struct.pack("<Q", int(addr)) + tail)[:128]


def stand_in_kernel(entry: str, dev=DEV) -> Kernel:
    """A Kernel with the shipped header's parameter table, loaded nowhere."""
    k = Kernel.__new__(Kernel)
    k.module = SimpleNamespace(device=dev, name=f"{entry}.ptx")
    k.name, k.func = entry, entry
    k.params = ptxdoc.parse_header((ptx_dir() / f"{entry}.ptx").read_text())[entry].params
    return k


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGPU()
    g.shapes = []           # (kernel, block, dynamic shared memory) of every launch
    for cls in (FakeStream, FakeEvent, FakeBuffer):
        monkeypatch.setattr(cls, "gpu", g, raising=False)

    def launch(func, grid, block, smem, stream, param_addrs, name="kernel"):
        stream = driver.as_stream(stream)
        if g.launch_error is not None:
            raise g.launch_error
        g.log.append(("launch", name, stream.handle))
        g.shapes.append((name, tuple(block), smem))
        if name in ("p3_gemm_fp8_send", "p3_gemm_fp8_send_wide", "p3_gemm_send"):
            tmaps = ctypes.c_uint64.from_address(int(param_addrs[2])).value   # copied at the launch call
            # what the kernel reads when it runs: the address in A's tensor map
            stream.queue.append(lambda: stream.ran.append(struct.unpack("<Q", g.read(tmaps, 8))[0]))

    def no_call(name, *a, **kw):
        raise AssertionError(f"a driver call ({name}) reached the real driver")

    monkeypatch.setattr(driver, "call", no_call)
    monkeypatch.setattr(driver, "Stream", FakeStream)
    monkeypatch.setattr(driver, "Event", FakeEvent)
    monkeypatch.setattr(driver, "DeviceBuffer", FakeBuffer)
    monkeypatch.setattr(driver, "tensor_map", fake_tensor_map)
    monkeypatch.setattr(driver, "launch", launch)
    monkeypatch.setattr(driver, "ensure_current", lambda dev: None)
    monkeypatch.setattr(driver, "set_max_dynamic_smem", lambda func, n: None)
    monkeypatch.setattr(driver, "pointer_ordinal", lambda addr: 0)
    monkeypatch.setattr(driver, "device", lambda ordinal=None: DEV)
    for mod in (gemm_mod, quant_mod, send_mod):
        monkeypatch.setattr(mod, "kernel", lambda entry, dev=None: stand_in_kernel(entry))
    # the GEMMs' bf16-wire module is loaded from its text: a module of stand-in kernels
    monkeypatch.setattr(gemm_mod, "load", lambda text, device=None, name=None: StandInModule(text))
    return g


class StandInModule:
    """``load``'s result for a module text on the stand-in driver: its kernels, by entry name
    (``text`` kept for the tests to read)."""

    def __init__(self, text: str):
        self.text, self.device, self.name = text, DEV, "<stand-in module>"

    def __getitem__(self, entry: str) -> Kernel:
        k = stand_in_kernel(entry)
        k.module = self
        return k


class FakeTensor:
    """What the launchers read of a torch tensor (torch is not installed here): strides in
    elements, like torch's."""

    def __init__(self, shape, dtype: str, item: int, strides=None, ptr: int = 0x7E00_0000_0000):
        self.shape, self.dtype, self.item, self.ptr = tuple(shape), f"torch.{dtype}", item, ptr
        self.dense = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.strides = self.dense if strides is None else tuple(strides)
        self.device = SimpleNamespace(type="cuda", index=0)

    def data_ptr(self):
        return self.ptr

    def element_size(self):
        return self.item

    def stride(self):
        return self.strides

    def numel(self):
        return int(np.prod(self.shape))

    def is_contiguous(self):
        return all(s == d for s, d, n in zip(self.strides, self.dense, self.shape) if n != 1)


class FakeCAI:
    """A ``__cuda_array_interface__`` object (cupy-like): byte strides, None when dense."""

    def __init__(self, shape, typestr: str, strides=None, ptr: int = 0x7D00_0000_0000):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": strides}


# ---------------------------------------------------------------- kernel parameters: range and type

def block(entry: str) -> ParamBlock:
    return ParamBlock(stand_in_kernel(entry))


@pytest.mark.parametrize("entry, name, value", [
    ("p3_recv_reduce", "timeout_ns", -1), ("p3_recv_reduce", "timeout_ns", 1 << 64),
    ("p3_recv_reduce", "n_tokens", 1 << 32), ("p3_recv_reduce", "n_experts", -1),
    ("p3_scatter_send", "p3_control", 1 << 31), ("p3_scatter_send", "p3_control", -(1 << 31) - 1),
    ("p3_quant_fp8", "k_dim", 1 << 32), ("p3_gemm_fp8_send", "c_row_stride", -16)])
def test_an_integer_outside_its_parameter_type_is_refused_naming_kernel_and_parameter(entry, name, value):
    blk = block(entry)
    with pytest.raises(ConfigError) as e:
        blk.set(**{name: value})
    assert f"{entry}.{name}" in str(e.value) and str(value) in str(e.value)
    assert blk.get(name).value == 0                        # nothing stored


@pytest.mark.parametrize("value", [1.5, 2.0, np.float32(3), True, np.bool_(False), None, "16"])
def test_a_non_integer_is_refused_naming_kernel_and_parameter(value):
    with pytest.raises(ConfigTypeError, match=r"p3_quant_fp8\.rows: expected an integer"):
        block("p3_quant_fp8").set(rows=value)


def test_the_type_ranges_edges_are_stored_exactly(gpu):
    rr = block("p3_recv_reduce").set(timeout_ns=(1 << 64) - 1, n_tokens=(1 << 32) - 1, n_experts=np.uint32(7))
    assert (rr.get("timeout_ns").value, rr.get("n_tokens").value, rr.get("n_experts").value) == \
        ((1 << 64) - 1, (1 << 32) - 1, 7)
    sc = block("p3_scatter_send").set(p3_control=-1)          # the deliberate "send off" value
    assert sc.get("p3_control").value == -1
    sc.set(p3_control=-(1 << 31)).set(p3_control=(1 << 31) - 1, flags=(1 << 32) - 1)
    assert sc.get("p3_control").value == (1 << 31) - 1
    buf = FakeBuffer(64)
    assert sc.set(c_ptr=buf).get("c_ptr").value == buf.ptr     # a buffer: its address
    with pytest.raises(ConfigError, match=r"p3_scatter_send\.n_experts: expected a u32 value"):
        sc.set(n_experts=buf)                                  # an address does not fit a u32


def test_peer_addresses_are_range_checked_too():
    blk = block("p3_scatter_send")
    with pytest.raises(ConfigError, match=r"p3_scatter_send\.count_ptrs\[1\]: expected a u64 value"):
        blk.set(count_ptrs=[16, -8])
    with pytest.raises(ConfigTypeError, match=r"p3_scatter_send\.count_ptrs\[0\]"):
        blk.set(count_ptrs=[1.0])
    assert list(blk.set(count_ptrs=[8, (1 << 64) - 8]).get("count_ptrs").p)[:3] == [8, (1 << 64) - 8, 0]


def test_the_launchers_own_values_stay_in_range(gpu):
    """Edge values the launchers pass on purpose: p3_control -1 (send off), the tile launch's
    flags (grid << 16), the u64 strides of the quantiser, the FP8 GEMM's sizes."""
    s = ScatterSend(2, device=DEV)
    c, offs = FakeBuffer(1 << 16), FakeBuffer(12)
    blk = s.prepare(P3PeerSendConfig.disabled(), c, offs, p3_control=-1, expert_offsets_host=np.array([0, 1, 2]))
    assert blk.get("p3_control").value == -1 and blk.get("flags").value >> 16 == 132
    q = QuantFp8(DEV)
    blk = q.prepare(FakeBuffer(2 * 7168 * 8), FakeBuffer(7168 * 8), FakeBuffer(4 * 56 * 8), rows=8, k_dim=7168)
    assert (blk.get("rows").value, blk.get("k_dim").value, blk.get("s_col_stride").value) == (8, 7168, 32)
    g = GroupedGemmFp8Send(2, device=DEV)
    a, sa, b, sb, off, cc = fp8_buffers()
    blk = g.prepare(P3PeerSendConfig.disabled(), a, sa, b, sb, off, cc, rows=256, n_cols=128, k_dim=128)
    assert (blk.get("n_cols").value, blk.get("k_dim").value, blk.get("bm").value) == (128, 128, 128)


# ---------------------------------------------------------------- sizes, before any driver call

def test_the_quantiser_refuses_small_x_and_q_before_any_driver_call(gpu):
    q = QuantFp8(DEV)
    x, qq, s = FakeBuffer(256), FakeBuffer(128), FakeBuffer(4 * 4096 * 56)
    gpu.log.clear()
    with pytest.raises(ConfigError) as e:
        q.prepare(x, qq, s, rows=4096, k_dim=7168)
    msg = str(e.value)
    assert "x: expected at least 58720256 bytes (4096 rows of 14336 bytes at stride 14336), got 256" in msg
    assert "q: expected at least 29360128 bytes (4096 rows of 7168 bytes at stride 7168), got 128" in msg
    assert gpu.log == []


def test_an_explicit_row_stride_must_fit_the_array(gpu):
    q = QuantFp8(DEV)
    rows, k = 64, 256
    x = FakeTensor((rows, k), "bfloat16", 2)
    qq = FakeTensor((rows, k), "float8_e4m3fn", 1, ptr=0x7E10_0000_0000)
    s = FakeTensor((rows, 2), "float32", 4, strides=(1, 64), ptr=0x7E20_0000_0000)
    q.prepare(x, qq, s)                                               # their own strides: fine
    with pytest.raises(ConfigError) as e:
        q.prepare(x, qq, s, x_row_stride=4 * k, q_row_stride=2 * k)   # twice their rows' length
    msg = str(e.value)
    assert f"x: expected at least {63 * 4 * k + 2 * k} bytes" in msg and f"got {rows * 2 * k}" in msg
    assert f"q: expected at least {63 * 2 * k + k} bytes" in msg and f"got {rows * k}" in msg
    # a strided CAI view's own bytes are what it covers: its stride fits, a wider one does not
    xv = FakeCAI((rows, k), "<u2", strides=(4 * k, 2))
    q.prepare(xv, qq, s)
    with pytest.raises(ConfigError, match="x: expected at least"):
        q.prepare(xv, qq, s, x_row_stride=8 * k)


def test_the_fp8_gemm_checks_a_and_a_strided_c(gpu):
    g = GroupedGemmFp8Send(2, device=DEV)
    a, sa, b, sb, off, c = fp8_buffers()
    cfg = P3PeerSendConfig.disabled()
    common = dict(rows=256, n_cols=128, k_dim=128)
    gpu.log.clear()
    with pytest.raises(ConfigError) as e:
        g.prepare(cfg, FakeBuffer(256), sa, b, sb, off, c, **common)
    assert "a: expected at least 32768 bytes (256 rows of 128 bytes at stride 128), got 256" in str(e.value)
    half = FakeTensor((128, 128), "bfloat16", 2, strides=(256, 1))     # 128 rows of a wider C
    with pytest.raises(ConfigError, match=r"c: expected at least \d+ bytes \(256 rows at stride 512\)"):
        g.prepare(cfg, a, sa, b, sb, off, half, **common)
    assert gpu.log == []


def test_the_fp8_gemm_takes_deepgemms_tensors(gpu):
    """The GPU test's valid call (DeepGEMM's tensors as they are), with stand-in tensors."""
    g = GroupedGemmFp8Send(2, device=DEV)
    rows, k, n = 256, 256, 128
    a = FakeTensor((rows, k), "float8_e4m3fn", 1, ptr=0x7E00_0000_0000)
    sa = FakeTensor((rows, 2), "float32", 4, strides=(1, rows), ptr=0x7E10_0000_0000)   # the MN-major view
    b = FakeTensor((2, n, k), "float8_e4m3fn", 1, ptr=0x7E20_0000_0000)
    sb = FakeTensor((2, 1, 2), "float32", 4, ptr=0x7E30_0000_0000)
    off = FakeTensor((3,), "int32", 4, ptr=0x7E40_0000_0000)
    c = FakeTensor((rows, n), "bfloat16", 2, ptr=0x7E50_0000_0000)
    blk = g.prepare(P3PeerSendConfig.disabled(), a, sa, b, sb, off, c)
    assert blk.get("c_ptr").value == c.ptr and blk.get("c_row_stride").value == 2 * n
    wide = FakeTensor((rows, n), "bfloat16", 2, strides=(2 * n, 1), ptr=0x7E60_0000_0000)   # C in a wider array
    assert g.prepare(P3PeerSendConfig.disabled(), a, sa, b, sb, off, wide).get("c_row_stride").value == 4 * n


def test_the_wide_kernel_launches_128_row_tiles_in_its_own_shape(gpu):
    """128-row tiles launch p3_gemm_fp8_send_wide (512 threads, its shared memory), 64-row
    ones p3_gemm_fp8_send (384); wide=False launches p3_gemm_fp8_send for both (a linked
    launcher too: tests/cpu/test_bf16_only_modules.py); one block serves either (prepare
    binds it); variant_shape needs a variant."""
    from p3send.ops import gemm_fp8
    a, sa, b, sb, off, _ = fp8_buffers(rows=256, k=128, n=128)
    c = FakeBuffer(2 * 256 * 128)
    sizes = dict(rows=256, n_cols=128, k_dim=128)
    g, narrow = GroupedGemmFp8Send(2, device=DEV), GroupedGemmFp8Send(2, device=DEV, wide=False)
    assert g.wide and not narrow.wide
    blk = g.k.params_block()
    s = driver.Stream()
    for launcher, bm, want in ((g, 128, gemm_fp8.WIDE), (g, 64, (gemm_fp8.ENTRY, 384, gemm_fp8.SMEM)),
                               (narrow, 128, (gemm_fp8.ENTRY, 384, gemm_fp8.SMEM))):
        gpu.shapes.clear()
        launcher.launch(s, launcher.prepare(P3PeerSendConfig.disabled(), a, sa, b, sb, off, c, bm=bm, **sizes,
                                            into=blk if launcher is g else None))
        assert gpu.shapes == [(want[0], (want[1],), want[2])], (bm, gpu.shapes)
    with pytest.raises(ConfigError, match="wide: expected False or None with linked=True"):
        GroupedGemmFp8Send(2, device=DEV, wide=True, linked=True)
    with pytest.raises(ConfigError, match="variant_shape: expected None without a variant_ptx"):
        GroupedGemmFp8Send(2, device=DEV, variant_shape=(512, 1024))


# ---------------------------------------------------------------- one set of array helpers

def test_the_array_helpers_are_one_set_in_args():
    import p3send.ops.gemm_fp8 as fp8_mod
    for gone in ("_is_torch", "_shape", "_addr", "_size"):
        assert not hasattr(gemm_mod, gone), f"ops.gemm still has its own {gone}"
    assert quant_mod.array_layout is args_mod.array_layout and fp8_mod.array_layout is args_mod.array_layout
    for path in Path(args_mod.__file__).parent.glob("*.py"):
        if path.name != "args.py":
            found = re.findall(r"^def (array_layout|nbytes|span|contiguous|address|_torch_like|is_torch)\(",
                               path.read_text(), re.M)
            assert not found, f"{path.name} defines its own {found}"


def test_the_array_helpers_read_each_kind_of_argument(gpu):
    t = FakeTensor((4, 8), "bfloat16", 2)
    v = FakeTensor((4, 8), "bfloat16", 2, strides=(16, 1))
    cai = FakeCAI((4, 8), "<u2")
    caiv = FakeCAI((4, 8), "<u2", strides=(32, 2))
    buf = FakeBuffer(100)
    assert args_mod.array_layout(t) == ((4, 8), (16, 2), 2) and args_mod.array_layout(v) == ((4, 8), (32, 2), 2)
    assert args_mod.array_layout(cai) == ((4, 8), (16, 2), 2) and args_mod.array_layout(buf) == (None, None, None)
    assert [args_mod.contiguous(o) for o in (t, v, cai, caiv, buf, 5)] == [True, False, True, False, True, None]
    assert [args_mod.nbytes(o) for o in (t, v, cai, caiv, buf, 5)] == [64, None, 64, None, 100, None]
    assert [args_mod.span(o) for o in (t, v, cai, caiv, buf, 5)] == [64, 3 * 32 + 16, 64, 3 * 32 + 16, 100, None]
    assert args_mod.span(FakeTensor((0, 8), "bfloat16", 2)) == 0
    assert args_mod.address(t) == t.ptr and args_mod.address(buf) == buf.ptr and args_mod.address(7) == 7


# ---------------------------------------------------------------- calls queued back to back

def fp8_buffers(rows: int = 256, k: int = 128, n: int = 128, e: int = 2):
    """a, sa (flat MN-major), b, sb, device offsets, c of an FP8 problem, as stand-in buffers."""
    return (FakeBuffer(rows * k), FakeBuffer(4 * rows * (k // 128)), FakeBuffer(e * n * k),
            FakeBuffer(4 * e * (n // 128) * (k // 128)), FakeBuffer(4 * (e + 1)), FakeBuffer(rows * 2 * n))


def call(g, a, rest, stream):
    sa, b, sb, off, c = rest
    g(P3PeerSendConfig.disabled(), a, sa, b, sb, off, c, rows=256, n_cols=128, k_dim=128, stream=stream)


def test_a_repeated_call_launches_with_no_upload_and_no_host_wait(gpu):
    g = GroupedGemmFp8Send(2, device=DEV)
    a, *rest = fp8_buffers()
    s = FakeStream()
    call(g, a, rest, s)
    gpu.log.clear()
    for _ in range(3):
        call(g, a, rest, s)
    assert gpu.log == [("launch", "p3_gemm_fp8_send_wide", s.handle)] * 3     # 128-row tiles: the wide kernel
    s.synchronize()
    assert s.ran == [a.ptr] * 4


def test_the_bf16_gemm_calls_share_the_cache(gpu):
    from p3send.ops.gemm import GroupedGemmSend
    g = GroupedGemmSend(2, device=DEV)
    x1, x2, w, off, c = (FakeBuffer(2 * 128 * 64), FakeBuffer(2 * 128 * 64), FakeBuffer(2 * 2 * 256 * 64),
                         FakeBuffer(12), FakeBuffer(128 * 512))
    s = FakeStream()
    for x in (x1, x2, x1):
        g(P3PeerSendConfig.disabled(), x, w, off, c, rows=128, n_cols=256, k_dim=64, stream=s)
    s.synchronize()
    assert s.ran == [x1.ptr, x2.ptr, x1.ptr]
    assert [e[0] for e in gpu.log].count("upload") == 2          # two distinct sets of device arguments


def test_new_arguments_never_rewrite_what_a_queued_launch_reads(gpu):
    g = GroupedGemmFp8Send(2, device=DEV)
    a1, *rest = fp8_buffers()
    a2 = FakeBuffer(256 * 128)
    s = FakeStream()
    for a in (a1, a2, a1, a2):
        call(g, a, rest, s)
    s.synchronize()
    assert s.ran == [a1.ptr, a2.ptr, a1.ptr, a2.ptr]
    assert not any(x[0] == "ctx_sync" for x in gpu.log), "a whole-context synchronization in a stream-ordered call"


def test_a_full_cache_rewrites_its_oldest_slot_only_after_its_launches(gpu):
    g = GroupedGemmFp8Send(2, device=DEV)
    g.DEVICE_ARGS_SLOTS = 2
    a1, *rest = fp8_buffers()
    a2, a3 = FakeBuffer(256 * 128), FakeBuffer(256 * 128)
    s1, s2, s3 = FakeStream(), FakeStream(), FakeStream()
    call(g, a1, rest, s1)
    call(g, a2, rest, s2)
    gpu.log.clear()
    call(g, a3, rest, s3)                 # evicts a1's slot, whose launch on s1 has not run
    kinds = [x[0] for x in gpu.log]
    assert kinds.index("event_sync") < kinds.index("upload"), gpu.log
    assert s1.ran == [a1.ptr]             # it ran, reading a1's maps, before the slot was rewritten
    call(g, a2, rest, s1)                 # a2's slot, last read on s2: s1 waits for that first
    assert ("wait", s1.handle) in gpu.log
    for s in (s1, s2, s3):
        s.synchronize()
    assert (s1.ran, s2.ran, s3.ran) == ([a1.ptr, a2.ptr], [a2.ptr], [a3.ptr])


def test_a_call_under_graph_capture_is_refused_before_any_upload(gpu):
    g = GroupedGemmFp8Send(2, device=DEV)
    a, *rest = fp8_buffers()
    s = FakeStream()
    s.capture = True
    gpu.log.clear()
    with pytest.raises(ConfigError, match="cannot be captured"):
        call(g, a, rest, s)
    assert gpu.log == []
    s.capture = False
    call(g, a, rest, s)                   # the refused call left nothing behind
    s.synchronize()
    assert s.ran == [a.ptr]


# ---------------------------------------------------------------- the temporary stream

@pytest.mark.parametrize("which", ["gemm_fp8", "quant", "scatter"])
def test_the_temporary_stream_is_closed_when_the_launch_raises(gpu, which):
    gpu.launch_error = CudaError("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE", 1, "stand-in")
    if which == "gemm_fp8":
        a, *rest = fp8_buffers()
        run = lambda: call(GroupedGemmFp8Send(2, device=DEV), a, rest, None)   # noqa: E731
    elif which == "quant":
        run = lambda: QuantFp8(DEV)(FakeBuffer(1 << 12), FakeBuffer(1 << 12), FakeBuffer(1 << 12),  # noqa: E731
                                    rows=4, k_dim=128)
    else:
        run = lambda: ScatterSend(1, device=DEV)(P3PeerSendConfig.disabled(), FakeBuffer(64),  # noqa: E731
                                                 FakeBuffer(8), p3_control=-1)
    with pytest.raises(CudaError, match="stand-in"):
        run()
    assert gpu.streams and all(s.closed for s in gpu.streams)
