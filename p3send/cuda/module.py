"""Load p3send's PTX through the driver, check each entry's parameters against its
documented table before any launch, and launch with prebuilt parameter blocks.

Typed launchers for the shipped kernels live here too (``ScatterSend``,
``RecvReduce``, ``abi_echo``); ``combine.py`` builds on them.
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import numpy as np

from . import driver, ptxdoc
from .abi import P3_MAX_RANKS, P3PeerSendConfig, P3SendCtx, validate
from .errors import ConfigError, CudaError, P3SendError, ParamMismatchError

FLAG_ROW_CACHE = 1
FLAG_SIGNAL = 2
FLAG_SCOPE_GPU = 4   # every receiver on this GPU: .gpu-scope release (SPEC §7)


class PeerPtrs(ctypes.LittleEndianStructure):
    """``u64[8]`` passed by value (e.g. ``count_ptrs``)."""
    _fields_ = [("p", ctypes.c_uint64 * P3_MAX_RANKS)]


_CTYPES = {"u64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32,
           "s32": ctypes.c_int32, "f32": ctypes.c_float, "P3PeerSendConfig": P3PeerSendConfig,
           "u64[8]": PeerPtrs}


def ptx_dir() -> Path:
    from .ptxcheck import ptx_dir as _d
    return _d()


class Kernel:
    """One ``.entry`` of a loaded module, with its parameter table (from the PTX header)."""

    def __init__(self, module: "Module", name: str, params: list[ptxdoc.Param]):
        self.module, self.name, self.params = module, name, params
        self.func = driver.get_function(module.handle, name)
        want = [(p.offset, p.size) for p in params]
        try:
            got = driver.param_info(self.func, len(params))
        except CudaError as e:
            raise ParamMismatchError(f"{module.name}: entry {name} has fewer parameters than the "
                                     f"{len(params)} documented ({e})") from e
        if got != want:
            rows = "\n".join(f"  param {i} ({p.name}): documented {w}, driver {g}"
                             for i, (p, w, g) in enumerate(zip(params, want, got)) if w != g)
            raise ParamMismatchError(
                f"{module.name}: entry {name}: the driver's parameter layout (offset, size) differs from "
                f"the documented table:\n{rows}")
        self.num_regs = driver.func_attribute(self.func, "NUM_REGS")
        self.max_threads = driver.func_attribute(self.func, "MAX_THREADS_PER_BLOCK")

    def params_block(self, **values) -> "ParamBlock":
        return ParamBlock(self, **values)

    def __repr__(self):
        return f"Kernel({self.name}, {len(self.params)} params, {self.num_regs} regs)"


class ParamBlock:
    """Live ctypes objects for every parameter plus the array of their addresses, so a
    repeated launch costs one ``cuLaunchKernel`` (the fast host path)."""

    def __init__(self, kernel: Kernel, **values):
        self.kernel = kernel
        self._objs = {}
        for p in kernel.params:
            ct = _CTYPES.get(p.type)
            if ct is None:
                ct = ctypes.c_uint8 * p.size
            self._objs[p.name] = ct()
        self.addrs = np.array([ctypes.addressof(o) for o in self._objs.values()], dtype=np.uint64)
        self.set(**values)

    def set(self, **values) -> "ParamBlock":
        for name, v in values.items():
            obj = self._objs.get(name)
            if obj is None:
                raise TypeError(f"{self.kernel.name}: no parameter {name!r}; parameters are "
                                f"{', '.join(self._objs)}")
            if isinstance(obj, P3PeerSendConfig):
                if not isinstance(v, P3PeerSendConfig):
                    raise TypeError(f"{self.kernel.name}.{name}: expected a P3PeerSendConfig, got {type(v).__name__}")
                ctypes.memmove(ctypes.addressof(obj), ctypes.addressof(v), ctypes.sizeof(obj))
            elif isinstance(obj, PeerPtrs):
                vals = [driver.device_ptr(x, f"{name}[{i}]") for i, x in enumerate(v)]
                if len(vals) > P3_MAX_RANKS:
                    raise ValueError(f"{name}: at most {P3_MAX_RANKS} addresses, got {len(vals)}")
                obj.p[:] = vals + [0] * (P3_MAX_RANKS - len(vals))
            elif isinstance(obj, ctypes.Array):
                b = bytes(v)
                if len(b) != ctypes.sizeof(obj):
                    raise ValueError(f"{name}: expected {ctypes.sizeof(obj)} bytes, got {len(b)}")
                ctypes.memmove(ctypes.addressof(obj), b, len(b))
            elif isinstance(obj, ctypes.c_float):
                obj.value = float(v)
            else:
                obj.value = driver.device_ptr(v, name) if not isinstance(v, (int, np.integer)) else int(v)
        return self

    def get(self, name):
        return self._objs[name]

    def launch(self, grid, block, stream: driver.Stream, smem: int = 0) -> None:
        driver.ensure_current(self.kernel.module.device)
        driver.launch(self.kernel.func, grid, block, smem, stream, self.addrs, self.kernel.name)


class Module:
    """A PTX file (or string) JIT-loaded on a device, with every documented entry checked.

    ``image``: a cubin already linked from ``text``'s sources (see ``link``)."""

    def __init__(self, text: str, name: str, dev: driver.Device, image: bytes | None = None):
        self.name, self.text, self.device = name, text, dev
        target = ptxdoc.ptx_target(text)
        if target and target.startswith("sm_"):
            need = int(target[3:].rstrip("af"))
            have = dev.cc[0] * 10 + dev.cc[1]
            if have < need:
                raise P3SendError(f"{name}: PTX targets {target}, but {dev.name} is sm_{have}")
        dev.activate()
        if image is None:
            self.handle, self.info_log = driver.load_module(text, name)
        else:
            self.handle, self.info_log = driver.load_image(image), ""
        entries = ptxdoc.parse_header(text)
        decls = ptxdoc.parse_decls(text)
        self.kernels: dict[str, Kernel] = {}
        for ename, params in decls.items():
            documented = entries.get(ename)
            if documented is not None and documented.kind == "entry":
                self.kernels[ename] = Kernel(self, ename, documented.params)
            elif ename not in entries and _is_entry(text, ename):
                self.kernels[ename] = Kernel(self, ename, params)  # a user's PTX without a header

    def __getitem__(self, name) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"{self.name} has no entry {name!r}; entries: {', '.join(self.kernels)}") from None


