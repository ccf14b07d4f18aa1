"""Bad input to every setter and helper of p3send.abi raises a P3SendError naming the argument.

The sweep: each field setter of P3PeerSendConfig (and P3SendCtx), the items and slices of
``recv_buf_ptrs``, ``from_bytes``, ``validate``, every layout and range-table helper and
``rank_config``, given out-of-range, negative, float, None, str, bool, dict and
wrong-length values. Each case must raise a P3SendError subclass of the right kind
(TypeError for a wrong type, ValueError for a wrong value, IndexError for an index) whose
problem starts with the argument's name as the caller wrote it, and must leave the config
as it was. The positive controls: the edge values are accepted and stored exactly, the
image stays 184 bytes, and numpy integers are integers.
"""
from __future__ import annotations

import ctypes
import inspect
import itertools
import pickle
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from p3send.abi import config, errors, layout
from p3send.abi.config import CONFIG_DTYPE, FIELDS, P3PeerSendConfig, P3SendCtx, rank_config, shape_problems, validate
from p3send.abi.errors import ConfigError, P3SendError

BASE = 0x7F00_0000_0000
U64_MAX, I64_MIN, I64_MAX = 2**64 - 1, -(2**63), 2**63 - 1
SCALARS = [f for f in FIELDS if f.kind != "ptr[8]"]


class Ptr:
    """An object with ``.ptr``, as a DeviceBuffer."""

    def __init__(self, ptr):
        self.ptr = ptr


@dataclass
class Case:
    id: str
    call: Callable          # call(cfg): cfg is a fresh disabled() config, which must stay as it was
    name: str               # the argument the message must name, as the caller wrote it
    kind: str               # "type" (TypeError), "value" (ValueError) or "index" (IndexError)


CASES: list[Case] = []


def case(id, call, name, kind):
    CASES.append(Case(id, call, name, kind))


# Values of the wrong type for an integer argument: (id, value).
NOT_INT = [("float", 1.5), ("integral-float", 4.0), ("np.float64", np.float64(2.0)), ("None", None), ("str", "4"),
           ("bool", True), ("np.bool", np.True_), ("dict", {1: 2}), ("list", [1]), ("complex", 1j)]
OUT_OF_RANGE = {"ptr": [("negative", -1), ("2**64", 2**64), ("2**64+5", 2**64 + 5), ("-2**63", I64_MIN)],
                "i64": [("2**63", 2**63), ("-2**63-1", I64_MIN - 1), ("2**64+5", 2**64 + 5)]}


def setter(name, value):
    return lambda cfg: setattr(cfg, name, value)


# ---------------------------------------------------------------- every scalar field

for f in SCALARS:
    for vid, v in NOT_INT:
        case(f"{f.name}={vid}", setter(f.name, v), f.name, "type")
    for vid, v in OUT_OF_RANGE[f.kind]:
        case(f"{f.name}={vid}", setter(f.name, v), f.name, "value")
    case(f"P3PeerSendConfig({f.name}=1.5)", lambda cfg, n=f.name: P3PeerSendConfig(**{n: 1.5}), f.name, "type")


# ---------------------------------------------------------------- recv_buf_ptrs as a whole

def gen(n):
    return (BASE + 16 * i for i in range(n))


WHOLE = [   # (id, a factory of the value: a generator is used up once, kind)
    ("dict", lambda: {i: BASE for i in range(8)}, "type"), ("set", lambda: set(gen(8)), "type"),
    ("str", lambda: "12345678", "type"), ("bytes", lambda: bytes(8), "type"),
    ("bytearray", lambda: bytearray(8), "type"),
    ("None", lambda: None, "type"), ("int", lambda: 5, "type"), ("float", lambda: 1.5, "type"),
    ("generator-7", lambda: gen(7), "value"), ("generator-9", lambda: gen(9), "value"),
    ("endless", lambda: itertools.count(BASE, 16), "value"), ("list-7", lambda: [BASE] * 7, "value"),
    ("list-9", lambda: [BASE] * 9, "value"), ("empty", lambda: [], "value"),
    ("2-D array", lambda: np.full((2, 4), BASE, dtype=np.uint64), "value"),
]
for vid, make, kind in WHOLE:
    case(f"recv_buf_ptrs={vid}", lambda cfg, make=make: setattr(cfg, "recv_buf_ptrs", make()), "recv_buf_ptrs", kind)

