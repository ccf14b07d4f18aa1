"""The ABI of Modular MAX's ``P3PeerSendConfig``, byte for byte.

184 bytes, alignment 8, little-endian; field names are the Mojo names. ``FIELDS`` is
the single table every other form (ctypes, numpy, C header, JSON, Mojo, PTX lint) is
checked against. No CUDA import here: this module is usable anywhere.
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, ConfigTypeError, FieldError

P3_MAX_RANKS = 8
P5_SEND_MBX_INTS = 32
P5_SEND_MBX_STRIDE = 4
#: p3send's own: u64 trace slots per CTA block at ``trace_ptr`` (``send_trace_slot`` < this).
P3_TRACE_SLOTS = 16
P3_CONFIG_SIZE = 184
P3_CONFIG_ALIGN = 8

# ---- The limits, one place each: validate(), the launchers, shape_problems() and the CLI
# all check through the functions below.
#: Rows (msg_bytes) are whole 16-byte vectors ...
P3_MSG_ALIGN = 16
#: ... of at most 1 MiB: the kernels reject larger rows (vector indices stay 32-bit within a row).
P3_MAX_MSG_BYTES = 1 << 20
#: The receive reduces a token's slots with one lane each: top_k <= 32 there.
P3_MAX_TOP_K = 32

#: Addresses below this are never real device memory: Mojo's dangling pointers are 1, 4, 8.
DANGLING_LIMIT = 0x10000


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int
    kind: str        # "ptr" (u64 device address), "i64", or "ptr[8]"
    mojo: str        # the Mojo type as declared in MAX
    c: str           # the C declaration type in ptx/p3send.h
    align: int       # required alignment of a real address (pointer fields)
    disabled: object  # Mojo's disabled() value (a tuple for recv_buf_ptrs)
    meaning: str


FIELDS: tuple[Field, ...] = (
    Field("atomic_counter", 0, 8, "ptr", "UnsafePointer[Int32, Mut]", "uint64_t", 8, 0x4,
          "range table (Region A), int32 [n_experts*n_ranks*2]; read-only to the send"),
    Field("src_info_ptr", 8, 8, "ptr", "UnsafePointer[Int32, Imm]", "uint64_t", 8, 0x4,
          "int32 (rows, 2): [2r]=src_idx, [2r+1]=src_topk per absolute row"),
    Field("row_base_ptr", 16, 8, "ptr", "UnsafePointer[UInt64, Mut]", "uint64_t", 8, 0x8,
          "row cache, u64 per absolute row: 0 unresolved, 1 no destination, else base"),
    Field("recv_buf_ptrs", 24, 64, "ptr[8]", "StaticTuple[UnsafePointer[UInt8], 8]",
          "uint64_t[8]", 16, (0x1,) * P3_MAX_RANKS,
          "receive buffer of each p2p rank as seen from this rank, (max_tokens, top_k, msg_bytes)"),
    Field("n_ranks", 88, 8, "i64", "Int", "int64_t", 0, 0, "EP ranks (1..8); 0 disables the send"),
    Field("p2p_world_size", 96, 8, "i64", "Int", "int64_t", 0, 1, "peers reachable by P2P; dst_p2p = rank % this"),
    Field("top_k", 104, 8, "i64", "Int", "int64_t", 0, 1, "experts per token"),
    Field("msg_bytes", 112, 8, "i64", "Int", "int64_t", 0, 0, "bytes per row/slot, a positive multiple of 16"),
    Field("max_tokens_per_rank", 120, 8, "i64", "Int", "int64_t", 0, 0, "token capacity of each receive buffer"),
    Field("my_rank", 128, 8, "i64", "Int", "int64_t", 0, 0, "this rank, in 0..n_ranks-1"),
    Field("send_mbx", 136, 8, "ptr", "UnsafePointer[Int32, SHARED] (P5SendMailboxPtr)", "uint64_t", 4, 0x4,
          "SMEM mailbox; 32-bit .shared address on device + 4 pad bytes; opaque, kernels ignore it"),
    Field("send_stamp_ptr", 144, 8, "ptr", "UnsafePointer[UInt64, Mut]", "uint64_t", 8, 0x8,
          "u64 [2*cta]: first/last %globaltimer of the CTA's peer stores"),
    Field("send_stamp_on", 152, 8, "i64", "Int", "int64_t", 0, 0, "non-zero enables send stamps"),
    Field("trace_ptr", 160, 8, "ptr", "UnsafePointer[UInt64, Mut]", "uint64_t", 8, 0x8,
          "u64 [cta*P3_TRACE_SLOTS + send_trace_slot]: accumulated send busy ns"),
    Field("trace_on", 168, 8, "i64", "Int", "int64_t", 0, 0, "non-zero enables the trace"),
    Field("send_trace_slot", 176, 8, "i64", "Int", "int64_t", 0, -1, "this kernel's slot in the CTA's trace block"),
)
FIELD_BY_NAME = {f.name: f for f in FIELDS}


def _ctype(f: Field):
    if f.kind == "ptr[8]":
        return ctypes.c_uint64 * P3_MAX_RANKS
    return ctypes.c_uint64 if f.kind == "ptr" else ctypes.c_int64


class P3PeerSendConfig(ctypes.LittleEndianStructure):
    """``P3PeerSendConfig`` as passed by value to every p3send kernel.

    ``bytes(cfg)`` is the exact 184-byte little-endian image. Device addresses are
    unsigned 64-bit integers. Assigning an attribute that is not a field raises.
    """

    _fields_ = [(f.name, _ctype(f)) for f in FIELDS]

    def __setattr__(self, name, value):
        f = FIELD_BY_NAME.get(name)
        if f is None:
            raise FieldError([f"P3PeerSendConfig has no field {name!r}; fields are: {', '.join(FIELD_BY_NAME)}"])
        if f.kind == "ptr[8]":
            if not isinstance(value, ctypes.Array):
                value = list(value)
            if len(value) != P3_MAX_RANKS:
                raise ConfigError([f"recv_buf_ptrs: expected {P3_MAX_RANKS} addresses, got {len(value)}"])
            value = (ctypes.c_uint64 * P3_MAX_RANKS)(*[_field_int(f"recv_buf_ptrs[{i}]", v, "ptr")
                                                       for i, v in enumerate(value)])
        else:
            value = _field_int(name, value, f.kind)
        super().__setattr__(name, value)

    @classmethod
    def disabled(cls) -> P3PeerSendConfig:
        """Mojo's ``disabled()``: dangling pointers (address = pointee alignment), 0 scalars,
        ``p2p_world_size = top_k = 1`` and ``send_trace_slot = -1``."""
        cfg = cls()
        for f in FIELDS:
            setattr(cfg, f.name, f.disabled)
        return cfg

    @classmethod
    def from_bytes(cls, data) -> P3PeerSendConfig:
        try:
            data = bytes(data)
        except TypeError:
            raise ConfigTypeError([f"image: expected {P3_CONFIG_SIZE} bytes, got {type(data).__name__}"]) from None
        if len(data) != P3_CONFIG_SIZE:
            raise ConfigError([f"image: expected {P3_CONFIG_SIZE} bytes, got {len(data)}"])
        return cls.from_buffer_copy(data)

    def to_dict(self) -> dict:
        return {f.name: (list(getattr(self, f.name)) if f.kind == "ptr[8]" else getattr(self, f.name))
                for f in FIELDS}

    def __eq__(self, other):
        return isinstance(other, P3PeerSendConfig) and bytes(self) == bytes(other)

    __hash__ = None

    def __repr__(self):
        def show(k, v):
            return [hex(x) for x in v] if isinstance(v, list) else hex(v) if FIELD_BY_NAME[k].kind == "ptr" else v
        body = ", ".join(f"{k}={show(k, v)}" for k, v in self.to_dict().items())
        return f"P3PeerSendConfig({body})"


_RANGE = {"ptr": (0, (1 << 64) - 1, "an unsigned 64-bit address"),
          "i64": (-(1 << 63), (1 << 63) - 1, "a signed 64-bit integer")}


def _field_int(name: str, value, kind: str) -> int:
    """``value`` as the integer field ``name`` stores, or a ConfigError naming the field:
    a non-integer, or an integer that does not fit (ctypes would wrap it silently)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigTypeError([f"{name}: expected an integer, got {type(value).__name__} {value!r:.40}"]) from None
    lo, hi, what = _RANGE[kind]
    if not lo <= v <= hi:
        raise ConfigError([f"{name}: expected {what} ({lo}..{hi}), got {v}"])
    return v


