"""The numpy reference of the FP8 wire (``p3send.abi.wire``): what a sender writes into a
slot for a bf16 row (or, the FP8 GEMM's consumers, for an fp32 one), and what a receiver
reads back. The quantisation is the FP8 GEMM's activation quantiser (``fp8.quantize``),
applied to the row's bf16 (or fp32) values."""
from __future__ import annotations

import numpy as np

from ..abi.errors import ConfigError
from ..abi.layout import SENTINEL
from ..abi.wire import WIRE_FP8, wire_msg_bytes
from . import fp8


def encode(rows_bf16_bits: np.ndarray) -> np.ndarray:
    """FP8-wire bytes ``(n, msg_bytes)`` uint8 of bf16 rows ``(n, hidden)`` (uint16 bits):
    the e4m3 codes, then the float32 scales (little-endian), per row."""
    bits = np.asarray(rows_bf16_bits, dtype=np.uint16)
    return encode_f32((bits.astype(np.uint32) << 16).view(np.float32))     # fp8.quantize's own widening


def encode_f32(rows_f32: np.ndarray) -> np.ndarray:
    """``encode`` of float32 rows ``(n, hidden)``: what the FP8 GEMM sends when its consumers
    quantise their fp32 sums (``FLAG_WIRE_FP8_STAGED``)."""
    x = np.asarray(rows_f32, dtype=np.float32)
    n, hidden = x.shape
    mb = wire_msg_bytes(hidden, WIRE_FP8, what="FP8 wire reference")
    q, s = fp8.quantize_f32(x)
    out = np.empty((n, mb), np.uint8)
    out[:, :hidden] = q
    out[:, hidden:] = np.ascontiguousarray(s, dtype="<f4").view(np.uint8).reshape(n, mb - hidden)
    return out


#: How far the wire of fp32 values y may be from ``encode`` of bf16(y) (``requantised``): the
#: bf16 rounding moves each value and each block's amax by at most 2^-8 of itself (half a unit
#: of bf16's 8 significant bits), so a scale by at most 2^-8 (plus float32's roundings of it)
#: and a value times its multiplier by at most about 2^-7: less than half of e4m3's narrowest
#: step (2^-4 of the value in a binade, 2^-9 absolute among the subnormals, where the move is
#: below 2^-13), so the two round to the same code or to neighbours.
SCALE_REL = 2.0 ** -8 + 2.0 ** -21


def requantised(got: np.ndarray, want: np.ndarray, hidden: int) -> str | None:
    """Whether FP8-wire rows ``got`` (uint8 ``(n, msg_bytes)``) can be the wire of fp32 values
    whose bf16 rounding ``want`` is the wire of (``encode``): every code at most one e4m3 step
    from ``want``'s (sign-magnitude order, -0 = +0), a NaN block's codes all 0x7F in both,
    each scale within ``SCALE_REL`` of ``want``'s (NaN and +Inf as they are), a NaN code
    (0x7F, 0xFF) exactly where ``want`` has one. None when so, else what differs first.
    Not for values whose bf16 rounding overflows (|y| >= 3.3961e38, bf16's largest finite
    plus half its last step): their bf16 row holds an infinity the fp32 values do not."""
    g, w = np.asarray(got, np.uint8), np.asarray(want, np.uint8)
    mb = wire_msg_bytes(hidden, WIRE_FP8, what="FP8 wire reference")
    if g.shape != w.shape or g.ndim != 2 or g.shape[1] != mb:
        return f"shapes {g.shape} and {w.shape}, expected (n, {mb})"
    gs = np.ascontiguousarray(g[:, hidden:]).view("<f4").astype(np.float64)
    ws = np.ascontiguousarray(w[:, hidden:]).view("<f4").astype(np.float64)
    with np.errstate(invalid="ignore"):
        same = (np.isnan(gs) & np.isnan(ws)) | (gs == ws) | (np.abs(gs - ws) <= SCALE_REL * np.abs(ws))
    bad = np.argwhere(~same)
    if len(bad):
        r, b = bad[0]
        return f"row {r} block {b}: scale {gs[r, b]!r}, expected {ws[r, b]!r} within {SCALE_REL:.3g}"

    def order(c):
        m = (c & 0x7F).astype(np.int64)
        return np.where(c & 0x80, -m, m)
    gc, wc = g[:, :hidden], w[:, :hidden]
    dist = np.abs(order(gc) - order(wc))
    nan_blk = np.repeat(np.isnan(ws), fp8.BLOCK, axis=1)
    # a NaN code (0x7F/0xFF) is no neighbour of +-448: it must stand exactly where want's does
    nan_code = ((gc & 0x7F) == 0x7F) != ((wc & 0x7F) == 0x7F)
    bad = np.argwhere(np.where(nan_blk, gc != fp8.E4M3_NAN, (dist > 1) | nan_code))
    if len(bad):
        r, c = bad[0]
        return (f"row {r} column {c}: code {int(g[r, c]):#04x}, expected {int(w[r, c]):#04x} or a neighbour "
                f"({len(bad)} codes off)")
    return None


def requantised_slots(got: np.ndarray, want: np.ndarray, hidden: int) -> str | None:
    """``requantised`` over two buffers of FP8-wire slots (flat uint8, slot j at byte
    j*msg_bytes): the slots ``want`` leaves all ``SENTINEL`` (unowned: a scale is never
    0xABABABAB, a negative number) and the bytes past the last whole slot equal in ``got``,
    every other slot ``requantised`` of ``want``'s. None when so, else what differs first."""
    mb = wire_msg_bytes(hidden, WIRE_FP8, what="FP8 wire reference")
    g, w = np.asarray(got, np.uint8).ravel(), np.asarray(want, np.uint8).ravel()
    if g.shape != w.shape:
        return f"buffers of {g.size} and {w.size} bytes"
    n = w.size // mb
    if not np.array_equal(g[n * mb:], w[n * mb:]):
        return "bytes past the last slot differ"
    gs, ws = g[:n * mb].reshape(n, mb), w[:n * mb].reshape(n, mb)
    owned = ~(ws == SENTINEL).all(axis=1)
    if not np.array_equal(gs[~owned], ws[~owned]):
        return f"unowned slots written: {np.flatnonzero(~owned)[(gs[~owned] != SENTINEL).any(axis=1)][:8].tolist()}"
    return requantised(gs[owned], ws[owned], hidden)


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
