"""The 184-byte P3PeerSendConfig image: table, ctypes, numpy, the C compiler and cffi agree;
so do the send functions' P3SendCtx/P3SendAcct and prototypes in ptx/p3send.h."""
from __future__ import annotations

import ctypes
import re
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p3send.abi import config as abi
from p3send.abi.config import CONFIG_DTYPE, FIELDS, P3PeerSendConfig, validate
from p3send.abi.errors import ConfigError
from tests.cpu.conftest import HEADER

# docs/ABI.md §2, copied by hand: (name, offset, size). Every other form is compared to this.
SPEC_TABLE = [
    ("atomic_counter", 0, 8), ("src_info_ptr", 8, 8), ("row_base_ptr", 16, 8),
    ("recv_buf_ptrs", 24, 64), ("n_ranks", 88, 8), ("p2p_world_size", 96, 8),
    ("top_k", 104, 8), ("msg_bytes", 112, 8), ("max_tokens_per_rank", 120, 8),
    ("my_rank", 128, 8), ("send_mbx", 136, 8), ("send_stamp_ptr", 144, 8),
    ("send_stamp_on", 152, 8), ("trace_ptr", 160, 8), ("trace_on", 168, 8),
    ("send_trace_slot", 176, 8),
]
# The same image as a struct format, field by field: 3 pointers, 8 receive buffers,
# 6 Ints, send_mbx, stamp ptr, stamp on, trace ptr, trace on, trace slot.
PACK = "<3Q8Q6qQQqQqq"


def test_constants():
    assert (abi.P3_MAX_RANKS, abi.P5_SEND_MBX_INTS, abi.P5_SEND_MBX_STRIDE, abi.P3_TRACE_SLOTS,
            abi.P3_CONFIG_SIZE, abi.P3_CONFIG_ALIGN) == (8, 32, 4, 16, 184, 8)
    assert struct.calcsize(PACK) == 184


def test_fields_table_matches_spec():
    assert [(f.name, f.offset, f.size) for f in FIELDS] == SPEC_TABLE
    assert {f.kind for f in FIELDS} == {"ptr", "i64", "ptr[8]"}
    assert [f.name for f in FIELDS if f.kind == "i64"] == [
        "n_ranks", "p2p_world_size", "top_k", "msg_bytes", "max_tokens_per_rank", "my_rank",
        "send_stamp_on", "trace_on", "send_trace_slot"]


def test_ctypes_layout():
    assert ctypes.sizeof(P3PeerSendConfig) == 184
    assert ctypes.alignment(P3PeerSendConfig) == 8
    for name, off, size in SPEC_TABLE:
        desc = getattr(P3PeerSendConfig, name)
        assert (desc.offset, desc.size) == (off, size), name


def test_numpy_dtype_layout():
    assert CONFIG_DTYPE.itemsize == 184
    assert list(CONFIG_DTYPE.names) == [n for n, _, _ in SPEC_TABLE]
    for name, off, size in SPEC_TABLE:
        dt, got_off = CONFIG_DTYPE.fields[name][:2]
        assert (got_off, dt.itemsize) == (off, size), name


def test_header_compiled_by_the_c_compiler_matches(tmp_path):
    from p3send.conform import c_layout
    layout = c_layout(HEADER)   # offsets from the system compiler's offsetof/sizeof
    assert (layout.size, layout.align) == (184, 8)
    assert [(m.name, m.offset, m.size) for m in layout.members] == SPEC_TABLE
    ptr_classes = {m.cls for m in layout.members if abi.FIELD_BY_NAME[m.name].kind != "i64"}
    assert ptr_classes == {"uint"}   # device addresses are uint64_t, not host pointers
    assert {m.cls for m in layout.members if abi.FIELD_BY_NAME[m.name].kind == "i64"} == {"int"}


