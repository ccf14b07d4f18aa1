"""The optional NVSHMEM transport, host side: one PE per rank, set up through p3send's own
exchanges; receive buffers and counts on the symmetric heap; ``recv_buf_ptrs`` for the peers of
this NVLink domain from ``nvshmem_ptr``; every sending module linked with the shim and
``libnvshmem_device.a`` and initialised with ``nvshmemx_cumodule_init``.

Needs ``pip install 'p3send[nvshmem]'``: the pinned ``nvidia-nvshmem-cu13`` wheel (the host and
device libraries) and nvshmem4py's low-level bindings (``nvshmem.bindings``: the host API, one
Python call per C call). nvshmem4py's higher layer (``nvshmem.core``) is not used: it wants
cuda.core objects and its own bootstrap; p3send passes the unique id over its exchanges and
loads its modules itself. The host library is loaded from the pinned wheel's own path (so
another NVSHMEM on the library path cannot be picked up) before nvshmem.bindings looks for it
by name, and its version is checked against the one the shim was built for.

Which ranks are "in the domain" follows MAX: rank ``dst`` is reachable by stores from ``me`` iff
``dst // p2p_world_size == me // p2p_world_size``, and its buffer is ``recv_buf_ptrs[dst %
p2p_world_size]``. Ranks outside need the kernels' put path (docs/SCALING.md says what is built).
"""
from __future__ import annotations

import ctypes
import importlib

import numpy as np

from ..abi.config import P3_MAX_RANKS
from ..abi.errors import ConfigError, P3SendError
from ..cuda import driver, loader, nvshmem_link
from ..cuda.nvshmem_link import NVSHMEM_VERSION, NvshmemUnavailable, NvshmemVersionError

#: nvshmem4py, whose ``nvshmem.bindings`` this module calls.
NVSHMEM4PY = "nvshmem4py-cu13"
NVSHMEM4PY_VERSION = "0.4.1"
#: NVSHMEM's signal operations (nvshmem_types.h), as the shim's ``sig_op`` takes them.
SIGNAL_SET, SIGNAL_ADD = 9, 10
#: The versioned structs of nvshmem_uniqueid.h / nvshmem_types.h. NVSHMEM 3.4.5 reads v1; nvshmem4py
#: 0.4.1 is compiled against 3.8's v2 of the init attributes (the same 144 bytes and prefix, a device
#: id in v1's padding), so the version words are written here as v1's, the ones the pinned library reads.
_UNIQUEID_BYTES, _INIT_ATTR_BYTES, _INIT_ARGS_BYTES, _UNIQUEID_ARGS_BYTES = 128, 144, 128, 24
#: Offsets in nvshmemx_init_attr_v1 of attr.version, attr.args.version, attr.args.uid_args.version.
_ATTR_VERSION_AT = ((0, _INIT_ATTR_BYTES), (16, _INIT_ARGS_BYTES), (24, _UNIQUEID_ARGS_BYTES))


class NvshmemError(P3SendError, RuntimeError):
    """An NVSHMEM host call failed. ``call``: the C function; ``status``: what it returned
    (None when it returns nothing but a check failed)."""

    def __init__(self, call: str, message: str, status=None):
        self._init_args = (call, message, status)
        self.call, self.status = call, status
        super().__init__(f"{call}: {message}" + ("" if status is None else f" (status {status})"))


def _version_word(nbytes: int) -> int:
    # NVSHMEMX_*_INITIALIZER: (1 << 16) + sizeof(struct), the struct's version-1 tag
    return (1 << 16) + nbytes


_bindings_module = None