ITEM_BAD = [("float", [BASE] * 7 + [1.5], "type"), ("bool", [True] + [BASE] * 7, "type"),
            ("None", [BASE] * 3 + [None] + [BASE] * 4, "type"), ("str", ["0x1000"] + [BASE] * 7, "type"),
            ("negative", [BASE] * 7 + [-1], "value"), ("2**64", [2**64] + [BASE] * 7, "value"),
            ("float-array", np.full(8, 4096.0), "type"), ("bool-array", np.ones(8, dtype=bool), "type")]
for vid, v, kind in ITEM_BAD:
    case(f"recv_buf_ptrs=[.. {vid} ..]", setter("recv_buf_ptrs", v), "recv_buf_ptrs", kind)


# ---------------------------------------------------------------- recv_buf_ptrs items and slices

def item(index, value):
    def call(cfg):
        cfg.recv_buf_ptrs[index] = value
    return call


for index in (0, 7, -1, -8):
    for vid, v in NOT_INT:
        case(f"recv_buf_ptrs[{index}]={vid}", item(index, v), f"recv_buf_ptrs[{index}]", "type")
    for vid, v in OUT_OF_RANGE["ptr"]:
        case(f"recv_buf_ptrs[{index}]={vid}", item(index, v), f"recv_buf_ptrs[{index}]", "value")
for index in (8, -9, 100, 2**64):
    case(f"recv_buf_ptrs[{index}]=BASE", item(index, BASE), f"recv_buf_ptrs[{index}]", "index")
for vid, index in (("str", "0"), ("float", 1.0), ("None", None), ("bool", True)):
    case(f"recv_buf_ptrs[{vid} index]=BASE", item(index, BASE), "recv_buf_ptrs", "type")

SLICES = [
    ("[0:2]=[1.5, BASE]", slice(0, 2), [1.5, BASE], "recv_buf_ptrs[0]", "type"),
    ("[2:4]=[BASE, -1]", slice(2, 4), [BASE, -1], "recv_buf_ptrs[3]", "value"),
    ("[-2:]=[BASE, 2**64]", slice(-2, None), [BASE, 2**64], "recv_buf_ptrs[7]", "value"),
    ("[::2]=[.. None ..]", slice(None, None, 2), [BASE, BASE, None, BASE], "recv_buf_ptrs[4]", "type"),
    ("[0:2]=3 values", slice(0, 2), [BASE] * 3, "recv_buf_ptrs[0:2]", "value"),
    ("[:]=7 values", slice(None), [BASE] * 7, "recv_buf_ptrs[:]", "value"),
    ("[::2]=3 values", slice(None, None, 2), [BASE] * 3, "recv_buf_ptrs[::2]", "value"),
    ("[:]=dict", slice(None), {i: BASE for i in range(8)}, "recv_buf_ptrs[:]", "type"),
    ("[0:2]=str", slice(0, 2), "ab", "recv_buf_ptrs[0:2]", "type"),
    ("[0:2]=None", slice(0, 2), None, "recv_buf_ptrs[0:2]", "type"),
    ("[::0]", slice(None, None, 0), [BASE], "recv_buf_ptrs[::0]", "value"),
    ("[0.5:2]", slice(0.5, 2), [BASE], "recv_buf_ptrs[0.5:2]", "type"),
]
for sid, sl, v, name, kind in SLICES:
    case(f"recv_buf_ptrs{sid}", item(sl, v), name, kind)


# ---------------------------------------------------------------- P3SendCtx

def ctx_set(name, value):
    return lambda cfg: setattr(P3SendCtx(), name, value)


def ctx_item(index, value):
    def call(cfg):
        P3SendCtx().count_ptrs[index] = value
    return call


for name, bad in (("expert_offsets", -1), ("state_ptr", 2**64), ("diag_ptr", 1.5), ("n_experts", -1),
                  ("n_experts", 2**32), ("flags", 1.5), ("flags", True), ("p3_control", 2**31),
                  ("p3_control", -(2**31) - 1), ("reserved", None)):
    case(f"P3SendCtx.{name}={bad!r}", ctx_set(name, bad), name,
         "value" if isinstance(bad, int) and not isinstance(bad, bool) else "type")