def test_header_through_cffi_abi_mode():
    # cffi's own C parser (no compiler) lays out the struct block of the header.
    cffi = pytest.importorskip("cffi")
    text = HEADER.read_text()
    block = re.search(r"typedef struct P3PeerSendConfig \{.*?\} P3PeerSendConfig;", text, re.S).group()
    defines = dict(re.findall(r"#define (\w+) (\d+)\n", text))
    block = re.sub(r"\b[A-Z][A-Z0-9_]+\b", lambda m: defines.get(m.group(), m.group()), block)
    ffi = cffi.FFI()
    ffi.cdef(block)
    assert (ffi.sizeof("P3PeerSendConfig"), ffi.alignof("P3PeerSendConfig")) == (184, 8)
    fields = dict(ffi.typeof("P3PeerSendConfig").fields)
    assert list(fields) == [n for n, _, _ in SPEC_TABLE]
    for name, off, size in SPEC_TABLE:
        assert (ffi.offsetof("P3PeerSendConfig", name), ffi.sizeof(fields[name].type)) == (off, size)
        assert getattr(P3PeerSendConfig, name).offset == off   # and ctypes agrees


def test_disabled_image_is_byte_exact(disabled_image):
    cfg = P3PeerSendConfig.disabled()
    assert bytes(cfg) == disabled_image
    assert cfg.to_dict()["recv_buf_ptrs"] == [1] * 8
    assert (cfg.p2p_world_size, cfg.top_k, cfg.send_trace_slot) == (1, 1, -1)


def test_numpy_view_of_disabled_image(disabled_image):
    rec = np.frombuffer(disabled_image, dtype=CONFIG_DTYPE)[0]
    assert int(rec["send_trace_slot"]) == -1 and int(rec["send_mbx"]) == 4
    assert rec["recv_buf_ptrs"].tolist() == [1] * 8


u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-2**63, 2**63 - 1)
configs = st.fixed_dictionaries({f.name: (st.lists(u64, min_size=8, max_size=8) if f.kind == "ptr[8]"
                                          else u64 if f.kind == "ptr" else i64) for f in FIELDS})


def _build(values: dict) -> P3PeerSendConfig:
    cfg = P3PeerSendConfig()
    for name, v in values.items():
        setattr(cfg, name, v)
    return cfg


@given(configs)
def test_from_bytes_round_trip(values):
    cfg = _build(values)
    image = bytes(cfg)
    back = P3PeerSendConfig.from_bytes(image)
    assert back == cfg and back.to_dict() == values
    # Independent encodings of the same bytes: struct.pack in declaration order, numpy.
    flat = [values[n] for n in ("atomic_counter", "src_info_ptr", "row_base_ptr")]
    flat += values["recv_buf_ptrs"]
    flat += [values[n] for n, _, _ in SPEC_TABLE[4:]]
    assert image == struct.pack(PACK, *flat)
    rec = np.frombuffer(image, dtype=CONFIG_DTYPE)[0]
    assert {n: (rec[n].tolist() if n == "recv_buf_ptrs" else int(rec[n])) for n in values} == values


def test_from_bytes_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected 184 bytes, got 183"):
        P3PeerSendConfig.from_bytes(b"\0" * 183)


def test_misspelled_attribute_raises():
    cfg = P3PeerSendConfig.disabled()
    with pytest.raises(AttributeError, match="n_rank"):
        cfg.n_rank = 4
    with pytest.raises(AttributeError):
        P3PeerSendConfig(n_rank=4)
    with pytest.raises(ValueError, match="recv_buf_ptrs: expected 8 addresses, got 3"):
        cfg.recv_buf_ptrs = [1, 2, 3]
    assert bytes(cfg) == bytes(P3PeerSendConfig.disabled())   # nothing half-written


# ---------------------------------------------------------------- validate()

BASE = 0x7F00_0000_0000


def enabled() -> P3PeerSendConfig:
    """A config that launches a real send: 4 ranks, DeepSeek-V3 rows, all features on."""
    cfg = P3PeerSendConfig.disabled()
    cfg.atomic_counter, cfg.src_info_ptr, cfg.row_base_ptr = BASE + 0x1000, BASE + 0x2000, BASE + 0x3000
    cfg.recv_buf_ptrs = [BASE + (i + 1) * 0x100_0000 for i in range(8)]
    cfg.n_ranks, cfg.p2p_world_size, cfg.top_k, cfg.my_rank = 4, 4, 8, 1
    cfg.msg_bytes, cfg.max_tokens_per_rank = 14336, 128
    cfg.send_stamp_on, cfg.send_stamp_ptr = 1, BASE + 0x4000
    cfg.trace_on, cfg.trace_ptr, cfg.send_trace_slot = 1, BASE + 0x5000, 3
    return cfg


