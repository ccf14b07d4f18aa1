"""Argument checks the launchers share: what a buffer argument tells of itself (address,
shape, byte strides, size, dtype, device), the checks of sizes and alignment, and the
one-shot launch on a temporary stream.

The array helpers take torch tensors (read directly: torch refuses
``__cuda_array_interface__`` for some dtypes, bf16 among them), ``__cuda_array_interface__``
objects (cupy, numba), p3send ``DeviceBuffer``s (bytes, no shape) and plain addresses
(nothing known but the address)."""
from __future__ import annotations

import warnings

import numpy as np

from ..abi.errors import P3SendError
from ..cuda import driver

_TORCH_ATTRS = ("data_ptr", "dtype", "device", "element_size", "is_contiguous", "stride", "shape")


def is_torch(obj) -> bool:
    """Whether ``obj`` is a torch tensor (told by its methods; torch is never imported).

    Args:
        obj: any argument.

    Returns:
        True for an object with torch's ``data_ptr``, ``dtype``, ``device``,
        ``element_size``, ``is_contiguous``, ``stride`` and ``shape``.
    """
    return all(hasattr(obj, a) for a in _TORCH_ATTRS)


def array_layout(obj) -> tuple[tuple | None, tuple | None, int | None]:
    """The shape, byte strides and item size of an array argument.

    Args:
        obj: a torch tensor, a ``__cuda_array_interface__`` object, a DeviceBuffer or an address.

    Returns:
        (shape, strides in bytes, bytes per element) of a torch tensor or CAI object (the
        strides of a CAI object without ``strides`` are the dense ones); (None, None, None)
        for a DeviceBuffer or an address (no shape to check).
    """
    if is_torch(obj):
        es = int(obj.element_size())
        return tuple(int(d) for d in obj.shape), tuple(int(s) * es for s in obj.stride()), es
    cai = getattr(obj, "__cuda_array_interface__", None) if not isinstance(obj, driver.DeviceBuffer) else None
    if cai is None:
        return None, None, None
    shape = tuple(int(d) for d in cai["shape"])
    item = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is None:
        acc, out = 1, []
        for d in reversed(shape):
            out.append(acc * item)
            acc *= d
        strides = tuple(reversed(out))
    return shape, tuple(int(s) for s in strides), item


def contiguous(obj) -> bool | None:
    """Whether an array argument is dense (C order).

    Args:
        obj: as ``array_layout``.

    Returns:
        A torch tensor's ``is_contiguous()``; for a CAI object, whether it gives no
        ``strides``; True for a DeviceBuffer; None for an address (unknown).
    """
    if isinstance(obj, driver.DeviceBuffer):
        return True
    if is_torch(obj):
        return bool(obj.is_contiguous())
    cai = getattr(obj, "__cuda_array_interface__", None)
    return None if cai is None else cai.get("strides") is None


def address(obj, name: str = "buffer") -> int:
    """The device address of an array argument.

    Args:
        obj: as ``array_layout``, or anything ``driver.device_ptr`` takes.
        name: the argument, for the message.

    Returns:
        The address (a torch tensor's ``data_ptr()``).

    Raises:
        ConfigTypeError: ``obj`` is no buffer (names ``name``).
    """
    return int(obj.data_ptr()) if is_torch(obj) else driver.device_ptr(obj, name)


def nbytes(obj) -> int | None:
    """The size of a dense buffer argument.

    Args:
        obj: as ``array_layout``.

    Returns:
        The bytes of a DeviceBuffer, of a contiguous torch tensor or CAI object (see
        ``contiguous``); None for a strided array or an address (unknown).
    """
    if isinstance(obj, driver.DeviceBuffer):
        return obj.nbytes
    if is_torch(obj):
        return int(obj.numel()) * int(obj.element_size()) if obj.is_contiguous() else None
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None and cai.get("strides") is None:
        return int(np.prod(cai["shape"])) * np.dtype(cai["typestr"]).itemsize
    return None


def span(obj) -> int | None:
    """The bytes an array argument covers from its address: what a kernel may touch of it.

    Args:
        obj: as ``array_layout``.

    Returns:
        A DeviceBuffer's size; for a torch tensor or CAI object, strided or not, the offset
        of its last element plus one element (0 when empty); None for an address or an array
        with a negative stride (unknown).
    """
    if isinstance(obj, driver.DeviceBuffer):
        return obj.nbytes
    shape, strides, item = array_layout(obj)
    if shape is None or any(s < 0 for s in strides):
        return None
    if any(d == 0 for d in shape):
        return 0
    return sum((d - 1) * s for d, s in zip(shape, strides)) + item


def check_rows_fit(name: str, obj, rows: int, row_bytes: int, row_stride: int, problems: list) -> None:
    """Appends a problem naming ``name`` unless ``obj`` covers ``rows`` rows of ``row_bytes``
    bytes at ``row_stride`` (``(rows - 1) * row_stride + row_bytes`` bytes; checked where its
    size is known: ``span``).

    Args:
        name: the argument, for the message.
        obj: the array argument.
        rows, row_bytes, row_stride: what the kernel reads or writes of it (rows >= 1).
        problems: the launch's problems so far; appended to.

    Returns:
        None.
    """
    have = span(obj)
    need = (rows - 1) * row_stride + row_bytes
    if have is not None and rows >= 1 and have < need:
        problems.append(f"{name}: expected at least {need} bytes ({rows} rows of {row_bytes} bytes at stride "
                        f"{row_stride}), got {have}")


