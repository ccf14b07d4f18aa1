"""The one seam to the CUDA driver: every ``cuda.bindings.driver`` call lives here.

Importing this module does not touch CUDA; the first call that needs the driver runs
``cuInit`` (lazily, once). Each driver call goes through ``call()``, which turns a
non-success ``CUresult`` into ``CudaError`` (``ContextLostError`` for sticky errors)
naming the call, the error name and code, and the driver's explanation.

Threading: the primary context of the chosen device is made current on the thread
that first asks for the device; use one thread per device (or call ``activate``).
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from ..abi.errors import ConfigError, ConfigTypeError, ContextLostError, CudaError, NoDeviceError

# Errors after which the context is unusable (CUDA docs: "the process must be terminated").
_STICKY = {214, 700, 701, 702, 710, 714, 715, 716, 717, 718, 719, 720, 999}


@functools.cache
def _cu():
    """The driver module, initialised once. Raises NoDeviceError without a driver/GPU."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:  # cuda-bindings not installed
        raise NoDeviceError(f"cuda-bindings is not installed ({e}); pip install 'cuda-bindings>=12.9,<14'") from e
    try:
        err, = cu.cuInit(0)
    except RuntimeError as e:  # cuda.pathfinder: libcuda.so not found (no driver)
        raise NoDeviceError(f"no CUDA driver on this machine: {e}") from e
    if err != cu.CUresult.CUDA_SUCCESS:
        raise NoDeviceError(f"cuInit failed: {_err_name(cu, err)} ({int(err)}): {_err_str(cu, err)}")
    return cu


def _err_name(cu, err) -> str:
    r = cu.cuGetErrorName(err)
    return r[1].decode() if r[0] == cu.CUresult.CUDA_SUCCESS and r[1] else f"CUresult {int(err)}"


def _err_str(cu, err) -> str:
    r = cu.cuGetErrorString(err)
    return r[1].decode() if r[0] == cu.CUresult.CUDA_SUCCESS and r[1] else ""


