"""The FP8 scatter send's launch shape and magic numbers, tied between ptx/ and the launcher
(no GPU): the per-warp shared memory the header states is what ScatterSend reserves, the
block fits the entry's .maxntid and the device's opt-in limit, and msg_bytes/33 by the
multiply-high the FP8 code uses is exact wherever the checks let it through."""
from __future__ import annotations

import re

import numpy as np

from p3send.cuda import ptxlint
from p3send.ops.send import ScatterSend
from tests.cpu.test_ptx import PTX_DIR

H200_SMEM_OPTIN = 232448      # 227 KiB: sm_90's opt-in maximum per block


def test_the_fp8_launch_shape_is_the_headers():
    text = (PTX_DIR / "p3_scatter_send_fp8.ptx").read_text()
    consts = ptxlint.header_constants(text.splitlines())
    assert int(consts["FP8_MIN_WARP_BYTES"]) == 256 + 4 * 512 <= ScatterSend.FP8_WARP_BYTES
    assert ScatterSend.FP8_SMEM == ScatterSend.FP8_WARP_BYTES * ScatterSend.FP8_THREADS // 32
    assert ScatterSend.FP8_WARP_BYTES % 16 == 0
    assert ScatterSend.FP8_THREADS % 32 == 0 and ScatterSend.FP8_SMEM <= H200_SMEM_OPTIN
    maxntid = int(re.search(r"^\.maxntid (\d+), 1, 1", text, re.M).group(1))
    assert ScatterSend.FP8_THREADS <= maxntid
    # the stated launch in the header is the launcher's
    assert f"p3send: {ScatterSend.FP8_THREADS} threads and {ScatterSend.FP8_SMEM} bytes" in " ".join(
        line.lstrip("/ ") for line in text.splitlines())


def test_msg_bytes_over_33_by_a_multiply_high_is_exact_where_it_is_used():
    magic = 130150525                                # ceil(2^32 / 33), the PTX's immediate
    assert magic == -(-(1 << 32) // 33)
    for f in ("p3_send_rows.ptx",):
        assert "mul.hi.u32" in (PTX_DIR / f).read_text() and str(magic) in (PTX_DIR / f).read_text(), f
    x = np.arange(1 << 21, dtype=np.uint64)          # the checks refuse msg_bytes > 2^20
    assert np.array_equal((x * np.uint64(magic)) >> np.uint64(32), x // np.uint64(33))


def fp8_tile_columns(hidden: int, warp_bytes: int) -> int:
    """The header's rule: the widest multiple of 256 columns dividing hidden whose 4 bf16 rows
    fit the warp's stage (8*W <= warp_bytes - 256), at most 2048."""
    fit = min(8, (warp_bytes - 256) // 2048)
    return 256 * max(u for u in range(1, fit + 1) if (hidden // 256) % u == 0)


def test_the_shipped_launch_takes_the_tiles_the_header_states():
    # p3send's launch: W 1792 at hidden 7168 (4 resolutions a row), 2048 at 8192
    assert fp8_tile_columns(7168, ScatterSend.FP8_WARP_BYTES) == 1792
    assert fp8_tile_columns(8192, ScatterSend.FP8_WARP_BYTES) == 2048
    text = " ".join(line.lstrip("/ ") for line in (PTX_DIR / "p3_scatter_send_fp8.ptx").read_text().splitlines())
    assert f"P = {ScatterSend.FP8_WARP_BYTES}: W 1792 at hidden 7168, 2048 at 8192" in text