def _is_entry(text: str, name: str) -> bool:
    import re
    return re.search(rf"\.entry\s+{re.escape(name)}\s*\(", text) is not None


_modules: dict[tuple[int, str], Module] = {}


def load(source, *, device: driver.Device | None = None, name: str | None = None) -> Module:
    """Load PTX from a shipped entry name (``"p3_scatter_send"``), a path, or PTX text.

    Modules are cached per device and content. A bad PTX raises CudaError with the JIT
    log; a parameter layout that differs from the header raises ParamMismatchError.
    """
    dev = device or driver.device()
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and
                                     (source.endswith(".ptx") or "/" in source)):
        path = Path(source)
        text, name = path.read_text(), name or path.name
    elif isinstance(source, str) and "\n" not in source:
        path = ptx_dir() / f"{source}.ptx"
        if not path.exists():
            raise P3SendError(f"no shipped PTX named {source!r} in {ptx_dir()}")
        text, name = path.read_text(), name or path.name
        # a kernel that calls the linkable functions is one module with them appended
        siblings = [(p.name, p.read_text()) for p in sorted(ptx_dir().glob("*.ptx")) if p != path]
        try:
            text = ptxdoc.module_text(text, siblings)
        except ValueError as e:
            raise P3SendError(f"{name}: {e}") from e
    else:
        text = source.decode() if isinstance(source, bytes) else source
        name = name or "<ptx string>"
    key = (dev.ordinal, hashlib.sha1(text.encode()).hexdigest())
    mod = _modules.get(key)
    if mod is None:
        mod = _modules[key] = Module(text, name, dev)
    return mod


def link(sources, *, device: driver.Device | None = None, name: str = "<linked>",
         max_registers: int | None = None) -> Module:
    """Link PTX sources ((name, text) pairs; names of shipped files may be given alone,
    e.g. ``"p3_send_rows"``) with the driver's JIT linker, resolving ``.extern .func``
    references across them: how a runtime links p3send's device functions into its own
    kernel. Every documented entry of the sources is checked as in ``load``."""
    dev = device or driver.device()
    pairs = []
    for src in sources:
        if isinstance(src, str):
            path = ptx_dir() / f"{src}.ptx"
            pairs.append((path.name, path.read_text()))
        else:
            pairs.append((src[0], src[1]))
    dev.activate()
    image, _ = driver.link_ptx(pairs, {"CU_JIT_MAX_REGISTERS": max_registers} if max_registers else None)
    return Module("\n".join(t for _, t in pairs), name, dev, image=image)