case("P3SendCtx.count_ptrs[0]=-1", ctx_item(0, -1), "count_ptrs[0]", "value")
case("P3SendCtx.count_ptrs[8]=0", ctx_item(8, 0), "count_ptrs[8]", "index")
case("P3SendCtx.count_ptrs=[0]*7", ctx_set("count_ptrs", [0] * 7), "count_ptrs", "value")


# ---------------------------------------------------------------- from_bytes

for vid, data, kind in (("int 184", 184, "type"), ("str", "x" * 184, "type"), ("list of ints", [0] * 184, "type"),
                        ("None", None, "type"), ("float", 1.5, "type"), ("dict", {0: 0}, "type"),
                        ("183 bytes", bytes(183), "value"), ("185 bytes", bytes(185), "value"),
                        ("empty", b"", "value"), ("80-byte array", np.zeros(10), "value"),
                        ("object array", np.array([None] * 184, dtype=object), "type")):
    case(f"from_bytes({vid})", lambda cfg, d=data: P3PeerSendConfig.from_bytes(d), "data", kind)


# ---------------------------------------------------------------- validate

for vid, v in (("bytes", bytes(184)), ("None", None), ("dict", {"n_ranks": 1})):
    case(f"validate(cfg={vid})", lambda cfg, v=v: validate(v), "cfg", "type")
for vid, v, kind in (("float", 1.5, "type"), ("str", "0", "type"), ("None", None, "type"), ("bool", True, "type"),
                     ("2**31", 2**31, "value"), ("-2**31-1", -(2**31) - 1, "value")):
    case(f"validate(p3_control={vid})", lambda cfg, v=v: validate(cfg, p3_control=v), "p3_control", kind)
for vid, v in (("int 1", 1), ("str", "yes"), ("None", None), ("float", 1.0)):
    case(f"validate(row_cache={vid})", lambda cfg, v=v: validate(cfg, row_cache=v), "row_cache", "type")
    case(f"validate(raise_on_error={vid})", lambda cfg, v=v: validate(cfg, raise_on_error=v), "raise_on_error",
         "type")


# ---------------------------------------------------------------- layout helpers

def helper_cases(fn, good: dict, ranges: dict):
    """``fn(**good)`` with one argument replaced by each wrong type and each out-of-range value."""
    for arg in good:
        for vid, v in NOT_INT:
            case(f"{fn.__name__}({arg}={vid})", lambda cfg, a=arg, v=v: fn(**{**good, a: v}), arg, "type")
        for v in ranges.get(arg, ()):
            case(f"{fn.__name__}({arg}={v})", lambda cfg, a=arg, v=v: fn(**{**good, a: v}), arg, "value")


helper_cases(layout.recv_count_layout, dict(e=2, rk=3, n_ranks=8),
             dict(e=[-1, 2**63], rk=[-1, 8, 9], n_ranks=[0, -1]))
helper_cases(layout.recv_buf_layout, dict(src_idx=3, src_topk=2, byte_off=16, top_k=8, msg_bytes=14336),
             dict(src_idx=[-1], src_topk=[-1, 8], byte_off=[-1, 14336], top_k=[0, -1], msg_bytes=[0, -16]))
helper_cases(layout.recv_buf_bytes, dict(max_tokens_per_rank=128, top_k=8, msg_bytes=14336),
             dict(max_tokens_per_rank=[-1], top_k=[-1], msg_bytes=[-16, 2**64]))
helper_cases(layout.recv_counts_len, dict(n_local_experts=32, n_ranks=8),
             dict(n_local_experts=[-1], n_ranks=[-1]))
case("recv_buf_bytes past a 64-bit Int", lambda cfg: layout.recv_buf_bytes(2**40, 2**20, 2**20),
     "max_tokens_per_rank", "value")
case("recv_buf_layout past a 64-bit Int", lambda cfg: layout.recv_buf_layout(2**62, 0, 0, 8, 16), "src_idx", "value")
case("recv_count_layout past a 64-bit Int", lambda cfg: layout.recv_count_layout(2**62, 0, 8), "e", "value")