def bindings():
    """``nvshmem.bindings`` with the pinned wheel's host library loaded, its version checked.

    Raises:
        NvshmemUnavailable: the wheel or nvshmem4py is not installed; NvshmemVersionError: the
            wheel, or the host library loaded in this process, is not NVSHMEM_VERSION.
    """
    global _bindings_module
    if _bindings_module is not None:
        return _bindings_module
    w = nvshmem_link.wheel()
    try:
        # RTLD_GLOBAL: nvshmem.bindings resolves every symbol through the global scope first
        ctypes.CDLL(str(w.host_lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NvshmemUnavailable(f"cannot load {w.host_lib} ({e}): {nvshmem_link.INSTALL}") from e
    try:
        b = importlib.import_module("nvshmem.bindings")
    except ImportError as e:
        raise NvshmemUnavailable(f"the NVSHMEM transport needs nvshmem4py's bindings ({e}): pip install "
                                 f"'p3send[nvshmem]' (it pins {NVSHMEM4PY}=={NVSHMEM4PY_VERSION})") from e
    v = np.zeros(3, np.int32)
    b.vendor_get_version_info(v.ctypes.data, v.ctypes.data + 4, v.ctypes.data + 8)
    found = ".".join(str(int(x)) for x in v)
    if found != NVSHMEM_VERSION:
        raise NvshmemVersionError(f"the NVSHMEM host library loaded in this process is {found}, expected "
                                  f"{NVSHMEM_VERSION} (another libnvshmem_host.so.3 was loaded before p3send's)",
                                  found)
    _bindings_module = b
    return b


def same_domain(dst: int, me: int, p2p_world_size: int) -> bool:
    """Whether rank ``dst`` is in rank ``me``'s NVLink domain (MAX's rule: the same node)."""
    return dst // p2p_world_size == me // p2p_world_size


class SymmetricBuffer:
    """``nbytes`` on the NVSHMEM symmetric heap (``nvshmem_malloc``: collective, every PE asks
    the same size in the same order). ``ptr``: the address, the same on every PE; peers reach
    it with puts to (ptr, pe), or with stores to ``world.ptr(ptr, pe)`` where that is not 0."""

    def __init__(self, world: NvshmemWorld, nbytes: int, *, fill: int | None = None):
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ConfigError(f"nbytes: expected an integer > 0, got {nbytes!r}", "argument")
        self.world, self.nbytes = world, int(nbytes)
        world.device.activate()
        self.ptr = int(world.b.malloc(self.nbytes))
        if not self.ptr:
            raise NvshmemError("nvshmem_malloc", f"no {self.nbytes} bytes on the symmetric heap (raise "
                               "NVSHMEM_SYMMETRIC_SIZE, or allocate less)")
        world.buffers.append(self)
        if fill is not None:
            self.fill(fill)

    def _range(self, nbytes: int, offset: int) -> None:
        if nbytes < 0 or offset < 0 or offset + nbytes > self.nbytes:
            raise ConfigError(f"offset, nbytes: expected a range inside the {self.nbytes}-byte symmetric buffer, "
                              f"got {nbytes} bytes at offset {offset}", "argument")
        self.world.device.activate()

    def fill(self, byte: int, offset: int = 0, nbytes: int | None = None) -> None:
        """Set bytes to ``byte`` (synchronous)."""
        n = self.nbytes - offset if nbytes is None else nbytes
        self._range(n, offset)
        driver.call("cuMemsetD8", self.ptr + offset, byte & 0xFF, n)
        driver.call("cuCtxSynchronize")

    def upload(self, arr, offset: int = 0) -> None:
        """Copy the bytes of ``arr`` (made contiguous) in at ``offset`` (synchronous)."""
        arr = np.ascontiguousarray(arr)
        self._range(arr.nbytes, offset)
        if arr.nbytes:
            driver.call("cuMemcpyHtoD", self.ptr + offset, arr.ctypes.data, arr.nbytes)
            driver.call("cuCtxSynchronize")

    def download(self, dtype=np.uint8, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """The bytes from ``offset`` (default: to the end) as a flat array of ``dtype``."""
        dtype = np.dtype(dtype)
        n = self.nbytes - offset if nbytes is None else nbytes
        self._range(n, offset)
        if n % dtype.itemsize:     # never a silent truncation
            raise ConfigError(f"nbytes: expected a multiple of {dtype.itemsize} ({dtype}), got {n}", "argument")
        out = np.empty(n // dtype.itemsize, dtype)
        if n:
            driver.call("cuMemcpyDtoH", out.ctypes.data, self.ptr + offset, n)
        return out

    def free(self) -> None:
        """Free it (collective, like the allocation); idempotent."""
        if self.ptr:
            self.world.device.activate()
            self.world.b.free(self.ptr)
            self.ptr = 0
            if self in self.world.buffers:
                self.world.buffers.remove(self)

    def __int__(self):
        return self.ptr


class NvshmemWorld:
    """NVSHMEM initialised in this process as PE ``exchange.rank`` of ``exchange.n_ranks`` (one PE
    per rank), bound to ``device``. Rank 0 makes the unique id; the exchange's allgather carries
    it to every rank (``ProcessExchange``, ``TorchExchange`` or ``MPIExchange``); every rank then
    joins with ``nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)``.

    Use as a context manager, or call ``finalize`` (collective) when done: it frees the symmetric
    buffers and finalizes each initialised module, then NVSHMEM.

    Args:
        exchange: an exchange with ``rank``, ``n_ranks`` and ``allgather``.
        device: the GPU of this rank (default ``driver.device()``).
        timeout_s: bound on the unique id's allgather (default: the exchange's).

    Raises:
        NvshmemUnavailable / NvshmemVersionError: see ``bindings``; NvshmemError: NVSHMEM refused
        to initialise, or reports another PE number or PE count than the exchange.
    """

    def __init__(self, exchange, *, device: driver.Device | None = None, timeout_s: float | None = None):
        self.b = bindings()
        self.rank, self.n_ranks = int(exchange.rank), int(exchange.n_ranks)
        self.device = device or driver.device()
        self.device.activate()      # NVSHMEM binds the PE to the context current at init
        self.buffers: list[SymmetricBuffer] = []
        self.modules: list = []
        self.initialized = False
        uid = self.b.uniqueid()
        mine = None
        if self.rank == 0:
            ctypes.memset(uid.ptr, 0, _UNIQUEID_BYTES)
            ctypes.c_int32.from_address(uid.ptr).value = _version_word(_UNIQUEID_BYTES)
            self._check("nvshmemx_get_uniqueid", lambda: self.b.get_uniqueid(uid.ptr))
            mine = ctypes.string_at(uid.ptr, _UNIQUEID_BYTES)
        ids = exchange.allgather(mine) if timeout_s is None else exchange.allgather(mine, timeout_s)
        if not isinstance(ids[0], bytes) or len(ids[0]) != _UNIQUEID_BYTES:
            raise NvshmemError("nvshmemx_get_uniqueid", f"rank 0 sent no {_UNIQUEID_BYTES}-byte unique id "
                               f"(got {type(ids[0]).__name__})")
        ctypes.memmove(uid.ptr, ids[0], _UNIQUEID_BYTES)
        self._uid = uid            # NVSHMEM keeps a pointer to it until init returns
        attr = self.b.InitAttr()
        ctypes.memset(attr.ptr, 0, _INIT_ATTR_BYTES)
        for offset, size in _ATTR_VERSION_AT:
            ctypes.c_int32.from_address(attr.ptr + offset).value = _version_word(size)
        self._check("nvshmemx_set_attr_uniqueid_args",
                    lambda: self.b.set_attr_uniqueid_args(self.rank, self.n_ranks, uid.ptr, attr.ptr))
        self._check("nvshmemx_hostlib_init_attr",
                    lambda: self.b.hostlib_init_attr(int(self.b.Flags.INIT_WITH_UNIQUEID), attr.ptr))
        self.initialized = True
        pe, npes = int(self.b.my_pe()), int(self.b.n_pes())
        if (pe, npes) != (self.rank, self.n_ranks):
            self.finalize()
            raise NvshmemError("nvshmem_my_pe", f"NVSHMEM made this rank PE {pe} of {npes}, the exchange says "
                               f"rank {self.rank} of {self.n_ranks}")

    def _check(self, call: str, fn):
        try:
            return fn()
        except self.b.NVSHMEMError as e:
            raise NvshmemError(call, "NVSHMEM refused (set NVSHMEM_DEBUG=INFO for its log)", e.status) from e
        except RuntimeError as e:   # nvshmem.bindings: a function missing from the loaded library
            raise NvshmemError(call, str(e)) from e

    # ---------------------------------------------------------------- memory
    def alloc(self, nbytes: int, *, fill: int | None = None) -> SymmetricBuffer:
        """A symmetric buffer (collective: every rank allocates the same sizes in the same order)."""
        return SymmetricBuffer(self, nbytes, fill=fill)

    def ptr(self, addr: int, pe: int) -> int:
        """``nvshmem_ptr``: the address in this process of symmetric ``addr`` at PE ``pe``, for
        loads and stores, or 0 when ``pe`` is reachable only by puts."""
        if isinstance(pe, bool) or not isinstance(pe, (int, np.integer)) or not (0 <= pe < self.n_ranks):
            raise ConfigError(f"pe: expected an integer 0..{self.n_ranks - 1}, got {pe!r}", "argument")
        return int(self.b.ptr(int(addr), int(pe)))

    def recv_buf_ptrs(self, buf: SymmetricBuffer | int, p2p_world_size: int) -> list[int]:
        """``recv_buf_ptrs`` for this rank's config: entry ``dst % p2p_world_size`` is
        ``nvshmem_ptr(buf, dst)`` for every rank ``dst`` in this rank's NVLink domain, the rest 0.

        Raises:
            ConfigError: p2p_world_size is not 1..8 or does not divide the world; NvshmemError: a
                rank of the domain is not reachable by stores (nvshmem_ptr gave 0).
        """
        if isinstance(p2p_world_size, bool) or not isinstance(p2p_world_size, (int, np.integer)) \
                or not (1 <= p2p_world_size <= P3_MAX_RANKS) or self.n_ranks % p2p_world_size:
            raise ConfigError(f"p2p_world_size: expected 1..{P3_MAX_RANKS} dividing n_ranks = {self.n_ranks}, "
                              f"got {p2p_world_size}", "argument")
        out = [0] * P3_MAX_RANKS
        base = self.rank // p2p_world_size * p2p_world_size
        for dst in range(base, base + p2p_world_size):
            p = self.ptr(int(buf), dst)
            if not p:
                raise NvshmemError("nvshmem_ptr", f"rank {dst} is in rank {self.rank}'s NVLink domain "
                                   f"(p2p_world_size {p2p_world_size}) but not reachable by stores; is its GPU "
                                   "peer-accessible from this one?")
            out[dst % p2p_world_size] = p
        return out

    # ---------------------------------------------------------------- modules
    def load(self, sources, *, name: str = "<nvshmem module>") -> loader.Module:
        """Link a sending module with the shim and libnvshmem_device.a for this GPU, load it and
        initialise its NVSHMEM device state (``nvshmemx_cumodule_init``) before any launch.

        Args:
            sources: (name, PTX text) pairs, or names of shipped modules (``"p3_scatter_send"``:
                ``nvshmem_link.shipped_module``); the first holds the entries (their headers are
                checked against the driver's parameter layout as for every p3send module).
            name: the module's name in messages.
        """
        sources = [nvshmem_link.shipped_module(s) if isinstance(s, str) else (str(s[0]), s[1]) for s in sources]
        arch = f"sm_{self.device.cc[0]}{self.device.cc[1]}"
        image, _ = nvshmem_link.link_cubin(sources, arch)
        mod = loader.Module(sources[0][1], name, self.device, image=image)
        self.init_module(mod)
        return mod

    def init_module(self, mod: loader.Module) -> None:
        """``nvshmemx_cumodule_init`` on a loaded module that was linked with libnvshmem_device.a."""
        self.device.activate()
        status = self._check("nvshmemx_cumodule_init", lambda: self.b.cumodule_init(int(mod.handle)))
        if status:
            raise NvshmemError("nvshmemx_cumodule_init", f"{mod.name}: NVSHMEM refused the module (was it linked "
                               "with libnvshmem_device.a?)", status)
        self.modules.append(mod)

    # ---------------------------------------------------------------- sync and teardown
    def barrier(self) -> None:
        """``nvshmem_barrier_all``: every PE's puts complete and every PE arrived."""
        self.device.activate()
        self._check("nvshmem_barrier_all", self.b.barrier_all)

    def finalize(self) -> None:
        """Free the symmetric buffers, finalize the modules, then NVSHMEM (collective; idempotent)."""
        if not self.initialized:
            return
        self.device.activate()
        driver.call("cuCtxSynchronize")
        for buf in list(self.buffers):
            buf.free()
        for mod in self.modules:
            self._check("nvshmemx_cumodule_finalize", lambda m=mod: self.b.cumodule_finalize(int(m.handle)))
        self.modules.clear()
        self.b.hostlib_finalize()
        self.initialized = False

    def __enter__(self) -> NvshmemWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()


# ---------------------------------------------------------------- the shipped senders' put path

#: The transport's block: 40 bytes after the sender state's 40*n_experts (``P3NvshmemBlock`` in
#: ptx/p3send.h): u64 recv_sym, u64 counts_sym, u64 staging, u64 staging_rows, u64 tile_src_mask
#: (bit r: PE r is reachable by loads and stores, so a bf16 put to it may read the shared tile
#: itself; 0: every row staged, what a NIC needs). p3_send_rows reads it
#: only under FLAG_NVSHMEM; it lives in the state so that neither P3SendCtx nor an entry's
#: parameters change (the modules loaded without the transport are exactly today's).
BLOCK_BYTES = 40


class NvshmemTransport:
    """The put path of the shipped senders for one rank of ``world``: a launcher given it
    (``ScatterSend(..., transport=t)``, ``EpilogueSend(..., transport=t)``) loads its module
    linked with the shim (``world.load``: the text with its NVSHMEM regions), sets
    ``FLAG_NVSHMEM`` (with ``all_puts``, ``FLAG_NVSHMEM_ALL`` too: every rank by puts, this one
    included) and keeps this block after its sender state.

    Rows for a rank outside this rank's NVLink domain (MAX's rule, ``same_domain``) are stored
    (or quantised) to their staging row (``staging + row*msg_bytes``, a symmetric buffer of
    ``staging_rows`` rows allocated here), then put to the same slot of that rank's ``recv``;
    their count is an NVSHMEM signal (SET) on ``counts[e*n_ranks + my_rank]`` at that rank's PE,
    after the puts are complete. Rows for ranks in the domain keep the direct stores through
    ``cfg.recv_buf_ptrs`` / ``count_ptrs`` (``world.recv_buf_ptrs``). PE == rank.

    Args:
        world: the NvshmemWorld (PE ``world.rank`` of ``world.n_ranks``).
        recv: the symmetric receive buffer's slot 0 (a SymmetricBuffer, or its address plus an
            offset: the same on every PE), holding ``max_tokens*top_k`` slots of ``msg_bytes``.
        counts: the symmetric receive counts' word 0 (u64 [n_experts*n_ranks]), likewise.
        msg_bytes: the wire's row bytes (the staging's row).
        staging_rows: rows of the staging, > every absolute row a send may hold
            (``expert_offsets[-1]``); collective (every PE allocates the same size).
        all_puts: FLAG_NVSHMEM_ALL.
        stage_all: stage every put row (the path a NIC needs) even to a PE that loads and stores
            reach, whose bf16 puts otherwise read the shared tile itself (``tile_src_mask``).
        inline: inline p3_send_rows in the linked text (``nvshmem_link.shipped_module``; default:
            where ``nvshmem_link.INLINED`` says).
        recv_bytes, counts_bytes: the bytes behind ``recv`` / ``counts``, checked against each
            cfg (the device does not bound the puts' writes at the other PEs): required with an
            address; a SymmetricBuffer gives its own, which they may narrow but not exceed.

    Raises:
        ConfigError: a bad argument; NvshmemError: the staging does not fit the heap.
    """

    def __init__(self, world: NvshmemWorld, *, recv, counts, msg_bytes: int, staging_rows: int,
                 all_puts: bool = False, stage_all: bool = False, recv_bytes: int | None = None,
                 counts_bytes: int | None = None, inline: bool | None = None):
        from .send import FLAG_NVSHMEM, FLAG_NVSHMEM_ALL
        problems = []
        for what, v in (("msg_bytes", msg_bytes), ("staging_rows", staging_rows)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                problems.append(f"{what}: expected an integer >= 1, got {v!r}")
        if problems:
            raise ConfigError(problems, "NVSHMEM transport")
        self.world, self.msg_bytes, self.staging_rows = world, int(msg_bytes), int(staging_rows)
        self.recv, self.recv_bytes = self._sym("recv", recv, recv_bytes)
        self.counts, self.counts_bytes = self._sym("counts", counts, counts_bytes)
        self.flags = FLAG_NVSHMEM | (FLAG_NVSHMEM_ALL if all_puts else 0)
        self.all_puts = bool(all_puts)
        self.staging = world.alloc(self.staging_rows * self.msg_bytes)
        self.tile_src_mask = 0 if stage_all else \
            sum(1 << pe for pe in range(min(world.n_ranks, P3_MAX_RANKS)) if world.ptr(self.recv, pe))
        self.inline = inline
        self._kernels: dict = {}

    @staticmethod
    def _sym(what, v, nbytes):
        # recv_bytes / counts_bytes bound what the put path may write at every PE (problems()
        # refuses a cfg whose slots or counts need more): a size larger than the buffer itself,
        # or not a size, would let that check pass a send that writes past the buffer.
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer))
                                   or nbytes < 1):
            raise ConfigError(f"{what}_bytes: expected None or an integer >= 1, got {nbytes!r}", "NVSHMEM transport")
        if isinstance(v, SymmetricBuffer):
            if nbytes is not None and nbytes > v.nbytes:
                raise ConfigError(f"{what}_bytes: expected at most the SymmetricBuffer's {v.nbytes} bytes, "
                                  f"got {nbytes}", "NVSHMEM transport")
            return v.ptr, v.nbytes if nbytes is None else int(nbytes)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 or v % 16:
            raise ConfigError(f"{what}: expected a SymmetricBuffer or a 16-byte aligned symmetric address, got {v!r}",
                              "NVSHMEM transport")
        if nbytes is None:      # nothing on the device bounds the puts' writes at the other PEs
            raise ConfigError(f"{what}_bytes: expected the bytes behind the address {v:#x} (required with an "
                              f"address; a SymmetricBuffer gives its own), got None", "NVSHMEM transport")
        return int(v), int(nbytes)

    def block(self) -> bytes:
        """The 40 bytes p3_send_rows reads at state_ptr + 40*n_experts."""
        return np.array([self.recv, self.counts, self.staging.ptr, self.staging_rows, self.tile_src_mask],
                        np.uint64).tobytes()

    def sender_state(self, n_experts: int) -> driver.DeviceBuffer:
        """A launcher's sender state (40*n_experts zero bytes) followed by the block."""
        buf = driver.DeviceBuffer(40 * n_experts + BLOCK_BYTES, fill=0)
        buf.upload(np.frombuffer(self.block(), np.uint8), offset=40 * n_experts)
        return buf

    def kernel(self, entry: str):
        """The shipped ``entry`` linked with the shim and libnvshmem_device.a (loaded once)."""
        if entry not in self._kernels:
            src = nvshmem_link.shipped_module(entry, inline=self.inline)
            self._kernels[entry] = self.world.load([src], name=f"{entry} (NVSHMEM)")[entry]
        return self._kernels[entry]

    def problems(self, cfg, n_experts: int, *, rows_end: int | None = None,
                 rows_cap: int | None = None) -> list[str]:
        """What keeps ``cfg`` from a send of ``n_experts`` experts through this transport (collected,
        not raised). ``rows_end``: expert_offsets[-1] when known, else ``rows_cap`` (rows of C)."""
        out = []
        if cfg.n_ranks != self.world.n_ranks or cfg.my_rank != self.world.rank:
            out.append(f"cfg: n_ranks {cfg.n_ranks}, my_rank {cfg.my_rank}: the transport's PEs are the ranks, "
                       f"expected n_ranks {self.world.n_ranks}, my_rank {self.world.rank}")
        if cfg.msg_bytes != self.msg_bytes:
            out.append(f"msg_bytes: the transport's staging rows hold {self.msg_bytes} bytes, got {cfg.msg_bytes}")
        rows = rows_end if rows_end is not None else rows_cap
        if rows is not None and rows > self.staging_rows:
            out.append(f"staging_rows: the send holds rows up to {rows}, the transport stages {self.staging_rows}")
        need = cfg.max_tokens_per_rank * cfg.top_k * cfg.msg_bytes
        if need > self.recv_bytes:          # both sizes are known (_sym)
            out.append(f"recv: {self.recv_bytes} bytes, the cfg's slots need {need}")
        need = 8 * n_experts * max(cfg.n_ranks, 0)
        if need > self.counts_bytes:
            out.append(f"counts: {self.counts_bytes} bytes, n_experts*n_ranks counts need {need}")
        return out

    def close(self) -> None:
        """Free the staging (collective)."""
        self.staging.free()
