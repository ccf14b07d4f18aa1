"""The comparison kernels of ``p3send bench``: what a good engineer would write instead of
hand-written PTX, doing the same job from the same inputs as ``p3_scatter_send``, and the
ceilings that bound what a kernel of each family can do.

- ``TritonScatter``: a Triton kernel, compiled ahead of time with ``triton.compile``
  (needs Triton, not torch; ``baselines_triton``) and launched through the driver seam like
  every p3send kernel.
- ``CudaScatter``: a CUDA C++ kernel (``kernels/baselines.cu``, shipped as package data)
  compiled at bench time with NVRTC (``driver.nvrtc_compile``).
- ``SMCopy``: the plainest SM copy (the SM ceiling): each CTA copies one contiguous tile
  of ``threads * vpt`` 16-byte vectors and exits.
- ``RowsCopy``: the scatter ceiling (rows to precomputed destinations), with the least
  signal of the send's protocol or another protocol's; ``ReduceCeiling``: the receive's
  arithmetic with no wait.

The two scatter baselines share one design: one CTA (program) per (row, column chunk), the
chunks of a row equal in size; each CTA issues its 16-byte loads of C first, then one warp
resolves the row (expert by counting ``expert_offsets <= row``, owning rank = the first
whose range-table range holds the row, ``dst_p2p = rank % p2p_world_size``, the
``src_info`` bounds check) while the loads are in flight, then every thread stores. The
signal: one thread of the row's chunk-0 CTA adds the row to ``pair[e][p]`` (relaxed), and
after ``bar.sync`` one thread counts the CTA into ``done[e]`` with an acq_rel atomic at
.gpu scope (the release of all the CTA's stores); the CTA that completes ``done[e]`` (rows
of e x chunks) swaps every ``pair[e][p]`` to 0 and publishes it with a .gpu release store
into ``count_ptrs[p][e*n_ranks + my_rank]``, then resets ``done[e]``; CTA 0 publishes 0 for
empty experts. The state (``u32 done[E]``, ``u32 pair[E][8]``) is zeroed once at
construction and self-resetting inside the kernel, so its cost is in the timed launch. The
.gpu scope is enough only for receivers on this GPU (the bench's one-GPU sections);
p3_scatter_send's default signal is .sys.

``time_baselines`` runs each baseline's launch-shape variants and reports the fastest, so
the bar is each baseline's best shape on the GPU at hand. Triton, torch and NVRTC are
optional; a baseline that cannot be built raises ``BaselineUnavailable`` saying why.
"""
from __future__ import annotations

import ctypes
import functools
from importlib import resources

import numpy as np

from ..abi.config import P3PeerSendConfig
from ..abi.errors import ConfigError, P3SendError, ParamMismatchError
from ..cuda import driver
from ..ops.send import send_args


class BaselineUnavailable(P3SendError):
    """A baseline cannot be built here (Triton or NVRTC missing, or a compile error)."""


# ---------------------------------------------------------------- CUDA C++ (NVRTC)

def kernel_source(name: str = "baselines.cu") -> str:
    """The text of ``p3send/bench/kernels/<name>`` (package data: found in an installed wheel too)."""
    return (resources.files(__package__) / "kernels" / name).read_text()


@functools.cache
def _cuda_module(ordinal: int, arch: str, threads: int, vpt: int, hint: int = 0):
    """kernels/baselines.cu compiled for ``arch`` with these -D values and loaded on the
    current device: (module, which compiler)."""
    try:
        cubin, _ = driver.nvrtc_compile(kernel_source(), arch, "baselines.cu",
                                        {"VPT": vpt, "HINT": hint, "MAXT": threads})
        major, minor = driver.nvrtc_version()
    except P3SendError as e:      # NVRTC missing, or the compile failed (its log in the message)
        raise BaselineUnavailable(f"the CUDA C++ baselines cannot be built: {e}") from e
    return driver.load_image(cubin), f"NVRTC {major}.{minor}"


