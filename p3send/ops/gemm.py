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

``GroupedGemmLauncher`` is what this launcher and the FP8 one (``ops.gemm_fp8``) share: the
loading, the checks their arguments have in common and the device-side arguments.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from ..abi.config import P3PeerSendConfig, P3SendCtx
from ..abi.errors import ConfigError, P3SendError
from ..abi.wire import FLAG_WIRE_FP8, FP8_HIDDEN_MULTIPLE, WIRE_BF16, WIRE_FP8, wire_format
from ..cuda import driver, ptxdoc
from ..cuda.loader import Kernel, ParamBlock, kernel, link, load, ptx_dir
from .args import address, aligned, array_layout, contiguous, nbytes, run_once
from .send import SendLauncher

ENTRY = "p3_gemm_send"
THREADS = 384
SMEM = 215764            # the kernel's dynamic shared memory (its PTX header, LAUNCH)
BN, BK = 256, 64         # output columns per tile, K per pipeline stage
MAX_EXPERTS = 128
LINK_MAX_REGISTERS = 168  # 65536 / 384 threads, rounded down to 8


def require_hopper(dev: driver.Device, entry: str = ENTRY, needs: str = "wgmma, setmaxnreg") -> None:
    """Refuse a GPU other than compute capability 9.0 (the kernels' PTX targets sm_90a).

    Args:
        dev: the GPU.
        entry: the kernel, for the message.
        needs: what of sm_90a it needs, for the message.

    Raises:
        P3SendError: ``dev`` is not a Hopper GPU.
    """
    if tuple(dev.cc) != (9, 0):
        raise P3SendError(f"{entry} is Hopper-only (PTX .target sm_90a: {needs}): it needs compute "
                          f"capability 9.0 (H100, H200, GH200); {dev.name} has {dev.cc[0]}.{dev.cc[1]}")


def module_text(entry: str, variant_ptx: str | None = None, *, linked: bool = False, bf16_only: bool = False) -> str:
    """A grouped GEMM's module text: its shipped PTX (or a variant's text), with the send's two
    functions as ``.extern`` for a linker (``linked``: nvcc's own -rdc form) or with
    p3_send_rows.ptx appended (the module the loader compiles, the calls inlined).

    Args:
        entry: the kernel (``ptx/<entry>.ptx``).
        variant_ptx: the text of a measurement variant, used instead of the shipped file.
        linked: the ``.extern`` form instead of the inlined module.
        bf16_only: append p3_send_rows.ptx without its FP8-wire code (``ptxdoc.without_fp8``):
            the module for the bf16 wire, whose send runs faster without it (docs/PERF.md).

    Returns:
        The PTX text.
    """
    text = variant_ptx if variant_ptx is not None else (ptx_dir() / f"{entry}.ptx").read_text()
    if linked:
        return ptxdoc.set_prototype_linkage(text, "extern")
    rows = (ptx_dir() / "p3_send_rows.ptx").read_text()
    return ptxdoc.module_text(text, [("p3_send_rows.ptx", ptxdoc.without_fp8(rows) if bf16_only else rows)])