#: numpy structured dtype with the same offsets, for arrays of configs.
CONFIG_DTYPE = np.dtype({
    "names": [f.name for f in FIELDS],
    "formats": [("<u8", (P3_MAX_RANKS,)) if f.kind == "ptr[8]" else ("<u8" if f.kind == "ptr" else "<i8")
                for f in FIELDS],
    "offsets": [f.offset for f in FIELDS],
    "itemsize": P3_CONFIG_SIZE,
})


class P3SendCtx(ctypes.LittleEndianStructure):
    """p3send's launch state for the in-epilogue send functions (ptx/p3_send_rows.ptx),
    beside the ABI struct: 104 bytes, alignment 8, in device memory."""

    _fields_ = [("count_ptrs", ctypes.c_uint64 * P3_MAX_RANKS),   # receive counts of p2p rank p
                ("expert_offsets", ctypes.c_uint64),              # int32[n_experts+1]
                ("state_ptr", ctypes.c_uint64),                   # sender state, 40*n_experts bytes
                ("diag_ptr", ctypes.c_uint64),                    # u32[4] or 0
                ("n_experts", ctypes.c_uint32),
                ("flags", ctypes.c_uint32),                       # FLAG_ROW_CACHE | FLAG_SIGNAL | FLAG_SCOPE_GPU
                ("p3_control", ctypes.c_int32),                   # < 0: nothing sent
                ("reserved", ctypes.c_uint32)]


