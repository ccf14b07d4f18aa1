"""``GroupedGemmFp8Send``: the MoE down-projection as DeepSeek-V3 serves it, an FP8
block-scaled grouped GEMM for Hopper (sm_90a) with p3send's peer send in its epilogue
(``ptx/p3_gemm_fp8_send_wide.ptx`` for 128-row tiles, ``ptx/p3_gemm_fp8_send.ptx`` for 64-row
ones and the linked route: the same parameters, C and receive bytes).

    gemm = GroupedGemmFp8Send(n_experts)
    gemm(cfg, a, sa, b, sb, expert_offsets, c=c)                               # plain GEMM (send off): C
    gemm(cfg, a, sa, b, sb, expert_offsets, count_ptrs=counts, p3_control=0)  # rows go to their owners

a: e4m3 ``(rows, K)`` (torch.float8_e4m3fn or uint8), sa: float32 activation scales per (row,
128 of K) in DeepGEMM's TMA-aligned MN-major layout (``ops.quant.scale_layout``; what
``QuantFp8`` writes), b: e4m3 ``(E, N, K)``, sb: float32 ``(E, N/128, K/128)``; C bf16
``(rows, N)``. These are the tensors DeepGEMM's ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``
takes; where DeepGEMM takes ``m_indices`` (the expert of each row, -1 for padding), this takes
``expert_offsets`` (int32 ``(E+1,)``: expert e's span ``[off[e], off[e+1])``, padding rows at
the end of a span included), which is what the send needs to account rows per expert; with
the send on, padding rows are the rows the range table gives no rank (never sent). By
default expert starts must be multiples of 128 (DeepGEMM's contiguous layout);
``expert_align=1`` accepts any (the kernel does not need the alignment).
"""
from __future__ import annotations

import numpy as np

from ..abi.config import P3PeerSendConfig
from ..abi.errors import ConfigError
from ..abi.wire import FLAG_WIRE_FP8, FLAG_WIRE_FP8_STAGED
from ..cuda import driver
from ..cuda.loader import ParamBlock
from .args import aligned, array_arg, array_layout, check_rows_fit, span
from .gemm import GroupedGemmLauncher
from .quant import FP8_DTYPES, check_rows_array, check_scales

ENTRY = "p3_gemm_fp8_send"
THREADS = 384
SMEM = 201956            # the kernel's dynamic shared memory (its PTX header, LAUNCH)
#: the 512-thread kernel launched for 128-row tiles inlined: entry, threads, dynamic shared memory
WIDE = ("p3_gemm_fp8_send_wide", 512, 202004)
BN, BK = 128, 128        # output columns per tile, K per pipeline stage (one scale block each)
MAX_EXPERTS = 128
LINK_MAX_REGISTERS = 168  # 65536 / 384 threads, rounded down to 8
CONTIGUOUS_ALIGN = 128   # DeepGEMM's get_m_alignment_for_contiguous_layout()