OFF, CNT = [0, 5, 9], [[2, 3], [1, 0]]
RANGE_BAD = [
    ("expert_offsets", [0, 4.5, 9], "type"), ("expert_offsets", [0.0, 5.0, 9.0], "type"),
    ("expert_offsets", np.array([0, 5, 9], dtype=np.float32), "type"), ("expert_offsets", [True, True, True], "type"),
    ("expert_offsets", None, "type"), ("expert_offsets", "059", "type"), ("expert_offsets", {0: 1}, "type"),
    ("expert_offsets", [0, 5], "value"), ("expert_offsets", [[0, 5, 9]], "value"), ("expert_offsets", 9, "value"),
    ("expert_offsets", [0, -1, 9], "value"), ("expert_offsets", [-4, 5, 9], "value"),
    ("expert_offsets", [5, 3, 9], "value"), ("expert_offsets", [0, 5, 2**31], "value"),
    ("expert_offsets", np.array([0, 5, 2**64 - 1], dtype=np.uint64), "value"), ("expert_offsets", [0, [5], 9], "value"),
    ("counts", [[1.5, 3], [1, 0]], "type"), ("counts", [[2, 3], [1, 0.0]], "type"), ("counts", None, "type"),
    ("counts", "x", "type"), ("counts", [[True, False], [True, False]], "type"), ("counts", {0: [1]}, "type"),
    ("counts", [2, 3, 1, 0], "value"), ("counts", [[[2, 3], [1, 0]]], "value"), ("counts", [[2, 3], [1]], "value"),
    ("counts", [[2, -3], [1, 0]], "value"), ("counts", [[2, 2**31], [1, 0]], "value"),
    ("counts", np.zeros((2, 0), dtype=np.int32), "value"), ("counts", [[5, 3], [1, 0]], "value"),
    ("ready", 1, "type"), ("ready", "yes", "type"), ("ready", None, "type"), ("ready", 0, "type"),
]
for arg, v, kind in RANGE_BAD:
    kw = {"expert_offsets": OFF, "counts": CNT, arg: v}
    case(f"encode_range_table({arg}={v!r:.30})", lambda cfg, kw=kw: layout.encode_range_table(**kw), arg, kind)

TABLE = [1026, 2, 1029, 3, 1030, 1, 1030, 0]
DECODE_BAD = [
    ("table", np.array(TABLE, dtype=np.float64), "type"), ("table", [1026.5] + TABLE[1:], "type"),
    ("table", None, "type"), ("table", "table", "type"), ("table", np.ones(8, dtype=bool), "type"),
    ("table", bytes(32), "type"), ("table", TABLE[:-1], "value"), ("table", TABLE + [0, 0], "value"),
    ("table", np.array(TABLE).reshape(2, 2, 2), "value"), ("table", [2**31] + TABLE[1:], "value"),
    ("n_experts", -1, "value"), ("n_ranks", 0, "value"), ("n_ranks", -2, "value"),
] + [(arg, v, "type") for arg in ("n_experts", "n_ranks") for _, v in NOT_INT]
for arg, v, kind in DECODE_BAD:
    kw = {"table": TABLE, "n_experts": 2, "n_ranks": 2, arg: v}
    case(f"decode_range_table({arg}={v!r:.30})", lambda cfg, kw=kw: layout.decode_range_table(**kw), arg, kind)

for vid, v, kind in (("str", "0x10", "type"), ("float", 1.5, "type"), ("None", None, "type"), ("bool", True, "type"),
                     ("negative", -1, "value"), ("2**64", 2**64, "value")):
    case(f"is_dangling({vid})", lambda cfg, v=v: config.is_dangling(v), "addr", kind)


# ---------------------------------------------------------------- rank_config

GOOD = dict(n_ranks=2, my_rank=1, recv_bufs=[BASE, BASE + 0x100000], top_k=4, msg_bytes=256, max_tokens=16,
            range_table=BASE + 0x1000, src_info=BASE + 0x2000)


def rank(**kw):
    return lambda cfg: rank_config(**{**GOOD, **kw})


for arg in ("n_ranks", "my_rank", "top_k", "msg_bytes", "max_tokens", "p2p_world_size", "trace_slot"):
    for vid, v in NOT_INT:
        if v is None and arg == "p2p_world_size":
            continue        # None: the default (n_ranks)
        case(f"rank_config({arg}={vid})", rank(**{arg: v}), arg, "type")
    for vid, v in OUT_OF_RANGE["i64"]:
        case(f"rank_config({arg}={vid})", rank(**{arg: v}), arg, "value")