def test_valid_configs_validate_clean():
    assert validate(enabled(), row_cache=True) == []
    assert validate(P3PeerSendConfig.disabled()) == []
    assert validate(P3PeerSendConfig.disabled(), p3_control=-1, row_cache=True) == []
    off = enabled()
    off.atomic_counter = 0x4   # dangling is fine while the send is gated off
    assert validate(off, p3_control=-1) == []


def _set(**kw):
    def mutate(cfg):
        for k, v in kw.items():
            if k.startswith("recv_buf_ptrs_"):
                ptrs = list(cfg.recv_buf_ptrs)
                ptrs[int(k.rsplit("_", 1)[1])] = v
                cfg.recv_buf_ptrs = ptrs
            else:
                setattr(cfg, k, v)
    return mutate


BAD = [
    # (case id, mutation, field the message must name, a word it must contain)
    ("n_ranks=9", _set(n_ranks=9), "n_ranks", "got 9"),
    ("n_ranks=-1", _set(n_ranks=-1), "n_ranks", "got -1"),
    ("n_ranks=p2p=9", _set(n_ranks=9, p2p_world_size=9), "p2p_world_size", "got 9"),
    ("p2p_world_size=0", _set(p2p_world_size=0), "p2p_world_size", "got 0"),
    ("p2p_world_size=9", _set(p2p_world_size=9), "p2p_world_size", "got 9"),
    ("my_rank=n_ranks", _set(my_rank=4), "my_rank", "got 4"),
    ("my_rank=-1", _set(my_rank=-1), "my_rank", "got -1"),
    ("top_k=0", _set(top_k=0), "top_k", "got 0"),
    ("msg_bytes=0", _set(msg_bytes=0), "msg_bytes", "multiple of 16"),
    ("msg_bytes=24", _set(msg_bytes=24), "msg_bytes", "got 24"),
    ("null atomic_counter", _set(atomic_counter=0), "atomic_counter", "null"),
    ("null recv_buf_ptrs[2]", _set(recv_buf_ptrs_2=0), "recv_buf_ptrs[2]", "null"),
    ("misaligned src_info_ptr", _set(src_info_ptr=BASE + 0x2004), "src_info_ptr", "aligned"),
    ("misaligned recv buffer", _set(recv_buf_ptrs_0=BASE + 0x100_0008), "recv_buf_ptrs[0]", "16-byte"),
    ("dangling 0x4 as real", _set(atomic_counter=0x4), "atomic_counter", "dangling 0x4"),
    ("dangling row cache", _set(row_base_ptr=0x8), "row_base_ptr", "dangling 0x8"),
    ("stamp on, dangling ptr", _set(send_stamp_ptr=0x8), "send_stamp_ptr", "dangling"),
    ("trace on, dangling ptr", _set(trace_ptr=0x8), "trace_ptr", "dangling"),
    ("trace on, slot -1", _set(send_trace_slot=-1), "send_trace_slot", "got -1"),
    ("trace on, slot 16", _set(send_trace_slot=16), "send_trace_slot", "got 16"),
]


@pytest.mark.parametrize("mutate,field,word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validate_names_the_bad_field(mutate, field, word):
    cfg = enabled()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg, row_cache=True)
    named = [p for p in err.value.problems if p.startswith(field + ":")]
    assert named, f"no problem names {field}: {err.value.problems}"
    assert any(word in p for p in named), named
    assert field in str(err.value)
    assert validate(cfg, row_cache=True, raise_on_error=False) == err.value.problems


def test_validate_flags_gate_their_pointers():
    cfg = enabled()
    cfg.send_stamp_on, cfg.send_stamp_ptr = 0, 0x8   # stamps off: the dangling ptr is fine
    cfg.trace_on, cfg.trace_ptr, cfg.send_trace_slot = 0, 0x8, -1
    assert validate(cfg) == []


