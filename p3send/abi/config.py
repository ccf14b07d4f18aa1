"""The ABI of Modular MAX's ``P3PeerSendConfig``, byte for byte.

184 bytes, alignment 8, little-endian; field names are the Mojo names. ``FIELDS`` is
the single table every other form (ctypes, numpy, C header, JSON, Mojo, PTX lint) is
checked against. No CUDA import here: this module is usable anywhere.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

P3_MAX_RANKS = 8
P5_SEND_MBX_INTS = 32
P5_SEND_MBX_STRIDE = 4
#: p3send's own: u64 trace slots per CTA block at ``trace_ptr`` (``send_trace_slot`` < this).
P3_TRACE_SLOTS = 16
P3_CONFIG_SIZE = 184
P3_CONFIG_ALIGN = 8

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
        if name not in FIELD_BY_NAME:
            raise AttributeError(
                f"P3PeerSendConfig has no field {name!r}; fields are: {', '.join(FIELD_BY_NAME)}")
        if name == "recv_buf_ptrs" and not isinstance(value, ctypes.Array):
            value = list(value)
            if len(value) != P3_MAX_RANKS:
                raise ValueError(f"recv_buf_ptrs: expected {P3_MAX_RANKS} addresses, got {len(value)}")
            value = (ctypes.c_uint64 * P3_MAX_RANKS)(*[_addr(v) for v in value])
        super().__setattr__(name, value)

    @classmethod
    def disabled(cls) -> "P3PeerSendConfig":
        """Mojo's ``disabled()``: dangling pointers (address = pointee alignment), 0 scalars,
        ``p2p_world_size = top_k = 1`` and ``send_trace_slot = -1``."""
        cfg = cls()
        for f in FIELDS:
            setattr(cfg, f.name, f.disabled)
        return cfg

    @classmethod
    def from_bytes(cls, data) -> "P3PeerSendConfig":
        data = bytes(data)
        if len(data) != P3_CONFIG_SIZE:
            raise ValueError(f"P3PeerSendConfig image: expected {P3_CONFIG_SIZE} bytes, got {len(data)}")
        return cls.from_buffer_copy(data)

    def to_dict(self) -> dict:
        return {f.name: (list(getattr(self, f.name)) if f.kind == "ptr[8]" else getattr(self, f.name))
                for f in FIELDS}

    def __eq__(self, other):
        return isinstance(other, P3PeerSendConfig) and bytes(self) == bytes(other)

    __hash__ = None

    def __repr__(self):
        body = ", ".join(f"{k}={[hex(x) for x in v] if isinstance(v, list) else (hex(v) if FIELD_BY_NAME[k].kind == 'ptr' else v)}"
                         for k, v in self.to_dict().items())
        return f"P3PeerSendConfig({body})"


def _addr(v) -> int:
    """A device address from an int or a ctypes/numpy integer."""
    return int(v)


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
#: expert = -1 and zeros: s32 expert, pad, u64 units, u32 pair[8].
P3_SEND_ACCT_SIZE = 48


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
        raise TypeError(f"expected a P3PeerSendConfig, got {type(cfg).__name__}")
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

    if not (0 <= cfg.n_ranks <= P3_MAX_RANKS):
        p.append(f"n_ranks: expected 0..{P3_MAX_RANKS} (0 disables the send), got {cfg.n_ranks}")
    if not (1 <= cfg.p2p_world_size <= P3_MAX_RANKS):
        p.append(f"p2p_world_size: expected 1..{P3_MAX_RANKS}, got {cfg.p2p_world_size}")
    if cfg.top_k < 1:
        p.append(f"top_k: expected >= 1, got {cfg.top_k}")
    if cfg.max_tokens_per_rank < 0:
        p.append(f"max_tokens_per_rank: expected >= 0, got {cfg.max_tokens_per_rank}")
    if cfg.send_trace_slot < -1 or cfg.send_trace_slot >= P3_TRACE_SLOTS:
        p.append(f"send_trace_slot: expected -1..{P3_TRACE_SLOTS - 1}, got {cfg.send_trace_slot}")
    if enabled:
        if cfg.msg_bytes <= 0 or cfg.msg_bytes % 16:
            p.append(f"msg_bytes: expected a positive multiple of 16, got {cfg.msg_bytes}")
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
