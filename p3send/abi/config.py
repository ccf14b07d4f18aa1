"""The ABI of Modular MAX's ``P3PeerSendConfig``, byte for byte.

184 bytes, alignment 8, little-endian; field names are the Mojo names. ``FIELDS`` is
the single table every other form (ctypes, numpy, C header, JSON, Mojo, PTX lint) is
checked against. No CUDA import here: this module is usable anywhere.

Every way of writing a field checks what is written: attribute assignment, the
constructor's arguments, and item or slice assignment of ``cfg.recv_buf_ptrs``. A value
of the wrong type or out of the field's range raises a ``ConfigError`` naming the field
(ctypes itself would truncate it to 64 bits without a word).
"""
from __future__ import annotations

import ctypes
import itertools
import math
import numbers
import operator
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, ConfigIndexError, ConfigTypeError, FieldError
from .wire import WIRE_FP8, wire_format, wire_problems

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
    """One field of ``P3PeerSendConfig``: a row of ``FIELDS``.

    Attributes:
        name: the Mojo field name, byte for byte.
        offset: byte offset in the 184-byte image.
        size: bytes (8, or 64 for ``recv_buf_ptrs``).
        kind: ``"ptr"`` (u64 device address), ``"i64"`` (Mojo ``Int``) or ``"ptr[8]"``
            (eight u64 addresses).
        mojo: the Mojo type as declared in MAX.
        c: the C declaration type in ptx/p3send.h.
        align: required alignment of a real address (pointer fields; 0 for integers).
        disabled: Mojo's ``disabled()`` value (a tuple of 8 for ``recv_buf_ptrs``).
        meaning: one line for the tables.
    """

    name: str
    offset: int
    size: int
    kind: str
    mojo: str
    c: str
    align: int
    disabled: object
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


# ---------------------------------------------------------------- checking one value

#: kind -> (lowest, highest, description) of the integers a field of that kind stores.
_RANGE = {"ptr": (0, (1 << 64) - 1, "an unsigned 64-bit address"),
          "i64": (-(1 << 63), (1 << 63) - 1, "a signed 64-bit integer"),
          "u32": (0, (1 << 32) - 1, "an unsigned 32-bit integer"),
          "i32": (-(1 << 31), (1 << 31) - 1, "a signed 32-bit integer")}


def describe_value(value) -> str:
    """``value`` as an error message shows what was given: its type and a short repr.

    Args:
        value: anything.

    Returns:
        ``"<type name> <repr>"``, the repr on one line and cut to 40 characters.
    """
    text = " ".join(repr(value).split())
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _bounds(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"{lo}..{hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def checked_int(name: str, value, kind: str = "i64", *, lo: int | None = None, hi: int | None = None,
                why: str = "", expected: str = "an integer", what: str = "argument") -> int:
    """``value`` as a Python int, refused unless it is an integer that fits.

    The one integer check of p3send.abi: the config's fields, ``P3SendCtx``, the layout
    helpers and ``rank_config`` all go through it.

    Args:
        name: the argument or field as the caller wrote it (``"rk"``, ``"recv_buf_ptrs[3]"``).
        value: the value given; anything with ``__index__`` (int, numpy integers) is an
            integer, anything else (float, str, None, bool) is refused.
        kind: the storage the value must fit: ``"ptr"`` (u64), ``"i64"``, ``"u32"`` or ``"i32"``.
        lo, hi: narrower inclusive bounds, when the argument has them (None: the kind's).
        why: said after the bounds, e.g. ``" (rk < n_ranks=8)"``.
        expected: what a wrong type is told was expected.
        what: what the error says is invalid (``ConfigError.what``).

    Returns:
        int: the value.

    Raises:
        ConfigTypeError: ``value`` is not an integer (or is a bool).
        ConfigError: it does not fit ``kind`` or lies outside ``lo..hi``.
    """
    # bool is an int subclass, so operator.index takes True as 1. Refused everywhere: True
    # as an address is 0x1, the dangling pointer Mojo's disabled() uses (a real-looking
    # write of a mistaken argument, e.g. ``buf is not None`` passed for ``buf``), and as a
    # count or index it is the same mistake; the two flags are Mojo Ints and take 1 / 0.
    if isinstance(value, (bool, np.bool_)):
        raise ConfigTypeError([f"{name}: expected {expected}, got {describe_value(value)} "
                               "(a bool is not taken as a number)"], what)
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigTypeError([f"{name}: expected {expected}, got {describe_value(value)}"], what) from None
    low, high, desc = _RANGE[kind]
    if not low <= v <= high:
        raise ConfigError([f"{name}: expected {desc} ({low}..{high}), got {v}"], what)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError([f"{name}: expected {_bounds(lo, hi)}{why}, got {v}"], what)
    return v