def aligned(name, addr, align, problems):
    if addr == 0:
        problems.append(f"{name}: expected a device address, got null")
    elif addr % align:
        problems.append(f"{name}: expected a {align}-byte aligned address, got {addr:#x}")


# ---------------------------------------------------------------- device arrays (tensors)

def describe(obj) -> dict:
    """What can be told of a buffer argument without a launch: {'addr', 'nbytes' (None:
    unknown), 'dtype' (numpy-style name or None), 'device' ('cuda:N', 'cpu', ... or None:
    unknown), 'contiguous' (None: unknown)}. Torch tensors (``data_ptr``), DLPack
    devices (``__dlpack_device__``), ``__cuda_array_interface__`` objects (the device
    from the driver's pointer attributes), DeviceBuffers and plain addresses."""
    if isinstance(obj, driver.DeviceBuffer):
        return {"addr": obj.ptr, "nbytes": obj.nbytes, "dtype": None,
                "device": None if obj.ordinal is None else f"cuda:{obj.ordinal}", "contiguous": True}
    if isinstance(obj, (int, np.integer)):
        return {"addr": int(obj), "nbytes": None, "dtype": None, "device": None, "contiguous": None}
    if is_torch(obj):                          # torch first: its CAI refuses some dtypes (bf16)
        dev = obj.device
        return {"addr": int(obj.data_ptr()), "nbytes": int(obj.numel()) * int(obj.element_size()),
                "dtype": str(obj.dtype).replace("torch.", ""),
                "device": f"{dev.type}:{dev.index}" if dev.type == "cuda" else dev.type,
                "contiguous": bool(obj.is_contiguous())}
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        addr = int(cai["data"][0])
        dt = np.dtype(cai["typestr"])
        contiguous = cai.get("strides") is None
        ordinal = driver.pointer_ordinal(addr) if addr else None
        return {"addr": addr, "nbytes": int(np.prod(cai["shape"])) * dt.itemsize,
                "dtype": dt.name if dt.kind != "V" else None,
                "device": "unknown (not GPU memory)" if ordinal is None and addr else
                          (None if ordinal is None else f"cuda:{ordinal}"), "contiguous": contiguous}
    return {"addr": driver.device_ptr(obj), "nbytes": None, "dtype": None, "device": None, "contiguous": None}


def array_arg(obj, name: str, problems: list, *, dtypes=None, nbytes_min: int | None = None,
              ordinal: int | None = None, strided_ok: bool = False) -> tuple[int, int | None]:
    """Check a buffer argument (see ``describe``) and return (address, bytes if known).
    Appends to ``problems`` what is wrong, naming ``name``: a dtype not in ``dtypes``
    (names like "int32"; None: any), a device other than GPU ``ordinal``, fewer than
    ``nbytes_min`` bytes, a non-contiguous array (``strided_ok``: allowed, its size then
    unknown). Only what the object tells is checked (an int address carries no dtype,
    size or device)."""
    if obj is None:
        problems.append(f"{name}: expected a device buffer, got None")
        return 0, None
    try:
        d = describe(obj)
    except TypeError as e:
        problems.append(str(e).replace("buffer:", f"{name}:", 1))
        return 0, None
    if dtypes is not None and d["dtype"] is not None and d["dtype"] not in dtypes:
        problems.append(f"{name}: expected dtype {' or '.join(dtypes)}, got {d['dtype']}")
    if ordinal is not None and d["device"] is not None and d["device"] != f"cuda:{ordinal}":
        problems.append(f"{name}: expected memory of GPU {ordinal} (cuda:{ordinal}), got {d['device']}")
    if d["contiguous"] is False:
        if not strided_ok:
            problems.append(f"{name}: expected a contiguous array, got a strided view")
        d["nbytes"] = None
    if nbytes_min is not None and d["nbytes"] is not None and d["nbytes"] < nbytes_min:
        problems.append(f"{name}: expected at least {nbytes_min} bytes, got {d['nbytes']}")
    return d["addr"], d["nbytes"]


def warn_deprecated(old: str, new: str) -> None:
    """A DeprecationWarning for a name renamed in 0.2.0 (its alias goes in 0.3), pointing at the caller."""
    warnings.warn(f"{old} is deprecated since p3send 0.2.0 and goes in 0.3; use {new}", DeprecationWarning,
                  stacklevel=3)


def run_once(enqueue, stream=None) -> None:
    """A launcher's one-shot call: ``enqueue(stream)``, or, without a stream, ``enqueue`` on
    a temporary stream that is then synchronized and closed, also when ``enqueue`` raises.

    Args:
        enqueue: a function of one ``driver.Stream`` that enqueues the launch.
        stream: the caller's stream (no host wait), or None (synchronous).

    Returns:
        None.
    """
    if stream is not None:
        enqueue(stream)
        return
    s = driver.Stream()
    try:
        enqueue(s)
        s.synchronize()
    except BaseException:
        try:
            s.close()
        except P3SendError:
            pass                   # the launch's own error is the one to report
        raise
    s.close()