def kernel(entry: str, device: driver.Device | None = None) -> Kernel:
    """A shipped kernel by entry name (file name == entry name)."""
    return load(entry, device=device)[entry]


# ---------------------------------------------------------------- typed launchers

def abi_echo(cfg: P3PeerSendConfig, tag: int = 0x5EED_0F_C0FFEE, device=None) -> tuple[bytes, int]:
    """Launch ``p3_abi_echo``; return (the 184 bytes the device saw, the tag it saw)."""
    k = kernel("p3_abi_echo", device)
    out = driver.DeviceBuffer(192, fill=0)
    try:
        s = driver.Stream()
        k.params_block(cfg=cfg, out=out, tag=tag).launch((1,), (32,), s)
        s.synchronize()
        raw = out.download()
        s.close()
    finally:
        out.free()
    return raw[:184].tobytes(), int(raw[184:192].view(np.uint64)[0])


def _nbytes(obj) -> int | None:
    if isinstance(obj, driver.DeviceBuffer):
        return obj.nbytes
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = cai["shape"]
        item = np.dtype(cai["typestr"]).itemsize
        return int(np.prod(shape)) * item if cai.get("strides") is None else None
    return None


def _aligned(name, addr, align, problems):
    if addr == 0:
        problems.append(f"{name}: expected a device address, got null")
    elif addr % align:
        problems.append(f"{name}: expected a {align}-byte aligned address, got {addr:#x}")


def _send_args(launcher, cfg, expert_offsets, host_offsets, rows_cap, count_ptrs, row_cache, p3_control, same_gpu):
    """Checks and values shared by the send launchers: (problems, expert_offsets address,
    count pointers [8], flags). A numpy ``expert_offsets`` is uploaded into the launcher's
    own buffer (and checked); otherwise ``host_offsets`` (if given) is checked."""
    problems = validate(cfg, p3_control=p3_control, row_cache=row_cache, raise_on_error=False)
    n = launcher.n_experts
    if isinstance(expert_offsets, np.ndarray):
        host_offsets = expert_offsets
        if getattr(launcher, "_offs_buf", None) is None:
            launcher._offs_buf = driver.DeviceBuffer(4 * (n + 1))
        if expert_offsets.size == n + 1:
            launcher._offs_buf.upload(np.ascontiguousarray(expert_offsets, dtype=np.int32))
        expert_offsets = launcher._offs_buf
    offs_addr = driver.device_ptr(expert_offsets, "expert_offsets")
    _aligned("expert_offsets", offs_addr, 4, problems)
    if host_offsets is not None:
        off = np.asarray(host_offsets, dtype=np.int64)
        if off.shape != (n + 1,):
            problems.append(f"expert_offsets: expected {n + 1} int32 values, got shape {off.shape}")
        elif (off < 0).any() or (np.diff(off) < 0).any() or off[-1] > np.iinfo(np.int32).max:
            problems.append(f"expert_offsets: expected non-decreasing values in 0..2^31-1, got {off.tolist()[:12]}")
        elif rows_cap is not None and off[-1] > rows_cap:
            problems.append(f"expert_offsets: rows up to {int(off[-1])} but the input holds {rows_cap} rows")
    flags = FLAG_ROW_CACHE if row_cache else 0
    peers = [0] * P3_MAX_RANKS
    if count_ptrs is not None:
        flags |= FLAG_SIGNAL | (FLAG_SCOPE_GPU if same_gpu else 0)
        cp = list(count_ptrs)
        for i in range(min(cfg.n_ranks, cfg.p2p_world_size) if cfg.n_ranks > 0 else 0):
            if i >= len(cp):
                problems.append(f"count_ptrs[{i}]: expected the receive counts of p2p rank {i}, got nothing")
                continue
            peers[i] = driver.device_ptr(cp[i], f"count_ptrs[{i}]")
            _aligned(f"count_ptrs[{i}]", peers[i], 8, problems)
    return problems, offs_addr, peers, flags


