"""The combine's wire formats: how one (token, k) row is laid out in a receive slot.

``msg_bytes`` (a field of MAX's struct) sizes the slot but cannot name the format: 7,392 B
is an FP8 row of 7,168 columns and also a bf16 row of 3,696. So every launcher and
``validate`` take the format and ``hidden`` explicitly, and refuse a ``msg_bytes`` that does
not match.

- ``WIRE_BF16`` (0): ``hidden`` bf16 values, ``msg_bytes = 2 * hidden``.
- ``WIRE_FP8`` (1): the ``hidden`` e4m3 codes first, then one float32 scale per 128 columns
  (little-endian; scale ``j`` for columns ``128j .. 128j+127``), so
  ``msg_bytes = hidden + 4 * hidden / 128 = 33 * hidden / 32``. ``msg_bytes`` must stay a
  multiple of 16 (every row store is a 16-byte vector), so ``hidden`` must be a multiple of
  512 (33 is odd); a model whose ``hidden`` is not pads its rows to the next multiple of 512
  (DeepSeek-V3's 7,168 = 14 x 512 needs none). The values follow the FP8 GEMM's activation
  quantiser (``p3send.oracle.fp8.quantize``: amax clamped at 1e-4, ``scale = amax / 448``).

The senders learn the format from a flag bit, ``FLAG_WIRE_FP8`` (``P3_FLAG_WIRE_FP8`` in
``ptx/p3send.h``), in the ``flags`` word they already take (``P3SendCtx.flags`` and
``p3_scatter_send``'s ``flags`` parameter): no parameter is appended, so a C launcher that
does not set it keeps the bf16 wire. The receiver learns it from the entry a launcher
loads (``RECV_ENTRY``): ``p3_recv_reduce`` (bf16) or ``p3_recv_reduce_fp8`` (the same
parameters, ``hidden = 32 * msg_bytes / 33``).

Where the rounding happens: ``p3_scatter_send_fp8``, ``p3_epilogue_send`` and the BF16 GEMM
quantise bf16 rows (the wire bytes are ``oracle.wire.encode`` of them, bit for bit). The FP8
GEMM at 128-row tiles quantises its fp32 sums in its consumers (``FLAG_WIRE_FP8_STAGED``:
the tile it hands ``p3_send_rows`` holds the wire's row already): one rounding, to e4m3,
instead of bf16 then e4m3; ``GroupedGemmFp8Send.prepare(fp8_source="bf16")`` keeps the other.
"""
from __future__ import annotations

import numbers

from .errors import ConfigError

WIRE_BF16 = 0
WIRE_FP8 = 1
WIRE_FORMATS = {"bf16": WIRE_BF16, "fp8": WIRE_FP8}
FLAG_WIRE_FP8 = 16
#: with FLAG_WIRE_FP8: the tile handed to p3_send_rows holds the wire's rows already (codes, then
#: scales); set by the FP8 GEMM's launcher for its consumers' quantiser (P3_FLAG_WIRE_FP8_STAGED)
FLAG_WIRE_FP8_STAGED = 128
FP8_BLOCK = 128
FP8_HIDDEN_MULTIPLE = 512
#: The receive kernel of each format (same parameter table; ptx/p3_recv_reduce*.ptx).
RECV_ENTRY = {WIRE_BF16: "p3_recv_reduce", WIRE_FP8: "p3_recv_reduce_fp8"}
WIRE_NAMES = {WIRE_BF16: "bf16", WIRE_FP8: "fp8"}


def wire_format(value, *, what: str = "argument") -> int:
    """The format code of ``value``: ``"bf16"``/``"fp8"`` or ``WIRE_BF16``/``WIRE_FP8``."""
    if isinstance(value, str) and value.lower() in WIRE_FORMATS:
        return WIRE_FORMATS[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in (WIRE_BF16, WIRE_FP8):
        return value
    raise ConfigError([f"wire: expected 'bf16' or 'fp8', got {value!r}"], what)


def as_columns(value) -> int | None:
    """``value`` as a Python int when it is an integer (numpy's included, bool not), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def wire_msg_bytes(hidden, wire="bf16", *, what: str = "argument") -> int:
    """The slot size of a row of ``hidden`` columns in format ``wire``; refuses a ``hidden``
    the format cannot carry (bf16: a positive multiple of 8; fp8: of 512)."""
    fmt = wire_format(wire, what=what)
    if as_columns(hidden) is None:
        raise ConfigError([f"hidden: expected an integer, got {type(hidden).__name__}"], what)
    hidden = as_columns(hidden)
    mult = 8 if fmt == WIRE_BF16 else FP8_HIDDEN_MULTIPLE
    if hidden <= 0 or hidden % mult:
        raise ConfigError([f"hidden: expected a positive multiple of {mult} for the "
                           f"{'bf16' if fmt == WIRE_BF16 else 'fp8'} wire, got {hidden}"], what)
    return 2 * hidden if fmt == WIRE_BF16 else hidden + 4 * (hidden // FP8_BLOCK)


def wire_problems(msg_bytes: int, hidden, wire="bf16") -> list[str]:
    """The problems (empty: none) of a slot size ``msg_bytes`` for ``hidden`` columns in
    format ``wire``, each naming the argument (for ``validate`` and the launchers)."""
    try:
        want = wire_msg_bytes(hidden, wire)
    except ConfigError as exc:
        return list(exc.problems)
    if int(msg_bytes) != want:
        name = "bf16" if wire_format(wire) == WIRE_BF16 else "fp8"
        return [f"msg_bytes: expected {want} for {hidden} columns on the {name} wire, got {int(msg_bytes)}"]
    return []


def wire_hidden(msg_bytes: int, wire="bf16") -> int:
    """The columns of a row of ``msg_bytes`` bytes in format ``wire`` (bf16: msg_bytes/2,
    fp8: 32*msg_bytes/33), or 0 when ``msg_bytes`` is no slot size of that format."""
    fmt, m = wire_format(wire), int(msg_bytes)
    if fmt == WIRE_BF16:
        return m // 2 if m > 0 and m % 16 == 0 else 0
    return 32 * m // 33 if m > 0 and m % (33 * FP8_HIDDEN_MULTIPLE // 32) == 0 else 0


def wire_flags(wire="bf16") -> int:
    """The sender flag bits of format ``wire``: ``FLAG_WIRE_FP8`` for fp8, else 0."""
    return FLAG_WIRE_FP8 if wire_format(wire) == WIRE_FP8 else 0