class GroupedGemmFp8Send(GroupedGemmLauncher):
    """Launcher for ``p3_gemm_fp8_send`` on one Hopper GPU. Owns the sender state (zeroed once,
    self-resetting), the diagnostics and, per parameter block, the P3SendCtx and tensor maps.

    n_experts: the experts of every launch (``expert_offsets`` holds n_experts + 1), 1..128.
    device: the Device to launch on, a Hopper GPU (default: ``driver.device()``).
    linked: link the kernel with ``p3_send_rows.ptx`` through the driver's linker (the route
    of docs/EMBEDDING.md (c)) instead of one module with the calls inlined (the default).
    num_sms: the persistent grid (default: every SM). variant_ptx: the text of a measurement
    variant of the kernel (tools/build_gemm_fp8.py --variant), loaded instead of the shipped one
    (on the FP8 wire a variant without the consumers' quantiser, such as ``outline``, needs
    ``fp8_source="bf16"``: it refuses FLAG_WIRE_FP8_STAGED, sending nothing).
    wide: launch ``p3_gemm_fp8_send_wide`` (512 threads: two accumulator sets per consumer, four
    send warps in a warpgroup of their own; the same C and receive bytes) for 128-row tiles,
    ``p3_gemm_fp8_send`` for 64-row ones (default: True unless linked or a variant; docs/PERF.md
    measures both). variant_shape:
    the variant's launch shape (threads, dynamic shared memory), default (THREADS, SMEM)."""

    ENTRY, THREADS, SMEM, BN, BK, MAX_EXPERTS = ENTRY, THREADS, SMEM, BN, BK, MAX_EXPERTS
    LINK_MAX_REGISTERS, NEEDS, KIND, WIDE = LINK_MAX_REGISTERS, "wgmma e4m3", "FP8 ", WIDE

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, linked: bool = False,
                 num_sms: int | None = None, variant_ptx: str | None = None, wide: bool | None = None,
                 variant_shape: tuple | None = None):
        super().__init__(n_experts, device=device, linked=linked, num_sms=num_sms, variant_ptx=variant_ptx,
                         wide=wide, variant_shape=variant_shape)

    def prepare(self, cfg: P3PeerSendConfig, a, sa, b, sb, expert_offsets, c=None, *, rows: int | None = None,
                n_cols: int | None = None, k_dim: int | None = None, c_row_stride: int | None = None,
                bm: int | None = None, count_ptrs=None, row_cache: bool = False, p3_control: int = -1,
                same_gpu: bool = False, expert_offsets_host=None, expert_align: int = CONTIGUOUS_ALIGN,
                into: ParamBlock | None = None, wire: str = "bf16", fp8_source: str | None = None) -> ParamBlock:
        """Check every argument (all problems at once, each naming its argument) and fill the
        parameter block (no launch).

        Arrays are torch tensors, ``__cuda_array_interface__`` objects, DeviceBuffers or
        addresses (the last two carry no shape: give the sizes).

        Args:
            cfg: the sender's config; read only with the send on, when ``msg_bytes`` must be
                the slot size of an n_cols row on ``wire``: 2*n_cols (bf16), 33*n_cols/32 (fp8).
            a: e4m3 (rows, K) activations (float8_e4m3fn or uint8), unit column stride, rows
                at a multiple of 16 bytes >= K, 16-byte aligned, covering ``(rows - 1) * row
                stride + K`` bytes (checked where its size is known: not for an address).
            sa: float32 activation scales (rows, K/128) in the TMA-aligned MN-major layout
                (what ``QuantFp8`` writes; ``ops.quant.check_scales``), 16-byte aligned.
            b: e4m3 (E, N, K) weights, contiguous (K innermost), E = ``n_experts``,
                16-byte aligned.
            sb: float32 (E, N/128, K/128) weight scales, contiguous, 4-byte aligned.
            expert_offsets: int32 (E+1,): expert e's rows are ``[off[e], off[e+1])`` of a,
                padding rows included; a device array, or numpy (uploaded and checked).
            c: the output C, bf16 (rows, n_cols) (bfloat16, uint16 or uint8 bytes) at
                ``c_row_stride``, 16-byte aligned, covering ``(rows - 1) * c_row_stride +
                2*n_cols`` bytes: required and written when the send is off, else untouched
                (may be None).
            rows: rows of a, 1..2^31-1 (default: a's leading dimension).
            n_cols: N, a positive multiple of 128 with E*N < 2^31 (default: b's dim 1).
            k_dim: K, a positive multiple of 128 (default: a's columns, else b's dim 2; b's
                dim 2 must equal it).
            c_row_stride: bytes between rows of C, a multiple of 16 >= 2*n_cols (default: c's
                row stride when it has a shape, else 2*n_cols).
            bm: 128 or 64 rows per tile (default: 64 when the host offsets show at most 64
                rows per expert on average, else 128).
            count_ptrs, row_cache, same_gpu: as ``ScatterSend.prepare`` (used with the send on).
            p3_control: < 0 (the default), or ``cfg.n_ranks == 0``: the send is off and C is
                written; >= 0: the rows go to their owners as ``p3_scatter_send`` sends them.
            expert_offsets_host: the device offsets' values as numpy, checked when given
                (numpy ``expert_offsets`` are their own).
            expert_align: with host offsets known, every expert must start at a multiple of
                this (default 128, DeepGEMM's contiguous layout; 1: any start).
            into: fill this block (from ``params_block()`` of ``self.k`` or of any kernel of
                the launcher: it is bound to the kernel of ``bm`` and ``wire``, ``kernel_for``)
                instead of the launcher's own; each block has its own P3SendCtx and tensor maps on the device, uploaded
                synchronously: do not prepare a block while its launch is in flight (calling
                the launcher has no such limit: ``GroupedGemmLauncher.__call__``).
            wire: the rows' format on the wire (``abi.wire``): ``"bf16"`` (the default) or
                ``"fp8"`` (n_cols a multiple of 512; the launch's flags carry ``FLAG_WIRE_FP8``
                and the rows go out as e4m3 codes and block scales: the kernel is the same).
                Read only with the send on.
            fp8_source: on the fp8 wire, what is quantised: ``"fp32"`` (the default at
                128-row tiles: the consumers quantise their fp32 sums, one rounding, and the
                send warps copy; ``FLAG_WIRE_FP8_STAGED``) or ``"bf16"`` (the default at 64-row
                tiles, the only one there: ``p3_send_rows`` quantises the staged bf16 tile, so
                the wire bytes are ``oracle.wire.encode`` of the C the gated GEMM writes).

        Returns:
            The filled ParamBlock.

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
            CudaError: the driver refused a tensor map.
        """
        problems: list = []
        rows, k_dim, a_stride = check_rows_array("a", a, rows, k_dim, problems, None)
        bs, bstr, bi = array_layout(b)
        if bs is not None:
            if len(bs) != 3 or bstr != (bs[1] * bs[2] * bi, bs[2] * bi, bi):
                problems.append(f"b: expected a contiguous e4m3 (E, N, K) array, got shape {bs}, byte strides {bstr}")
            else:
                n_cols = self.check_weights("b", bs, n_cols, k_dim, "a", problems)
                k_dim = bs[2] if k_dim is None else k_dim
        rows, n_cols, k_dim = self.check_sizes(rows, n_cols, k_dim, "a", problems)
        a_stride = k_dim if a_stride is None else int(a_stride)
        if a_stride % 16 or a_stride < k_dim:
            problems.append(f"a: expected rows at a multiple of 16 bytes >= K = {k_dim}, got row stride {a_stride}")
        ordinal = self.dev.ordinal
        aa, _ = array_arg(a, "a", problems, dtypes=FP8_DTYPES, ordinal=ordinal, strided_ok=True)
        ba, _ = array_arg(b, "b", problems, dtypes=FP8_DTYPES, ordinal=ordinal,
                          nbytes_min=self.n_experts * n_cols * k_dim)
        aligned("a", aa, 16, problems)
        aligned("b", ba, 16, problems)
        if rows >= 1 and k_dim > 0:             # what A's tensor map reads
            check_rows_fit("a", a, rows, k_dim, a_stride, problems)
        saa, sa_col = check_scales("sa", sa, rows, k_dim, problems)
        n_sb = self.n_experts * (n_cols // BN) * (k_dim // BK) if n_cols > 0 and k_dim > 0 else 0
        sbs, _, _ = array_layout(sb)
        want_sb = (self.n_experts, n_cols // BN, k_dim // BK)
        if sbs is not None and sbs != want_sb:
            problems.append(f"sb: expected float32 weight scales of shape {want_sb} (E, N/128, K/128), got {sbs}")
        sba, _ = array_arg(sb, "sb", problems, dtypes=("float32",), ordinal=ordinal, nbytes_min=4 * n_sb)
        aligned("sb", sba, 4, problems)
        send, host, sargs = self.check_send(cfg, expert_offsets, expert_offsets_host, rows, n_cols, count_ptrs,
                                            row_cache, p3_control, same_gpu, problems, wire)
        if host is not None and expert_align > 1:
            off = np.asarray(host, dtype=np.int64)
            if off.shape == (self.n_experts + 1,):
                bad = np.flatnonzero(off[:-1] % expert_align)
                if len(bad):
                    problems.append(f"expert_offsets: expected every expert to start at a multiple of {expert_align} "
                                    f"(DeepGEMM's contiguous layout; expert_align=1 takes any start), got expert "
                                    f"{int(bad[0])} at row {int(off[bad[0]])}")
        c_addr, stride = self.check_c(c, c_row_stride, rows, n_cols, send, problems)
        bm = self.tile_rows(bm, host, problems)
        if fp8_source not in (None, "fp32", "bf16"):
            problems.append(f"fp8_source: expected 'fp32' or 'bf16', got {fp8_source!r}")
        elif fp8_source == "fp32" and bm != 128:
            problems.append(f"fp8_source: 'fp32' needs 128-row tiles (a row's 128 columns in one warpgroup), "
                            f"got bm {bm}")
        if problems:
            raise ConfigError(problems, "FP8 grouped-GEMM launch")
        if send and sargs.flags & FLAG_WIRE_FP8 and (fp8_source or ("fp32" if bm == 128 else "bf16")) == "fp32":
            sargs.flags |= FLAG_WIRE_FP8_STAGED
        kb = k_dim // BK
        # the scales' map spans each column's padded rows (m_pad = sa_col / 4), as DeepGEMM's does:
        # the padding is read only for tile rows past the input, which are never written; its
        # box is 4 rows taller than the tile (the kernel loads from m0 rounded down to 4)
        maps = driver.tensor_map("float8_e4m3", aa, (k_dim, rows), (BK, bm), strides=[a_stride]) + \
            driver.tensor_map("float8_e4m3", ba, (k_dim, self.n_experts * n_cols), (BK, BN)) + \
            driver.tensor_map("float32", saa, (sa_col // 4, kb), (bm + 4, 1), strides=[sa_col], swizzle=0)
        return self.fill_block(into, cfg, sargs, send, p3_control, maps, sb=sba, c_ptr=c_addr, c_row_stride=stride,
                               n_cols=n_cols, k_dim=k_dim, bm=bm)

    def c_address(self, c, c_row_stride: int | None, stride: int, problems: list) -> tuple[int, int | None, int]:
        """``GroupedGemmLauncher.c_address`` for this launcher's arrays: the row stride is
        ``stride`` unless no ``c_row_stride`` is given and ``c`` is a 2-D array of 2-byte items
        (then its own); its dtype must be bfloat16, uint16 or uint8 and its memory this GPU's
        (else a problem is appended to ``problems``). Its size is the bytes it covers, strided
        or not (``args.span``)."""
        cs, cstr, _ = array_layout(c)
        if cs is not None and c_row_stride is None and len(cs) == 2 and cstr[1] == 2:
            stride = cstr[0]
        c_addr, _ = array_arg(c, "c", problems, dtypes=("bfloat16", "uint16", "uint8"), ordinal=self.dev.ordinal,
                              strided_ok=True)
        return c_addr, span(c), stride
