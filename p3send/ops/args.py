"""Argument checks the launchers share: sizes and alignment of device buffers."""
from __future__ import annotations

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