#: Bytes of a P3SendAcct (per-warp accounting of the send functions), initialised to
#: expert = -1 and zeros: s32 expert, u32 ready, u64 units, u32 pair[8].
P3_SEND_ACCT_SIZE = 48


# ---------------------------------------------------------------- the limits, one rule each
# Each returns the problem (naming ``name``, what was expected, what was given) or None.

def n_ranks_problem(v: int, name: str = "n_ranks") -> str | None:
    if not 1 <= v <= P3_MAX_RANKS:
        return f"{name}: expected 1..{P3_MAX_RANKS}, got {v}"
    return None


def top_k_problem(v: int, name: str = "top_k", *, receive: bool = True) -> str | None:
    """1..32 where the receive reduces the slots (one lane each); the send alone needs >= 1."""
    if v < 1 or (receive and v > P3_MAX_TOP_K):
        return f"{name}: expected " + (f"1..{P3_MAX_TOP_K}" if receive else ">= 1") + f", got {v}"
    return None


def msg_bytes_problem(v: int, name: str = "msg_bytes") -> str | None:
    if v <= 0 or v % P3_MSG_ALIGN or v > P3_MAX_MSG_BYTES:
        return f"{name}: expected a positive multiple of {P3_MSG_ALIGN} up to {P3_MAX_MSG_BYTES} (1 MiB), got {v}"
    return None


def hidden_problem(v: int, name: str = "hidden") -> str | None:
    """bf16 rows: msg_bytes = 2 * hidden, so msg_bytes_problem's rule in elements."""
    elems, most = P3_MSG_ALIGN // 2, P3_MAX_MSG_BYTES // 2
    if v <= 0 or v % elems or v > most:
        return f"{name}: expected a positive multiple of {elems} bf16 elements up to {most} (rows of at most " \
               f"1 MiB), got {v}"
    return None


def max_tokens_problem(v: int, name: str = "max_tokens_per_rank") -> str | None:
    """A receive buffer of 0 tokens has no slot: every row sent to it would be dropped."""
    if v < 1:
        return f"{name}: expected >= 1 token per receive buffer (with 0 every row would be dropped), got {v}"
    return None