def cuda_function(dev: driver.Device, name: str, *, threads: int = 256, vpt: int = 1):
    """Kernel ``name`` of kernels/baselines.cu, compiled for ``dev`` with these -D values
    (cached) and loaded: for other bench sections' launches (``Launch``).

    Raises:
        BaselineUnavailable: NVRTC is missing or the compile failed.
    """
    mod, _ = _cuda_module(dev.ordinal, f"sm_{dev.cc[0]}{dev.cc[1]}", threads, vpt)
    return driver.get_function(mod, name)


# ---------------------------------------------------------------- launches

class Launch:
    """One prepared launch: a function, its shape and live ctypes objects for every
    parameter (their addresses prebuilt, so a launch is one cuLaunchKernel)."""

    def __init__(self, func, name: str, grid: int, block: int, smem: int, objs: list):
        self.func, self.name, self.grid, self.block, self.smem = func, name, grid, block, smem
        self.objs = objs
        self.addrs = np.array([ctypes.addressof(o) for o in objs], dtype=np.uint64)
        _check_params(func, name, tuple((ctypes.sizeof(o), ctypes.alignment(o)) for o in objs))

    def __call__(self, stream: driver.Stream) -> None:
        if self.grid:
            driver.launch(self.func, (self.grid,), (self.block,), self.smem, stream, self.addrs, self.name)


_checked: set = set()