for arg in ("range_table", "src_info", "row_base", "send_stamps", "trace"):
    for vid, v in NOT_INT:
        if v is not None:   # None: the pointer left dangling
            case(f"rank_config({arg}={vid})", rank(**{arg: v}), arg, "type")
    for vid, v in OUT_OF_RANGE["ptr"]:
        case(f"rank_config({arg}={vid})", rank(**{arg: v}), arg, "value")
    case(f"rank_config({arg}=Ptr(-1))", rank(**{arg: Ptr(-1)}), f"{arg}.ptr", "value")
    case(f"rank_config({arg}=Ptr(1.5))", rank(**{arg: Ptr(1.5)}), f"{arg}.ptr", "type")
for vid, v, name, kind in (
        ("dict", {0: BASE, 1: BASE}, "recv_bufs", "type"), ("set", {BASE, BASE + 16}, "recv_bufs", "type"),
        ("str", "ab", "recv_bufs", "type"), ("bytes", b"ab", "recv_bufs", "type"), ("None", None, "recv_bufs", "type"),
        ("int", 5, "recv_bufs", "type"), ("9 buffers", [BASE] * 9, "recv_bufs", "value"),
        ("endless", "count", "recv_bufs", "value"), ("[BASE, 1.5]", [BASE, 1.5], "recv_bufs[1]", "type"),
        ("[BASE, None]", [BASE, None], "recv_bufs[1]", "type"), ("[-1]", [-1, BASE], "recv_bufs[0]", "value"),
        ("[True]", [True, BASE], "recv_bufs[0]", "type"), ("[2**64]", [BASE, 2**64], "recv_bufs[1]", "value"),
        ("[Ptr(-1)]", [Ptr(-1), BASE], "recv_bufs[0].ptr", "value"), ("[dict]", [{}, BASE], "recv_bufs[0]", "type")):
    def bufs(cfg, v=v):
        rank_config(**{**GOOD, "recv_bufs": itertools.count(BASE, 16) if v == "count" else v})
    case(f"rank_config(recv_bufs={vid})", bufs, name, kind)


# ---------------------------------------------------------------- the sweep

def named(problems: list[str], name: str) -> bool:
    """A problem starts with ``name`` as a whole word (``trace_slot`` is not ``send_trace_slot``)."""
    return any(re.match(re.escape(name) + r"(?![A-Za-z0-9_])", p) for p in problems)


KIND = {"type": TypeError, "value": ValueError, "index": IndexError}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_a_p3send_error_naming_the_argument(c: Case):
    cfg = P3PeerSendConfig.disabled()
    before = bytes(cfg)
    with pytest.raises(Exception) as err:
        c.call(cfg)
    e = err.value
    assert isinstance(e, P3SendError), f"{type(e).__name__}: {e}"
    assert isinstance(e, KIND[c.kind]), f"expected a {KIND[c.kind].__name__}, got {type(e).__mro__}: {e}"
    problems = getattr(e, "problems", [str(e)])
    assert named(problems, c.name), f"no problem names {c.name!r}: {problems}"
    assert "expected" in str(e) and "got" in str(e), str(e)
    assert bytes(cfg) == before, "a refused write changed the config"


def test_the_sweep_covers_every_setter_and_helper():
    ids = " ".join(c.id for c in CASES)
    for f in FIELDS:
        assert f"{f.name}=" in ids or f"{f.name}[" in ids, f.name
    for fn in ("from_bytes", "validate", "recv_count_layout", "recv_buf_layout", "recv_buf_bytes", "recv_counts_len",
               "encode_range_table", "decode_range_table", "rank_config", "is_dangling", "P3SendCtx"):
        assert fn in ids, fn
    assert len(CASES) >= 400


# ---------------------------------------------------------------- problems, not exceptions

SHAPE = dict(max_tokens=512, top_k=8, hidden=7168, n_local_experts=32, timeout_ms=1.0)
SHAPE_BAD = [(arg, v) for arg in ("n_ranks", "max_tokens", "top_k", "hidden", "n_local_experts")
             for v in ("8", None, 1.5, True, {1: 2})]
SHAPE_BAD += [("timeout_ms", v) for v in ("1", None, True, float("nan"), float("inf"), -1.0, 0, 1e300)]