class DeviceArgsCache:
    """Device copies of launches' device-side arguments (a P3SendCtx and tensor maps: one
    payload of ``slot_bytes`` bytes), one per distinct content, in ``slots`` slots of one
    allocation: launches enqueued one after another never rewrite what an earlier one may
    still read.

    ``acquire`` gives a payload's slot for a launch on a stream: a payload held already
    is launched from its slot again, with no upload and no host wait; a new one is uploaded
    into a free slot, or, once every slot is taken, into the least recently used one after
    the launches that read it have completed (a host wait on the event ``launched`` recorded
    at its last launch).

    Args:
        slot_bytes: bytes per payload (a multiple of 64: tensor maps need 64-byte alignment).
        slots: how many payloads are kept.
    """

    def __init__(self, slot_bytes: int, slots: int):
        if slot_bytes <= 0 or slot_bytes % 64 or slots < 1:
            raise ConfigError([f"slot_bytes, slots: expected a positive multiple of 64 and >= 1, got {slot_bytes}, "
                               f"{slots}"], "device-argument cache")
        self.slot_bytes, self.slots = int(slot_bytes), int(slots)
        self.buf = driver.DeviceBuffer(self.slot_bytes * self.slots)
        self.index: OrderedDict = OrderedDict()    # payload -> slot, least recently used first
        self.free = list(range(self.slots - 1, -1, -1))
        self.events: list = [None] * self.slots    # the event of each slot's last launch
        self.streams: list = [None] * self.slots   # the handle of the stream it was recorded on

    def address(self, slot: int) -> int:
        """The device address of ``slot``.

        Args:
            slot: from ``acquire``.

        Returns:
            The address (64-byte aligned).
        """
        return self.buf.ptr + slot * self.slot_bytes

    def acquire(self, payload: bytes, stream: driver.Stream) -> int:
        """The slot holding ``payload`` for a launch on ``stream``, uploading it there when new.

        Args:
            payload: the ``slot_bytes`` bytes the launch reads.
            stream: the launch's stream.

        Returns:
            The slot (``address`` gives its address); its content is ``payload`` for every
            launch enqueued on ``stream`` from now on.
        """
        if len(payload) != self.slot_bytes:
            raise ConfigError([f"payload: expected {self.slot_bytes} bytes, got {len(payload)}"],
                              "device-argument cache")
        i = self.index.get(payload)
        if i is not None:
            self.index.move_to_end(payload)
            if self.events[i] is not None and self.streams[i] != int(stream):
                # its last reader ran on another stream: this launch (and so its event) follows it
                stream.wait(self.events[i])
            return i
        if self.free:
            i = self.free.pop()
        else:
            _, i = self.index.popitem(last=False)
            if self.events[i] is not None:
                self.events[i].synchronize()      # the slot's readers are done before it is rewritten
        try:
            self.buf.upload(np.frombuffer(payload, dtype=np.uint8), stream, offset=i * self.slot_bytes)
        except BaseException:
            self.free.append(i)
            raise
        self.index[payload] = i
        return i

    def launched(self, slot: int, stream: driver.Stream) -> None:
        """Record that a launch reading ``slot`` was enqueued on ``stream``.

        Args:
            slot: from ``acquire``.
            stream: the launch's stream.

        Returns:
            None.
        """
        if self.events[slot] is None:
            self.events[slot] = driver.Event(timing=False)
        self.events[slot].record(stream)
        self.streams[slot] = int(stream)

    def close(self) -> None:
        """Free the slots and their events."""
        for ev in self.events:
            if ev is not None:
                ev.close()
        self.events = [None] * self.slots
        self.index.clear()
        self.buf.free()


class Loaded(NamedTuple):
    """A kernel a grouped-GEMM launcher loaded: its own block, its launch shape, whether its
    p3_send_rows quantises (the fp8 wire's module, or a linked launcher's one)."""

    block: ParamBlock
    threads: int
    smem: int
    fp8_wire: bool