def call(name: str, *args, log: str = ""):
    """Call ``cuda.bindings.driver.<name>(*args)``; return its outputs (None, one value
    or a tuple) or raise CudaError naming the call."""
    cu = _cu()
    res = getattr(cu, name)(*args)
    err, out = res[0], res[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        _raise(cu, name, err, log)
    return None if not out else (out[0] if len(out) == 1 else out)


def _raise(cu, name: str, err, log: str = ""):
    """Raise CudaError (ContextLostError for a sticky error) for ``err`` returned by ``name``."""
    code = int(err)
    cls = ContextLostError if code in _STICKY else CudaError
    expl = _err_str(cu, err)
    if cls is ContextLostError:
        expl += " [sticky error: this CUDA context is lost; restart the process]"
    raise cls(name, _err_name(cu, err), code, expl, log)


def available() -> tuple[bool, str]:
    """(True, description) when a usable GPU is present, else (False, the reason)."""
    try:
        n = call("cuDeviceGetCount")
    except (NoDeviceError, CudaError) as e:
        return False, str(e)
    if n < 1:
        return False, "the CUDA driver reports no GPU"
    return True, f"{n} GPU(s)"


def device_count() -> int:
    return call("cuDeviceGetCount")


def pci_bus_id(ordinal: int) -> str:
    """PCI bus id of GPU ``ordinal`` ("0000:19:00.0"): names one physical GPU the same way in
    every process, whatever each process's CUDA_VISIBLE_DEVICES."""
    raw = call("cuDeviceGetPCIBusId", 32, call("cuDeviceGet", ordinal))
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    return raw.split(b"\0", 1)[0].decode()


def ordinal_of_pci_bus_id(bus_id: str) -> int | None:
    """This process's ordinal of the GPU at ``bus_id``, or None when it is not visible here."""
    try:
        return int(call("cuDeviceGetByPCIBusId", bus_id.encode()))
    except CudaError as e:
        if e.name in ("CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_INVALID_VALUE"):
            return None
        raise


def can_access_peer(ordinal: int, peer: int) -> bool:
    """Whether kernels on GPU ``ordinal`` can access memory of GPU ``peer`` (device
    handles only: no context is created on ``peer``)."""
    if ordinal == peer:
        return True
    return bool(call("cuDeviceCanAccessPeer", call("cuDeviceGet", ordinal), call("cuDeviceGet", peer)))


class Device:
    """A GPU and its primary context (retained for the life of the process). ``ordinal``:
    the GPU's index among those the driver reports (``device()`` makes each one once)."""

    def __init__(self, ordinal: int = 0):
        cu = _cu()
        n = call("cuDeviceGetCount")
        if not (0 <= ordinal < n):
            raise NoDeviceError(f"device {ordinal} requested, the driver reports {n} GPU(s)")
        self.ordinal = ordinal
        self.handle = call("cuDeviceGet", ordinal)
        self.context = call("cuDevicePrimaryCtxRetain", self.handle)
        self.activate()
        A = cu.CUdevice_attribute
        attr = lambda a: call("cuDeviceGetAttribute", a, self.handle)  # noqa: E731
        self.cc = (attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                   attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2_bytes = attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.smem_optin = attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.smem_per_sm = attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        self.name = call("cuDeviceGetName", 256, self.handle).split(b"\0")[0].decode()

    def activate(self) -> None:
        """Make this GPU's primary context current in the calling thread."""
        global _current
        call("cuCtxSetCurrent", self.context)
        _current = self.ordinal

    def synchronize(self) -> None:
        """Wait for all work on this GPU (``cuCtxSynchronize``); raises CudaError on a failed kernel."""
        self.activate()
        call("cuCtxSynchronize")

    def can_access_peer(self, other: Device) -> bool:
        """Whether kernels here can reach ``other``'s memory by peer access (NVLink or PCIe P2P).

        Args:
            other: another Device.
        """
        return bool(call("cuDeviceCanAccessPeer", self.handle, other.handle))

    def enable_peer_access(self, other: Device) -> None:
        """Let kernels on this device access ``other``'s memory (idempotent).

        Args:
            other: the Device whose memory this one's kernels will read and write.

        Raises:
            CudaError: no P2P path between the two GPUs, or the driver refused.
        """
        if other.ordinal == self.ordinal:
            return
        if not self.can_access_peer(other):
            raise CudaError("cuDeviceCanAccessPeer", "PEER_ACCESS_UNSUPPORTED", 0,
                            f"GPU {self.ordinal} cannot reach GPU {other.ordinal} by P2P "
                            "(no NVLink/PCIe P2P path); p3send needs direct peer access")
        self.activate()
        try:
            call("cuCtxEnablePeerAccess", other.context, 0)
        except CudaError as e:
            if e.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                raise

    def __repr__(self):
        return f"Device({self.ordinal}: {self.name}, sm_{self.cc[0]}{self.cc[1]}, {self.sm_count} SMs)"


_devices: dict[int, Device] = {}
_current: int | None = None   # ordinal whose context this process last made current


def ensure_current(dev: Device) -> None:
    """Make ``dev``'s context current if another device's is (one process, several GPUs)."""
    if _current != dev.ordinal:
        dev.activate()


def env_ordinal(var: str, text: str | None = None) -> int:
    """A GPU ordinal from environment variable ``var`` (default 0); ConfigError if it is none."""
    text = os.environ.get(var, "0") if text is None else text
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError([f"{var}: expected a GPU ordinal (an integer >= 0), got {text!r}"], "environment") from None
    if value < 0:
        raise ConfigError([f"{var}: expected a GPU ordinal (an integer >= 0), got {text!r}"], "environment")
    return value


def device(ordinal: int | None = None) -> Device:
    """The Device for ``ordinal`` (default: $P3SEND_DEVICE or 0), created once, made current."""
    if ordinal is None:
        ordinal = env_ordinal("P3SEND_DEVICE")
    dev = _devices.get(ordinal)
    if dev is None:
        dev = _devices[ordinal] = Device(ordinal)
    else:
        dev.activate()
    return dev


class Stream:
    """A non-blocking stream (or the legacy default stream when ``null``). ``as_stream``
    wraps anyone else's stream without owning it."""

    def __init__(self, null: bool = False):
        cu = _cu()
        self.handle = cu.CUstream(0) if null else call("cuStreamCreate", 1)  # CU_STREAM_NON_BLOCKING
        self._owned = not null
        self._source = None

    @classmethod
    def borrow(cls, handle, source=None) -> Stream:
        """A non-owning wrapper of an existing stream handle (``close`` leaves it alone);
        ``source`` (the object it came from) is kept alive with the wrapper."""
        s = cls.__new__(cls)
        s.handle, s._owned, s._source = _cu().CUstream(int(handle)), False, source
        return s

    def synchronize(self) -> None:
        """Wait until everything enqueued on this stream has completed."""
        call("cuStreamSynchronize", self.handle)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host wait).

        Args:
            event: a recorded Event (any stream, this GPU or a peer).
        """
        call("cuStreamWaitEvent", self.handle, event.handle, 0)

    def query(self) -> bool:
        """True when everything enqueued so far has completed (cuStreamQuery)."""
        cu = _cu()
        err = cu.cuStreamQuery(self.handle)[0]
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != cu.CUresult.CUDA_SUCCESS:
            _raise(cu, "cuStreamQuery", err)
        return True

    def capturing(self) -> bool:
        """Whether this stream is being captured into a CUDA graph (by p3send, torch, ...)."""
        cu = _cu()
        st = call("cuStreamIsCapturing", self.handle)
        return st != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def close(self) -> None:
        """Destroy the stream if this object created it (a borrowed one is left alone); idempotent."""
        if self._owned:
            self._owned = False
            call("cuStreamDestroy", self.handle)

    def __int__(self):
        return int(self.handle)


def as_stream(obj) -> Stream:
    """Any stream as a ``Stream``, never owned (closing the result leaves it alone):
    a ``Stream`` (returned as is), an object with the ``__cuda_stream__`` protocol
    (``(version, handle)``), a torch stream (``cuda_stream``), a cupy stream (``ptr``),
    a ``CUstream``/``cudaStream_t``, or a raw handle (int; 0 = the legacy default stream).
    Raises ConfigTypeError naming what it got."""
    if isinstance(obj, Stream):
        return obj
    proto = getattr(obj, "__cuda_stream__", None)
    if proto is not None:
        val = proto() if callable(proto) else proto
        if not (isinstance(val, tuple) and len(val) == 2):
            raise ConfigTypeError(f"stream: __cuda_stream__ must give (version, handle), got {val!r}", "argument")
        return Stream.borrow(int(val[1]), obj)
    for attr in ("cuda_stream", "ptr"):          # torch.cuda.Stream / ExternalStream, cupy Stream
        h = getattr(obj, attr, None)
        if isinstance(h, (int, np.integer)):
            return Stream.borrow(int(h), obj)
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        return Stream.borrow(int(obj))
    if type(obj).__name__ in ("CUstream", "cudaStream_t"):
        return Stream.borrow(int(obj), obj)
    raise ConfigTypeError(f"stream: expected a p3send Stream, a torch or cupy stream, an object with "
                          f"__cuda_stream__, a CUstream or an int handle, got {type(obj).__name__}", "argument")


class Event:
    """A CUDA event, for ordering streams and, with ``timing``, for measuring between two records."""

    def __init__(self, timing: bool = True):
        self.handle = call("cuEventCreate", 0 if timing else 2)  # 2 = CU_EVENT_DISABLE_TIMING

    def record(self, stream) -> Event:
        """Record the event on ``stream`` (anything ``as_stream`` takes); returns self.

        Args:
            stream: the stream whose work so far the event marks.
        """
        call("cuEventRecord", self.handle, as_stream(stream).handle)
        return self

    def synchronize(self) -> None:
        """Wait on the host until the recorded work has completed."""
        call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this record and ``end``'s (both with ``timing``, both completed).

        Args:
            end: the later Event.
        """
        return call("cuEventElapsedTime", self.handle, end.handle)

    def close(self) -> None:
        """Destroy the event; idempotent."""
        if self.handle is not None:
            call("cuEventDestroy", self.handle)
            self.handle = None


class DeviceBuffer:
    """A device allocation (``cuMemAlloc``, 256-byte aligned) with numpy copies in and out.

    Exposes ``__cuda_array_interface__`` (as bytes) so torch/cupy can view it.

    Args:
        nbytes: the size in bytes, >= 0 (0 allocates one byte, so the address is valid).
        fill: set every byte to this value (0..255) after allocating (default: not set).
        stream: the stream ``fill`` is enqueued on, or None: synchronous.
    """

    def __init__(self, nbytes: int, *, fill: int | None = None, stream: Stream | None = None):
        if nbytes < 0:
            raise ConfigError(f"nbytes: expected >= 0, got {nbytes}", "argument")
        self.nbytes = int(nbytes)
        self.ordinal = _current                      # the device whose context allocated it
        self._ptr = call("cuMemAlloc", max(self.nbytes, 1))
        self.ptr = int(self._ptr)
        if fill is not None:
            self.fill(fill, stream)

    @classmethod
    def from_array(cls, arr, stream: Stream | None = None) -> DeviceBuffer:
        """A new buffer holding the bytes of ``arr``.

        Args:
            arr: any numpy array (made contiguous first).
            stream: copy on this stream (then synchronized), or None for a synchronous copy.
        """
        arr = np.ascontiguousarray(arr)
        buf = cls(arr.nbytes)
        buf.upload(arr, stream)
        return buf

    def _check(self, nbytes: int, offset: int) -> None:
        if self.ordinal is not None and self.ordinal in _devices:
            ensure_current(_devices[self.ordinal])     # copies and memsets run in the owner's context
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ConfigError(f"copy of {nbytes} bytes at offset {offset} exceeds the {self.nbytes}-byte buffer",
                              "argument")

    def upload(self, arr, stream: Stream | None = None, offset: int = 0) -> None:
        """Copy the bytes of ``arr`` into the buffer; returns when they have landed.

        Args:
            arr: a numpy array (made contiguous first).
            stream: copy on this stream (then synchronized), or None.
            offset: the byte offset in the buffer.

        Raises:
            ConfigError: the copy would pass the end of the buffer.
        """
        arr = np.ascontiguousarray(arr)
        self._check(arr.nbytes, offset)
        if arr.nbytes:
            # host addresses as ints: the one form every cuda-bindings version accepts
            call("cuMemcpyHtoD", self.ptr + offset, arr.ctypes.data, arr.nbytes) if stream is None else \
                call("cuMemcpyHtoDAsync", self.ptr + offset, arr.ctypes.data, arr.nbytes, stream.handle)
            if stream is not None:
                stream.synchronize()  # the host array may go away; keep uploads simple and safe
            else:
                # From pageable memory cuMemcpyHtoD may return before its DMA has landed, and the
                # non-blocking streams the kernels run in do not wait for the legacy stream: wait
                # here (as fill does), or the next launch can read the old bytes.
                call("cuCtxSynchronize")

    def download(self, dtype=np.uint8, shape=None, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """The buffer's bytes as a new numpy array.

        Args:
            dtype: the element type of the result.
            shape: the result's shape (its bytes are what is copied), or None: flat.
            offset: the byte offset to start at.
            nbytes: bytes to copy (default: to the end, or as ``shape`` needs).

        Raises:
            ConfigError: the range passes the end of the buffer.
        """
        dtype = np.dtype(dtype)
        if nbytes is None:
            nbytes = self.nbytes - offset if shape is None else int(np.prod(shape)) * dtype.itemsize
        self._check(nbytes, offset)
        out = np.empty(nbytes // dtype.itemsize, dtype=dtype)
        if nbytes:
            call("cuMemcpyDtoH", out.ctypes.data, self.ptr + offset, nbytes)
        return out if shape is None else out.reshape(shape)

    def fill(self, byte: int, stream: Stream | None = None, offset: int = 0, nbytes: int | None = None) -> None:
        """Set bytes of the buffer to ``byte`` (``cuMemsetD8``).

        Args:
            byte: the value (0..255).
            stream: enqueue on this stream (no host wait), or None: synchronous.
            offset: the first byte; nbytes: how many (default: to the end).
        """
        n = self.nbytes - offset if nbytes is None else nbytes
        self._check(n, offset)
        if n:
            call("cuMemsetD8Async", self.ptr + offset, byte & 0xFF, n, as_stream(stream or _null()).handle)
            if stream is None:
                call("cuCtxSynchronize")

    def copy_from(self, src: DeviceBuffer, stream: Stream, nbytes: int | None = None) -> None:
        """Enqueue a device-to-device copy from ``src`` on ``stream``.

        Args:
            src: the buffer to copy from; stream: where the copy is enqueued;
            nbytes: bytes to copy (default: the smaller of the two sizes).
        """
        n = min(self.nbytes, src.nbytes) if nbytes is None else nbytes
        call("cuMemcpyDtoDAsync", self.ptr, src.ptr, n, stream.handle)

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None}

    def free(self) -> None:
        """Free the allocation; idempotent."""
        if self._ptr is not None:
            call("cuMemFree", self._ptr)
            self._ptr, self.ptr = None, 0

    def __int__(self):
        return self.ptr


_null_stream = None


def _null() -> Stream:
    global _null_stream
    if _null_stream is None:
        _null_stream = Stream(null=True)
    return _null_stream


def device_ptr(obj, what: str = "buffer") -> int:
    """The device address of a p3send DeviceBuffer, an int, or any object exposing
    ``__cuda_array_interface__`` (torch, cupy, numba) or ``data_ptr()``."""
    if isinstance(obj, DeviceBuffer):
        return obj.ptr
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if hasattr(obj, "data_ptr") and hasattr(obj, "device"):    # torch: its CAI refuses some dtypes
        return int(obj.data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    raise ConfigTypeError(f"{what}: expected a DeviceBuffer, a device address (int) or an object with "
                    f"__cuda_array_interface__, got {type(obj).__name__}", "argument")


# ---------------------------------------------------------------- modules and launches

def load_module(ptx: str | bytes, name: str = "<ptx>"):
    """JIT-load PTX; return (CUmodule, info_log). A bad PTX raises CudaError whose log
    holds ptxas' message (with the line) prefixed by ``name``."""
    cu = _cu()
    data = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    info, error = bytearray(1 << 16), bytearray(1 << 16)
    J = cu.CUjit_option
    opts = [J.CU_JIT_INFO_LOG_BUFFER, J.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            J.CU_JIT_ERROR_LOG_BUFFER, J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, J.CU_JIT_LOG_VERBOSE]
    vals = [info, len(info), error, len(error), 1]
    res = cu.cuModuleLoadDataEx(data + b"\0", len(opts), opts, vals)
    text = lambda b: bytes(b).split(b"\0", 1)[0].decode(errors="replace")  # noqa: E731
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        log = f"[{name}]\n" + text(error)
        raise CudaError("cuModuleLoadDataEx", _err_name(cu, res[0]), int(res[0]), _err_str(cu, res[0]), log)
    return res[1], text(info)


def link_ptx(inputs, options: dict | None = None, libraries=()) -> tuple[bytes, str]:
    """Link PTX inputs ((name, text) pairs, ``.extern`` references resolved across them)
    with the driver's JIT linker (cuLink*); return (the cubin, the info log).
    ``options``: extra CUjit_option name -> value, e.g. {"CU_JIT_MAX_REGISTERS": 128};
    ``libraries``: paths of device-code archives linked after them (e.g. libcudadevrt.a)."""
    cu = _cu()
    info, error = bytearray(1 << 16), bytearray(1 << 16)
    J = cu.CUjit_option
    opts = [J.CU_JIT_INFO_LOG_BUFFER, J.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            J.CU_JIT_ERROR_LOG_BUFFER, J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, J.CU_JIT_LOG_VERBOSE]
    vals = [info, len(info), error, len(error), 1]
    for k, v in (options or {}).items():
        opts.append(getattr(J, k))
        vals.append(v)
    text = lambda b: bytes(b).split(b"\0", 1)[0].decode(errors="replace")  # noqa: E731
    state = call("cuLinkCreate", len(opts), opts, vals)
    try:
        for name, src in inputs:
            data = (src.encode() if isinstance(src, str) else bytes(src)) + b"\0"
            res = cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data, len(data), name.encode(), 0, [], [])
            if res[0] != cu.CUresult.CUDA_SUCCESS:
                raise CudaError("cuLinkAddData", _err_name(cu, res[0]), int(res[0]), _err_str(cu, res[0]),
                                f"[{name}]\n" + text(error))
        for path in libraries:
            res = cu.cuLinkAddFile(state, cu.CUjitInputType.CU_JIT_INPUT_LIBRARY, str(path).encode(), 0, [], [])
            if res[0] != cu.CUresult.CUDA_SUCCESS:
                raise CudaError("cuLinkAddFile", _err_name(cu, res[0]), int(res[0]), _err_str(cu, res[0]),
                                f"[{path}]\n" + text(error))
        res = cu.cuLinkComplete(state)
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            raise CudaError("cuLinkComplete", _err_name(cu, res[0]), int(res[0]), _err_str(cu, res[0]), text(error))
        image, size = res[1], int(res[2])
        # the image belongs to the link state: copy it out before cuLinkDestroy
        image = ctypes.string_at(int(image), size) if not isinstance(image, (bytes, bytearray)) else bytes(image[:size])
    finally:
        cu.cuLinkDestroy(state)
    return image, text(info)


def load_image(image: bytes):
    """Load a linked cubin (from ``link_ptx``)."""
    return call("cuModuleLoadData", image)


def get_function(module, name: str):
    return call("cuModuleGetFunction", module, name.encode())


def param_info(func, count: int) -> list[tuple[int, int]]:
    """(offset, size) of the first ``count`` kernel parameters, as the driver lays them
    out. (Driver 580 has no parameter-count query; the count comes from the PTX, whose
    declarations the lint checks against its documented table.)"""
    return [tuple(int(x) for x in call("cuFuncGetParamInfo", func, i)) for i in range(count)]


def func_attribute(func, name: str) -> int:
    cu = _cu()
    return call("cuFuncGetAttribute", getattr(cu.CUfunction_attribute, "CU_FUNC_ATTRIBUTE_" + name), func)


def set_max_dynamic_smem(func, nbytes: int) -> None:
    cu = _cu()
    call("cuFuncSetAttribute", func,
         cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))


def occupancy(func, block: int, smem: int = 0) -> int:
    return call("cuOccupancyMaxActiveBlocksPerMultiprocessor", func, block, smem)


def launch(func, grid, block, smem: int, stream, param_addrs: np.ndarray, name: str = "kernel") -> None:
    """Launch with a prebuilt array of parameter addresses (np.uint64, one per parameter,
    each pointing at a live ctypes object holding the value). ``stream``: anything
    ``as_stream`` takes (every launcher's streams pass through here)."""
    stream = as_stream(stream)
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    try:
        call("cuLaunchKernel", func, gx, gy, gz, bx, by, bz, smem, stream.handle, param_addrs, 0)
    except CudaError as e:
        e.args = (f"{e.args[0]} [launching {name} grid={grid} block={block} smem={smem}]",)
        raise


def launch_programmatic(func, grid, block, smem: int, stream, param_addrs: np.ndarray, name: str = "kernel") -> None:
    """``launch`` with programmatic stream serialisation (PDL, cuLaunchKernelEx with
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the kernel's CTAs may start before
    the stream's previous kernel has finished; the kernel must ``griddepcontrol.wait`` before it
    reads what that kernel wrote."""
    cu = _cu()
    stream = as_stream(stream)
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (tuple(int(g) for g in grid) + (1, 1))[:3]
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (tuple(int(b) for b in block) + (1, 1))[:3]
    cfg.sharedMemBytes, cfg.hStream = int(smem), stream.handle
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    try:
        call("cuLaunchKernelEx", cfg, func, param_addrs, 0)
    except CudaError as e:
        e.args = (f"{e.args[0]} [launching {name} (PDL) grid={grid} block={block} smem={smem}]",)
        raise


class Graph:
    """A captured sequence of launches on one or more streams, replayed with ``launch``.

    Capture with ``Graph.capture(origin, others)`` as a context manager: the other
    streams fork from and join back into ``origin``. The constructor takes what the
    capture made: ``exec_handle``, the instantiated ``CUgraphExec``, and ``graph_handle``,
    its ``CUgraph``.
    """

    def __init__(self, exec_handle, graph_handle):
        self.exec, self.graph = exec_handle, graph_handle

    @staticmethod
    def capture(origin, others=()):
        """A context manager capturing the launches enqueued inside it; its ``graph``
        attribute holds the Graph after the block.

        Args:
            origin: the stream captured (anything ``as_stream`` takes).
            others: streams forked from ``origin`` at the start and joined into it at the end.
        """
        return _Capture(as_stream(origin), [as_stream(o) for o in others])

    def launch(self, stream) -> None:
        """Replay the graph on ``stream`` (anything ``as_stream`` takes).

        Args:
            stream: where the replay is enqueued.
        """
        call("cuGraphLaunch", self.exec, as_stream(stream).handle)

    def close(self) -> None:
        """Destroy the executable graph and the graph; idempotent."""
        if self.exec is not None:
            call("cuGraphExecDestroy", self.exec)
            call("cuGraphDestroy", self.graph)
            self.exec = self.graph = None


class _Capture:
    def __init__(self, origin, others):
        self.origin, self.others, self.graph = origin, others, None

    def __enter__(self):
        cu = _cu()
        call("cuStreamBeginCapture", self.origin.handle,
             cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        fork = Event(timing=False).record(self.origin)
        for s in self.others:
            s.wait(fork)
        self._events = [fork]
        return self

    def __exit__(self, exc_type, exc, tb):
        for s in self.others:
            ev = Event(timing=False).record(s)
            self.origin.wait(ev)
            self._events.append(ev)
        try:
            g = call("cuStreamEndCapture", self.origin.handle)
        except CudaError:
            if exc_type is None:
                raise
            return False
        if exc_type is not None:
            call("cuGraphDestroy", g)
            return False
        self.graph = Graph(call("cuGraphInstantiate", g, 0), g)
        for ev in self._events:
            ev.close()
        return False


def ipc_get_handle(buf: DeviceBuffer) -> bytes:
    """Legacy CUDA IPC handle of a cuMemAlloc allocation, as 64 bytes."""
    h = call("cuIpcGetMemHandle", buf.ptr)
    return ctypes.string_at(h.getPtr(), 64)  # opaque in cuda-bindings >= 13.4: copy the raw bytes


def ipc_open_handle(handle: bytes) -> int:
    """Map a peer process's allocation; returns its address in this process."""
    cu = _cu()
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), bytes(handle), 64)
    return int(call("cuIpcOpenMemHandle", h, 1))  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