def shape_problems(n_ranks: int, *, max_tokens: int, top_k: int, hidden: int, n_local_experts: int,
                   timeout_ms: float = 1.0) -> list[str]:
    """What is wrong with the shape of an EP combine (empty list: nothing): the rules of
    the config fields it becomes, plus its own. Combine, Rank and the CLI check with this."""
    problems = [p for p in (n_ranks_problem(n_ranks), hidden_problem(hidden), top_k_problem(top_k),
                            max_tokens_problem(max_tokens, "max_tokens")) if p]
    if n_local_experts < 1:
        problems.append(f"n_local_experts: expected >= 1, got {n_local_experts}")
    elif not problems and top_k > n_ranks * n_local_experts:
        problems.append(f"top_k: expected at most the {n_ranks * n_local_experts} experts "
                        f"({n_ranks} ranks x {n_local_experts}), got {top_k}")
    if timeout_ms <= 0:
        problems.append(f"timeout_ms: expected > 0, got {timeout_ms}")
    return problems


# ---------------------------------------------------------------- the one config builder

def rank_config(*, n_ranks: int, my_rank: int = 0, recv_bufs=(), top_k: int, msg_bytes: int, max_tokens: int,
                p2p_world_size: int | None = None, range_table=None, src_info=None, row_base=None,
                send_stamps=None, trace=None, trace_slot: int = 0) -> P3PeerSendConfig:
    """A rank's ``P3PeerSendConfig``: ``disabled()`` with the given fields set (nothing is
    validated here: ``validate`` and the launchers do that).

    recv_bufs[p]: p2p rank p's receive buffer as this rank sees it (at most 8; the rest
    stay dangling); p2p_world_size defaults to n_ranks. Addresses are ints or objects with
    a ``.ptr`` (a DeviceBuffer); None leaves the pointer dangling and, for ``send_stamps``
    and ``trace``, the feature off (``trace`` on uses ``trace_slot``).
    """
    def addr(name, v):
        return _field_int(name, getattr(v, "ptr", v), "ptr")

    cfg = P3PeerSendConfig.disabled()
    bufs = list(recv_bufs)
    if len(bufs) > P3_MAX_RANKS:
        raise ConfigError([f"recv_bufs: expected at most {P3_MAX_RANKS} receive buffers, got {len(bufs)}"])
    cfg.recv_buf_ptrs = [addr(f"recv_bufs[{p}]", b) for p, b in enumerate(bufs)] + [0x1] * (P3_MAX_RANKS - len(bufs))
    cfg.n_ranks, cfg.my_rank = n_ranks, my_rank
    cfg.p2p_world_size = n_ranks if p2p_world_size is None else p2p_world_size
    cfg.top_k, cfg.msg_bytes, cfg.max_tokens_per_rank = top_k, msg_bytes, max_tokens
    for name, v in (("atomic_counter", range_table), ("src_info_ptr", src_info), ("row_base_ptr", row_base)):
        if v is not None:
            setattr(cfg, name, addr(name, v))
    if send_stamps is not None:
        cfg.send_stamp_ptr, cfg.send_stamp_on = addr("send_stamps", send_stamps), 1
    if trace is not None:
        cfg.trace_ptr, cfg.trace_on, cfg.send_trace_slot = addr("trace", trace), 1, trace_slot
    return cfg


def is_dangling(addr: int) -> bool:
    """True for null and for the small addresses Mojo uses as dangling pointers."""
    return int(addr) < DANGLING_LIMIT