class GroupedGemmLauncher(SendLauncher):
    """What the grouped-GEMM launchers (``GroupedGemmSend``, ``GroupedGemmFp8Send``) share: the
    kernels loaded (inlined, linked or a variant; inlined, two modules per kernel: one for the
    bf16 wire, with p3_send_rows.ptx less its FP8 code, and one for the fp8 wire, with the file
    whole: ``wire_kernel()``), the sender state (zeroed once, self-resetting), the diagnostics,
    the argument checks of sizes, send, C and tile height, and per parameter block the
    P3SendCtx and tensor maps on the device. Subclasses set the kernel's ``ENTRY``,
    ``THREADS``, ``SMEM`` (its dynamic shared memory), ``BN`` and ``BK`` (the multiples N and
    K must be), ``MAX_EXPERTS``, ``LINK_MAX_REGISTERS`` (the linked route's cap), ``NEEDS``
    (what of sm_90a it needs, for the refusal of other GPUs), ``KIND`` (the prefix of its
    messages) and ``WIDE``: None, or (entry, threads, dynamic shared memory) of a second
    kernel with the same parameters that launches instead for 128-row tiles (``wide``).
    ``threads`` and ``smem`` are ENTRY's launch shape; ``launch`` runs each block in the shape
    of its own kernel (``kernel_for``: the wide kernel's is ``WIDE``'s).

    Two ways to launch: ``prepare`` a block (each block has its device-side arguments in its
    own buffer, uploaded synchronously: not while that block's launch is in flight) and
    ``launch`` it as often as wanted; or call the launcher, which may be called again while
    earlier calls are still queued (``__call__``: the device-side arguments are kept per
    distinct content in ``device_args``, ``DEVICE_ARGS_SLOTS`` of them). A block is of one
    kernel (``block.kernel``); ``prepare`` binds the block it fills to the kernel its tile
    height and wire need (blocks of this launcher's kernels all have the same parameters)."""

    ENTRY: str
    THREADS: int
    SMEM: int
    BN: int
    BK: int
    MAX_EXPERTS: int
    LINK_MAX_REGISTERS: int
    NEEDS: str
    KIND = ""
    WIDE: tuple | None = None
    #: distinct device-side argument sets (P3SendCtx + tensor maps) ``__call__`` keeps uploaded
    DEVICE_ARGS_SLOTS = 128

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, linked: bool = False,
                 num_sms: int | None = None, variant_ptx: str | None = None, wide: bool | None = None,
                 variant_shape: tuple | None = None):
        what = f"{self.KIND}grouped GEMM"
        if not (1 <= n_experts <= self.MAX_EXPERTS):
            raise ConfigError([f"n_experts: expected 1..{self.MAX_EXPERTS}, got {n_experts}"], what)
        if wide and self.WIDE is None:
            raise ConfigError([f"wide: expected False or None ({self.ENTRY} has no wide kernel), got True"], what)
        if wide and (linked or variant_ptx is not None):
            raise ConfigError(["wide: expected False or None with linked=True or a variant_ptx (the wide kernel "
                               "is loaded inlined and shipped only: linked, ptxas drops its setmaxnreg), got True"],
                              what)
        self.dev = device or driver.device()
        require_hopper(self.dev, self.ENTRY, self.NEEDS)
        sms = self.dev.sm_count
        if num_sms is not None and not (1 <= num_sms <= sms):
            raise ConfigError([f"num_sms: expected 1..{sms}, got {num_sms}"], what)
        self.grid, self.threads, self.smem = num_sms or sms, self.THREADS, self.SMEM
        self.n_experts, self.linked = int(n_experts), linked
        self.wide = self.WIDE is not None and not linked and variant_ptx is None if wide is None else bool(wide)
        self._variant = variant_ptx
        if variant_shape is not None and variant_ptx is None:
            raise ConfigError([f"variant_shape: expected None without a variant_ptx, got {variant_shape}"], what)
        self._variant_shape = variant_shape
        self._kernels: dict = {}    # (wide, fp8 wire) -> Kernel
        self._loaded: dict = {}     # id(Kernel) -> Loaded: its own block, launch shape, wire
        entry = self.ENTRY
        if linked:
            mod = link([(f"{entry}.ptx", module_text(entry, variant_ptx, linked=True)), "p3_send_rows"],
                       device=self.dev, name=f"{entry}+p3_send_rows (linked)", max_registers=self.LINK_MAX_REGISTERS)
            # one module for both wires (it links the shipped p3_send_rows whole)
            self._kernels[(False, False)] = self._kernels[(False, True)] = self._register(mod[entry], False, True)
        self.k = self.kernel_for(64)    # the bf16 wire's kernel of 64-row tiles (of every tile without wide)
        if self.wide:
            self.kernel_for(128)        # loaded now, not in the first prepare (a JIT compile: seconds)
        self.state = driver.DeviceBuffer(40 * self.n_experts, fill=0)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self._last = self._loaded[id(self.k)].block     # the own block the last prepare filled (launch's default)
        self._dev_args: dict = {}   # id(parameter block) -> its P3SendCtx and tensor maps on the device
        self.device_args: DeviceArgsCache | None = None    # __call__'s, made on its first launch
        self._one_shot = False      # prepare() inside __call__: the upload is left to the launch

    def _register(self, k: Kernel, wide: bool, fp8_wire: bool) -> Kernel:
        """Record k (its own block, its launch shape: WIDE's or ENTRY's, a variant's
        ``variant_shape``; whether it quantises) with its shared memory allowed; returns k."""
        _, threads, smem = self.WIDE if wide else (self.ENTRY, self.THREADS, self.SMEM)
        if self._variant_shape is not None:
            threads, smem = self._variant_shape
        if smem > self.dev.smem_optin:
            raise P3SendError(f"{k.name} needs {smem} B of shared memory per block; {self.dev.name} allows "
                              f"{self.dev.smem_optin}")
        driver.set_max_dynamic_smem(k.func, smem)
        self._loaded[id(k)] = Loaded(k.params_block(), threads, smem, fp8_wire)
        return k

    def kernel_for(self, bm: int, fp8_wire: bool = False) -> Kernel:
        """The kernel a launch of ``bm``-row tiles on the fp8 (``fp8_wire``) or bf16 wire runs:
        the wide kernel (``WIDE``) for 128-row tiles when ``self.wide``, else ``ENTRY``. Its
        module is compiled on first use (seconds)."""
        key = (self.wide and bm == 128, bool(fp8_wire))
        got = self._kernels.get(key)
        if got is None:
            entry = self.WIDE[0] if key[0] else self.ENTRY
            kind = "variant" if self._variant is not None else f"{entry}.ptx"
            if fp8_wire:
                k = kernel(entry, self.dev) if self._variant is None else \
                    load(module_text(entry, self._variant), device=self.dev, name=f"{entry} (variant)")[entry]
            else:
                k = load(module_text(entry, self._variant, bf16_only=True), device=self.dev,
                         name=f"{kind} (bf16 wire)")[entry]
            got = self._kernels[key] = self._register(k, key[0], key[1])
        return got

    def wire_kernel(self) -> Kernel:
        """The kernel of an fp8-wire launch of 128-row tiles: a module with the shipped
        ``p3_send_rows.ptx`` whole, which quantises when the flags carry ``FLAG_WIRE_FP8``
        (the bf16 wire's modules are built without that code). Loads every fp8-wire kernel
        this launcher may launch (``kernel_for(bm, True)``; compiled on first use, seconds:
        call this before timing). A linked launcher has one module: ``k``. A block for
        ``prepare(..., wire="fp8", into=...)`` may come from any of the launcher's kernels."""
        self.kernel_for(64, True)
        return self.kernel_for(128, True)

    def bind(self, blk: ParamBlock, k: Kernel) -> ParamBlock:
        """Make ``blk`` a block of ``k`` (its parameters' values kept): a block of any kernel
        with k's parameter table. Raises ConfigError for a block of another table."""
        if blk.kernel is not k:
            sig = [(p.offset, p.size, p.type, p.name) for p in k.params]
            if [(p.offset, p.size, p.type, p.name) for p in blk.kernel.params] != sig:
                raise ConfigError([f"into: expected a block of {k.name} (from params_block() of this launcher's "
                                   f"kernels), got a block of {blk.kernel.name}, whose parameters differ"],
                                  f"{self.KIND}grouped-GEMM launch")
            blk.kernel = k
        return blk

    @property
    def block(self) -> ParamBlock:
        """The launcher's own block that the last ``prepare`` without ``into`` filled (one per
        kernel: so ``launch(s, g.block)`` launches what that ``prepare`` filled)."""
        return self._last

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        """Enqueue a prepared launch on ``stream`` (no host wait), in the shape of the block's
        kernel.

        Args:
            stream: a ``driver.Stream``.
            block: a block from ``prepare(..., into=...)``, or None: the launcher's own block
                that the last ``prepare`` without ``into`` filled (``self.block``).

        Raises:
            ConfigError: a block of a kernel this launcher did not load, or one prepared for
                the fp8 wire whose kernel's p3_send_rows does not quantise.
        """
        blk = block or self._last
        got = self._loaded.get(id(blk.kernel))
        what = f"{self.KIND}grouped-GEMM launch"
        if got is None:
            raise ConfigError([f"block: expected a block prepared by this launcher, got one of {blk.kernel.name} "
                               f"that it did not load"], what)
        if getattr(blk, "fp8_wire", False) and not got.fp8_wire:
            raise ConfigError(["block: prepared for the fp8 wire, but not a block of an fp8-wire kernel "
                               "(wire_kernel(): its p3_send_rows quantises; this one would send bf16 rows)"], what)
        blk.launch((self.grid,), (got.threads,), stream, got.smem)

    def check_weights(self, name: str, shape: tuple, n_cols, k_dim, k_of: str, problems: list):
        """The weights' shape (E, N, K), once known to be one: E must be ``n_experts`` and K, when
        known, ``k_dim``; appends what differs.

        Args:
            name: the weights' argument, for the messages.
            shape: their shape.
            n_cols, k_dim: N and K so far (None: not known yet).
            k_of: the argument K was taken from, for the message.
            problems: the launch's problems so far; appended to.

        Returns:
            n_cols, from the shape when it was not known.
        """
        if shape[0] != self.n_experts:
            problems.append(f"{name}: expected {self.n_experts} experts (dim 0), got {shape[0]}")
        if k_dim is not None and shape[2] != k_dim:
            problems.append(f"{name}: expected K = {k_dim} (dim 2, as {k_of}), got {shape[2]}")
        return shape[1] if n_cols is None else n_cols

    def check_sizes(self, rows, n_cols, k_dim, rows_of: str, problems: list) -> tuple[int, int, int]:
        """The GEMM's sizes, checked: raises when one is not known, else appends what is out
        of range (rows 1..2^31-1, n_cols a positive multiple of BN with E*N < 2^31, k_dim a
        positive multiple of BK).

        Args:
            rows, n_cols, k_dim: the sizes (None: not derivable from the arrays given).
            rows_of: the argument holding the rows, for the message.
            problems: the launch's problems so far; appended to.

        Returns:
            (rows, n_cols, k_dim) as ints.

        Raises:
            ConfigError: ``problems`` and the missing sizes, when there are any.
        """
        for name, v in (("rows", rows), ("n_cols", n_cols), ("k_dim", k_dim)):
            if v is None:
                problems.append(f"{name}: expected a value (not derivable from the arrays given)")
        if problems:
            raise ConfigError(problems, f"{self.KIND}grouped-GEMM launch")
        rows, n_cols, k_dim = int(rows), int(n_cols), int(k_dim)
        if rows < 1 or rows >= 2 ** 31:
            problems.append(f"rows: expected 1..2^31-1 rows in {rows_of}, got {rows}")
        if n_cols <= 0 or n_cols % self.BN or self.n_experts * n_cols >= 2 ** 31:
            problems.append(f"n_cols: expected a positive multiple of {self.BN} (and E*N < 2^31), got {n_cols}")
        if k_dim <= 0 or k_dim % self.BK:
            problems.append(f"k_dim: expected a positive multiple of {self.BK}, got {k_dim}")
        return rows, n_cols, k_dim

    def check_send(self, cfg: P3PeerSendConfig, expert_offsets, expert_offsets_host, rows: int, n_cols: int,
                   count_ptrs, row_cache: bool, p3_control: int, same_gpu: bool, problems: list, wire="bf16"):
        """Whether the send is on (``p3_control >= 0`` and ``cfg.n_ranks != 0``) and its
        arguments (``send_args``; with the send off, the offsets' checks only: the send's cfg
        is not read); with it on, ``cfg.msg_bytes`` must be the slot size of an n_cols row on
        the wire: 2*n_cols (bf16), 33*n_cols/32 (fp8: n_cols a multiple of 512; the flags
        then carry ``FLAG_WIRE_FP8``, and ``p3_send_rows`` quantises the staged bf16 rows, or,
        the FP8 GEMM's ``fp8_source="fp32"``, copies the rows its consumers quantised).

        Args:
            cfg, expert_offsets, expert_offsets_host, count_ptrs, row_cache, p3_control,
                same_gpu: as ``prepare``.
            rows: rows of the input (the offsets may not reach past it).
            n_cols: N.
            problems: the launch's problems so far; appended to.
            wire: the rows' format on the wire, ``"bf16"`` or ``"fp8"`` (``abi.wire``).

        Returns:
            (send on, the offsets' host values or None, the SendArgs).

        Raises:
            ConfigError: ``wire`` is no format.
        """
        fmt = wire_format(wire, what=f"{self.KIND}grouped-GEMM launch")
        send = p3_control >= 0 and cfg.n_ranks != 0
        host = expert_offsets_host if not isinstance(expert_offsets, np.ndarray) else expert_offsets
        if send:
            fp8 = fmt == WIRE_FP8 and n_cols > 0 and n_cols % FP8_HIDDEN_MULTIPLE == 0
            sargs = self.send_args(cfg, expert_offsets, host_offsets=expert_offsets_host, rows_cap=rows,
                                   count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control,
                                   same_gpu=same_gpu, wire=WIRE_FP8 if fp8 else WIRE_BF16,
                                   hidden=n_cols if fp8 else None)
            if fmt == WIRE_BF16 and cfg.msg_bytes != 2 * n_cols:
                problems.append(f"msg_bytes: expected 2*n_cols = {2 * n_cols} (bf16 rows), got {cfg.msg_bytes}")
            elif fmt == WIRE_FP8 and not fp8:
                problems.append(f"n_cols: expected a positive multiple of {FP8_HIDDEN_MULTIPLE} for the fp8 wire "
                                f"(whole 128-column scale blocks, 16-byte rows), got {n_cols}")
        else:
            sargs = self.send_args(P3PeerSendConfig.disabled(), expert_offsets, host_offsets=expert_offsets_host,
                                   rows_cap=rows, p3_control=-1)
        problems += sargs.problems
        return send, host, sargs

    def c_address(self, c, c_row_stride: int | None, stride: int, problems: list) -> tuple[int, int | None, int]:
        """C's address and size in bytes (None: unknown) and its row stride (``stride``: the
        one given, or 2*n_cols); appends what is wrong with ``c``. This launcher's kind of
        array: a torch tensor, a ``__cuda_array_interface__`` object, a DeviceBuffer or an
        address.

        Args:
            c: the output C (not None).
            c_row_stride: the row stride the caller gave, or None.
            stride: the row stride to use unless C tells its own.
            problems: the launch's problems so far; appended to.

        Returns:
            (address, bytes or None, row stride).
        """
        return address(c, "c"), nbytes(c), stride

    def check_c(self, c, c_row_stride: int | None, rows: int, n_cols: int, send: bool,
                problems: list) -> tuple[int, int]:
        """C (written only with the send off: then required, 16-byte aligned, holding ``rows``
        rows at its row stride, a multiple of 16 >= 2*n_cols).

        Args:
            c, c_row_stride: as ``prepare``.
            rows, n_cols: the GEMM's sizes.
            send: whether the send is on (C is then not read or written).
            problems: the launch's problems so far; appended to.

        Returns:
            (C's address, 0 with the send on; the row stride).
        """
        stride = 2 * n_cols if c_row_stride is None else int(c_row_stride)
        c_addr = 0
        if not send:
            if c is None:
                problems.append("c: expected the output C (the send is off: p3_control < 0 or cfg.n_ranks == 0)")
            else:
                c_addr, nb, stride = self.c_address(c, c_row_stride, stride, problems)
                aligned("c", c_addr, 16, problems)
                if nb is not None and nb < (rows - 1) * stride + 2 * n_cols:
                    problems.append(f"c: expected at least {(rows - 1) * stride + 2 * n_cols} bytes "
                                    f"({rows} rows at stride {stride}), got {nb}")
            if stride % 16 or stride < 2 * n_cols:
                problems.append(f"c_row_stride: expected a multiple of 16 >= 2*n_cols ({2 * n_cols}), got {stride}")
        return c_addr, stride

    def tile_rows(self, bm: int | None, host, problems: list) -> int:
        """Rows per tile: ``bm``, or by default 64 when the host offsets show at most 64 rows
        per expert on average, else 128; appends a problem unless it is 64 or 128.

        Args:
            bm: as ``prepare``.
            host: the offsets' host values, or None (unknown: 128).
            problems: the launch's problems so far; appended to.

        Returns:
            bm.
        """
        if bm is None:
            bm = 128
            if host is not None:
                off = np.asarray(host, dtype=np.int64)
                if off.size == self.n_experts + 1 and (off[-1] - off[0]) <= 64 * self.n_experts:
                    bm = 64
        if bm not in (64, 128):
            problems.append(f"bm: expected 64 or 128, got {bm}")
        return bm

    def fill_block(self, into: ParamBlock | None, cfg: P3PeerSendConfig, sargs, send: bool, p3_control: int,
                   maps: bytes, **params) -> ParamBlock:
        """Upload the block's P3SendCtx (at 0) and tensor maps (at 256, 64-byte aligned) to its
        own device buffer (made on its first use, synchronously) and fill the block; inside
        ``__call__`` only keep those bytes as ``block.device_args`` (its launch finds or
        uploads them in ``device_args``).

        Args:
            into: the block, or None: the launcher's own.
            cfg: the config parameter.
            sargs: the SendArgs of ``check_send``.
            send, p3_control: as ``check_send`` found and ``prepare`` was given.
            maps: the tensor maps, 128 bytes each, in the kernel's order.
            **params: the kernel's other parameters.

        Returns:
            The filled ParamBlock.
        """
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = sargs.count_ptrs
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = sargs.expert_offsets, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, sargs.flags, int(p3_control) if send else -1
        fp8 = bool(sargs.flags & FLAG_WIRE_FP8) and ctx.p3_control >= 0
        k = self.kernel_for(int(params["bm"]), fp8)
        if into is None:
            blk = self._last = self._loaded[id(k)].block    # the launcher's own block of k: launch's default
        else:
            blk = self.bind(into, k)
        blk.fp8_wire = fp8                                  # launch checks it
        blk.device_args = bytes(ctx) + bytes(256 - ctypes.sizeof(ctx)) + maps
        if self._one_shot:
            return blk.set(cfg=cfg, **params)
        dev_args = self._dev_args.get(id(blk))
        if dev_args is None:
            dev_args = self._dev_args[id(blk)] = driver.DeviceBuffer(len(blk.device_args), fill=0)
        dev_args.upload(np.frombuffer(blk.device_args, dtype=np.uint8))
        return blk.set(cfg=cfg, ctx=dev_args.ptr, tmaps=dev_args.ptr + 256, **params)

    def __call__(self, *args, stream=None, **kw) -> None:
        """``prepare(*args, **kw)`` and launch: on ``stream`` with no host wait, or, without
        one, on a temporary stream, synchronized (and closed also when the launch raises).

        Calls may follow each other on a stream while earlier ones are still queued (the
        torch ops' case). The device-side arguments (P3SendCtx and tensor maps: the arrays'
        addresses, shapes and strides, the offsets and count_ptrs addresses, the flags,
        p3_control and the tile height) are kept per distinct content in ``device_args``: a
        call equal in them to one of the last ``DEVICE_ARGS_SLOTS`` distinct ones launches
        with no upload and no host wait; a new one is uploaded on the stream first (a host
        wait for that stream), into the least recently used slot once the launches reading it
        have completed. What is passed by value (cfg, sb, c, its row stride, the sizes) is
        copied at each launch. Not under CUDA graph capture (ConfigError): prepare a block
        before the capture and launch it inside.
        """
        self._one_shot = True
        try:
            blk = self.prepare(*args, **kw)
        finally:
            self._one_shot = False
        run_once(lambda s: self._launch_one_shot(driver.as_stream(s), blk), stream)

    def _launch_one_shot(self, stream: driver.Stream, blk: ParamBlock) -> None:
        if stream.capturing():
            raise ConfigError(["stream: a call of the launcher cannot be captured into a CUDA graph (its "
                               "device-side arguments live outside the graph); prepare a block before the "
                               "capture and launch it inside"], f"{self.KIND}grouped-GEMM launch")
        if self.device_args is None:
            self.device_args = DeviceArgsCache(len(blk.device_args), self.DEVICE_ARGS_SLOTS)
        slot = self.device_args.acquire(blk.device_args, stream)
        addr = self.device_args.address(slot)
        blk.set(ctx=addr, tmaps=addr + 256)
        self.launch(stream, blk)
        self.device_args.launched(slot, stream)

    def close(self) -> None:
        """Free the state, diagnostics, staging and the device-side arguments of every block."""
        super().close()
        for b in self._dev_args.values():
            b.free()
        self._dev_args = {}
        if self.device_args is not None:
            self.device_args.close()
            self.device_args = None