def ipc_close(ptr: int) -> None:
    call("cuIpcCloseMemHandle", ptr)


def memcpy_peer(dst: int, dst_dev: Device, src: int, src_dev: Device, nbytes: int, stream: Stream) -> None:
    call("cuMemcpyPeerAsync", dst, dst_dev.context, src, src_dev.context, nbytes, stream.handle)


def memcpy_dtod(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    call("cuMemcpyDtoDAsync", dst, src, nbytes, stream.handle)


def pointer_ordinal(addr: int) -> int | None:
    """The ordinal of the GPU whose memory ``addr`` is (cuPointerGetAttribute), or None
    when the driver does not know the address (host memory, a stale or made-up address)."""
    cu = _cu()
    res = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(addr))
    return int(res[1]) if res[0] == cu.CUresult.CUDA_SUCCESS else None


# ---------------------------------------------------------------- conditional graph nodes

class _IfBody:
    """``captured_if``'s context: the stream that captures the body of the IF node."""

    def __init__(self, stream: Stream, set_condition):
        self.stream, self.set_condition = stream, set_condition

    def __enter__(self) -> Stream:
        cu = _cu()
        s = self.stream
        info = call("cuStreamGetCaptureInfo", s.handle)
        if info[0] != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise CudaError("cuStreamGetCaptureInfo", "NOT_CAPTURING", 0,
                            "a conditional node needs a stream that is being captured into a CUDA graph "
                            "(torch.cuda.graph, driver.Graph.capture)")
        graph = info[2]
        ctx = call("cuCtxGetCurrent")
        handle = call("cuGraphConditionalHandleCreate", graph, ctx, 0, cu.CU_GRAPH_COND_ASSIGN_DEFAULT)
        self.set_condition(s, handle)               # a captured kernel that sets it from device memory
        info = call("cuStreamGetCaptureInfo", s.handle)
        deps = list(info[3])[: int(info[5])]
        params = cu.CUgraphNodeParams()
        params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 1
        params.conditional.ctx = ctx
        node = call("cuGraphAddNode", graph, deps, None, len(deps), params)
        call("cuStreamUpdateCaptureDependencies", s.handle, [node], None, 1,
             int(cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES))
        body = params.conditional.phGraph_out[0]
        self.body_stream = _body_stream()
        call("cuStreamBeginCaptureToGraph", self.body_stream.handle, body, None, None, 0,
             cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        return self.body_stream

    def __exit__(self, exc_type, exc, tb):
        try:
            call("cuStreamEndCapture", self.body_stream.handle)
        except CudaError:
            if exc_type is None:
                raise
        return False


_body = None


def _body_stream() -> Stream:
    global _body
    if _body is None:
        _body = Stream()
    return _body


def captured_if(stream, set_condition) -> _IfBody:
    """In ``stream`` (being captured into a CUDA graph): a conditional IF node, on the
    stream's current dependencies, whose body is what the ``with`` block enqueues on the
    stream it yields; work enqueued on ``stream`` afterwards depends on the node.
    ``set_condition(stream, handle)`` must enqueue, on ``stream``, the kernel that sets
    the condition (``cudaGraphSetConditional``) from device memory: no host value decides
    at replay. The handle resets to 0 (skip) at every graph launch."""
    return _IfBody(as_stream(stream), set_condition)


# ---------------------------------------------------------------- tensor maps (TMA descriptors)

#: Element types ``tensor_map`` encodes: name -> (CUtensorMapDataType member, bytes per element).
TENSOR_MAP_TYPES = {"bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
                    "float8_e4m3": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
                    "uint8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
                    "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
                    "int32": ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4)}