def validate(cfg: P3PeerSendConfig, *, p3_control: int = 0, row_cache: bool = False,
             raise_on_error: bool = True) -> list[str]:
    """Explain, field by field, what is wrong with ``cfg`` for a launch.

    The send is enabled when ``p3_control >= 0`` and ``n_ranks > 0``; only then are its
    pointers required to be real (not null, not dangling, aligned). Stamps and trace are
    checked whenever their flags are on; ``row_cache`` says the launch uses ``row_base_ptr``.
    Returns the list of problems; raises ``ConfigError`` listing all of them unless
    ``raise_on_error`` is False.
    """
    if not isinstance(cfg, P3PeerSendConfig):
        raise ConfigTypeError([f"cfg: expected a P3PeerSendConfig, got {type(cfg).__name__}"])
    p: list[str] = []
    enabled = p3_control >= 0 and cfg.n_ranks > 0

    def ptr(name, value, align, why):
        v = int(value)
        if v == 0:
            p.append(f"{name}: expected a device address ({why}), got null")
        elif is_dangling(v):
            p.append(f"{name}: expected a real device address ({why}), got dangling {v:#x}")
        elif v % align:
            p.append(f"{name}: expected a {align}-byte aligned address, got {v:#x}")

    if cfg.n_ranks != 0 and (x := n_ranks_problem(cfg.n_ranks)):
        p.append(f"{x} (0 disables the send)")
    p += [x for x in (n_ranks_problem(cfg.p2p_world_size, "p2p_world_size"),
                      top_k_problem(cfg.top_k, receive=False)) if x]
    if cfg.max_tokens_per_rank < 0:
        p.append(f"max_tokens_per_rank: expected >= 0, got {cfg.max_tokens_per_rank}")
    if cfg.send_trace_slot < -1 or cfg.send_trace_slot >= P3_TRACE_SLOTS:
        p.append(f"send_trace_slot: expected -1..{P3_TRACE_SLOTS - 1}, got {cfg.send_trace_slot}")
    if enabled:
        p += [x for x in (msg_bytes_problem(cfg.msg_bytes),
                          cfg.max_tokens_per_rank == 0 and max_tokens_problem(0)) if x]
        if not (0 <= cfg.my_rank < cfg.n_ranks):
            p.append(f"my_rank: expected 0..{cfg.n_ranks - 1} (n_ranks={cfg.n_ranks}), got {cfg.my_rank}")
        ptr("atomic_counter", cfg.atomic_counter, 8, "range table, read by the enabled send")
        ptr("src_info_ptr", cfg.src_info_ptr, 8, "src_info, read by the enabled send")
        if row_cache:
            ptr("row_base_ptr", cfg.row_base_ptr, 8, "row cache is on")
        # Clamped: out-of-range n_ranks/p2p_world_size are reported above, not an IndexError.
        for i in range(max(0, min(cfg.n_ranks, cfg.p2p_world_size, P3_MAX_RANKS))):
            ptr(f"recv_buf_ptrs[{i}]", cfg.recv_buf_ptrs[i], 16, f"p2p rank {i} receives rows")
    if cfg.send_stamp_on:
        ptr("send_stamp_ptr", cfg.send_stamp_ptr, 8, "send_stamp_on is set")
    if cfg.trace_on:
        ptr("trace_ptr", cfg.trace_ptr, 8, "trace_on is set")
        if not (0 <= cfg.send_trace_slot < P3_TRACE_SLOTS):
            p.append(f"send_trace_slot: expected 0..{P3_TRACE_SLOTS - 1} while trace_on is set, "
                     f"got {cfg.send_trace_slot}")
    if p and raise_on_error:
        raise ConfigError(p)
    return p


def layout_table() -> list[dict]:
    """The layout as plain data: name, offset, size, type (the Mojo type)."""
    return [{"name": f.name, "offset": f.offset, "size": f.size, "type": f.mojo} for f in FIELDS]


def _check_table() -> None:
    # The table itself must be a gap-free, aligned cover of 184 bytes: a typo here is a
    # wild write on some GPU, so refuse to import a broken table.
    off = 0
    for f in FIELDS:
        if f.offset != off or f.offset % 8:
            raise ImportError(f"p3send.abi: FIELDS broken at {f.name} (offset {f.offset}, expected {off})")
        off += f.size
    if off != P3_CONFIG_SIZE or ctypes.sizeof(P3PeerSendConfig) != P3_CONFIG_SIZE:
        raise ImportError("p3send.abi: P3PeerSendConfig is not 184 bytes")
    if ctypes.sizeof(P3SendCtx) != 104 or P3SendCtx.p3_control.offset != 96:
        raise ImportError("p3send.abi: P3SendCtx is not the documented 104-byte layout")


_check_table()
