"""``QuantFp8``: the activation quantiser of the FP8 down-projection (``ptx/p3_quant_fp8.ptx``),
and the argument helpers the FP8 launchers share (``scale_layout``, ``check_rows_array``,
``check_scales``).

    quant = QuantFp8()
    quant(x, q, scales)            # x bf16 (rows, K) -> q e4m3 (rows, K), scales float32 MN-major

DeepGEMM's rule per row and 128 columns (``p3send.oracle.fp8`` is the numpy reference, bit
for bit): ``amax`` clamped at 1e-4, ``scale = amax / 448``, ``q = e4m3_satfinite(x * (448 /
amax))``, the divisions rounded as torch rounds DeepGEMM's ``per_token_cast_to_fp8``
(``amax * fl(1/448)`` and ``fl(1/amax) * 448``: docs/KERNELS.md). The scales go in
DeepGEMM's TMA-aligned MN-major layout: ``(row, kb)`` at float ``kb * m_pad + row``,
``m_pad`` = rows rounded up to 4 (``scale_layout``), which is what
``GroupedGemmFp8Send`` (and DeepGEMM's grouped GEMMs) read. Arrays are torch tensors,
``__cuda_array_interface__`` objects, DeviceBuffers or addresses (give ``rows``/``k_dim``
with the last two).
"""
from __future__ import annotations

from typing import NamedTuple

from ..abi.errors import ConfigError
from ..cuda import driver
from ..cuda.loader import ParamBlock, kernel
from .args import aligned, array_arg, array_layout, check_rows_fit, run_once

ENTRY = "p3_quant_fp8"
THREADS = 256
BLOCK = 128              # columns per scale
FP8_DTYPES = ("float8_e4m3fn", "uint8")


class ScaleLayout(NamedTuple):
    """Activation scales of ``rows`` x K: ``kb`` = K/128 columns of ``m_pad`` floats each."""
    m_pad: int
    kb: int
    col_stride: int      # bytes between columns: 4 * m_pad
    nbytes: int          # the whole buffer: kb * col_stride