_SWIZZLES = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
             128: "CU_TENSOR_MAP_SWIZZLE_128B"}


def tensor_map(dtype: str, addr: int, dims, box, *, strides=None, swizzle: int = 128,
               l2_promotion: int = 256) -> bytes:
    """The 128 bytes of a tiled ``CUtensorMap`` (``cuTensorMapEncodeTiled``) over a
    row-major array at ``addr``.

    Args:
        dtype: a key of ``TENSOR_MAP_TYPES`` (e4m3 is encoded as bytes: TMA moves bits).
        addr: the device address of element 0, 16-byte aligned.
        dims: elements per dimension, innermost first, e.g. ``(K, rows)``.
        box: the box (tile) copied per TMA operation, innermost first.
        strides: bytes between consecutive entries of each outer dimension (default: dense).
        swizzle: 0, 32, 64 or 128 (bytes of the shared-memory swizzle pattern).
        l2_promotion: 0, 64, 128 or 256.

    Returns:
        The descriptor's 128 bytes, to copy into a ``.param`` or 64-byte aligned global memory.

    Raises:
        ConfigError: an unknown dtype, swizzle or a rank mismatch; CudaError: the driver refused.
    """
    if dtype not in TENSOR_MAP_TYPES or swizzle not in _SWIZZLES or len(dims) != len(box) or not 1 <= len(dims) <= 5:
        raise ConfigError([f"tensor_map: expected a dtype of {sorted(TENSOR_MAP_TYPES)}, a swizzle of "
                           f"{sorted(_SWIZZLES)} and dims/box of one rank 1..5; got {dtype!r}, {swizzle}, "
                           f"{tuple(dims)}, {tuple(box)}"], "tensor map")
    cu = _cu()
    kind, size = TENSOR_MAP_TYPES[dtype]
    if strides is None:
        strides, acc = [], size
        for d in dims[:-1]:
            acc *= int(d)
            strides.append(acc)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    promo = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}[l2_promotion]
    tm = call("cuTensorMapEncodeTiled", getattr(cu.CUtensorMapDataType, kind), len(dims), int(addr),
              [u64(int(d)) for d in dims], [u64(int(s)) for s in strides], [u32(int(b)) for b in box],
              [u32(1)] * len(dims), cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
              getattr(cu.CUtensorMapSwizzle, _SWIZZLES[swizzle]),
              getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{promo}"),
              cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return np.asarray(tm.opaque, dtype=np.uint64).tobytes()


# ---------------------------------------------------------------- nvJitLink (PTX on the CPU)
# nvJitLink is a library of its own (the nvidia-nvjitlink wheel): it needs no driver and no
# GPU, so nothing here goes through _cu() or cuInit, and check-ptx runs on CPU-only machines.

#: How to install the nvJitLink that matches the oldest supported driver.
NVJITLINK_INSTALL = ("pip install nvidia-nvjitlink==13.0.*  "
                     "(13.0 matches driver 580; a newer nvJitLink accepts PTX that driver rejects)")


def _nvjitlink():
    """``cuda.bindings.nvjitlink`` with libnvJitLink loaded. Not cached: a test that hides
    the module (``sys.modules[...] = None``) must see it missing."""
    import importlib
    try:
        nvjitlink = importlib.import_module("cuda.bindings.nvjitlink")
        nvjitlink.version()    # loads libnvJitLink: a missing wheel fails here, not mid-link
    except (ImportError, RuntimeError, OSError) as e:
        raise NoDeviceError(f"nvJitLink is not usable here ({type(e).__name__}: {str(e).strip()}); "
                            f"install it with: {NVJITLINK_INSTALL}") from e
    return nvjitlink


def nvjitlink_version() -> tuple[int, int]:
    """The (major, minor) version of libnvJitLink.

    Raises:
        NoDeviceError: cuda-bindings' nvjitlink module or the libnvJitLink wheel is missing;
            the message says how to install it.
    """
    major, minor = _nvjitlink().version()
    return int(major), int(minor)


def _nvjitlink_log(nvjitlink, handle, error: bool) -> str:
    size = (nvjitlink.get_error_log_size if error else nvjitlink.get_info_log_size)(handle)
    if not size:
        return ""
    buf = bytearray(size)
    (nvjitlink.get_error_log if error else nvjitlink.get_info_log)(handle, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def nvjitlink_refuses(options) -> str | None:
    """Why nvJitLink refuses ``options`` (e.g. ``["-arch=sm_11"]``), or None when it accepts them.

    Raises:
        NoDeviceError: nvJitLink is not installed.
    """
    nvjitlink = _nvjitlink()
    opts = [str(o) for o in options]
    try:
        handle = nvjitlink.create(len(opts), opts)
    except nvjitlink.nvJitLinkError as e:
        return f"nvJitLink refuses {' '.join(opts)}: {e}"
    nvjitlink.destroy(handle)
    return None


def nvjitlink_link(inputs, options) -> tuple[str, str]:
    """Compile PTX relocatably and link it into one image with nvJitLink (the image is dropped:
    this is for the logs, i.e. errors and per-function resources).

    Args:
        inputs: (name, PTX text) pairs, the ``.extern`` references of one resolved by the
            others; each name labels its input in the logs.
        options: nvJitLink options, e.g. ``["-arch=sm_90", "-verbose"]``.

    Returns:
        (info log, error): ``error`` is "" when it linked, else the error log (or the
        nvJitLink status when that log is empty). Bad PTX is a result, not an exception.

    Raises:
        NoDeviceError: nvJitLink is not installed; the message says how to install it.
    """
    _, info, error = nvjitlink_image(inputs, options, image=False)
    return info, error


def nvjitlink_image(inputs, options, libraries=(), *, image: bool = True) -> tuple[bytes, str, str]:
    """Link PTX and device-code libraries into one cubin with nvJitLink (what the optional
    NVSHMEM transport loads: a sending module, the shim and ``libnvshmem_device.a``).

    Args:
        inputs: (name, PTX text) pairs; each name labels its input in the logs.
        options: nvJitLink options, e.g. ``["-arch=sm_90"]``.
        libraries: paths of host archives or objects holding relocatable device code (``.a``),
            linked after the PTX.
        image: return the cubin (False: link for the logs only, the cubin dropped).

    Returns:
        (cubin, info log, error): ``cubin`` is b"" when ``image`` is False or the link fails,
        and ``error`` then the error log (or the nvJitLink status when that log is empty).

    Raises:
        NoDeviceError: nvJitLink is not installed; the message says how to install it.
    """
    nvjitlink = _nvjitlink()
    opts = [str(o) for o in options]
    try:
        handle = nvjitlink.create(len(opts), opts)
    except nvjitlink.nvJitLinkError as e:
        return b"", "", f"nvJitLink refuses {' '.join(opts)}: {e}"
    cubin, error = b"", ""
    try:
        try:
            for name, text in inputs:
                data = text.encode() if isinstance(text, str) else bytes(text)
                nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
            for path in libraries:
                nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, str(path))
            nvjitlink.complete(handle)
            if image:
                buf = bytearray(nvjitlink.get_linked_cubin_size(handle))
                nvjitlink.get_linked_cubin(handle, buf)
                cubin = bytes(buf)
        except nvjitlink.nvJitLinkError as e:
            error = str(e)
        # The logs die with the handle: read them before destroy.
        info = _nvjitlink_log(nvjitlink, handle, error=False)
        if error:
            error = _nvjitlink_log(nvjitlink, handle, error=True) or error
    finally:
        nvjitlink.destroy(handle)
    return cubin, info, error


# ---------------------------------------------------------------- NVRTC (CUDA C++ compiled at run time)

@functools.cache
def _nvrtc():
    """``cuda.bindings.nvrtc`` with libnvrtc loaded (once), or a P3SendError saying how to get it."""
    from ..abi.errors import P3SendError
    try:
        from cuda.bindings import nvrtc
        err, _, _ = nvrtc.nvrtcVersion()   # loads libnvrtc: a missing library fails here
    except Exception as e:  # noqa: BLE001 -- no cuda-bindings, or cuda.pathfinder finds no libnvrtc
        first = (str(e).splitlines() or [""])[0]
        raise P3SendError(f"NVRTC is not available ({type(e).__name__}: {first}); "
                          "pip install 'nvidia-cuda-nvrtc==13.*'") from e
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise P3SendError(f"NVRTC is not usable: nvrtcVersion returned {err}")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the libnvrtc that ``nvrtc_compile`` uses; P3SendError without one."""
    _, major, minor = _nvrtc().nvrtcVersion()
    return int(major), int(minor)


def nvrtc_compile(source: str, arch: str, name: str = "source.cu", defines: dict | None = None, *,
                  output: str = "cubin", options=()) -> tuple[bytes, str]:
    """Compile CUDA C++ ``source`` (self-contained: no include paths) with NVRTC.

    Args:
        source: the CUDA C++ text; ``name``: its file name in messages (e.g. "baselines.cu").
        arch: the target, e.g. "sm_90" (a cubin for that GPU) or "compute_90" (PTX only).
        defines: macro name -> value, passed as ``-DNAME=VALUE``.
        output: "cubin" or "ptx".
        options: further NVRTC options (strings), after ``--std=c++17``.

    Returns:
        (the cubin or the PTX text as bytes, NVRTC's log: warnings; "" when silent).

    Raises:
        P3SendError: NVRTC is not installed; ConfigError: an unknown ``output``;
        CudaError: the compile failed (call ``nvrtcCompileProgram``, the log attached).
    """
    if output not in ("cubin", "ptx"):
        raise ConfigError([f"output: expected 'cubin' or 'ptx', got {output!r}"], "nvrtc_compile")
    nv = _nvrtc()
    ok = nv.nvrtcResult.NVRTC_SUCCESS
    opts = [f"--gpu-architecture={arch}", "--std=c++17", *(f"-D{k}={v}" for k, v in (defines or {}).items()),
            *options]

    def check(call: str, res, log: str = ""):
        err = res[0]
        if err != ok:
            r = nv.nvrtcGetErrorString(err)
            what = r[1].decode() if r[0] == ok and r[1] else str(err)
            raise CudaError(call, what, int(err), f"NVRTC could not compile {name} for {arch}", log)
        return res[1:]

    prog, = check("nvrtcCreateProgram", nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        compiled = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size, = check("nvrtcGetProgramLogSize", nv.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        check("nvrtcGetProgramLog", nv.nvrtcGetProgramLog(prog, log))
        log = log.rstrip(b"\0 ").decode(errors="replace")
        check("nvrtcCompileProgram", compiled, f"[{name}]\n{log}")
        kind = "CUBIN" if output == "cubin" else "PTX"
        size, = check(f"nvrtcGet{kind}Size", getattr(nv, f"nvrtcGet{kind}Size")(prog))
        image = b" " * size
        check(f"nvrtcGet{kind}", getattr(nv, f"nvrtcGet{kind}")(prog, image))
    finally:
        nv.nvrtcDestroyProgram(prog)
    return (image if output == "cubin" else image.rstrip(b"\0")), log
