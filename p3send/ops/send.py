"""Launchers of the send kernels: ``ScatterSend`` (``p3_scatter_send``, a whole
expert-grouped C; ``p3_scatter_send_fp8`` for the FP8 wire) and ``EpilogueSend``
(``p3_epilogue_send``, fp32 tiles converted and sent by the linkable ``p3_send_rows``). Both
own their sender state and diagnostics; both take ``wire="bf16"|"fp8"`` (``p3send.abi.wire``)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..abi.config import P3_MAX_RANKS, P3PeerSendConfig, P3SendCtx, validate
from ..abi.errors import ConfigError, P3SendError
from ..abi.wire import FLAG_WIRE_FP8, WIRE_FP8, wire_format, wire_problems
from ..cuda import driver
from ..cuda.loader import ParamBlock, kernel
from .args import aligned, array_arg, run_once

FLAG_ROW_CACHE = 1
FLAG_SIGNAL = 2
FLAG_SCOPE_GPU = 4   # every receiver on this GPU: .gpu-scope release (docs/PROTOCOL.md)
FLAG_TILE = 8        # p3_scatter_send: the tile launch (flags bits 16..31: stamp/trace slots)
FLAG_NVSHMEM = 32    # ranks outside this NVLink domain by NVSHMEM puts (a module linked with the transport)
FLAG_NVSHMEM_ALL = 64  # ... every rank by puts, this one too (the one-PE self-put test): p3send.ops.nvshmem


@dataclass
class SendArgs:
    """What ``send_args`` found: ``problems`` (one message per bad argument, empty when all
    is well), the ``expert_offsets`` device address, ``count_ptrs`` (8 addresses, 0 past the
    p2p ranks) and the launch ``flags`` (``FLAG_ROW_CACHE``, ``FLAG_SIGNAL``, ``FLAG_SCOPE_GPU``)."""
    problems: list
    expert_offsets: int
    count_ptrs: list
    flags: int


def send_args(cfg: P3PeerSendConfig, expert_offsets, *, n_experts: int, ordinal: int | None, host_offsets=None,
              rows_cap: int | None = None, count_ptrs=None, row_cache: bool = False, p3_control: int = 0,
              same_gpu: bool = False, staging: driver.DeviceBuffer | None = None, wire="bf16",
              hidden: int | None = None) -> SendArgs:
    """The checks and values every send launcher shares (``ScatterSend``, ``EpilogueSend``,
    ``GroupedGemmSend`` and the benchmark's baselines).

    Args:
        cfg: the sender's config, checked with ``validate`` (collected, not raised).
        expert_offsets: int32 ``(n_experts+1,)``: a device array (DeviceBuffer, CAI object,
            torch tensor, address), or a numpy array, uploaded into ``staging`` and checked.
        n_experts: local experts per rank.
        ordinal: the launching GPU (device arrays on another GPU are refused), or None.
        host_offsets: the device offsets' values as numpy, checked when given.
        rows_cap: rows the input holds (the offsets may not reach past it), or None.
        count_ptrs: the receive counts of the p2p ranks (enables ``FLAG_SIGNAL``), or None.
        row_cache, p3_control, same_gpu: as ``ScatterSend.prepare``.
        staging: a device buffer of at least ``4*(n_experts+1)`` bytes for numpy offsets.
        wire: the row format, ``"bf16"`` or ``"fp8"``: with ``"fp8"`` the flags get
            ``FLAG_WIRE_FP8`` and ``msg_bytes`` is checked against ``hidden`` (required then).
        hidden: the row's columns (checked against ``msg_bytes`` when given).

    Returns:
        SendArgs; nothing is raised for bad arguments (the caller raises once, with all).
    """
    fmt = wire_format(wire, what="send launch")
    problems = validate(cfg, p3_control=p3_control, row_cache=row_cache, raise_on_error=False, wire=fmt,
                        hidden=hidden)
    n = n_experts
    if isinstance(expert_offsets, np.ndarray):
        host_offsets = expert_offsets
        if staging is None or staging.nbytes < 4 * (n + 1):
            raise ConfigError([f"expert_offsets: a numpy array needs a staging buffer of {4 * (n + 1)} bytes"],
                              "send launch")
        if expert_offsets.size == n + 1:
            staging.upload(np.ascontiguousarray(expert_offsets, dtype=np.int32))
        expert_offsets = staging
    offs_addr, _ = array_arg(expert_offsets, "expert_offsets", problems, dtypes=("int32",), nbytes_min=4 * (n + 1),
                             ordinal=ordinal)
    aligned("expert_offsets", offs_addr, 4, problems)
    if host_offsets is not None:
        off = np.asarray(host_offsets, dtype=np.int64)
        if off.shape != (n + 1,):
            problems.append(f"expert_offsets: expected {n + 1} int32 values, got shape {off.shape}")
        elif (off < 0).any() or (np.diff(off) < 0).any() or off[-1] > np.iinfo(np.int32).max:
            problems.append(f"expert_offsets: expected non-decreasing values in 0..2^31-1, got {off.tolist()[:12]}")
        elif rows_cap is not None and off[-1] > rows_cap:
            problems.append(f"expert_offsets: rows up to {int(off[-1])} but the input holds {rows_cap} rows")
    flags = (FLAG_ROW_CACHE if row_cache else 0) | (FLAG_WIRE_FP8 if fmt == WIRE_FP8 else 0)
    peers = [0] * P3_MAX_RANKS
    if count_ptrs is not None:
        flags |= FLAG_SIGNAL | (FLAG_SCOPE_GPU if same_gpu else 0)
        cp = list(count_ptrs)
        for i in range(min(cfg.n_ranks, cfg.p2p_world_size) if cfg.n_ranks > 0 else 0):
            if i >= len(cp):
                problems.append(f"count_ptrs[{i}]: expected the receive counts of p2p rank {i}, got nothing")
                continue
            peers[i] = driver.device_ptr(cp[i], f"count_ptrs[{i}]")
            aligned(f"count_ptrs[{i}]", peers[i], 8, problems)
    return SendArgs(problems, offs_addr, peers, flags)


def read_diagnostics(buf: driver.DeviceBuffer, reset: bool) -> dict:
    """A send's u32[4] diagnostics as {'dropped', 'unrouted', 'rejected'}; zeroed when ``reset``."""
    d = buf.download(np.uint32)
    if reset:
        buf.fill(0)
    return {"dropped": int(d[0]), "unrouted": int(d[1]), "rejected": bool(d[2])}


class SendLauncher:
    """What the send launchers share: the sender state and diagnostics they own, the staging
    of numpy offsets, launch, a one-shot call, diagnostics, close. Subclasses set ``dev``,
    ``n_experts``, ``state``, ``diag``, ``block``, ``grid``, ``threads`` and ``smem``."""

    offsets_buf: driver.DeviceBuffer | None = None

    def send_args(self, cfg: P3PeerSendConfig, expert_offsets, **kw) -> SendArgs:
        """``send_args`` for this launcher (its experts, its GPU, its staging buffer).

        Args:
            cfg, expert_offsets: as ``send_args``.
            **kw: the other keywords of ``send_args`` (host_offsets, rows_cap, count_ptrs,
                row_cache, p3_control, same_gpu).
        """
        if isinstance(expert_offsets, np.ndarray) and self.offsets_buf is None:
            self.offsets_buf = driver.DeviceBuffer(4 * (self.n_experts + 1))
        return send_args(cfg, expert_offsets, n_experts=self.n_experts, ordinal=self.dev.ordinal,
                         staging=self.offsets_buf, **kw)

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        """Enqueue a prepared launch on ``stream`` (no host wait).

        Args:
            stream: a ``driver.Stream``.
            block: a block from ``prepare(..., into=...)``, or None: the launcher's own.
        """
        (block or self.block).launch((self.grid,), (self.threads,), stream, self.smem)

    def __call__(self, *args, stream=None, **kw) -> None:
        """prepare(*args, **kw) and launch; synchronous when no stream is given (the temporary
        stream is closed also when the launch raises)."""
        blk = self.prepare(*args, **kw)
        run_once(lambda s: self.launch(s, blk), stream)

    def diagnostics(self, reset: bool = True) -> dict:
        """{'dropped': rows failing the bounds check, 'unrouted': rows owned by no rank,
        'rejected': cfg refused on the device} accumulated since the last reset."""
        return read_diagnostics(self.diag, reset)

    def close(self) -> None:
        """Free the state, diagnostics and staging buffers."""
        for b in (self.state, self.diag, getattr(self, "ctx", None), self.offsets_buf):
            if b is not None:
                b.free()
        self.offsets_buf = None


class ScatterSend(SendLauncher):
    """Launcher for ``p3_scatter_send`` on one device.

    Owns the sender state (per-expert completion and pair counters, zeroed once and
    self-resetting) and the diagnostics buffer. Two launch shapes (docs/KERNELS.md):

    - the tile launch (``FLAG_TILE``): one short-lived CTA of TILE_THREADS threads per tile
      of TILE_THREADS*TILE_VECTORS 16-byte vectors, over the whole GPU (the shape of the
      driver's copy). The default when no SM budget is set, the row cache is off and the
      rows are known at ``prepare`` (``tile_launch = False`` turns it off);
    - the persistent launch: ``grid`` CTAs of 1024 threads, one per SM. ``num_sms`` limits
      the send to that many SMs (like DeepEP's ``set_num_sms``); the row cache needs it.

    ``prepare(..., wire="fp8")`` sends bf16 rows of C on the FP8 wire with
    ``p3_scatter_send_fp8`` (same parameters; ``grid`` CTAs of FP8_THREADS threads, FP8_SMEM
    bytes of shared memory); ``p3_scatter_send`` itself refuses ``FLAG_WIRE_FP8``.

    Args:
        n_experts: the experts of every send (``expert_offsets`` holds n_experts + 1), >= 1.
        device: the Device to launch on (default: ``driver.device()``).
        num_sms: the SM budget, as ``set_num_sms`` (default None: every SM).
        threads: threads per CTA of the persistent launch, a multiple of 32 in 32..1024
            (default 1024); a smaller CTA is also the tile launch's CTA.
        transport: a ``p3send.ops.nvshmem.NvshmemTransport``: every send (either wire) then
            goes through ``p3_scatter_send_fp8`` linked with the NVSHMEM shim, with
            ``FLAG_NVSHMEM`` (rows for ranks outside this NVLink domain by puts; docs/SCALING.md
            section 5), the transport's block after the sender state. None (default): none.
    """

    THREADS = 1024
    #: cp.async staging per thread: 2 chunks x 6 vectors x 16 B (1024 threads: 192 KiB, one CTA per SM).
    SMEM_PER_THREAD = 2 * 6 * 16
    FLAG_TILE = FLAG_TILE
    #: the tile launch: CTAs of TILE_THREADS threads, TILE_VECTORS (<= 8) vectors per thread
    TILE_THREADS = 128
    TILE_VECTORS = 8
    #: the FP8 wire's launch: 12 warps a CTA (.maxntid 384 with .minnctapersm 1: up to 168
    #: registers a thread, so the quantiser's two blocks in flight need no spills, also with
    #: p3_send_rows compiled apart as the NVSHMEM link does: 13 warps or more cap it at 128),
    #: FP8_WARP_BYTES of shared memory each (its PTX header: the ctx, the acct, an mbarrier,
    #: one stage of 4 rows x up to 2048 columns: 1792 at hidden 7168); the shape measured
    #: best of those timed side by side (docs/PERF.md, "The FP8 wire")
    FP8_THREADS = 384
    FP8_WARP_BYTES = 16640
    FP8_SMEM = FP8_WARP_BYTES * FP8_THREADS // 32

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, num_sms: int | None = None,
                 threads: int = THREADS, transport=None):
        problems = []
        if n_experts < 1:
            problems.append(f"n_experts: expected >= 1, got {n_experts}")
        if threads % 32 or not (32 <= threads <= self.THREADS):
            problems.append(f"threads: expected a multiple of 32 in 32..{self.THREADS}, got {threads}")
        if problems:
            raise ConfigError(problems, "ScatterSend")
        self.dev = device or driver.device()
        self.k = kernel("p3_scatter_send", self.dev)
        self.n_experts, self.threads = int(n_experts), threads
        self.tile_threads = self.TILE_THREADS if threads == self.THREADS else threads
        self.tile_launch = True      # False: always the persistent launch
        # u64 done[e] + u32 pair[e][8] (+ the NVSHMEM transport's block: p3send.ops.nvshmem)
        self.transport = transport
        self.state = driver.DeviceBuffer(self.n_experts * 40, fill=0) if transport is None else \
            transport.sender_state(self.n_experts)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.smem = self.SMEM_PER_THREAD * threads
        if self.smem > self.dev.smem_optin:
            raise P3SendError(f"p3_scatter_send needs {self.smem} B of shared memory per block; "
                              f"{self.dev.name} allows {self.dev.smem_optin}")
        driver.set_max_dynamic_smem(self.k.func, max(self.smem, self.SMEM_PER_THREAD * self.THREADS))
        self.set_num_sms(num_sms)
        self.block = self.k.params_block()
        self.current = self.block        # the block the last prepare filled (launch's default)
        self.k_fp8 = self.block_fp8 = None

    def fp8_kernel(self):
        """``p3_scatter_send_fp8``, loaded on first use (its shared memory limit set)."""
        if self.k_fp8 is None:
            if self.FP8_SMEM > self.dev.smem_optin:
                raise P3SendError(f"p3_scatter_send_fp8 needs {self.FP8_SMEM} B of shared memory per block; "
                                  f"{self.dev.name} allows {self.dev.smem_optin}")
            self.k_fp8 = kernel("p3_scatter_send_fp8", self.dev) if self.transport is None else \
                self.transport.kernel("p3_scatter_send_fp8")        # linked with the transport's shim
            driver.set_max_dynamic_smem(self.k_fp8.func, self.FP8_SMEM)
            self.block_fp8 = self.k_fp8.params_block()
        return self.k_fp8

    def set_num_sms(self, num_sms: int | None) -> None:
        """Use ``num_sms`` SMs: the persistent launch, one CTA each (a 1024-thread CTA's
        staging fills an SM's shared memory); None: every SM, and the tile launch where it
        applies. A budget takes effect at the next launch, also of blocks prepared before;
        lifting it, at the next ``prepare``. ``grid`` is also the number of stamp and trace
        slots in either shape: size those buffers by it."""
        sms = self.dev.sm_count
        if num_sms is not None and not (1 <= num_sms <= sms):
            raise ConfigError([f"num_sms: expected 1..{sms}, got {num_sms}"], "ScatterSend")
        self.grid = num_sms or sms
        self.budget = num_sms is not None and num_sms < sms

    def tile_smem(self, cfg: P3PeerSendConfig, threads: int | None = None) -> int:
        """The tile launch's dynamic shared memory in bytes (the PTX header's formula): the
        vectors' slots 128*B, the row table 8*(1 + ceil((8*B - 1) / nv)), the offsets (8-byte
        padded) and the range table.

        Args:
            cfg: the config (its msg_bytes and n_ranks).
            threads: the CTA size B (default the tile launch's).
        """
        b, nv = threads or self.tile_threads, max(cfg.msg_bytes // 16, 1)
        n, ranks = self.n_experts, max(int(cfg.n_ranks), 0)
        return 128 * b + 8 * (1 + -(-(8 * b - 1) // nv)) + 8 * ((n + 2) // 2) + 8 * n * ranks

    def _tile_shape(self, cfg, rows, cap, row_cache) -> tuple | None:
        """(grid, block, smem) of the tile launch for this send, or None for the persistent one."""
        if not self.tile_launch or self.budget or row_cache or rows is None:
            return None
        nv = cfg.msg_bytes // 16
        smem = self.tile_smem(cfg)
        if max(rows, cap or 0) * nv >= 1 << 32 or smem > self.SMEM_PER_THREAD * self.THREADS or self.grid >= 1 << 16:
            return None
        tiles = -(-max(rows, 0) * nv // (self.tile_threads * self.TILE_VECTORS))
        return max(1, min(tiles, (1 << 31) - 1)), self.tile_threads, smem

    def launch(self, stream, block: ParamBlock | None = None) -> None:
        """Enqueue a prepared block in the shape ``prepare`` chose; a budget set after a
        block was prepared for the tile launch turns it into the persistent launch.

        Args:
            stream: a ``driver.Stream``.
            block: a block from ``prepare(..., into=...)``, or None: the launcher's own.
        """
        blk = block or self.current
        if getattr(blk, "fp8_wire", False):
            blk.launch((self.grid,), (self.FP8_THREADS,), stream, self.FP8_SMEM)
            return
        shape = getattr(blk, "launch_shape", None)
        if shape is not None and self.budget:
            flags = blk.get("flags")
            flags.value &= ~(FLAG_TILE | 0xFFFF0000)
            blk.launch_shape = shape = None
        grid, threads, smem = shape or (self.grid, self.threads, self.smem)
        blk.launch((grid,), (threads,), stream, smem)

    def prepare(self, cfg: P3PeerSendConfig, c, expert_offsets, c_row_stride: int | None = None, *,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, same_gpu: bool = False,
                expert_offsets_host=None, rows_in_c: int | None = None,
                into: ParamBlock | None = None, wire="bf16", hidden: int | None = None) -> ParamBlock:
        """Validate every argument and fill the parameter block (no launch).

        Args:
            cfg: the sender's P3PeerSendConfig.
            c: C, rows of ``cfg.msg_bytes`` bytes at ``c_row_stride`` (absolute row r at
                ``c + r*c_row_stride``), 16-byte aligned: a DeviceBuffer, a CAI object, a
                torch tensor or an address. With ``wire="fp8"``: bf16 rows of ``hidden``
                columns (``2*hidden`` bytes), quantised on the way out.
            expert_offsets: int32 (n_experts+1,) on the device, or a numpy array (uploaded
                into the launcher's staging buffer and checked).
            c_row_stride: bytes between rows of C, a multiple of 16 >= msg_bytes (default msg_bytes).
            count_ptrs: up to 8 receive-count arrays (u64 [n_experts*n_ranks]) of the p2p
                ranks, as seen from here: enables the arrival signal; None: no signal.
            row_cache: resolve rows through ``cfg.row_base_ptr`` (zeroed before every launch).
            p3_control: < 0 turns the send off (the MAX gate).
            same_gpu: every receiver is on this GPU: the signal uses .gpu-scope release.
            expert_offsets_host: the device offsets' values as numpy, so bounds are checked.
            rows_in_c: rows C holds (default: from C's size when known).
            into: fill this block (from ``self.k.params_block()``, or ``fp8_kernel().params_block()``
                with ``wire="fp8"``) instead of the launcher's own.
            wire: ``"bf16"`` (C's rows are the slots' bytes) or ``"fp8"`` (``p3send.abi.wire``:
                ``msg_bytes`` must be ``33*hidden/32``, checked before any launch).
            hidden: the row's columns (default: ``msg_bytes/2`` for bf16, ``32*msg_bytes/33``
                for fp8).

        Returns:
            The filled ParamBlock (``launch`` takes it).

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        fmt = wire_format(wire, what="scatter-send launch")
        fp8 = fmt == WIRE_FP8
        given = hidden is not None          # an explicit hidden is checked on either wire
        if hidden is None:
            hidden = cfg.msg_bytes * 32 // 33 if fp8 else cfg.msg_bytes // 2
        wire_bad = wire_problems(cfg.msg_bytes, hidden, fmt) if fp8 or given else []
        row_bytes = 2 * hidden if fp8 else cfg.msg_bytes      # a row of C
        stride = row_bytes if c_row_stride is None else int(c_row_stride)
        arg_problems = []
        c_addr, nb = array_arg(c, "c", arg_problems, ordinal=self.dev.ordinal, strided_ok=True)
        cap = rows_in_c
        if cap is None and nb is not None and stride:
            cap = (nb - row_bytes) // stride + 1 if nb >= row_bytes else 0
        sa = self.send_args(cfg, expert_offsets, host_offsets=expert_offsets_host, rows_cap=cap,
                            count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control, same_gpu=same_gpu)
        problems, offs_addr, peers, flags = sa.problems, sa.expert_offsets, sa.count_ptrs, sa.flags
        problems += arg_problems + [p for p in wire_bad if p not in problems]
        aligned("c", c_addr, 16, problems)
        what = "2*hidden" if fp8 else "msg_bytes"
        if stride % 16 or stride < row_bytes:
            problems.append(f"c_row_stride: expected a multiple of 16 >= {what} ({row_bytes}), got {stride}")
        if self.transport is not None:      # the transport sends either wire with p3_scatter_send_fp8
            host = expert_offsets if isinstance(expert_offsets, np.ndarray) else expert_offsets_host
            problems += self.transport.problems(cfg, self.n_experts, rows_end=None if host is None else int(host[-1]),
                                                rows_cap=cap)
            if not fp8 and cfg.msg_bytes % 512:
                problems.append(f"msg_bytes: the bf16 wire through the transport (p3_scatter_send_fp8's 256-column "
                                f"tiles) needs a multiple of 512, got {cfg.msg_bytes}")
            if into is not None and into.kernel is not self.fp8_kernel():
                problems.append("into: the NVSHMEM transport sends with its own p3_scatter_send_fp8, linked with the "
                                "shim: expected a block of fp8_kernel() (another module has no put path)")
            flags |= self.transport.flags
        if problems:
            raise ConfigError(problems, "scatter-send launch")
        if fp8 or self.transport is not None:
            self.fp8_kernel()
            blk = (into or self.block_fp8).set(cfg=cfg, count_ptrs=peers, c_ptr=c_addr, c_row_stride=stride,
                                                expert_offsets=offs_addr, state_ptr=self.state, diag_ptr=self.diag,
                                                n_experts=self.n_experts, flags=flags | (FLAG_WIRE_FP8 if fp8 else 0),
                                                p3_control=int(p3_control))
            blk.fp8_wire, blk.launch_shape = True, None
            self.current = blk
            return blk
        host = expert_offsets if isinstance(expert_offsets, np.ndarray) else expert_offsets_host
        rows = int(host[-1]) - int(host[0]) if host is not None and len(host) else cap
        shape = self._tile_shape(cfg, rows, cap, row_cache)
        if shape is not None:
            flags |= FLAG_TILE | self.grid << 16        # stamp/trace slots: as many as the persistent grid's
        blk = (into or self.block).set(cfg=cfg, count_ptrs=peers, c_ptr=c_addr, c_row_stride=stride,
                                       expert_offsets=offs_addr, state_ptr=self.state, diag_ptr=self.diag,
                                       n_experts=self.n_experts, flags=flags, p3_control=int(p3_control))
        blk.launch_shape, blk.fp8_wire = shape, False
        self.current = blk
        return blk


class EpilogueSend(SendLauncher):
    """Launcher for ``p3_epilogue_send``: fp32 accumulator tiles -> bf16 in shared-memory
    stages -> peers, by ``send_warps`` dedicated send warps fed through the mailbox (0:
    the epilogue warps send inline). Owns the sender state, diagnostics and P3SendCtx.

    Args:
        n_experts: the experts of every send (``expert_offsets`` holds n_experts + 1), >= 1.
        device: the Device to launch on (default: ``driver.device()``).
        bm: tile rows, a positive multiple of num_stages (default 16).
        bn: tile columns, a positive multiple of 8 (default 1024); the dynamic shared
            memory is bm*bn*2 bytes and must fit the device's opt-in limit.
        num_stages: shared-memory stages per tile (bm/num_stages rows each), 2..8 (default 2).
        send_warps: dedicated send warps, >= 0 (default 1; 0: the epilogue warps send).
        epilogue_warps: warps converting the accumulators, >= 1 (default 2); at most 8
            warps in all.
        grid: CTAs per launch (default: as many as fit, the occupancy times the SM count).
        transport: a ``p3send.ops.nvshmem.NvshmemTransport``: the kernel linked with the NVSHMEM
            shim and ``FLAG_NVSHMEM`` on every send (as ``ScatterSend``); None (default): none.
    """

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, bm: int = 16, bn: int = 1024,
                 num_stages: int = 2, send_warps: int = 1, epilogue_warps: int = 2, grid: int | None = None,
                 transport=None):
        problems = []
        if n_experts < 1:
            problems.append(f"n_experts: expected >= 1, got {n_experts}")
        if bn <= 0 or bn % 8:
            problems.append(f"bn: expected a positive multiple of 8, got {bn}")
        if not (2 <= num_stages <= 8):
            problems.append(f"num_stages: expected 2..8, got {num_stages}")
        elif bm <= 0 or bm % num_stages:
            problems.append(f"bm: expected a positive multiple of num_stages ({num_stages}), got {bm}")
        if epilogue_warps < 1 or send_warps < 0 or epilogue_warps + send_warps > 8:
            problems.append(f"warps: expected >= 1 epilogue warp, >= 0 send warps, 8 in all at most; "
                            f"got {epilogue_warps} + {send_warps}")
        if problems:
            raise ConfigError(problems, "epilogue-send geometry")
        self.dev = device or driver.device()
        self.transport = transport      # p3send.ops.nvshmem.NvshmemTransport: its linked module, its flags
        self.k = kernel("p3_epilogue_send", self.dev) if transport is None else transport.kernel("p3_epilogue_send")
        self.n_experts, self.bm, self.bn, self.num_stages = int(n_experts), bm, bn, num_stages
        self.send_warps, self.threads = send_warps, 32 * (epilogue_warps + send_warps)
        self.smem = bm * bn * 2
        if self.smem > self.dev.smem_optin:
            raise ConfigError([f"bm*bn*2 = {self.smem} B of shared memory exceeds {self.dev.smem_optin}"],
                              "epilogue-send geometry")
        driver.set_max_dynamic_smem(self.k.func, self.smem)
        per_sm = max(1, driver.occupancy(self.k.func, self.threads, self.smem))
        self.grid = grid or per_sm * self.dev.sm_count
        self.state = driver.DeviceBuffer(self.n_experts * 40, fill=0) if transport is None else \
            transport.sender_state(self.n_experts)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.ctx = driver.DeviceBuffer(ctypes.sizeof(P3SendCtx), fill=0)
        self.block = self.k.params_block()

    def prepare(self, cfg: P3PeerSendConfig, acc, n_cols: int, expert_offsets, *, acc_stride: int | None = None,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, same_gpu: bool = False,
                expert_offsets_host=None, rows_in_acc: int | None = None, wire="bf16") -> ParamBlock:
        """Validate every argument and fill the parameter block (no launch).

        Args:
            cfg: the sender's config; msg_bytes must be 2*n_cols (bf16 rows), or 33*n_cols/32
                with ``wire="fp8"``.
            acc: float32 (rows, >= n_cols) accumulators by absolute row, 16-byte aligned.
            n_cols: the hidden size, a positive multiple of 8.
            expert_offsets: as ``ScatterSend.prepare``.
            acc_stride: bytes between rows of acc (default 4*n_cols).
            count_ptrs, row_cache, p3_control, same_gpu, expert_offsets_host: as ``ScatterSend.prepare``.
            rows_in_acc: rows acc holds (default: from its size when known).
            wire: ``"bf16"`` or ``"fp8"`` (``p3send.abi.wire``: the bf16-rounded tiles
                quantised by ``p3_send_rows`` on the way out; n_cols a multiple of 512 and
                the launcher's ``bn`` of 128).

        Returns:
            The filled ParamBlock.

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        stride = 4 * n_cols if acc_stride is None else int(acc_stride)
        arg_problems = []
        acc_addr, nb = array_arg(acc, "acc", arg_problems, dtypes=("float32",), ordinal=self.dev.ordinal,
                                 strided_ok=True)
        cap = rows_in_acc
        if cap is None and nb is not None and stride:
            cap = (nb - 4 * n_cols) // stride + 1 if nb >= 4 * n_cols else 0
        fp8 = wire_format(wire, what="epilogue-send launch") == WIRE_FP8
        sa = self.send_args(cfg, expert_offsets, host_offsets=expert_offsets_host, rows_cap=cap,
                            count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control, same_gpu=same_gpu)
        problems, offs_addr, peers, flags = sa.problems, sa.expert_offsets, sa.count_ptrs, sa.flags
        problems += arg_problems
        aligned("acc", acc_addr, 16, problems)
        if n_cols <= 0 or n_cols % 8:
            problems.append(f"n_cols: expected a positive multiple of 8, got {n_cols}")
        if fp8:
            flags |= FLAG_WIRE_FP8
            problems += [p.replace("hidden:", "n_cols:", 1) for p in wire_problems(cfg.msg_bytes, n_cols, WIRE_FP8)]
            if self.bn % 128:
                problems.append(f"bn: expected a multiple of 128 on the fp8 wire (whole scale blocks), got {self.bn}")
        elif cfg.msg_bytes != 2 * n_cols:
            problems.append(f"msg_bytes: expected 2*n_cols = {2 * n_cols} (bf16 rows), got {cfg.msg_bytes}")
        if stride % 16 or stride < 4 * n_cols:
            problems.append(f"acc_stride: expected a multiple of 16 >= 4*n_cols ({4 * n_cols}), got {stride}")
        if self.transport is not None:
            host = expert_offsets if isinstance(expert_offsets, np.ndarray) else expert_offsets_host
            problems += self.transport.problems(cfg, self.n_experts, rows_end=None if host is None else int(host[-1]),
                                                rows_cap=cap)
            flags |= self.transport.flags
        if problems:
            raise ConfigError(problems, "epilogue-send launch")
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = peers
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = offs_addr, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, flags, int(p3_control)
        self.ctx.upload(np.frombuffer(bytes(ctx), dtype=np.uint8))
        return self.block.set(cfg=cfg, ctx=self.ctx, acc_ptr=acc_addr, acc_stride=stride, n_cols=n_cols,
                              bm=self.bm, bn=self.bn, num_stages=self.num_stages, n_send_warps=self.send_warps)