def _diagnostics(buf: driver.DeviceBuffer, reset: bool) -> dict:
    d = buf.download(np.uint32)
    if reset:
        buf.fill(0)
    return {"dropped": int(d[0]), "unrouted": int(d[1]), "rejected": bool(d[2])}


class _Sender:
    """What the send launchers share: launch, a one-shot call, diagnostics, close."""

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        (block or self.block).launch((self.grid,), (self.threads,), stream, self.smem)

    def __call__(self, *args, stream=None, **kw) -> None:
        """prepare(*args, **kw) and launch; synchronous when no stream is given."""
        blk = self.prepare(*args, **kw)
        s = stream or driver.Stream()
        self.launch(s, blk)
        if stream is None:
            s.synchronize()
            s.close()

    def diagnostics(self, reset: bool = True) -> dict:
        """{'dropped': rows failing the bounds check, 'unrouted': rows owned by no rank,
        'rejected': cfg refused on the device} accumulated since the last reset."""
        return _diagnostics(self.diag, reset)

    def close(self) -> None:
        for b in (self.state, self.diag, getattr(self, "ctx", None), getattr(self, "_offs_buf", None)):
            if b is not None:
                b.free()


class ScatterSend(_Sender):
    """Launcher for ``p3_scatter_send`` on one device.

    Owns the sender state (per-expert completion and pair counters, zeroed once and
    self-resetting) and the diagnostics buffer. ``num_sms`` limits the send to that many
    SMs (one 1024-thread CTA each, like DeepEP's ``set_num_sms``); default: all SMs.
    """

    THREADS = 1024
    #: cp.async staging per thread: 2 chunks x 6 vectors x 16 B (1024 threads: 192 KiB, one CTA per SM).
    SMEM_PER_THREAD = 2 * 6 * 16

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, num_sms: int | None = None,
                 threads: int = THREADS):
        if n_experts < 1:
            raise ValueError(f"n_experts: expected >= 1, got {n_experts}")
        if threads % 32 or not (32 <= threads <= 1024):
            raise ValueError(f"threads: expected a multiple of 32 in 32..1024, got {threads}")
        self.dev = device or driver.device()
        self.k = kernel("p3_scatter_send", self.dev)
        self.n_experts, self.threads = int(n_experts), threads
        self.state = driver.DeviceBuffer(self.n_experts * 40, fill=0)   # u64 done[e] + u32 pair[e][8]
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.smem = self.SMEM_PER_THREAD * threads
        if self.smem > self.dev.smem_optin:
            raise P3SendError(f"p3_scatter_send needs {self.smem} B of shared memory per block; "
                              f"{self.dev.name} allows {self.dev.smem_optin}")
        driver.set_max_dynamic_smem(self.k.func, max(self.smem, self.SMEM_PER_THREAD * self.THREADS))
        self.set_num_sms(num_sms)
        self.block = self.k.params_block()

    def set_num_sms(self, num_sms: int | None) -> None:
        """Use ``num_sms`` SMs: one CTA each (a 1024-thread CTA's staging fills an SM's shared memory)."""
        sms = self.dev.sm_count
        if num_sms is not None and not (1 <= num_sms <= sms):
            raise ValueError(f"num_sms: expected 1..{sms}, got {num_sms}")
        self.grid = num_sms or sms

    def prepare(self, cfg: P3PeerSendConfig, c, expert_offsets, c_row_stride: int | None = None, *,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, same_gpu: bool = False,
                expert_offsets_host=None, rows_in_c: int | None = None,
                into: ParamBlock | None = None) -> ParamBlock:
        """Validate every argument and fill the parameter block (no launch).

        cfg: the config; c: C (DeviceBuffer / CAI object / address), rows of
        ``cfg.msg_bytes`` at ``c_row_stride`` (default msg_bytes); expert_offsets: int32
        (n_experts+1,) on the device (DeviceBuffer/CAI/address) -- pass the same values as
        a numpy array in ``expert_offsets_host`` (or pass a numpy array as expert_offsets,
        uploaded once) so bounds are checked; count_ptrs: up to 8 receive-count arrays
        (enables the arrival signal); same_gpu: every receiver is on this GPU, so the signal
        may use .gpu-scope release (SPEC §7); into: fill this block instead of the launcher's own
        (several prepared launches, e.g. rotating inputs).
        """
        stride = cfg.msg_bytes if c_row_stride is None else int(c_row_stride)
        c_addr = driver.device_ptr(c, "c")
        nb = _nbytes(c)
        cap = rows_in_c
        if cap is None and nb is not None and stride:
            cap = (nb - cfg.msg_bytes) // stride + 1 if nb >= cfg.msg_bytes else 0
        problems, offs_addr, peers, flags = _send_args(self, cfg, expert_offsets, expert_offsets_host, cap,
                                                       count_ptrs, row_cache, p3_control, same_gpu)
        _aligned("c", c_addr, 16, problems)
        if stride % 16 or stride < cfg.msg_bytes:
            problems.append(f"c_row_stride: expected a multiple of 16 >= msg_bytes ({cfg.msg_bytes}), got {stride}")
        if problems:
            raise ConfigError(problems, "scatter-send launch")
        return (into or self.block).set(cfg=cfg, count_ptrs=peers, c_ptr=c_addr, c_row_stride=stride,
                                        expert_offsets=offs_addr, state_ptr=self.state, diag_ptr=self.diag,
                                        n_experts=self.n_experts, flags=flags, p3_control=int(p3_control))



