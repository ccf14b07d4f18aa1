"""Argument checks the launchers share: sizes and alignment of device buffers."""
from __future__ import annotations

import warnings

import numpy as np

from ..cuda import driver


def nbytes(obj) -> int | None:
    if isinstance(obj, driver.DeviceBuffer):
        return obj.nbytes
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = cai["shape"]
        item = np.dtype(cai["typestr"]).itemsize
        return int(np.prod(shape)) * item if cai.get("strides") is None else None
    return None


def aligned(name, addr, align, problems):
    if addr == 0:
        problems.append(f"{name}: expected a device address, got null")
    elif addr % align:
        problems.append(f"{name}: expected a {align}-byte aligned address, got {addr:#x}")


# ---------------------------------------------------------------- device arrays (tensors)

def _torch_like(obj) -> bool:
    return all(hasattr(obj, a) for a in ("data_ptr", "dtype", "device", "is_contiguous"))


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
    if _torch_like(obj):                       # torch first: its CAI refuses some dtypes (bf16)
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