def test_validate_rejects_non_config():
    with pytest.raises(TypeError, match="expected a P3PeerSendConfig, got bytes"):
        validate(bytes(184))


# ---------------------------------------------------------------- the send functions' structs

SEND_ROWS_PTX = HEADER.parent / "p3_send_rows.ptx"
_PTX_SIZES = {"u64": 8, "u32": 4, "s32": 4}


def _ptx_send_ctx() -> list[tuple[str, int, int]]:
    """P3SendCtx as the header of ptx/p3_send_rows.ptx tabulates it: (field, offset, size)."""
    text = SEND_ROWS_PTX.read_text()
    block = text[text.index("// P3SendCtx (104 bytes, align 8)"):text.index("// P3SendAcct")]
    rows = re.findall(r"^//\s+(\d+)\s+(u64|u32|s32)(?:\[(\d+)\])?\s+(\w+)", block, flags=re.M)
    return [(name, int(off), _PTX_SIZES[t] * int(n or 1)) for off, t, n, name in rows]


def _ptx_send_acct() -> list[tuple[str, int, int]]:
    """P3SendAcct as the header of ptx/p3_send_rows.ptx describes it (padding unnamed)."""
    text = SEND_ROWS_PTX.read_text()
    start = text.index("// P3SendAcct (48 bytes, align 8):")
    block = " ".join(ln.lstrip("/ ") for ln in text[start:].split("\n//\n", 1)[0].splitlines())
    block = re.sub(r"\([^)]*\)", "", block.split(":", 1)[1])
    return [(name, int(off), _PTX_SIZES[t] * int(n or 1))
            for off, t, name, n in re.findall(r"(\d+) (u64|u32|s32) (\w+)(?:\[(\d+)\])?", block)]


def test_send_ctx_ptx_ctypes_and_c_agree():
    from p3send.abi.config import P3SendCtx
    from p3send.conform import c_layout
    ptx = _ptx_send_ctx()
    assert [n for n, _, _ in ptx] == [n for n, _ in P3SendCtx._fields_]
    assert [(n, getattr(P3SendCtx, n).offset, getattr(P3SendCtx, n).size) for n, _ in P3SendCtx._fields_] == ptx
    assert (ctypes.sizeof(P3SendCtx), ctypes.alignment(P3SendCtx)) == (104, 8)
    layout = c_layout(HEADER, "P3SendCtx")     # offsets from the C compiler
    assert (layout.size, layout.align) == (104, 8)
    assert [(m.name, m.offset, m.size) for m in layout.members] == ptx
    assert {m.name: m.cls for m in layout.members}["p3_control"] == "int"   # s32: negative gates the send


def test_send_acct_ptx_and_c_agree():
    from p3send.conform import c_layout
    layout = c_layout(HEADER, "P3SendAcct")
    assert (layout.size, layout.align) == (abi.P3_SEND_ACCT_SIZE, 8) == (48, 8)
    members = [(m.name, m.offset, m.size) for m in layout.members]
    assert members == _ptx_send_acct() == [("expert", 0, 4), ("ready", 4, 4), ("units", 8, 8), ("pair", 16, 32)]
    assert {m.name: m.cls for m in layout.members}["expert"] == "int"       # -1: none


def test_header_flags_and_sizes_match_the_code():
    from p3send.abi import wire
    from p3send.ops import send
    defines = {k: int(v) for k, v in re.findall(r"^#define (P3_\w+) (\d+)\b", HEADER.read_text(), flags=re.M)}
    flags = {k[3:]: v for k, v in defines.items() if k.startswith("P3_FLAG_")}
    # the send's flags, and the one only p3_send_rows' callers set (the FP8 GEMM's launcher)
    assert flags == {**{n: getattr(send, n) for n in dir(send) if n.startswith("FLAG_")},
                     "FLAG_WIRE_FP8_STAGED": wire.FLAG_WIRE_FP8_STAGED}
    assert flags == {"FLAG_ROW_CACHE": 1, "FLAG_SIGNAL": 2, "FLAG_SCOPE_GPU": 4, "FLAG_TILE": 8, "FLAG_WIRE_FP8": 16,
                     "FLAG_NVSHMEM": 32, "FLAG_NVSHMEM_ALL": 64, "FLAG_WIRE_FP8_STAGED": 128}
    from p3send.ops import nvshmem
    assert defines["P3_NVSHMEM_BLOCK_SIZE"] == nvshmem.BLOCK_BYTES == 40
    assert (defines["P3_SEND_CTX_SIZE"], defines["P3_SEND_ACCT_SIZE"]) == (
        ctypes.sizeof(abi.P3SendCtx), abi.P3_SEND_ACCT_SIZE)