def checked_flag(name: str, value, *, what: str = "argument") -> bool:
    """``value`` as a bool, refused unless it is one (``True``/``False`` or a numpy bool).

    Args:
        name: the argument as the caller wrote it.
        value: the value given.
        what: what the error says is invalid.

    Returns:
        bool: the value.

    Raises:
        ConfigTypeError: ``value`` is not a bool (an int 1, a str "yes", None).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigTypeError([f"{name}: expected a bool (True or False), got {describe_value(value)}"], what)
    return bool(value)


def checked_items(name: str, value, *, count: int | None = None, at_most: int | None = None,
                  of: str = "addresses", what: str = "argument") -> list:
    """The items of the sequence ``value``, refused unless it is an ordered sequence of the
    right length (the items themselves are not checked here).

    Args:
        name: the argument as the caller wrote it.
        value: a list, tuple, range, ctypes array, 1-D numpy array or an iterator.
        count: the exact number of items wanted, or None.
        at_most: the most items accepted, or None (one of ``count`` / ``at_most`` is given).
        of: what the items are, for the message (``"addresses"``, ``"receive buffers"``).
        what: what the error says is invalid.

    Returns:
        list: the items, in order.

    Raises:
        ConfigTypeError: ``value`` is a mapping, a set, a str, bytes-like, or not iterable.
        ConfigError: a numpy array that is not 1-D, or the wrong number of items.
    """
    # A mapping iterates its keys, a set in no fixed order, a str or bytes by character or
    # by byte: none of them is a list of addresses, and each would be stored without a word.
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)):
        raise ConfigTypeError([f"{name}: expected a sequence of {of} (a list, tuple or 1-D integer array), "
                               f"got {describe_value(value)}"], what)
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise ConfigError([f"{name}: expected a 1-D sequence of {of}, got an array of shape {value.shape}"], what)
    try:
        it = iter(value)
    except TypeError:
        raise ConfigTypeError([f"{name}: expected a sequence of {of} (a list, tuple or 1-D integer array), "
                               f"got {describe_value(value)}"], what) from None
    limit = count if count is not None else at_most
    items = list(itertools.islice(it, limit + 1))     # an endless iterator stops here
    if len(items) > limit:
        got = str(len(value)) if hasattr(value, "__len__") else f"more than {limit}"
    else:
        got = str(len(items))
    if count is not None and len(items) != count:
        raise ConfigError([f"{name}: expected {count} {of}, got {got}"], what)
    if at_most is not None and len(items) > at_most:
        raise ConfigError([f"{name}: expected at most {at_most} {of}, got {got}"], what)
    return items


# ---------------------------------------------------------------- the structs

class PeerAddresses(ctypes.c_uint64 * P3_MAX_RANKS):
    """Eight u64 device addresses: the type of ``P3PeerSendConfig.recv_buf_ptrs``.

    Byte for byte a ``ctypes.c_uint64 * 8`` (reading an item gives an int, a slice a list
    of ints); writing an item or a slice checks each value as the pointer fields are
    checked: an integer in 0..2**64-1, never a bool, a float or a str. Negative indices
    count from the end; an index outside -8..7 raises ``ConfigIndexError``.
    """

    #: The field and the struct the messages name.
    field_name = "recv_buf_ptrs"
    owner = "P3PeerSendConfig"

    @classmethod
    def checked(cls, value, indices=range(P3_MAX_RANKS), name: str | None = None) -> list[int]:
        """The addresses of ``value`` for the entries ``indices``, each checked.

        Args:
            value: a sequence of ``len(indices)`` integers (see ``checked_items``).
            indices: the entries written, to name a bad item by its index.
            name: the name of the whole (default: the field name).

        Returns:
            list[int]: the addresses.

        Raises:
            ConfigTypeError, ConfigError: as ``checked_items`` and ``checked_int``, naming
            ``recv_buf_ptrs`` or ``recv_buf_ptrs[i]``.
        """
        items = checked_items(name or cls.field_name, value, count=len(indices), what=cls.owner)
        return [checked_int(f"{cls.field_name}[{i}]", v, "ptr", what=cls.owner) for i, v in zip(indices, items)]

    def __setitem__(self, key, value):
        name, n = self.field_name, len(self)
        if isinstance(key, slice):
            shown = f"{name}[{'' if key.start is None else key.start}:{'' if key.stop is None else key.stop}" + \
                    ("]" if key.step is None else f":{key.step}]")
            try:
                indices = range(*key.indices(n))
            except TypeError:
                raise ConfigTypeError([f"{shown}: expected a slice of integers or None, got {describe_value(key)}"],
                                      self.owner) from None
            except ValueError:
                raise ConfigError([f"{shown}: expected a slice with a non-zero step, got step {key.step}"],
                                  self.owner) from None
            super().__setitem__(key, self.checked(value, indices, shown))
            return
        if isinstance(key, (bool, np.bool_)) or not hasattr(type(key), "__index__"):
            raise ConfigTypeError([f"{name} index: expected an integer index or a slice, got {describe_value(key)}"],
                                  self.owner)
        i = operator.index(key)
        if not -n <= i < n:
            raise ConfigIndexError([f"{name}[{i}]: expected an index in 0..{n - 1} (or -{n}..-1 from the end), "
                                    f"got {i}"], self.owner)
        super().__setitem__(i, checked_int(f"{name}[{key}]", value, "ptr", what=self.owner))

    def __delitem__(self, key):
        raise ConfigTypeError([f"{self.field_name}[{key!r}]: the {P3_MAX_RANKS} entries are fixed; "
                               "assign an address (0x1 is disabled()'s) instead of deleting"], self.owner)


class _CountPtrs(PeerAddresses):
    field_name = "count_ptrs"
    owner = "P3SendCtx"


class _CheckedStructure(ctypes.LittleEndianStructure):
    """A ctypes struct whose fields refuse what they cannot store exactly; subclasses
    list ``_kinds`` (field -> kind, or the address-array class)."""

    _kinds: dict = {}

    def __setattr__(self, name, value):
        kind = self._kinds.get(name)
        owner = type(self).__name__
        if kind is None:
            raise FieldError([f"{owner} has no field {name!r}; fields are: {', '.join(self._kinds)}"], owner)
        if isinstance(kind, type):
            value = kind(*kind.checked(value))
        else:
            value = checked_int(name, value, kind, what=owner)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        owner = type(self).__name__
        if name not in self._kinds:
            raise FieldError([f"{owner} has no field {name!r}; fields are: {', '.join(self._kinds)}"], owner)
        raise ConfigTypeError([f"{name}: the fields of {owner} are bytes of a fixed image and cannot be deleted; "
                               "assign a value instead"], owner)


def _ctype(f: Field):
    if f.kind == "ptr[8]":
        return PeerAddresses
    return ctypes.c_uint64 if f.kind == "ptr" else ctypes.c_int64


class P3PeerSendConfig(_CheckedStructure):
    """``P3PeerSendConfig`` as passed by value to every p3send kernel.

    ``bytes(cfg)`` is the exact 184-byte little-endian image. Device addresses are
    unsigned 64-bit integers (0..2**64-1), the Mojo ``Int`` fields signed 64-bit ones.
    Every write is checked: ``cfg.n_ranks = v``, ``P3PeerSendConfig(n_ranks=v)``,
    ``cfg.recv_buf_ptrs = [8 addresses]``, ``cfg.recv_buf_ptrs[i] = v`` and slices.

    Raises:
        FieldError: assigning an attribute that is not a field (also an AttributeError).
        ConfigTypeError: a value that is not an integer (float, str, None, bool), or for
            ``recv_buf_ptrs`` not an ordered sequence (a dict, a set, a str, bytes).
        ConfigError: an integer that does not fit the field, or ``recv_buf_ptrs`` of other
            than 8 addresses; nothing is written then.
        ConfigIndexError: ``cfg.recv_buf_ptrs[i] = v`` with ``i`` outside -8..7.
    """

    _fields_ = [(f.name, _ctype(f)) for f in FIELDS]
    _kinds = {f.name: (PeerAddresses if f.kind == "ptr[8]" else f.kind) for f in FIELDS}

    @classmethod
    def disabled(cls) -> P3PeerSendConfig:
        """Mojo's ``disabled()``.

        Returns:
            P3PeerSendConfig: dangling pointers (address = pointee alignment), 0 scalars,
            ``p2p_world_size = top_k = 1`` and ``send_trace_slot = -1``.
        """
        cfg = cls()
        for f in FIELDS:
            setattr(cfg, f.name, f.disabled)
        return cfg

    @classmethod
    def from_bytes(cls, data) -> P3PeerSendConfig:
        """The config whose image is ``data``.

        Args:
            data: the 184-byte image: any object exposing its memory through the buffer
                protocol (bytes, bytearray, memoryview, array.array, a numpy array, a ctypes
                object) of exactly 184 bytes. Refused: an int (``bytes(184)`` would be 184
                zeros, not an image), a str (text has no bytes until encoded) and a list of
                ints (not memory; ``bytes(the_list)`` is one call away for who means it), nor a
                numpy array of Python objects (its memory holds pointers).

        Returns:
            P3PeerSendConfig: a copy (later changes of ``data`` do not show).

        Raises:
            ConfigTypeError: ``data`` is not bytes-like.
            ConfigError: ``data`` is not 184 bytes long.
        """
        what = "P3PeerSendConfig image"
        try:
            view = memoryview(data)
        except (TypeError, ValueError):
            view = None
        # A numpy object array exposes its memory too: pointers to Python objects, not an image.
        if view is None or "O" in view.format:
            raise ConfigTypeError([f"data: expected a bytes-like object of {P3_CONFIG_SIZE} bytes (bytes, bytearray, "
                                   f"memoryview, a numpy array), got {describe_value(data)}"], what) from None
        with view:
            if view.nbytes != P3_CONFIG_SIZE:
                raise ConfigError([f"data: expected {P3_CONFIG_SIZE} bytes, got {view.nbytes}"], what)
            return cls.from_buffer_copy(view.tobytes())   # tobytes: C order, also for strided views

    def to_dict(self) -> dict:
        """The fields as plain data.

        Returns:
            dict: field name -> int, and ``recv_buf_ptrs`` -> list of 8 ints, in table order.
        """
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


#: numpy structured dtype with the same offsets, for arrays of configs.
CONFIG_DTYPE = np.dtype({
    "names": [f.name for f in FIELDS],
    "formats": [("<u8", (P3_MAX_RANKS,)) if f.kind == "ptr[8]" else ("<u8" if f.kind == "ptr" else "<i8")
                for f in FIELDS],
    "offsets": [f.offset for f in FIELDS],
    "itemsize": P3_CONFIG_SIZE,
})


class P3SendCtx(_CheckedStructure):
    """p3send's launch state for the in-epilogue send functions (ptx/p3_send_rows.ptx),
    beside the ABI struct: 104 bytes, alignment 8, in device memory.

    Fields: ``count_ptrs`` u64[8] (receive counts of p2p rank p, 0: none),
    ``expert_offsets`` u64 (int32[n_experts+1]), ``state_ptr`` u64 (sender state,
    40*n_experts bytes), ``diag_ptr`` u64 (u32[4] or 0), ``n_experts`` u32, ``flags`` u32
    (FLAG_ROW_CACHE | FLAG_SIGNAL | FLAG_SCOPE_GPU), ``p3_control`` s32 (< 0: nothing
    sent), ``reserved`` u32. Writes are checked like ``P3PeerSendConfig``'s.

    Raises:
        FieldError: assigning an attribute that is not a field.
        ConfigTypeError: a value that is not an integer.
        ConfigError: an integer that does not fit the field's width.
    """

    _fields_ = [("count_ptrs", _CountPtrs),
                ("expert_offsets", ctypes.c_uint64),
                ("state_ptr", ctypes.c_uint64),
                ("diag_ptr", ctypes.c_uint64),
                ("n_experts", ctypes.c_uint32),
                ("flags", ctypes.c_uint32),
                ("p3_control", ctypes.c_int32),
                ("reserved", ctypes.c_uint32)]
    _kinds = {"count_ptrs": _CountPtrs, "expert_offsets": "ptr", "state_ptr": "ptr", "diag_ptr": "ptr",
              "n_experts": "u32", "flags": "u32", "p3_control": "i32", "reserved": "u32"}


#: Bytes of a P3SendAcct (per-warp accounting of the send functions), initialised to
#: expert = -1 and zeros: s32 expert, u32 ready, u64 units, u32 pair[8].
P3_SEND_ACCT_SIZE = 48


# ---------------------------------------------------------------- the limits, one rule each
# Each returns the problem (naming ``name``, what was expected, what was given) or None:
# a value of the wrong type is a problem too, never a TypeError from a comparison.

def _int_or_problem(v, name: str) -> tuple[int | None, str | None]:
    if isinstance(v, (bool, np.bool_)):
        return None, f"{name}: expected an integer, got {describe_value(v)} (a bool is not taken as a number)"
    try:
        return operator.index(v), None
    except TypeError:
        return None, f"{name}: expected an integer, got {describe_value(v)}"


def n_ranks_problem(v, name: str = "n_ranks") -> str | None:
    """The rule of an EP world's rank count: 1..8 (``P3_MAX_RANKS``).

    Args:
        v: the value given (an int; anything else is a problem).
        name: the name the problem gives it.

    Returns:
        str | None: the problem, or None when ``v`` is fine.
    """
    n, bad = _int_or_problem(v, name)
    if bad:
        return bad
    if not 1 <= n <= P3_MAX_RANKS:
        return f"{name}: expected 1..{P3_MAX_RANKS}, got {n}"
    return None


def top_k_problem(v, name: str = "top_k", *, receive: bool = True) -> str | None:
    """The rule of ``top_k``: 1..32 where the receive reduces the slots (one lane each);
    the send alone needs >= 1.

    Args:
        v: the value given (an int; anything else is a problem).
        name: the name the problem gives it.
        receive: whether the receive's limit (32) applies.

    Returns:
        str | None: the problem, or None when ``v`` is fine.
    """
    k, bad = _int_or_problem(v, name)
    if bad:
        return bad
    if k < 1 or (receive and k > P3_MAX_TOP_K):
        return f"{name}: expected " + (f"1..{P3_MAX_TOP_K}" if receive else ">= 1") + f", got {k}"
    return None


def msg_bytes_problem(v, name: str = "msg_bytes") -> str | None:
    """The rule of a row's size: a positive multiple of 16 bytes up to 1 MiB.

    Args:
        v: the value given, in bytes (an int; anything else is a problem).
        name: the name the problem gives it.

    Returns:
        str | None: the problem, or None when ``v`` is fine.
    """
    m, bad = _int_or_problem(v, name)
    if bad:
        return bad
    if m <= 0 or m % P3_MSG_ALIGN or m > P3_MAX_MSG_BYTES:
        return f"{name}: expected a positive multiple of {P3_MSG_ALIGN} up to {P3_MAX_MSG_BYTES} (1 MiB), got {m}"
    return None


def hidden_problem(v, name: str = "hidden") -> str | None:
    """bf16 rows: msg_bytes = 2 * hidden, so ``msg_bytes_problem``'s rule in elements.

    Args:
        v: the value given, in bf16 elements (an int; anything else is a problem).
        name: the name the problem gives it.

    Returns:
        str | None: the problem, or None when ``v`` is fine.
    """
    h, bad = _int_or_problem(v, name)
    if bad:
        return bad
    elems, most = P3_MSG_ALIGN // 2, P3_MAX_MSG_BYTES // 2
    if h <= 0 or h % elems or h > most:
        return f"{name}: expected a positive multiple of {elems} bf16 elements up to {most} (rows of at most " \
               f"1 MiB), got {h}"
    return None


def max_tokens_problem(v, name: str = "max_tokens_per_rank") -> str | None:
    """The rule of a receive buffer's capacity: >= 1 token (a buffer of 0 tokens has no
    slot: every row sent to it would be dropped).

    Args:
        v: the value given (an int; anything else is a problem).
        name: the name the problem gives it.

    Returns:
        str | None: the problem, or None when ``v`` is fine.
    """
    t, bad = _int_or_problem(v, name)
    if bad:
        return bad
    if t < 1:
        return f"{name}: expected >= 1 token per receive buffer (with 0 every row would be dropped), got {t}"
    return None


#: The longest timeout: its nanoseconds must fit the kernels' signed 64-bit clock arithmetic.
_MAX_TIMEOUT_MS = ((1 << 63) - 1) / 1e6


def shape_problems(n_ranks, *, max_tokens, top_k, hidden, n_local_experts, timeout_ms=1.0) -> list[str]:
    """What is wrong with the shape of an EP combine: the rules of the config fields it
    becomes, plus its own. Combine, Rank and the CLI check with this.

    Args:
        n_ranks: EP ranks, 1..8.
        max_tokens: tokens per rank's receive buffer, >= 1.
        top_k: experts per token, 1..32 and at most ``n_ranks * n_local_experts``.
        hidden: bf16 elements per row, a positive multiple of 8 up to 512 Ki.
        n_local_experts: experts per rank, >= 1.
        timeout_ms: the receive's deadline in milliseconds, a finite number > 0.

    Returns:
        list[str]: one problem per bad argument, each naming it (empty: nothing wrong).
        A value of the wrong type (a str ``hidden``, a float ``top_k``) is a problem too.
    """
    problems = [p for p in (n_ranks_problem(n_ranks), hidden_problem(hidden), top_k_problem(top_k),
                            max_tokens_problem(max_tokens, "max_tokens")) if p]
    n_local, bad = _int_or_problem(n_local_experts, "n_local_experts")
    if bad:
        problems.append(bad)
    elif n_local < 1:
        problems.append(f"n_local_experts: expected >= 1, got {n_local}")
    elif not problems and operator.index(top_k) > operator.index(n_ranks) * n_local:
        problems.append(f"top_k: expected at most the {operator.index(n_ranks) * n_local} experts "
                        f"({n_ranks} ranks x {n_local}), got {top_k}")
    if isinstance(timeout_ms, (bool, np.bool_)) or not isinstance(timeout_ms, numbers.Real):
        problems.append(f"timeout_ms: expected a number of milliseconds > 0, got {describe_value(timeout_ms)}")
    elif not (math.isfinite(timeout_ms) and 0 < timeout_ms <= _MAX_TIMEOUT_MS):
        problems.append(f"timeout_ms: expected > 0 and at most {_MAX_TIMEOUT_MS:.4g} (finite), got {timeout_ms}")
    return problems


# ---------------------------------------------------------------- the one config builder

def rank_config(*, n_ranks, my_rank=0, recv_bufs=(), top_k, msg_bytes, max_tokens, p2p_world_size=None,
                range_table=None, src_info=None, row_base=None, send_stamps=None, trace=None,
                trace_slot=0) -> P3PeerSendConfig:
    """A rank's ``P3PeerSendConfig``: ``disabled()`` with the given fields set.

    The values' rules (n_ranks 1..8, aligned real addresses, ...) are not checked here:
    ``validate`` and the launchers do that, so a test can build a config the kernel must
    refuse. Types and widths are: each argument is named as written here.

    Args:
        n_ranks, my_rank, top_k, msg_bytes: the fields of the same names (integers).
        max_tokens: ``max_tokens_per_rank`` (an integer).
        recv_bufs: p2p rank p's receive buffer as this rank sees it, at most 8 (the rest
            stay dangling): a sequence of addresses or of objects with an integer ``.ptr``
            (a DeviceBuffer).
        p2p_world_size: peers reachable by P2P; None: ``n_ranks``.
        range_table: ``atomic_counter``, the int32 (n_experts*n_ranks*2,) range table.
        src_info: ``src_info_ptr``, int32 (rows, 2).
        row_base: ``row_base_ptr``, u64 (rows,).
        send_stamps: ``send_stamp_ptr``, u64 (2*ctas,); given: ``send_stamp_on = 1``.
        trace: ``trace_ptr``, u64 (ctas*16,); given: ``trace_on = 1`` and
            ``send_trace_slot = trace_slot``.
        trace_slot: an integer.
        Addresses are ints (0..2**64-1) or objects with ``.ptr``; None leaves the pointer
        dangling and, for ``send_stamps`` and ``trace``, the feature off.

    Returns:
        P3PeerSendConfig: the config.

    Raises:
        ConfigTypeError: an argument of the wrong type (a float, a str, None where an
            integer is due, a bool, a dict ``recv_bufs``); the message names it.
        ConfigError: an integer that does not fit its field (a negative address), or
            more than 8 ``recv_bufs``.
    """
    what = "rank_config argument"

    def count(name, v):
        return checked_int(name, v, "i64", what=what)

    def addr(name, v):
        if hasattr(v, "ptr"):
            name, v = f"{name}.ptr", v.ptr
        return checked_int(name, v, "ptr", expected="an integer address or an object with .ptr", what=what)

    ints = {"n_ranks": count("n_ranks", n_ranks), "my_rank": count("my_rank", my_rank),
            "top_k": count("top_k", top_k), "msg_bytes": count("msg_bytes", msg_bytes),
            "max_tokens_per_rank": count("max_tokens", max_tokens)}
    ints["p2p_world_size"] = ints["n_ranks"] if p2p_world_size is None else count("p2p_world_size", p2p_world_size)
    slot = count("trace_slot", trace_slot)
    bufs = checked_items("recv_bufs", recv_bufs, at_most=P3_MAX_RANKS, of="receive buffers", what=what)
    ptrs = [addr(f"recv_bufs[{p}]", b) for p, b in enumerate(bufs)]
    fields = {name: addr(arg, v) for name, arg, v in (("atomic_counter", "range_table", range_table),
                                                        ("src_info_ptr", "src_info", src_info),
                                                        ("row_base_ptr", "row_base", row_base),
                                                        ("send_stamp_ptr", "send_stamps", send_stamps),
                                                        ("trace_ptr", "trace", trace)) if v is not None}
    cfg = P3PeerSendConfig.disabled()
    cfg.recv_buf_ptrs = ptrs + [0x1] * (P3_MAX_RANKS - len(ptrs))
    for name, v in {**ints, **fields}.items():
        setattr(cfg, name, v)
    if send_stamps is not None:
        cfg.send_stamp_on = 1
    if trace is not None:
        cfg.trace_on, cfg.send_trace_slot = 1, slot
    return cfg


def is_dangling(addr) -> bool:
    """Whether ``addr`` is null or one of the small addresses Mojo uses as dangling pointers.

    Args:
        addr: a device address, an integer in 0..2**64-1.

    Returns:
        bool: True below ``DANGLING_LIMIT`` (0x10000).

    Raises:
        ConfigTypeError: ``addr`` is not an integer.
        ConfigError: ``addr`` is not in 0..2**64-1.
    """
    return checked_int("addr", addr, "ptr", what="is_dangling argument") < DANGLING_LIMIT


def validate(cfg: P3PeerSendConfig, *, p3_control: int = 0, row_cache: bool = False,
             raise_on_error: bool = True, wire="bf16", hidden=None) -> list[str]:
    """Explain, field by field, what is wrong with ``cfg`` for a launch.

    The send is enabled when ``p3_control >= 0`` and ``n_ranks > 0``; only then are its
    pointers required to be real (not null, not dangling, aligned) and its ``msg_bytes``
    checked against the wire format. Stamps and trace are checked whenever their flags are on.

    Args:
        cfg: the config.
        p3_control: the launch's s32 control word (< 0: the send is gated off).
        row_cache: whether the launch uses ``row_base_ptr`` (a bool).
        raise_on_error: raise the problems (True) or only return them (False).
        wire: the row format, ``"bf16"`` or ``"fp8"`` (``p3send.abi.wire``).
        hidden: the row's columns; ``msg_bytes`` must be that format's slot size for it
            (``wire_problems``). Required with ``wire="fp8"`` (``msg_bytes`` alone cannot
            name the format); None with bf16: only ``msg_bytes``' own rule is checked.

    Returns:
        list[str]: one problem per bad field, each naming it (empty: launchable).

    Raises:
        ConfigTypeError: ``cfg`` is not a P3PeerSendConfig, ``p3_control`` or ``hidden``
            not an integer, ``row_cache`` or ``raise_on_error`` not a bool (always raised).
        ConfigError: ``p3_control`` outside the s32 range, ``wire`` not a format, no
            ``hidden`` with ``wire="fp8"`` (always raised); the config's problems, all of
            them, unless ``raise_on_error`` is False.
    """
    what = "validate argument"
    if not isinstance(cfg, P3PeerSendConfig):
        raise ConfigTypeError([f"cfg: expected a P3PeerSendConfig, got {type(cfg).__name__}"], what)
    p3_control = checked_int("p3_control", p3_control, "i32", what=what)
    row_cache = checked_flag("row_cache", row_cache, what=what)
    raise_on_error = checked_flag("raise_on_error", raise_on_error, what=what)
    fmt = wire_format(wire, what=what)
    if hidden is None and fmt == WIRE_FP8:
        raise ConfigError(["hidden: expected the row's columns with wire='fp8' (msg_bytes alone cannot name "
                           "the format), got None"], what)
    if hidden is not None:
        hidden = checked_int("hidden", hidden, "i64", what=what)
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
        if hidden is not None:
            p += wire_problems(cfg.msg_bytes, hidden, fmt)
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
    """The layout as plain data.

    Returns:
        list[dict]: one dict per field, in offset order: ``name``, ``offset``, ``size``
        (bytes) and ``type`` (the Mojo type).
    """
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