class EpilogueSend(_Sender):
    """Launcher for ``p3_epilogue_send``: fp32 accumulator tiles -> bf16 in shared-memory
    stages -> peers, by ``send_warps`` dedicated send warps fed through the mailbox (0:
    the epilogue warps send inline). Owns the sender state, diagnostics and P3SendCtx."""

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, bm: int = 16, bn: int = 1024,
                 num_stages: int = 2, send_warps: int = 1, epilogue_warps: int = 2, grid: int | None = None):
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
        self.k = kernel("p3_epilogue_send", self.dev)
        self.n_experts, self.bm, self.bn, self.num_stages = int(n_experts), bm, bn, num_stages
        self.send_warps, self.threads = send_warps, 32 * (epilogue_warps + send_warps)
        self.smem = bm * bn * 2
        if self.smem > self.dev.smem_optin:
            raise ConfigError([f"bm*bn*2 = {self.smem} B of shared memory exceeds {self.dev.smem_optin}"],
                              "epilogue-send geometry")
        driver.set_max_dynamic_smem(self.k.func, self.smem)
        per_sm = max(1, driver.occupancy(self.k.func, self.threads, self.smem))
        self.grid = grid or per_sm * self.dev.sm_count
        self.state = driver.DeviceBuffer(self.n_experts * 40, fill=0)
        self.diag = driver.DeviceBuffer(16, fill=0)
        self.ctx = driver.DeviceBuffer(ctypes.sizeof(P3SendCtx), fill=0)
        self.block = self.k.params_block()

    def prepare(self, cfg: P3PeerSendConfig, acc, n_cols: int, expert_offsets, *, acc_stride: int | None = None,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, same_gpu: bool = False,
                expert_offsets_host=None, rows_in_acc: int | None = None) -> ParamBlock:
        """acc: fp32 (rows, >= n_cols) accumulators by absolute row; n_cols: hidden (cfg.msg_bytes
        must be 2*n_cols); the rest as ``ScatterSend.prepare``."""
        stride = 4 * n_cols if acc_stride is None else int(acc_stride)
        acc_addr = driver.device_ptr(acc, "acc")
        nb = _nbytes(acc)
        cap = rows_in_acc
        if cap is None and nb is not None and stride:
            cap = (nb - 4 * n_cols) // stride + 1 if nb >= 4 * n_cols else 0
        problems, offs_addr, peers, flags = _send_args(self, cfg, expert_offsets, expert_offsets_host, cap,
                                                       count_ptrs, row_cache, p3_control, same_gpu)
        _aligned("acc", acc_addr, 16, problems)
        if n_cols <= 0 or n_cols % 8:
            problems.append(f"n_cols: expected a positive multiple of 8, got {n_cols}")
        if cfg.msg_bytes != 2 * n_cols:
            problems.append(f"msg_bytes: expected 2*n_cols = {2 * n_cols} (bf16 rows), got {cfg.msg_bytes}")
        if stride % 16 or stride < 4 * n_cols:
            problems.append(f"acc_stride: expected a multiple of 16 >= 4*n_cols ({4 * n_cols}), got {stride}")
        if problems:
            raise ConfigError(problems, "epilogue-send launch")
        ctx = P3SendCtx()
        ctx.count_ptrs[:] = peers
        ctx.expert_offsets, ctx.state_ptr, ctx.diag_ptr = offs_addr, self.state.ptr, self.diag.ptr
        ctx.n_experts, ctx.flags, ctx.p3_control = self.n_experts, flags, int(p3_control)
        self.ctx.upload(np.frombuffer(bytes(ctx), dtype=np.uint8))
        return self.block.set(cfg=cfg, ctx=self.ctx, acc_ptr=acc_addr, acc_stride=stride, n_cols=n_cols,
                              bm=self.bm, bn=self.bn, num_stages=self.num_stages, n_send_warps=self.send_warps)