@pytest.mark.parametrize("arg, value", SHAPE_BAD, ids=[f"{a}={v!r}" for a, v in SHAPE_BAD])
def test_shape_problems_reports_bad_types_as_problems(arg, value):
    kw = {"n_ranks": 8, **SHAPE, arg: value}
    problems = shape_problems(kw.pop("n_ranks"), **kw)
    assert named(problems, arg), problems
    assert len(problems) == 1, problems


PROBLEM_HELPERS = [config.n_ranks_problem, config.top_k_problem, config.msg_bytes_problem, config.hidden_problem,
                   config.max_tokens_problem]


@pytest.mark.parametrize("fn", PROBLEM_HELPERS, ids=[f.__name__ for f in PROBLEM_HELPERS])
@pytest.mark.parametrize("value", ["16", None, 16.0, True, [16]], ids=["str", "None", "float", "bool", "list"])
def test_problem_helpers_type_check(fn, value):
    p = fn(value, "x")
    assert p is not None and p.startswith("x: expected an integer"), p


# ---------------------------------------------------------------- positive controls

@pytest.mark.parametrize("f", SCALARS, ids=[f.name for f in SCALARS])
def test_edge_values_are_stored_exactly(f):
    lo, hi = (0, U64_MAX) if f.kind == "ptr" else (I64_MIN, I64_MAX)
    fmt = "<Q" if f.kind == "ptr" else "<q"
    for v in (lo, hi, 0, np.uint64(hi) if f.kind == "ptr" else np.int64(lo)):
        cfg = P3PeerSendConfig.disabled()
        setattr(cfg, f.name, v)
        assert getattr(cfg, f.name) == int(v) and type(getattr(cfg, f.name)) is int
        assert struct.unpack_from(fmt, bytes(cfg), f.offset)[0] == int(v)
        assert P3PeerSendConfig(**{f.name: v}).to_dict()[f.name] == int(v)


def test_recv_buf_ptrs_items_and_slices_are_stored_exactly():
    cfg = P3PeerSendConfig.disabled()
    cfg.recv_buf_ptrs[0] = 0
    cfg.recv_buf_ptrs[7] = U64_MAX
    cfg.recv_buf_ptrs[-2] = np.uint64(BASE)           # index 6
    cfg.recv_buf_ptrs[1:3] = [BASE + 16, BASE + 32]
    cfg.recv_buf_ptrs[3:6:2] = (BASE + 48, BASE + 80)  # 3 and 5
    cfg.recv_buf_ptrs[4] += 0x10                      # read-modify-write goes through the check too
    want = [0, BASE + 16, BASE + 32, BASE + 48, 0x11, BASE + 80, BASE, U64_MAX]
    assert list(cfg.recv_buf_ptrs) == want == cfg.to_dict()["recv_buf_ptrs"]
    assert all(type(x) is int for x in cfg.recv_buf_ptrs) and type(cfg.recv_buf_ptrs[-1]) is int
    assert cfg.recv_buf_ptrs[1:3] == [BASE + 16, BASE + 32]
    assert struct.unpack_from("<8Q", bytes(cfg), 24) == tuple(want)
    assert np.frombuffer(bytes(cfg), dtype=CONFIG_DTYPE)[0]["recv_buf_ptrs"].tolist() == want
    for seq in (tuple(want), iter(want), np.array(want, dtype=np.uint64), (ctypes.c_uint64 * 8)(*want),
                cfg.recv_buf_ptrs, range(8)):
        other = P3PeerSendConfig.disabled()
        other.recv_buf_ptrs = seq
        assert list(other.recv_buf_ptrs) == (list(range(8)) if isinstance(seq, range) else want)


def test_the_image_and_the_layout_are_unchanged():
    assert ctypes.sizeof(P3PeerSendConfig) == 184 and ctypes.alignment(P3PeerSendConfig) == 8
    assert (P3PeerSendConfig.recv_buf_ptrs.offset, P3PeerSendConfig.recv_buf_ptrs.size) == (24, 64)
    assert ctypes.sizeof(P3SendCtx) == 104 and P3SendCtx.count_ptrs.size == 64
    cfg = rank_config(**GOOD)
    image = bytes(cfg)
    assert len(image) == 184
    back = P3PeerSendConfig.from_buffer_copy(image)
    assert back == cfg and bytes(pickle.loads(pickle.dumps(cfg))) == image
    # by value, as a kernel parameter block copies it
    block = (ctypes.c_uint8 * 184)()
    ctypes.memmove(ctypes.addressof(block), ctypes.addressof(cfg), 184)
    assert bytes(block) == image