class GroupedGemmSend(GroupedGemmLauncher):
    """Launcher for ``p3_gemm_send`` on one Hopper GPU. Owns the sender state (zeroed once,
    self-resetting), the diagnostics and the P3SendCtx.

    n_experts: the experts of every launch (``expert_offsets`` holds n_experts + 1), 1..128.
    device: the Device to launch on, a Hopper GPU (default: ``driver.device()``).
    linked: link the kernel with ``p3_send_rows.ptx`` through the driver's linker
    (docs/EMBEDDING.md (c); real calls, slower) instead of loading modules with the calls
    inlined (the default: ``k`` for the bf16 wire, ``wire_kernel()`` for the fp8 wire).
    num_sms: the persistent grid (default: every SM).
    variant_ptx: the text of a measurement variant of the kernel (tools/build_gemm.py
    --variant), loaded (or linked) instead of the shipped one."""

    ENTRY, THREADS, SMEM, BN, BK, MAX_EXPERTS = ENTRY, THREADS, SMEM, BN, BK, MAX_EXPERTS
    LINK_MAX_REGISTERS, NEEDS = LINK_MAX_REGISTERS, "wgmma, setmaxnreg"

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, linked: bool = False,
                 num_sms: int | None = None, variant_ptx: str | None = None):
        super().__init__(n_experts, device=device, linked=linked, num_sms=num_sms, variant_ptx=variant_ptx)

    def prepare(self, cfg: P3PeerSendConfig, x, w, expert_offsets, c=None, *, rows: int | None = None,
                n_cols: int | None = None, k_dim: int | None = None, c_row_stride: int | None = None,
                bm: int | None = None, count_ptrs=None, row_cache: bool = False, p3_control: int = -1,
                same_gpu: bool = False, expert_offsets_host=None, into: ParamBlock | None = None,
                wire: str = "bf16") -> ParamBlock:
        """Check every argument and fill the parameter block (no launch).

        Args:
            cfg: the sender's config; with the send on, msg_bytes must be the slot size of an
                n_cols row on ``wire``: 2*n_cols (bf16), 33*n_cols/32 (fp8).
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
            into: fill this block (from ``self.k.params_block()``; on the fp8 wire from
                ``wire_kernel().params_block()``) instead of the launcher's
                own; each block has its own P3SendCtx and tensor maps on the device, so several
                prepared launches coexist. They are uploaded synchronously: do not prepare a
                block while its launch is in flight (calling the launcher has no such limit).
            wire: the rows' format on the wire (``abi.wire``): ``"bf16"`` (the default) or
                ``"fp8"`` (n_cols a multiple of 512; the launch's flags carry ``FLAG_WIRE_FP8``
                and ``p3_send_rows`` sends each staged bf16 row as e4m3 codes and block scales).
                Read only with the send on.

        Returns:
            The filled ParamBlock.

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        problems = []
        xs, _, xi = array_layout(x)
        ws, _, wi = array_layout(w)
        x_strided, w_strided = contiguous(x) is False, contiguous(w) is False
        if xs is not None:
            if len(xs) != 2 or xi != 2 or x_strided:
                problems.append(f"x: expected a contiguous 2-byte (bf16) (rows, K) array, got shape {xs}, "
                                f"{xi}-byte items{', strided' if x_strided else ''}")
            else:
                rows = xs[0] if rows is None else rows
                k_dim = xs[1] if k_dim is None else k_dim
        if ws is not None:
            if len(ws) != 3 or wi != 2 or w_strided:
                problems.append(f"w: expected a contiguous bf16 (E, N, K) array, got shape {ws}, {wi}-byte items")
            else:
                n_cols = self.check_weights("w", ws, n_cols, k_dim, "x", problems)
        rows, n_cols, k_dim = self.check_sizes(rows, n_cols, k_dim, "x", problems)
        xa, wa = address(x, "x"), address(w, "w")
        aligned("x", xa, 16, problems)
        aligned("w", wa, 16, problems)
        for name, obj, need in (("x", x, 2 * rows * k_dim), ("w", w, 2 * self.n_experts * n_cols * k_dim)):
            nb = nbytes(obj)
            if nb is not None and nb < need:
                problems.append(f"{name}: expected at least {need} bytes, got {nb}")
        send, host, sargs = self.check_send(cfg, expert_offsets, expert_offsets_host, rows, n_cols, count_ptrs,
                                            row_cache, p3_control, same_gpu, problems, wire)
        c_addr, stride = self.check_c(c, c_row_stride, rows, n_cols, send, problems)
        bm = self.tile_rows(bm, host, problems)
        if problems:
            raise ConfigError(problems, "grouped-GEMM launch")
        maps = driver.tensor_map("bfloat16", xa, (k_dim, rows), (BK, bm)) + \
            driver.tensor_map("bfloat16", wa, (k_dim, self.n_experts * n_cols), (BK, BN))
        return self.fill_block(into, cfg, sargs, send, p3_control, maps, c_ptr=c_addr, c_row_stride=stride,
                               n_cols=n_cols, k_dim=k_dim, bm=bm)