class RecvReduce:
    """Launcher for ``p3_recv_reduce`` for one receiving rank: owns its state and record."""

    THREADS = 256

    def __init__(self, *, device: driver.Device | None = None, max_ctas: int | None = None):
        self.dev = device or driver.device()
        self.k = kernel("p3_recv_reduce", self.dev)
        self.state = driver.DeviceBuffer(32, fill=0)
        self.diag = driver.DeviceBuffer(32, fill=0)
        self.max_ctas = max_ctas or 4 * self.dev.sm_count   # 4 CTAs of 256 threads fit an SM
        self.block = self.k.params_block()
        self.grid = 1

    def prepare(self, cfg: P3PeerSendConfig, recv, counts, topk_idx, weights, out, *, n_tokens: int,
                n_experts: int, timeout_ns: int, stamps=None) -> ParamBlock:
        problems = []
        if not (1 <= cfg.n_ranks <= P3_MAX_RANKS):
            problems.append(f"n_ranks: expected 1..{P3_MAX_RANKS}, got {cfg.n_ranks}")
        if not (1 <= cfg.top_k <= 32):
            problems.append(f"top_k: expected 1..32 for the receive side, got {cfg.top_k}")
        if cfg.msg_bytes <= 0 or cfg.msg_bytes % 16:
            problems.append(f"msg_bytes: expected a positive multiple of 16 (hidden a multiple of 8 bf16), got {cfg.msg_bytes}")
        if not (0 <= n_tokens <= cfg.max_tokens_per_rank):
            problems.append(f"n_tokens: expected 0..max_tokens_per_rank ({cfg.max_tokens_per_rank}), got {n_tokens}")
        if n_experts < 1:
            problems.append(f"n_experts: expected >= 1, got {n_experts}")
        if timeout_ns < 0:
            problems.append(f"timeout_ns: expected >= 0, got {timeout_ns}")
        addrs = {}
        for name, obj, align, need in (("recv", recv, 16, True), ("counts", counts, 8, True),
                                       ("topk_idx", topk_idx, 4, True), ("weights", weights, 4, out is not None),
                                       ("out", out, 16, False)):
            a = 0 if obj is None else driver.device_ptr(obj, name)
            if need or a:
                _aligned(name, a, align, problems)
            addrs[name] = a
        units = n_tokens * -(-max(cfg.msg_bytes, 0) // 512)      # one warp per (token, 512-byte chunk)
        if units >= 1 << 32:
            problems.append(f"n_tokens: {n_tokens} tokens x {cfg.msg_bytes}-byte rows exceed 2^32 work units")
        if problems:
            raise ConfigError(problems, "receive launch")
        warps = max(1, units)
        self.grid = max(1, min(self.max_ctas, -(-warps // (self.THREADS // 32))))
        return self.block.set(cfg=cfg, recv_ptr=addrs["recv"], counts_ptr=addrs["counts"],
                              topk_idx=addrs["topk_idx"], weights=addrs["weights"], out_ptr=addrs["out"],
                              state_ptr=self.state, diag_ptr=self.diag, timeout_ns=int(timeout_ns),
                              stamp_ptr=0 if stamps is None else stamps, n_tokens=n_tokens, n_experts=n_experts)

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        (block or self.block).launch((self.grid,), (self.THREADS,), stream)

    def record(self) -> dict:
        """The last launch's record: timed-out waits, first missing slot and its value."""
        d = self.diag.download(np.uint64)
        return {"timeouts": int(d[0]) if d[0] != 1 << 63 else None, "rejected": int(d[0]) == 1 << 63,
                "first_missing_slot": int(np.int64(d[1])), "value": int(d[2]), "end_ns": int(d[3])}

    def close(self) -> None:
        self.state.free()
        self.diag.free()