def test_from_bytes_takes_bytes_like_objects_of_184_bytes():
    cfg = rank_config(**GOOD)
    image = bytes(cfg)
    for data in (image, bytearray(image), memoryview(image), np.frombuffer(image, dtype=np.uint8),
                 np.frombuffer(image, dtype=CONFIG_DTYPE), np.frombuffer(image, dtype="<u8"), cfg,
                 np.frombuffer(image + image, dtype=np.uint8).reshape(2, 184)[:, ::1][0]):
        assert P3PeerSendConfig.from_bytes(data) == cfg


def test_layout_helpers_take_their_edge_values_and_numpy_integers():
    assert layout.recv_count_layout(0, 7, 8) == 7 and layout.recv_count_layout(np.int64(2), np.uint8(3), 8) == 19
    assert layout.recv_buf_layout(0, 7, 15, 8, 16) == 127
    assert layout.recv_buf_bytes(0, 8, 16) == 0 and layout.recv_counts_len(0, 8) == 0
    assert layout.recv_buf_bytes(np.int32(128), 8, 14336) == 14_680_064
    t = layout.encode_range_table(np.array(OFF, dtype=np.int32), np.array(CNT, dtype=np.uint8))
    assert t.tolist() == TABLE and layout.encode_range_table(OFF, CNT, ready=np.True_).tolist() == TABLE
    assert layout.encode_range_table([0], np.zeros((0, 3), dtype=np.int64)).tolist() == []
    lo, hi = layout.decode_range_table(t, np.int64(2), 2)
    assert (hi - lo).tolist() == CNT


def test_rank_config_takes_edge_addresses_and_numpy_integers():
    cfg = rank_config(**{**GOOD, "recv_bufs": np.array([0, U64_MAX], dtype=np.uint64), "range_table": Ptr(U64_MAX),
                         "src_info": 0, "n_ranks": np.int64(2), "trace": BASE, "trace_slot": I64_MIN})
    assert cfg.recv_buf_ptrs[:3] == [0, U64_MAX, 1]
    assert (cfg.atomic_counter, cfg.src_info_ptr, cfg.send_trace_slot, cfg.trace_on) == (U64_MAX, 0, I64_MIN, 1)
    assert rank_config(**{**GOOD, "recv_bufs": iter([BASE, BASE])}).recv_buf_ptrs[:2] == [BASE, BASE]


def test_validate_keeps_working_with_the_checked_arguments():
    cfg = rank_config(**GOOD)
    assert validate(cfg) == [] and validate(cfg, p3_control=np.int32(-1), row_cache=np.False_) == []
    assert validate(cfg, p3_control=2**31 - 1) == validate(cfg, p3_control=-(2**31)) == []


def test_out_of_range_index_is_also_an_index_error():
    cfg = P3PeerSendConfig.disabled()
    with pytest.raises(IndexError):
        cfg.recv_buf_ptrs[8] = BASE
    with pytest.raises(ConfigError, match=r"recv_buf_ptrs\[0\]"):
        del cfg.recv_buf_ptrs[0]
    with pytest.raises(ConfigError, match="n_ranks"):
        del cfg.n_ranks
    assert bytes(cfg) == bytes(P3PeerSendConfig.disabled())


# ---------------------------------------------------------------- structured docstrings

def _public(module):
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj
            if inspect.isclass(obj):
                for mname, m in vars(obj).items():
                    if not mname.startswith("_") and (isinstance(m, classmethod) or inspect.isfunction(m)):
                        yield f"{name}.{mname}", getattr(obj, mname)


PUBLIC = [(f"{m.__name__}.{n}", o) for m in (config, layout, errors) for n, o in _public(m)]


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_names_have_structured_docstrings(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    if inspect.isclass(obj):
        return
    params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
    if params:
        assert "Args:" in doc, f"{name}: no Args section"
        for p in params:
            assert re.search(rf"\b{p}\b", doc.split("Args:", 1)[1]), f"{name}: argument {p} not described"
    assert "Returns:" in doc, f"{name}: no Returns section"