def scale_layout(rows: int, k_dim: int) -> ScaleLayout:
    """DeepGEMM's TMA-aligned MN-major layout of the activation scales of (rows, k_dim)."""
    m_pad = -(-int(rows) // 4) * 4
    kb = -(-int(k_dim) // BLOCK)
    return ScaleLayout(m_pad, kb, 4 * m_pad, 4 * m_pad * kb)


def check_rows_array(name: str, obj, rows: int | None, cols: int | None, problems: list,
                     row_stride: int | None) -> tuple[int | None, int | None, int | None]:
    """A (rows, cols) array with contiguous rows: returns (rows, cols, row stride in bytes),
    taking what is not given from the array; appends shape/stride problems naming ``name``
    (its dtype is checked by the caller)."""
    shape, strides, item = array_layout(obj)
    if shape is None:
        return rows, cols, row_stride
    if len(shape) != 2:
        problems.append(f"{name}: expected a 2-D (rows, K) array, got shape {shape}")
        return rows, cols, row_stride
    if strides[1] != item:
        problems.append(f"{name}: expected contiguous rows (unit column stride), got byte strides {strides}")
    if rows is not None and shape[0] < rows:
        problems.append(f"{name}: expected at least {rows} rows, got shape {shape}")
    if cols is not None and shape[1] != cols:
        problems.append(f"{name}: expected {cols} columns, got shape {shape}")
    return (shape[0] if rows is None else rows), (shape[1] if cols is None else cols), \
        (strides[0] if row_stride is None else row_stride)


def check_scales(name: str, obj, rows: int, k_dim: int, problems: list) -> tuple[int, int]:
    """Activation scales in the MN-major layout: a float32 (rows, K/128) view with strides
    (4, 4*m_pad) bytes (DeepGEMM's ``get_col_major_tma_aligned_tensor``), or a flat buffer of
    ``scale_layout(rows, K).nbytes`` bytes. Returns (address, column stride in bytes)."""
    lay = scale_layout(rows, k_dim)
    shape, strides, _ = array_layout(obj)
    addr, nb = array_arg(obj, name, problems, dtypes=("float32",), strided_ok=True)
    col = lay.col_stride
    if shape is not None and len(shape) == 2:
        if shape != (rows, lay.kb) or strides[0] != 4 or strides[1] % 16 or strides[1] < 4 * rows:
            problems.append(f"{name}: expected float32 scales of shape ({rows}, {lay.kb}) in the TMA-aligned "
                            f"MN-major layout (byte strides (4, a multiple of 16 >= {4 * rows}), e.g. "
                            f"(4, {lay.col_stride})), got shape {shape}, byte strides {strides}")
        else:
            col = strides[1]
    elif shape is not None and len(shape) != 1:
        problems.append(f"{name}: expected (rows, K/128) MN-major scales or a flat buffer, got shape {shape}")
    elif nb is not None and nb < lay.nbytes:
        problems.append(f"{name}: expected at least {lay.nbytes} bytes ({lay.kb} columns of {lay.m_pad} "
                        f"floats), got {nb}")
    aligned(name, addr, 16, problems)
    return addr, col


class QuantFp8:
    """Launcher for ``p3_quant_fp8`` on one device (any sm_90+ GPU)."""

    def __init__(self, device: driver.Device | None = None):
        self.dev = device or driver.device()
        self.k = kernel(ENTRY, self.dev)
        self.block = self.k.params_block()
        self.grids: dict[int, int] = {}      # id(parameter block) -> its grid

    def prepare(self, x, q, scales, *, rows: int | None = None, k_dim: int | None = None,
                x_row_stride: int | None = None, q_row_stride: int | None = None,
                into: ParamBlock | None = None) -> ParamBlock:
        """Check every argument and fill the parameter block (no launch).

        Args:
            x: bf16 (rows, K) (bfloat16 or uint16 bits), unit column stride, 16-byte aligned,
                covering ``(rows - 1) * x_row_stride + 2*K`` bytes: a torch tensor, a
                ``__cuda_array_interface__`` object, a DeviceBuffer or an address (for the
                last two give ``rows`` and ``k_dim``; an address's size is not checked).
            q: the output codes, e4m3 (rows, K) (float8_e4m3fn or uint8), unit column
                stride, 16-byte aligned, covering ``(rows - 1) * q_row_stride + K`` bytes.
            scales: the output scales, float32 in the TMA-aligned MN-major layout: a
                (rows, K/128) view with byte strides (4, a multiple of 16 >= 4*rows), or a flat
                buffer of at least ``scale_layout(rows, K).nbytes`` bytes; 16-byte aligned.
            rows: rows to quantise (>= 1); default: x's leading dimension (else q's). Each
                array that carries a shape must hold at least this many.
            k_dim: K, a positive multiple of 128 (rows * K / 8 under 2^32 - 256); default:
                x's (else q's) columns. Each array with a shape must have K columns.
            x_row_stride: bytes between rows of x, a multiple of 16 >= 2*K (default: from the
                array, else 2*K).
            q_row_stride: bytes between rows of q, a multiple of 16 >= K (default: from the
                array, else K).
            into: fill this block (from ``self.k.params_block()``) instead of the launcher's
                own, so several prepared launches coexist.

        Returns:
            The filled ParamBlock (its grid is remembered for ``launch``).

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        problems: list = []
        rows, k_dim, x_row_stride = check_rows_array("x", x, rows, k_dim, problems, x_row_stride)
        rows, k_dim, q_row_stride = check_rows_array("q", q, rows, k_dim, problems, q_row_stride)
        for nm, v in (("rows", rows), ("k_dim", k_dim)):
            if v is None:
                problems.append(f"{nm}: expected a value (not derivable from the arrays given)")
        if problems:
            raise ConfigError(problems, "FP8 quantiser launch")
        rows, k_dim = int(rows), int(k_dim)
        xs = 2 * k_dim if x_row_stride is None else int(x_row_stride)
        qs = k_dim if q_row_stride is None else int(q_row_stride)
        if rows < 1:
            problems.append(f"rows: expected at least 1, got {rows}")
        if k_dim < BLOCK or k_dim % BLOCK:
            problems.append(f"k_dim: expected a positive multiple of {BLOCK}, got {k_dim}")
        elif rows * (k_dim // 8) >= 2 ** 32 - THREADS:
            problems.append(f"rows: rows * k_dim / 8 must stay under 2^32 - {THREADS}, got {rows} x {k_dim}")
        if xs % 16 or xs < 2 * k_dim:
            problems.append(f"x_row_stride: expected a multiple of 16 >= {2 * k_dim}, got {xs}")
        if qs % 16 or qs < k_dim:
            problems.append(f"q_row_stride: expected a multiple of 16 >= {k_dim}, got {qs}")
        ordinal = self.dev.ordinal
        xa, _ = array_arg(x, "x", problems, dtypes=("bfloat16", "uint16"), ordinal=ordinal, strided_ok=True)
        qa, _ = array_arg(q, "q", problems, dtypes=FP8_DTYPES, ordinal=ordinal, strided_ok=True)
        aligned("x", xa, 16, problems)
        aligned("q", qa, 16, problems)
        if rows >= 1 and k_dim >= BLOCK:         # what the kernel reads of x and writes of q
            check_rows_fit("x", x, rows, 2 * k_dim, xs, problems)
            check_rows_fit("q", q, rows, k_dim, qs, problems)
        sa, scol = check_scales("scales", scales, rows, k_dim, problems)
        if problems:
            raise ConfigError(problems, "FP8 quantiser launch")
        blk = into or self.block
        self.grids[id(blk)] = -(-rows * (k_dim // 8) // THREADS)
        return blk.set(x_ptr=xa, x_row_stride=xs, q_ptr=qa, q_row_stride=qs, s_ptr=sa, s_col_stride=scol,
                       rows=rows, k_dim=k_dim)

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        """Enqueue a prepared launch on ``stream`` (no host wait).

        Args:
            stream: a ``driver.Stream``.
            block: a block from ``prepare(..., into=...)``, or None: the launcher's own.

        Raises:
            ConfigError: ``block`` was never filled by this launcher's ``prepare``.
        """
        blk = block or self.block
        grid = self.grids.get(id(blk))
        if grid is None:
            raise ConfigError(["block: expected a block filled by this launcher's prepare(); call prepare first"],
                              "quantiser launch")
        blk.launch((grid,), (THREADS,), stream)

    def __call__(self, x, q, scales, *, stream: driver.Stream | None = None, **kw) -> None:
        """prepare and launch; synchronous when no stream is given (the temporary stream is
        closed also when the launch raises)."""
        blk = self.prepare(x, q, scales, **kw)
        run_once(lambda s: self.launch(s, blk), stream)