def _check_params(func, name: str, shapes: tuple) -> None:
    """The driver's parameter layout of ``func`` must be exactly ``shapes`` ((size, align) per
    parameter, packed in order): a wrong count or size would launch garbage."""
    key = (int(func), shapes)
    if func is None or key in _checked:
        return
    want, at = [], 0
    for size, align in shapes:
        at = -(-at // align) * align
        want.append((at, size))
        at += size
    got = driver.param_info(func, len(shapes))
    extra = True
    try:
        driver.param_info(func, len(shapes) + 1)
    except P3SendError:
        extra = False
    if got != want or extra:
        raise ParamMismatchError(f"{name}: the driver's parameter layout {got}{' and more' if extra else ''} "
                          f"differs from the arguments built here {want}")
    _checked.add(key)


def _tile(nv: int, threads: int, vpt: int) -> tuple[int, int, int]:
    """A row of ``nv`` vectors cut into equal chunks of at most threads*vpt: (chunks,
    cta_vecs, block: the whole warps that cover a chunk with vpt vectors per thread)."""
    chunks = -(-nv // (threads * vpt))
    cta_vecs = -(-nv // chunks)
    return chunks, cta_vecs, 32 * -(-cta_vecs // (32 * vpt))


class _ScatterBaseline:
    """What the two scatter baselines share: the same argument checks as ScatterSend, the
    state (self-resetting) and diagnostics, prepare/launch/__call__/close."""

    label = "scatter baseline"

    def __init__(self, n_experts: int, device: driver.Device | None, threads: int, vpt: int):
        if n_experts < 1:
            raise ConfigError([f"n_experts: expected >= 1, got {n_experts}"], f"{self.label}")
        if threads % 32 or not (32 <= threads <= 1024) or vpt < 1 or threads * vpt > 8192:
            raise ConfigError([f"threads, vpt: expected a multiple of 32 in 32..1024 and vpt >= 1, "
                               f"threads*vpt <= 8192; got {threads}, {vpt}"], f"{self.label}")
        self.dev = device or driver.device()
        self.n_experts, self.threads, self.vpt = int(n_experts), threads, vpt
        self.state = driver.DeviceBuffer(36 * self.n_experts, fill=0)   # u32 done[E], u32 pair[E][8]
        self.diag = driver.DeviceBuffer(8, fill=0)
        self.offsets_buf = driver.DeviceBuffer(4 * (self.n_experts + 1))
        self.last: Launch | None = None
        self.grid = 0

    def prepare(self, cfg: P3PeerSendConfig, c, expert_offsets, c_row_stride: int | None = None, *,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, expert_offsets_host=None,
                rows_in_c: int | None = None) -> Launch:
        """The arguments of ``ScatterSend.prepare`` (the signal is always .gpu scope: receivers
        on this GPU). The grid needs the row count: pass the offsets as numpy (as
        ``expert_offsets`` or ``expert_offsets_host``), else ``rows_in_c`` bounds it."""
        stride = cfg.msg_bytes if c_row_stride is None else int(c_row_stride)
        host = expert_offsets if isinstance(expert_offsets, np.ndarray) else expert_offsets_host
        c_addr = driver.device_ptr(c, "c")
        nb = getattr(c, "nbytes", None) if isinstance(c, driver.DeviceBuffer) else None
        cap = rows_in_c
        if cap is None and nb is not None and stride:
            cap = (nb - cfg.msg_bytes) // stride + 1 if nb >= cfg.msg_bytes else 0
        sa = send_args(cfg, expert_offsets, n_experts=self.n_experts, ordinal=self.dev.ordinal, host_offsets=host,
                       rows_cap=cap, count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control,
                       same_gpu=True, staging=self.offsets_buf)
        problems, offs_addr, counts = sa.problems, sa.expert_offsets, sa.count_ptrs
        if row_cache:
            problems.append("row_cache: the baselines do not implement the row cache")
        if cfg.send_stamp_on or cfg.trace_on:
            problems.append("send_stamp_on, trace_on: the baselines do not write stamps or trace")
        if c_addr % 16:
            problems.append(f"c: expected a 16-byte aligned address, got {c_addr:#x}")
        if stride % 16 or stride < cfg.msg_bytes:
            problems.append(f"c_row_stride: expected a multiple of 16 >= msg_bytes ({cfg.msg_bytes}), got {stride}")
        if host is None and cap is None:
            problems.append("expert_offsets_host: the baselines size their grid from the row count; pass the "
                            "offsets as numpy or rows_in_c")
        if problems:
            raise ConfigError(problems, f"{self.label} launch")
        if p3_control < 0 or cfg.n_ranks == 0:        # the send is off: nothing to launch
            self.last = Launch(None, self.label, 0, 0, 0, [])
            return self.last
        rows = int(host[-1]) - int(host[0]) if host is not None else int(cap)
        nv = cfg.msg_bytes // 16
        chunks, cta_vecs, block = _tile(nv, self.threads, self.vpt)
        self.grid = max(1, rows * chunks)
        if self.grid >= 1 << 31:
            raise ConfigError([f"rows: {rows} rows x {chunks} chunks exceed the grid"], f"{self.label} launch")
        state = self.state.ptr if count_ptrs is not None else 0
        self.last = self._build(cfg, counts, c_addr, stride, offs_addr, state, chunks, cta_vecs, block)
        return self.last

    def launch(self, stream: driver.Stream, prepared: Launch | None = None) -> None:
        driver.ensure_current(self.dev)
        (prepared or self.last)(stream)

    def __call__(self, *args, stream=None, **kw) -> None:
        """prepare(*args, **kw) and launch; synchronous when no stream is given."""
        launch = self.prepare(*args, **kw)
        s = stream or driver.Stream()
        self.launch(s, launch)
        if stream is None:
            s.synchronize()
            s.close()

    def diagnostics(self, reset: bool = True) -> dict:
        """{'dropped', 'unrouted'} rows since the last reset ('rejected' is always False: the
        host checks reject a bad config before any launch)."""
        d = self.diag.download(np.uint32)
        if reset:
            self.diag.fill(0)
        return {"dropped": int(d[0]), "unrouted": int(d[1]), "rejected": False}

    def close(self) -> None:
        for b in (self.state, self.diag, self.offsets_buf):
            if b is not None:
                b.free()


class CudaScatter(_ScatterBaseline):
    """The CUDA C++ scatter baseline (NVRTC): one CTA of ``threads`` threads per (row, chunk),
    ``vpt`` 16-byte vectors per thread."""

    label = "CUDA C++ scatter baseline"

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, threads: int = 256,
                 vpt: int = 1):
        super().__init__(n_experts, device, threads, vpt)
        mod, self.compiler = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "baseline_scatter")
        self.config = f"{threads} thr x {vpt} vec ({self.compiler})"

    def _build(self, cfg, counts, c_addr, stride, offs_addr, state, chunks, cta_vecs, block) -> Launch:
        u64, i32 = ctypes.c_uint64, ctypes.c_int32
        objs = [P3PeerSendConfig.from_buffer_copy(bytes(cfg)), (u64 * 8)(*counts), u64(c_addr), u64(stride),
                u64(offs_addr), u64(state), u64(self.diag.ptr), i32(self.n_experts), i32(chunks), i32(cta_vecs)]
        return Launch(self.func, "baseline_scatter", self.grid, block, 0, objs)


class SMCopy:
    """The SM ceiling: ``baseline_copy`` over ``nbytes`` (a multiple of 16), one tile of
    ``threads * vpt`` vectors per CTA."""

    def __init__(self, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1, hint: int = 0):
        self.dev = device or driver.device()
        mod, self.compiler = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt,
                                          hint=hint)
        self.func = driver.get_function(mod, "baseline_copy")
        self.threads, self.vpt = threads, vpt
        self.config = f"{threads} thr x {vpt} vec{', .cs' if hint else ''} ({self.compiler})"

    def prepare(self, dst, src, nbytes: int) -> Launch:
        problems = []
        d, s = driver.device_ptr(dst, "dst"), driver.device_ptr(src, "src")
        for name, a in (("dst", d), ("src", s)):
            if a % 16:
                problems.append(f"{name}: expected a 16-byte aligned address, got {a:#x}")
        if nbytes < 0 or nbytes % 16:
            problems.append(f"nbytes: expected a non-negative multiple of 16, got {nbytes}")
        if problems:
            raise ConfigError(problems, "SM copy")
        nvec = nbytes // 16
        grid = -(-nvec // (self.threads * self.vpt))
        return Launch(self.func, "baseline_copy", grid, self.threads, 0,
                      [ctypes.c_uint64(d), ctypes.c_uint64(s), ctypes.c_uint64(nvec)])

    def launch(self, stream: driver.Stream, prepared: Launch) -> None:
        driver.ensure_current(self.dev)
        prepared(stream)


class RowsCopy(SMCopy):
    """The scatter ceiling: ``baseline_rows``, the CUDA C++ scatter baseline's CTA shape copying every row
    of C to its precomputed destination (``row_dst[r]``, u64 on the device): no routing, no
    bounds check. What no kernel of its family writing the same slots from the same rows
    beats. ``signal``: False; True, the least signal of the send's protocol (one release per
    CTA into one of 32 counters, the last CTA of each publishing a flag); "kernel", that
    order by the kernel boundary (the copy, then ``baseline_publish`` setting the 32 flags);
    "red", another protocol's (one fire-and-forget release reduction per CTA, for receivers
    that know how many rows to expect)."""

    SIGNALS = {False: 0, True: 1, "kernel": 0, "red": 2}

    def __init__(self, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1,
                 rows_per_cta: int = 1, signal: bool | str = False):
        if signal not in self.SIGNALS:
            raise ConfigError([f"signal: expected one of {list(self.SIGNALS)}, got {signal!r}"], "scatter ceiling")
        super().__init__(device=device, threads=threads, vpt=vpt)
        mod, _ = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "baseline_rows")
        self.publish = driver.get_function(mod, "baseline_publish") if signal == "kernel" else None
        self.signal = signal
        self.rows_per_cta = max(1, int(rows_per_cta))
        self.state = driver.DeviceBuffer(32 * 4 + 32 * 8, fill=0) if signal else None   # u32 done[32], u64 flag[32]
        if self.rows_per_cta > 1:
            self.config = self.config.replace(" (", f", {self.rows_per_cta} rows/CTA (", 1)
        self.config += {False: "", True: ", signalled", "kernel": ", then a publish kernel",
                        "red": ", release reductions"}[signal]

    def prepare(self, row_dst, c, rows: int, msg_bytes: int):
        """The launch (a callable taking a stream): with ``signal="kernel"``, baseline_rows
        without its signal, then baseline_publish setting the 32 flags."""
        problems = []
        if rows < 0:
            problems.append(f"rows: expected >= 0, got {rows}")
        if msg_bytes <= 0 or msg_bytes % 16:
            problems.append(f"msg_bytes: expected a positive multiple of 16, got {msg_bytes}")
        if driver.device_ptr(c, "c") % 16:
            problems.append("c: expected a 16-byte aligned address")
        if problems:
            raise ConfigError(problems, "scatter ceiling")
        chunks, cta_vecs, block = _tile(msg_bytes // 16, self.threads, self.vpt)
        done = self.state.ptr if self.state is not None else 0
        u64, i32 = ctypes.c_uint64, ctypes.c_int32
        grid = -(-rows // self.rows_per_cta) * chunks
        copy = Launch(self.func, "baseline_rows", grid, block, 0,
                      [u64(driver.device_ptr(row_dst, "row_dst")), u64(driver.device_ptr(c, "c")),
                       u64(msg_bytes), i32(msg_bytes // 16), i32(chunks), i32(cta_vecs), u64(done),
                       u64(done + 128 if done else 0), i32(self.SIGNALS[self.signal]), i32(self.rows_per_cta),
                       i32(rows)])
        if self.publish is None:
            return copy
        publish = Launch(self.publish, "baseline_publish", 1 if grid else 0, 32, 0,
                         [u64(self.state.ptr + 128), i32(32), u64(grid)])

        def both(stream):
            copy(stream)
            publish(stream)
        both.grid = grid
        return both

    def close(self) -> None:
        if self.state is not None:
            self.state.free()
            self.state = None


class ReduceCeiling(SMCopy):
    """The reduce ceiling: ``baseline_reduce``, the receive's top-k reduce (same arithmetic, so
    the same bytes out) for every rank of a one-GPU round in one launch, with no wait, no
    re-arm and no diagnostics: what no receive of the same slots beats."""

    def __init__(self, *, device: driver.Device | None = None, threads: int = 128, vpt: int = 1):
        super().__init__(device=device, threads=threads, vpt=vpt)
        mod, _ = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "baseline_reduce")

    def prepare(self, recv: list, topk_idx: list, weights: list, out: list, *, tokens: int, top_k: int,
                msg_bytes: int, n_global: int) -> Launch:
        ranks = len(recv)
        problems = []
        if not 1 <= ranks <= 8 or not (len(topk_idx) == len(weights) == len(out) == ranks):
            problems.append(f"recv, topk_idx, weights, out: expected 1..8 ranks each, got "
                            f"{len(recv)}, {len(topk_idx)}, {len(weights)}, {len(out)}")
        if not 1 <= top_k <= 8:
            problems.append(f"top_k: expected 1..8, got {top_k}")
        if msg_bytes <= 0 or msg_bytes % 16:
            problems.append(f"msg_bytes: expected a positive multiple of 16, got {msg_bytes}")
        if problems:
            raise ConfigError(problems, "reduce ceiling")
        ptrs = (ctypes.c_uint64 * 32)()
        for i, group in enumerate((recv, topk_idx, weights, out)):
            for r, x in enumerate(group):
                ptrs[8 * i + r] = driver.device_ptr(x, "reduce ceiling buffer")
        nv = msg_bytes // 16
        chunks, cta_vecs, block = _tile(nv, self.threads, self.vpt)
        i32 = ctypes.c_int32
        return Launch(self.func, "baseline_reduce", ranks * tokens * chunks, block, 0,
                      [ptrs, i32(tokens), i32(top_k), i32(nv), i32(n_global), i32(chunks), i32(cta_vecs)])


# ---------------------------------------------------------------- Triton

def triton_version() -> str | None:
    """The installed Triton's version, or None (the Triton baseline is then skipped)."""
    try:
        from . import baselines_triton
    except Exception:  # noqa: BLE001 -- no Triton, or one that does not import here
        return None
    return baselines_triton.VERSION


class TritonScatter(_ScatterBaseline):
    """The Triton scatter baseline: one program of ``threads`` threads per (row, chunk),
    ``vpt`` 16-byte vectors per thread, compiled ahead of time and launched through the
    driver."""

    label = "Triton scatter baseline"

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1):
        try:
            from . import baselines_triton
        except Exception as e:  # noqa: BLE001 -- Triton is an optional comparison only
            raise BaselineUnavailable(f"Triton is not installed or does not import ({e})") from e
        super().__init__(n_experts, device, threads, vpt)
        self.tl = baselines_triton
        self.config = f"{threads} thr x {vpt} vec (Triton {baselines_triton.VERSION})"
        self.funcs: dict = {}

    def _build(self, cfg, counts, c_addr, stride, offs_addr, state, chunks, cta_vecs, block) -> Launch:
        bv = 1 << max(0, cta_vecs - 1).bit_length()              # BV: the power of two >= cta_vecs
        nw = max(1, min(32, bv // (32 * self.vpt)))
        ep = 1 << self.n_experts.bit_length()                     # EP >= n_experts + 1
        key = (bv, ep, state != 0, nw)
        if key not in self.funcs:
            cubin, name, smem, nw, names, scratch = self.tl.compile_scatter(self.dev.cc[0] * 10 + self.dev.cc[1],
                                                                            *key)
            if scratch:
                raise BaselineUnavailable("the Triton baseline needs scratch memory; this launcher passes none")
            mod = driver.load_image(cubin)
            func = driver.get_function(mod, name)
            if smem > 48 * 1024:
                driver.set_max_dynamic_smem(func, smem)
            self.funcs[key] = (mod, func, name, smem, nw, names)
        _, func, name, smem, nw, names = self.funcs[key]
        v = dict(c=c_addr, off=offs_addr, table=cfg.atomic_counter, src_info=cfg.src_info_ptr, state=state,
                 diag=self.diag.ptr, c_stride_w=stride // 4, n_ranks=cfg.n_ranks, p2p=cfg.p2p_world_size,
                 top_k=cfg.top_k, msg_w=cfg.msg_bytes // 4, max_tokens=cfg.max_tokens_per_rank,
                 my_rank=cfg.my_rank, n_experts=self.n_experts, chunks=chunks, cta_vecs=cta_vecs)
        for i in range(8):
            v[f"r{i}"], v[f"k{i}"] = cfg.recv_buf_ptrs[i], counts[i]
        kinds = {n: ctypes.c_uint64 for n in self.tl.TL_PTRS} | {n: ctypes.c_int32 for n in self.tl.TL_I32}
        objs = [kinds.get(n, ctypes.c_int64)(v[n]) for n in names]
        objs += [ctypes.c_uint64(0), ctypes.c_uint64(0)]         # Triton's global and profile scratch
        return Launch(func, name, self.grid, 32 * nw, smem, objs)


# ---------------------------------------------------------------- in the bench

#: The variants tried at bench time (each baseline reports its fastest; the first is the default):
#: (threads, vpt), for the copy (threads, vpt[, hint]).
TRITON_VARIANTS = ((256, 4), (256, 1), (256, 2), (128, 4), (512, 2), (128, 8))
CUDA_VARIANTS = ((256, 2), (256, 1), (256, 4), (128, 4), (512, 2))
COPY_VARIANTS = ((256, 1), (256, 2), (256, 4), (128, 2), (512, 1), (256, 1, 1))
ROWS_VARIANTS = ((256, 1), (256, 2), (256, 4), (128, 8), (128, 8, 2), (256, 4, 4), (1024, 1, 8))  # (.., rows/CTA)
REDUCE_VARIANTS = ((128, 1), (256, 1), (64, 1), (128, 2), (256, 2))


def time_baselines(timer, sends: list, copy: tuple, *, n_experts: int, dev, iters: int, warmup: int,
               variants: bool = True, ceiling: tuple | None = None, best: dict | None = None) -> tuple[dict, dict]:
    """Time the baselines next to a bench section's own rows, on the section's buffers.

    sends: per rotated input set, a dict of ScatterSend.prepare's arguments (cfg, c,
    expert_offsets, expert_offsets_host, count_ptrs, rows_in_c); copy: (dsts, srcs, nbytes),
    one dst/src per set, as the section's cuMemcpyDtoD row uses. Each baseline runs its
    variants (TRITON_VARIANTS, CUDA_VARIANTS, COPY_VARIANTS; only the first with
    ``variants=False``) and reports its fastest. ceiling: (row_dsts, cs, n_rows, msg_bytes,
    identity_dsts), one row_dst table per set (and one writing row r to row r of the copy's
    destination), adds the RowsCopy rows: the scatter ceiling, its identity-destination
    control, and its three signals. best: a dict to receive, per row, (fn(i) launching the
    fastest variant on the timer's stream, its baseline) for a timing in turns; the caller
    then closes those (``close_baselines``).

    Returns (rows, skipped): rows {label: the Timer's result + "config" (the fastest variant,
    in words), "variant" (its tuple) and "variants" (every variant's median)}, the labels
    being ``TritonScatter.label``, ``CudaScatter.label``, "SM copy ceiling" and the ceilings';
    skipped {label: reason}."""
    rows, skipped = {}, {}
    dsts, srcs, nbytes = copy

    def scatter(kern, i):
        a = sends[i]
        return kern.prepare(a["cfg"], a["c"], a["expert_offsets"], expert_offsets_host=a["expert_offsets_host"],
                            count_ptrs=a["count_ptrs"], rows_in_c=a.get("rows_in_c"))

    contestants = (
        (TritonScatter.label, TRITON_VARIANTS, lambda t, v: TritonScatter(n_experts, device=dev, threads=t, vpt=v),
         scatter, len(sends)),
        (CudaScatter.label, CUDA_VARIANTS, lambda t, v: CudaScatter(n_experts, device=dev, threads=t, vpt=v),
         scatter, len(sends)),
        ("SM copy ceiling", COPY_VARIANTS, lambda t, v, h=0: SMCopy(device=dev, threads=t, vpt=v, hint=h),
         lambda kern, i: kern.prepare(dsts[i], srcs[i], nbytes), len(dsts)))
    if ceiling is not None:
        row_dsts, cs, n_rows, msg, ident = ceiling
        for label, sig, tables in (("scatter ceiling (destinations precomputed)", False, row_dsts),
                                   ("scatter ceiling, identity destinations (control)", False, ident),
                                   ("signalled scatter ceiling", True, row_dsts),
                                   ("scatter ceiling, then a publish kernel", "kernel", row_dsts),
                                   ("scatter ceiling, release reductions (another protocol)", "red", row_dsts)):
            def rows_copy(t, v, n=1, sig=sig):
                return RowsCopy(device=dev, threads=t, vpt=v, rows_per_cta=n, signal=sig)
            contestants += ((label, ROWS_VARIANTS, rows_copy,
                             lambda kern, i, tables=tables: kern.prepare(tables[i], cs[i], n_rows, msg), len(tables)),)
    for label, vs, make, prepare, n_sets in contestants:
        per = {}
        for v in vs[: None if variants else 1]:
            try:
                kern = make(*v)
            except BaselineUnavailable as e:
                skipped[label] = str(e)
                break
            launches = [prepare(kern, i) for i in range(n_sets)]

            def fn(i, kern=kern, launches=launches, n_sets=n_sets):
                kern.launch(timer.s, launches[i % n_sets])
            per[kern.config] = (timer.run(fn, iters, warmup), v, fn, kern)
        if per:
            fastest = min(per, key=lambda k: per[k][0]["median_us"])
            rows[label] = dict(per[fastest][0], config=fastest, variant=per[fastest][1],
                               variants={k: round(x[0]["median_us"], 2) for k, x in per.items()})
            if best is not None:
                best[label] = per[fastest][2:]
            close_baselines(x[3] for k, x in per.items() if best is None or k != fastest)
    return rows, skipped


def close_baselines(baselines) -> None:
    """Close every baseline of the iterable that has a ``close``."""
    for b in baselines:
        if hasattr(b, "close"):
            b.close()