_C_TO_PTX = {"unsigned": ("b32", "u32"), "int": ("b32", "s32")}


def _header_prototypes() -> dict[str, list[tuple[str, str]]]:
    """``extern "C" __device__`` prototypes of the header: name -> [(C type, parameter)]."""
    text = HEADER.read_text()
    cuda = text[text.index("#ifdef __CUDACC__"):]
    cuda = cuda[:cuda.index("#endif")]
    out = {}
    for name, args in re.findall(r'extern "C" __device__ void (\w+)\(([^)]*)\);', cuda):
        params = []
        for a in args.split(","):
            m = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", a.replace("*", " * "))
            params.append((" ".join(m.group(1).split()), m.group(2)))
        out[name] = params
    return out


def test_header_prototypes_match_the_ptx_functions():
    from p3send.cuda import ptxdoc
    text = SEND_ROWS_PTX.read_text()
    decls, documented = ptxdoc.parse_decls(text), ptxdoc.parse_header(text)
    protos = _header_prototypes()
    assert set(protos) == {"p3_send_rows", "p3_send_flush"} == {n for n, e in documented.items() if e.kind == "func"}
    pointee = {"cfg": "const P3PeerSendConfig *", "ctx": "const P3SendCtx *", "acct": "P3SendAcct *"}
    for name, params in protos.items():
        assert [p for _, p in params] == [p.name for p in decls[name]] == [p.name for p in documented[name].params]
        for (ctype, pname), decl, doc in zip(params, decls[name], documented[name].params):
            if pname in pointee:
                assert (ctype, decl.type, doc.type) == (pointee[pname], "b64", "u64"), (name, pname)
            else:
                assert (decl.type, doc.type) == _C_TO_PTX[ctype], (name, pname, ctype)


def test_header_prototypes_link_with_the_ptx(tmp_path):
    # nvcc emits the extern declarations from the header; nvJitLink must resolve them
    # against ptx/p3_send_rows.ptx (CPU only: nothing is loaded on a GPU).
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = tmp_path / "caller.cu"
    src.write_text('#include "p3send.h"\n'
                   'extern "C" __global__ void caller(const __grid_constant__ P3PeerSendConfig cfg,\n'
                   '                                  const P3SendCtx *ctx) {\n'
                   '    __shared__ __align__(16) unsigned char tile[1024];\n'
                   '    __shared__ P3SendAcct acct[1];\n'
                   '    p3_send_rows(&cfg, ctx, &acct[0], (unsigned)__cvta_generic_to_shared(tile), 512,\n'
                   '                 0, 2, 0, 512, 0, 0u, 1u);\n'
                   '    p3_send_flush(&cfg, ctx, &acct[0]);\n'
                   '}\n')
    out = tmp_path / "caller.ptx"
    r = subprocess.run([nvcc, "-rdc=true", "-ptx", "-arch=sm_90", f"-I{HEADER.parent}", str(src), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from p3send.cuda import ptxdoc, ptxlint
    ptx = out.read_text()
    ours = ptxdoc.parse_decls(SEND_ROWS_PTX.read_text())
    theirs = ptxdoc.parse_decls(ptx)
    for name in ("p3_send_rows", "p3_send_flush"):
        assert [(p.offset, p.size, p.type) for p in theirs[name]] == [(p.offset, p.size, p.type) for p in ours[name]]
    why = ptxlint.nvjitlink_missing()
    if why:
        pytest.skip(why)
    report = ptxlint.assemble(ptx, "caller.ptx", "sm_90", deps=[(SEND_ROWS_PTX.name, SEND_ROWS_PTX.read_text())])
    assert report.ok, report.error
