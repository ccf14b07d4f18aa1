"""The numpy reference of the FP8 wire (``p3send.abi.wire``): what a sender writes into a
slot for a bf16 row, and what a receiver reads back. The quantisation is the FP8 GEMM's
activation quantiser (``fp8.quantize``), applied to the row's bf16 values."""
from __future__ import annotations

import numpy as np

from ..abi.errors import ConfigError
from ..abi.wire import WIRE_FP8, wire_msg_bytes
from . import fp8


def encode(rows_bf16_bits: np.ndarray) -> np.ndarray:
    """FP8-wire bytes ``(n, msg_bytes)`` uint8 of bf16 rows ``(n, hidden)`` (uint16 bits):
    the e4m3 codes, then the float32 scales (little-endian), per row."""
    bits = np.asarray(rows_bf16_bits, dtype=np.uint16)
    n, hidden = bits.shape
    mb = wire_msg_bytes(hidden, WIRE_FP8, what="FP8 wire reference")
    q, s = fp8.quantize(bits)
    out = np.empty((n, mb), np.uint8)
    out[:, :hidden] = q
    out[:, hidden:] = np.ascontiguousarray(s, dtype="<f4").view(np.uint8).reshape(n, mb - hidden)
    return out


def decode(wire: np.ndarray, hidden: int) -> np.ndarray:
    """float32 values ``(n, hidden)`` of FP8-wire rows ``(n, msg_bytes)`` uint8: each code's
    e4m3 value times its block's scale, one float32 rounding (as the reduce multiplies)."""
    w = np.asarray(wire, dtype=np.uint8)
    mb = wire_msg_bytes(hidden, WIRE_FP8, what="FP8 wire reference")
    if w.ndim != 2 or w.shape[1] != mb:
        raise ConfigError([f"wire: expected (n, {mb}) bytes for {hidden} columns, got {w.shape}"],
                          "FP8 wire reference")
    v = fp8.e4m3_to_f32(w[:, :hidden])
    s = np.ascontiguousarray(w[:, hidden:]).view("<f4").astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (v * np.repeat(s, fp8.BLOCK, axis=1)).astype(np.float32)
