"""``GroupedGemmSend``: the MoE down-projection (a grouped bf16 GEMM for Hopper, sm_90a)
with p3send's peer send in its epilogue (``ptx/p3_gemm_send.ptx``).

    gemm = GroupedGemmSend(n_experts)
    gemm(cfg, x, w, expert_offsets, c=c)                                # plain GEMM (send off): C
    gemm(cfg, x, w, expert_offsets, count_ptrs=counts, p3_control=0)   # rows go to their owners

x: bf16 (rows, K) row-major; w: bf16 (E, N, K) (each expert's weights N x K, K contiguous, as
``torch.nn.Linear`` stores them); C[r] = x[r] @ w[e]^T for the rows r of expert e. Arrays are
torch/cupy tensors (``__cuda_array_interface__`` or ``data_ptr``), DeviceBuffers or addresses;
for the last two give ``rows``, ``n_cols`` and ``k_dim``. The kernel is Hopper-only: it needs
compute capability 9.0 exactly.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..abi.config import P3PeerSendConfig, P3SendCtx
from ..abi.errors import ConfigError, P3SendError
from ..cuda import driver, ptxdoc
from ..cuda.loader import ParamBlock, kernel, link, ptx_dir
from .args import aligned, nbytes
from .send import SendLauncher

ENTRY = "p3_gemm_send"
THREADS = 384
SMEM = 215764            # the kernel's dynamic shared memory (its PTX header, LAUNCH)
BN, BK = 256, 64         # output columns per tile, K per pipeline stage
MAX_EXPERTS = 128
LINK_MAX_REGISTERS = 168  # 65536 / 384 threads, rounded down to 8


def _is_torch(obj) -> bool:
    # torch refuses __cuda_array_interface__ for bf16: read such tensors directly
    return hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "is_contiguous")


def _shape(obj):
    """(shape, strides or None when contiguous, item size), or Nones for a bare buffer."""
    if _is_torch(obj):
        return tuple(obj.shape), None if obj.is_contiguous() else tuple(obj.stride()), obj.element_size()
    cai = getattr(obj, "__cuda_array_interface__", None) if not isinstance(obj, driver.DeviceBuffer) else None
    if cai is not None:
        return tuple(cai["shape"]), cai.get("strides"), np.dtype(cai["typestr"]).itemsize
    return None, None, None


def _addr(obj, name: str) -> int:
    return int(obj.data_ptr()) if _is_torch(obj) else driver.device_ptr(obj, name)


def _size(obj) -> int | None:
    if _is_torch(obj):
        return obj.numel() * obj.element_size() if obj.is_contiguous() else None
    return nbytes(obj)


def require_hopper(dev: driver.Device) -> None:
    if tuple(dev.cc) != (9, 0):
        raise P3SendError(f"{ENTRY} is Hopper-only (PTX .target sm_90a: wgmma, setmaxnreg): it needs compute "
                          f"capability 9.0 (H100, H200, GH200); {dev.name} has {dev.cc[0]}.{dev.cc[1]}")


def _module_text_linked() -> str:
    """The shipped text as nvcc wrote it: p3_send_rows/p3_send_flush as .extern, for a linker."""
    return ptxdoc.set_prototype_linkage((ptx_dir() / f"{ENTRY}.ptx").read_text(), "extern")


class GroupedGemmSend(SendLauncher):
    """Launcher for ``p3_gemm_send`` on one Hopper GPU. Owns the sender state (zeroed once,
    self-resetting), the diagnostics and the P3SendCtx.

    linked: link the kernel with ``p3_send_rows.ptx`` through the driver's linker
    (docs/EMBEDDING.md (c); real calls, slower) instead of loading one module with the
    calls inlined (the default). num_sms: the persistent grid (default: every SM)."""

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, linked: bool = False,
                 num_sms: int | None = None):
        if not (1 <= n_experts <= MAX_EXPERTS):
            raise ConfigError([f"n_experts: expected 1..{MAX_EXPERTS}, got {n_experts}"], "grouped GEMM")
        self.dev = device or driver.device()
        require_hopper(self.dev)
        if linked:
            mod = link([(f"{ENTRY}.ptx", _module_text_linked()), "p3_send_rows"], device=self.dev,
                       name=f"{ENTRY}+p3_send_rows (linked)", max_registers=LINK_MAX_REGISTERS)
            self.k = mod[ENTRY]
        else:
            self.k = kernel(ENTRY, self.dev)
        if SMEM > self.dev.smem_optin:
            raise P3SendError(f"{ENTRY} needs {SMEM} B of shared memory per block; {self.dev.name} allows "
                              f"{self.dev.smem_optin}")
        driver.set_max_dynamic_smem(self.k.func, SMEM)
        sms = self.dev.sm_count
        if num_sms is not None and not (1 <= num_sms <= sms):
            raise ConfigError([f"num_sms: expected 1..{sms}, got {num_sms}"], "grouped GEMM")
        self.grid, self.threads, self.smem = num_sms or sms, THREADS, SMEM
        self.n_experts, self.linked = int(n_experts), linked
        self.state = driver.DeviceBuffer(40 * self.n_experts, fill=0)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.block = self.k.params_block()
        self._dev_args: dict = {}   # id(parameter block) -> its P3SendCtx and tensor maps on the device

    def prepare(self, cfg: P3PeerSendConfig, x, w, expert_offsets, c=None, *, rows: int | None = None,
                n_cols: int | None = None, k_dim: int | None = None, c_row_stride: int | None = None,
                bm: int | None = None, count_ptrs=None, row_cache: bool = False, p3_control: int = -1,
                same_gpu: bool = False, expert_offsets_host=None, into: ParamBlock | None = None) -> ParamBlock:
        """Check every argument and fill the parameter block (no launch).

        Args:
            cfg: the sender's config; with the send on, msg_bytes must be 2*n_cols.
            x: bf16 (rows, K) row-major, 16-byte aligned (a torch/cupy tensor, a DeviceBuffer
                or an address; for the last two give ``rows`` and ``k_dim``).
            w: bf16 (E, N, K): each expert's N x K weights, K contiguous (as
                ``torch.nn.Linear`` stores them).
            expert_offsets: int32 (E+1,) on the device, or numpy (uploaded and checked).
            c: the output C, bf16 (rows, n_cols) at ``c_row_stride``: written when the send
                is off (``p3_control < 0`` or ``cfg.n_ranks == 0``), else untouched (may be None).
            rows, n_cols, k_dim: the sizes, where the arrays do not tell them.
            c_row_stride: bytes between rows of C (default 2*n_cols).
            bm: 128 or 64 rows per tile (default: 64 when the host offsets show at most 64
                rows per expert on average, else 128).
            count_ptrs, row_cache, same_gpu, expert_offsets_host: as ``ScatterSend.prepare``.
            p3_control: < 0 (the default): plain GEMM writing C; >= 0: the rows go to their
                owners as ``p3_scatter_send`` sends them.
            into: fill this block (from ``self.k.params_block()``) instead of the launcher's
                own; each block has its own P3SendCtx and tensor maps on the device, so several
                prepared launches coexist. They are uploaded synchronously: do not prepare a
                block while its launch is in flight.

        Returns:
            The filled ParamBlock.

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        problems = []
        xs, xstr, xi = _shape(x)
        ws, wstr, wi = _shape(w)
        if xs is not None:
            if len(xs) != 2 or xi != 2 or xstr is not None:
                problems.append(f"x: expected a contiguous 2-byte (bf16) (rows, K) array, got shape {xs}, "
                                f"{xi}-byte items{', strided' if xstr is not None else ''}")
            else:
                rows = xs[0] if rows is None else rows
                k_dim = xs[1] if k_dim is None else k_dim
        if ws is not None:
            if len(ws) != 3 or wi != 2 or wstr is not None:
                problems.append(f"w: expected a contiguous bf16 (E, N, K) array, got shape {ws}, {wi}-byte items")
            else:
                if ws[0] != self.n_experts:
                    problems.append(f"w: expected {self.n_experts} experts (dim 0), got {ws[0]}")
                n_cols = ws[1] if n_cols is None else n_cols
                if k_dim is not None and ws[2] != k_dim:
                    problems.append(f"w: expected K = {k_dim} (dim 2, as x), got {ws[2]}")
        for name, v in (("rows", rows), ("n_cols", n_cols), ("k_dim", k_dim)):
            if v is None:
                problems.append(f"{name}: expected a value (not derivable from the arrays given)")
        if problems:
            raise ConfigError(problems, "grouped-GEMM launch")
        rows, n_cols, k_dim = int(rows), int(n_cols), int(k_dim)
        if rows < 1 or rows >= 2 ** 31:
            problems.append(f"rows: expected 1..2^31-1 rows in x, got {rows}")
        if n_cols <= 0 or n_cols % BN or self.n_experts * n_cols >= 2 ** 31:
            problems.append(f"n_cols: expected a positive multiple of {BN} (and E*N < 2^31), got {n_cols}")
        if k_dim <= 0 or k_dim % BK:
            problems.append(f"k_dim: expected a positive multiple of {BK}, got {k_dim}")
        xa, wa = _addr(x, "x"), _addr(w, "w")
        aligned("x", xa, 16, problems)
        aligned("w", wa, 16, problems)
        for name, obj, need in (("x", x, 2 * rows * k_dim), ("w", w, 2 * self.n_experts * n_cols * k_dim)):
            nb = _size(obj)
            if nb is not None and nb < need:
                problems.append(f"{name}: expected at least {need} bytes, got {nb}")
        send = p3_control >= 0 and cfg.n_ranks != 0
        host = expert_offsets_host if not isinstance(expert_offsets, np.ndarray) else expert_offsets
        if send:
            sa = self.send_args(cfg, expert_offsets, host_offsets=expert_offsets_host, rows_cap=rows,
                                count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control, same_gpu=same_gpu)
            if cfg.msg_bytes != 2 * n_cols:
                problems.append(f"msg_bytes: expected 2*n_cols = {2 * n_cols} (bf16 rows), got {cfg.msg_bytes}")
        else:   # the offsets checks only (the send's cfg is not read)
            sa = self.send_args(P3PeerSendConfig.disabled(), expert_offsets, host_offsets=expert_offsets_host,
                                rows_cap=rows, p3_control=-1)
        problems += sa.problems
        offs_addr, peers, flags = sa.expert_offsets, sa.count_ptrs, sa.flags
        stride = 2 * n_cols if c_row_stride is None else int(c_row_stride)
        c_addr = 0
        if not send:
            if c is None:
                problems.append("c: expected the output C (the send is off: p3_control < 0 or cfg.n_ranks == 0)")
            else:
                c_addr = _addr(c, "c")
                aligned("c", c_addr, 16, problems)
                nb = _size(c)
                if nb is not None and nb < (rows - 1) * stride + 2 * n_cols:
                    problems.append(f"c: expected at least {(rows - 1) * stride + 2 * n_cols} bytes "
                                    f"({rows} rows at stride {stride}), got {nb}")
            if stride % 16 or stride < 2 * n_cols:
                problems.append(f"c_row_stride: expected a multiple of 16 >= 2*n_cols ({2 * n_cols}), got {stride}")
        if bm is None:
            bm = 128
            if host is not None:
                off = np.asarray(host, dtype=np.int64)
                if off.size == self.n_experts + 1 and (off[-1] - off[0]) <= 64 * self.n_experts:
                    bm = 64
        if bm not in (64, 128):
            problems.append(f"bm: expected 64 or 128, got {bm}")
        if problems:
            raise ConfigError(problems, "grouped-GEMM launch")
        maps = driver.tensor_map("bfloat16", xa, (k_dim, rows), (BK, bm)) + \
            driver.tensor_map("bfloat16", wa, (k_dim, self.n_experts * n_cols), (BK, BN))
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = peers
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = offs_addr, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, flags, int(p3_control) if send else -1
        blk = into or self.block
        dev_args = self._dev_args.get(id(blk))
        if dev_args is None:   # [0, 104): P3SendCtx; [256, 512): the two tensor maps (64-byte aligned)
            dev_args = self._dev_args[id(blk)] = driver.DeviceBuffer(512, fill=0)
        dev_args.upload(np.frombuffer(bytes(ctx) + bytes(256 - ctypes.sizeof(ctx)) + maps, dtype=np.uint8))
        return blk.set(cfg=cfg, ctx=dev_args.ptr, tmaps=dev_args.ptr + 256, c_ptr=c_addr,
                       c_row_stride=stride, n_cols=n_cols, k_dim=k_dim, bm=bm)

    def close(self) -> None:
        """Free the state, diagnostics, staging and the device-side arguments of every block."""
        super().close()
        for b in self._dev_args.values():
            b.free()
        self._dev_args = {}
