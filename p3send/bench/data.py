"""The bench's inputs: random non-zero bytes on the GPU, torch when it is there, even splits."""
from __future__ import annotations

import numpy as np

from ..cuda import driver


def torch_or_none():
    """torch with a usable GPU, or None (torch is an optional comparison only)."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 -- a broken torch install is the same as none here
        return None


def random_bytes(nbytes: int, rng: np.random.Generator, torch=None, ordinal: int = 0) -> driver.DeviceBuffer:
    """A buffer of ``nbytes`` random non-zero bytes on GPU ``ordinal`` (made current),
    generated on the GPU when ``torch`` is given, else uploaded from ``rng`` in 64 MiB pieces."""
    driver.device(ordinal)
    buf = driver.DeviceBuffer(nbytes)
    if torch is not None:
        t = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{ordinal}")
        torch.cuda.synchronize(ordinal)
        driver.device(ordinal)
        driver.memcpy_dtod(buf.ptr, t.data_ptr(), nbytes, driver.Stream(null=True))
        driver.device(ordinal).synchronize()
        del t
    else:
        chunk = 1 << 26
        for o in range(0, nbytes, chunk):
            n = min(chunk, nbytes - o)
            buf.upload(rng.integers(1, 256, n, dtype=np.uint8), offset=o)
    return buf


def split_even(total: int, parts: int) -> np.ndarray:
    """``total`` cut into ``parts`` int64 counts differing by at most one (the first ones larger)."""
    base = np.full(parts, total // parts, np.int64)
    base[: total % parts] += 1
    return base
