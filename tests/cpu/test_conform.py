"""`p3send layout` and `p3send conform`: correct and deliberately broken C, Mojo and JSON."""
from __future__ import annotations

import json
import re
import runpy

import numpy as np
import pytest

from p3send.abi.config import CONFIG_DTYPE, FIELDS
from p3send.conform import check_path, find_cuda_headers, render
from tests.cpu.conftest import DISABLED_HEX, HEADER, ROOT, compile_and_run

# A foreign C runtime's declaration, written the way such a runtime would: its own
# device-pointer typedef, `struct Name {...};`, several declarators on one line.
GOOD_C = """\
#include <stdint.h>
typedef unsigned long long devptr_t;   /* like CUdeviceptr */
struct P3PeerSendConfig {
    devptr_t atomic_counter, src_info_ptr;
    devptr_t row_base_ptr;
    devptr_t recv_buf_ptrs[8];
    int64_t n_ranks;
    int64_t p2p_world_size;
    int64_t top_k;
    int64_t msg_bytes;
    int64_t max_tokens_per_rank;
    int64_t my_rank;
    devptr_t send_mbx;
    devptr_t send_stamp_ptr;
    int64_t send_stamp_on;
    devptr_t trace_ptr;
    int64_t trace_on;
    int64_t send_trace_slot;
};
"""

# The struct as MAX writes it (Pointer/Int(8) spelling, a docstring, an alias, a
# multi-line type, methods whose locals must not be taken for fields).
GOOD_MOJO = '''\
from utils import StaticTuple

comptime P5SendMailboxPtr = UnsafePointer[Int32, MutAnyOrigin, address_space = AddressSpace.SHARED]


@fieldwise_init
struct P3PeerSendConfig(ImplicitlyCopyable, Movable):
    """Runtime state for the in-epilogue EP-combine peer scatter-send.

  (an oddly indented docstring line must not end the struct)
    """

    var atomic_counter: Pointer[Int32, MutUntrackedOrigin]
    var src_info_ptr: Pointer[Int32, ImmUntrackedOrigin]
    var row_base_ptr: Pointer[UInt64, MutUntrackedOrigin]
    var recv_buf_ptrs: StaticTuple[
        Pointer[UInt8, MutUntrackedOrigin], Int(8)
    ]
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    var send_mbx: P5SendMailboxPtr
    var send_stamp_ptr: Pointer[UInt64, MutUntrackedOrigin]
    var send_stamp_on: Int
    var trace_ptr: Pointer[UInt64, MutUntrackedOrigin]
    var trace_on: Int
    var send_trace_slot: Int

    @staticmethod
    def disabled() -> Self:
        var scratch: Int32 = 0
        return Self(...)

    def recv_count_layout(self, e: Int, rk: Int) -> Int:
        return e * self.n_ranks + rk
'''


def _swap_lines(text, a, b):
    lines = text.splitlines(keepends=True)
    ia = next(i for i, ln in enumerate(lines) if re.search(rf"\b{a}\b", ln))
    ib = next(i for i, ln in enumerate(lines) if re.search(rf"\b{b}\b", ln))
    lines[ia], lines[ib] = lines[ib], lines[ia]
    return "".join(lines)


def _drop_line(text, name):
    return "".join(ln for ln in text.splitlines(keepends=True) if not re.search(rf"\b{name}\b", ln))


# (id, broken text, field the report must name, phrase it must contain)
BROKEN_C = [
    ("missing", _drop_line(GOOD_C, "top_k"), "top_k", "missing"),
    ("extra", GOOD_C.replace("int64_t trace_on;", "int64_t trace_on;\n    int64_t flags;"),
     "flags", "extra field"),
    ("reordered", _swap_lines(GOOD_C, "top_k", "msg_bytes"), "top_k", "out of order"),
    ("resized", GOOD_C.replace("recv_buf_ptrs[8]", "recv_buf_ptrs[4]"), "recv_buf_ptrs", "size expected 64, found 32"),
    ("int32", GOOD_C.replace("int64_t n_ranks;", "int32_t n_ranks;"), "n_ranks", "size expected 8, found 4"),
    ("unsigned Int", GOOD_C.replace("int64_t send_trace_slot;", "uint64_t send_trace_slot;"),
     "send_trace_slot", "unsigned integer"),
    ("double ptr", GOOD_C.replace("devptr_t trace_ptr;", "double trace_ptr;"), "trace_ptr", "floating point"),
    ("packed", "#pragma pack(push, 4)\n" + GOOD_C + "#pragma pack(pop)\n", "struct alignment", "found 4"),
]

BROKEN_MOJO = [
    ("missing", _drop_line(GOOD_MOJO, "top_k"), "top_k", "missing"),
    ("extra", GOOD_MOJO.replace("var trace_on: Int\n", "var trace_on: Int\n    var flags: Int\n"),
     "flags", "extra field"),
    ("reordered", _swap_lines(GOOD_MOJO, "var top_k", "var msg_bytes"), "top_k", "out of order"),
    ("resized", GOOD_MOJO.replace("Int(8)", "Int(4)"), "recv_buf_ptrs", "size expected 64, found 32"),
    ("int32", GOOD_MOJO.replace("var n_ranks: Int", "var n_ranks: Int32"), "n_ranks", "size expected 8, found 4"),
    ("UInt", GOOD_MOJO.replace("var my_rank: Int", "var my_rank: UInt"), "my_rank", "unsigned integer"),
]


def _json_broken():
    good = json.loads(render("json"))

    def edit(fn):
        d = json.loads(json.dumps(good))
        fn(d)
        return json.dumps(d)

    def field(d, name):
        return next(f for f in d["fields"] if f["name"] == name)

    def swap(d):
        f = d["fields"]
        f[6], f[7] = f[7], f[6]

    return [
        ("missing", edit(lambda d: d["fields"].remove(field(d, "top_k"))), "top_k", "missing"),
        ("extra", edit(lambda d: d["fields"].append({"name": "flags", "offset": 184, "size": 8, "type": "Int"})),
         "flags", "extra field"),
        ("reordered", edit(swap), "top_k", "out of order"),
        ("resized", edit(lambda d: field(d, "recv_buf_ptrs").update(
            size=32, type="StaticTuple[UnsafePointer[UInt8], 4]")), "recv_buf_ptrs",
         "size expected 64, found 32"),
        ("int32", edit(lambda d: field(d, "n_ranks").update(size=4, type="Int32")), "n_ranks",
         "size expected 8, found 4"),
        ("moved", edit(lambda d: field(d, "my_rank").update(offset=132)), "my_rank",
         "offset expected 128, found 132"),
        ("total size", edit(lambda d: d.update(size=192)), "struct size", "found 192"),
        ("align", edit(lambda d: d.update(align=4)), "struct alignment", "found 4"),
    ]


BROKEN = ([("c", ".h") + b for b in BROKEN_C] + [("mojo", ".mojo") + b for b in BROKEN_MOJO]
          + [("json", ".json") + b for b in _json_broken()])


# ---------------------------------------------------------------- conform

@pytest.mark.parametrize("text,suffix", [(GOOD_C, ".h"), (GOOD_C.replace(
    "struct P3PeerSendConfig {", "typedef struct {").replace("};", "} P3PeerSendConfig;"), ".h"),
    (GOOD_MOJO, ".mojo"), (render("json"), ".json")], ids=["c struct", "c typedef", "mojo", "json"])
def test_correct_declarations_conform(tmp_path, cli, text, suffix):
    path = tmp_path / ("decl" + suffix)
    path.write_text(text)
    rc, out = cli("conform", path)
    assert rc == 0, out
    assert "conforms" in out


def test_the_shipped_header_conforms(cli):
    rc, out = cli("conform", HEADER)
    assert rc == 0, out


def test_cxx_header_conforms(tmp_path, cli):
    # C++-only syntax (namespace, <cstdint>, member functions, static members) is
    # compiled as C++; a `void *` device address is accepted as a host pointer.
    path = tmp_path / "runtime.hpp"
    path.write_text("#include <cstdint>\nnamespace rt {\n" + GOOD_C.split("\n", 1)[1].replace(
        "devptr_t send_mbx;", "void *send_mbx;").replace(
        "int64_t send_trace_slot;", "int64_t send_trace_slot = -1;\n"
        "    static constexpr int kMaxRanks = 8;\n    int64_t slot() const { return send_trace_slot; }")
        + "}\nusing rt::P3PeerSendConfig;\n")
    rc, out = cli("conform", path)
    assert rc == 0, out


@pytest.mark.parametrize("kind,suffix,text,field,phrase", [b[:2] + b[3:] for b in BROKEN],
                         ids=[f"{b[0]}-{b[2]}" for b in BROKEN])
def test_broken_declarations_are_named(tmp_path, cli, kind, suffix, text, field, phrase):
    path = tmp_path / ("decl" + suffix)
    path.write_text(text)
    rc, out = cli("conform", path)
    assert rc == 1, out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(f"- {field}")]
    assert lines, f"no problem names {field}:\n{out}"
    assert any(phrase in ln for ln in lines), out


def test_every_shifted_field_is_reported(tmp_path):
    # Dropping top_k moves every later field up by 8: each one is a separate problem.
    path = tmp_path / "decl.h"
    path.write_text(_drop_line(GOOD_C, "top_k"))
    problems = check_path(path)
    for f in FIELDS[7:]:
        assert f"{f.name}: offset expected {f.offset}, found {f.offset - 8}" in problems
    assert "struct size: expected 184 bytes, found 176" in problems


def test_kind_override_and_struct_name(tmp_path, cli):
    path = tmp_path / "decl.txt"
    path.write_text(GOOD_C.replace("P3PeerSendConfig", "MyCfg"))
    rc, out = cli("conform", path, "--kind", "c", "--struct", "MyCfg")
    assert rc == 0, out


IF_BRANCHES = ("static int rt_ok(int x) {\n#if RT_FAST\n  if (x > 0) {\n#else\n  if (x >= 0) {\n#endif\n"
               "    return 1;\n  }\n  return 0;\n}\n")


@pytest.mark.parametrize("text", [GOOD_C + IF_BRANCHES, "#include <stdint.h>\n" + IF_BRANCHES + GOOD_C],
                         ids=["struct before", "struct after"])
def test_braces_unbalanced_by_if_branches_elsewhere_do_not_matter(tmp_path, cli, text):
    # Each #if branch opens the function's block: the file is fine, only a brace count
    # that sees both branches is not. The struct is still found and checked.
    path = tmp_path / "runtime.h"
    path.write_text(text)
    rc, out = cli("conform", path)
    assert rc == 0, out
    path.write_text(text.replace("int64_t my_rank;", "int32_t my_rank;"))
    rc, out = cli("conform", path)
    assert rc == 1 and "- my_rank: size expected 8, found 4" in out, out


def test_header_defining_functions_of_a_library_conforms(tmp_path, cli):
    # The probe links the header's functions; one that calls into a library that is not
    # linked here must not stop the layout from being measured (lazy binding).
    path = tmp_path / "runtime.h"
    path.write_text(GOOD_C.replace("struct P3", "void rt_launch(void);\n"
                                   "void rt_helper(void) { rt_launch(); }\nstruct P3"))
    rc, out = cli("conform", path)
    assert rc == 0, out


# ---------------------------------------------------------------- C++ as runtimes write it

# Every data member with a default member initialiser, in each spelling C++ allows.
CXX_MEMBERS = """\
    std::uint64_t atomic_counter = 4;
    std::uint64_t src_info_ptr{4};
    std::uint64_t row_base_ptr = {8};
    std::uint64_t recv_buf_ptrs[8] = {};
    std::int64_t n_ranks = 0, p2p_world_size{1};
    std::int64_t top_k = {1};
    std::int64_t msg_bytes{};
    std::int64_t max_tokens_per_rank = 0;
    std::int64_t my_rank = -1;
    void *send_mbx = nullptr;
    std::uint64_t send_stamp_ptr{8};
    std::int64_t send_stamp_on = 0;
    std::uint64_t trace_ptr = {0};
    std::int64_t trace_on{0};
    std::int64_t send_trace_slot{-1};
"""
# Members that declare no data: constructors (one with an initialiser list holding
# braces), a method, static and private non-data members.
CXX_METHODS = """\
    P3PeerSendConfig() = default;
    explicit P3PeerSendConfig(std::int64_t rank) noexcept : top_k{1}, my_rank(rank) { n_ranks = 1; }
    P3PeerSendConfig(std::int64_t n, std::int64_t k) noexcept : n_ranks{n}, top_k{k} {}
    std::int64_t slot() const { return send_trace_slot; }
    static constexpr int kMaxRanks = 8;
  private:
    static int instances_;
    void reset() { *this = P3PeerSendConfig{}; }
"""
RECV_SPELLINGS = {
    "= {}": "std::uint64_t recv_buf_ptrs[8] = {};",
    "= {0}": "std::uint64_t recv_buf_ptrs[8] = {0};",
    "[8]{}": "std::uint64_t recv_buf_ptrs[8]{};",
    "[8]{1, ...}": "std::uint64_t recv_buf_ptrs[8]{1, 1, 1, 1, 1, 1, 1, 1};",
    "array<void*, 8>": "std::array<void*, 8> recv_buf_ptrs{};",
    "array<uint64_t, 8>": "std::array<std::uint64_t, 8> recv_buf_ptrs = {};",
}


def _cxx(members=CXX_MEMBERS, wrap="nested", keyword="struct"):
    """A C++ header declaring the struct inside namespace max::ep (two spellings)."""
    access = "  public:\n" if keyword == "class" else ""
    struct = f"{keyword} P3PeerSendConfig {{\n{access}{members}{CXX_METHODS}}};\n"
    head = "#include <array>\n#include <cstdint>\n"
    if wrap == "nested":
        return head + "namespace max {\nnamespace ep {\n" + struct + "}  // namespace ep\n}  // namespace max\n"
    return head + "namespace max::ep {\n" + struct + "}\n"


@pytest.mark.parametrize("spelling", list(RECV_SPELLINGS))
@pytest.mark.parametrize("wrap,keyword", [("nested", "struct"), ("c++17", "class")])
def test_cxx_namespaced_struct_with_initialisers_conforms(tmp_path, cli, wrap, keyword, spelling):
    path = tmp_path / "runtime.hpp"
    path.write_text(_cxx(CXX_MEMBERS.replace("std::uint64_t recv_buf_ptrs[8] = {};",
                                             RECV_SPELLINGS[spelling]), wrap, keyword))
    rc, out = cli("conform", path)
    assert rc == 0, out


@pytest.mark.parametrize("struct", ["P3PeerSendConfig", "ep::P3PeerSendConfig", "max::ep::P3PeerSendConfig",
                                    "::max::ep::P3PeerSendConfig", " max :: ep :: P3PeerSendConfig"])
def test_qualified_struct_name_selects_it(tmp_path, cli, struct):
    path = tmp_path / "runtime.hpp"
    path.write_text(_cxx(wrap="c++17") + "namespace other { struct P3PeerSendConfigs { int x; }; }\n")
    rc, out = cli("conform", path, "--struct", struct)
    assert rc == 0, out
    assert f"{struct} conforms" in out


@pytest.mark.parametrize("old,new,field,phrase", [
    ("std::int64_t n_ranks = 0, p2p_world_size{1};", "std::int32_t n_ranks = 0;\n    std::int64_t p2p_world_size{1};",
     "n_ranks", "size expected 8, found 4"),
    ("std::int64_t send_trace_slot{-1};", "std::uint64_t send_trace_slot{1};", "send_trace_slot", "unsigned integer"),
    ("std::uint64_t recv_buf_ptrs[8] = {};", "std::array<std::uint32_t, 16> recv_buf_ptrs{};", "recv_buf_ptrs",
     "found 16 x 4-byte unsigned integer"),
    ("std::int64_t msg_bytes{};\n", "", "msg_bytes", "missing"),
], ids=["int32 with init", "unsigned brace init", "array<u32, 16>", "dropped"])
def test_cxx_namespaced_struct_is_really_checked(tmp_path, cli, old, new, field, phrase):
    # The struct in the namespace is measured, not skipped: a wrong member is named.
    path = tmp_path / "runtime.hpp"
    path.write_text(_cxx(CXX_MEMBERS.replace(old, new)))
    rc, out = cli("conform", path, "--struct", "max::ep::P3PeerSendConfig")
    assert rc == 1, out
    assert any(ln.strip().startswith(f"- {field}") and phrase in ln for ln in out.splitlines()), out


@pytest.mark.parametrize("asked", ["max::P3PeerSendConfig", "other::P3PeerSendConfig",
                                   "max::ep::P3PeerSendConfig2", "P3PeerSendCfg"])
def test_struct_not_found_never_lists_the_name_asked_for(tmp_path, cli, asked):
    path = tmp_path / "runtime.hpp"
    path.write_text(_cxx() + "struct Other { int x; };\n")
    rc, out = cli("conform", path, "--struct", asked)
    assert rc == 2, out
    seen = re.search(r"no struct '([\w:]+)' found \(structs seen: (.*)\)$", out.strip())
    assert seen and seen.group(1) == asked, out
    assert seen.group(2).split(", ") == ["Other", "max::ep::P3PeerSendConfig"]


# ---------------------------------------------------------------- Mojo as MAX writes it

def _mojo_variant(header, counts="N"):
    """GOOD_MOJO with another struct header line and the array count spelled ``counts``."""
    return GOOD_MOJO.replace("struct P3PeerSendConfig(ImplicitlyCopyable, Movable):", header).replace(
        "Int(8)", counts).replace("from utils import StaticTuple\n",
                                  "from utils import StaticTuple\n\ncomptime N: Int = 8\nalias M: Int = 2 * 4\n")


WRAPPED = "struct P3PeerSendConfig(\n    ImplicitlyCopyable,\n    Movable,  # traits wrap\n):"


@pytest.mark.parametrize("header,counts", [
    (WRAPPED, "Int(8)"),
    ("struct P3PeerSendConfig(ImplicitlyCopyable, Movable):", "N"),
    ("struct P3PeerSendConfig(ImplicitlyCopyable, Movable):", "Int(M)"),
    ("struct P3PeerSendConfig(\n    ImplicitlyCopyable, Movable\n):", "M // 2 + 4"),
], ids=["wrapped traits", "comptime N: Int", "alias M = 2 * 4", "both"])
@pytest.mark.parametrize("suffix", [".mojo", ".txt"])
def test_mojo_wrapped_traits_and_comptime_counts(tmp_path, cli, header, counts, suffix):
    path = tmp_path / ("decl" + suffix)
    path.write_text(_mojo_variant(header, counts))
    rc, out = cli("conform", path)
    assert rc == 0, out
    path.write_text(_mojo_variant(header, counts).replace("var n_ranks: Int", "var n_ranks: Int32"))
    rc, out = cli("conform", path)   # the body after the wrapped header is really read
    assert rc == 1 and "- n_ranks: size expected 8, found 4" in out, out


# ---------------------------------------------------------------- JSON types

def _json_with(**types):
    """``layout --format json`` with the named fields' "type" (and size) replaced."""
    d = json.loads(render("json"))
    for f in d["fields"]:
        if f["name"] in types:
            f["type"], f["size"] = types[f["name"]]
    return json.dumps(d)


C_TYPES = {f.name: (f.c, f.size) for f in FIELDS}


@pytest.mark.parametrize("text", [
    _json_with(**C_TYPES),
    _json_with(recv_buf_ptrs=("std::array<void*, 8>", 64), send_mbx=("void *", 8), top_k=("long long", 8)),
    _json_with(recv_buf_ptrs=("InlineArray[UInt64, 8]", 64), send_mbx=("OpaquePointer", 8)),
], ids=["C types (uint64_t[8])", "void* and std::array", "other Mojo spellings"])
def test_json_c_and_mojo_type_strings_conform(tmp_path, cli, text):
    path = tmp_path / "decl.json"
    path.write_text(text)
    rc, out = cli("conform", path)
    assert rc == 0, out


@pytest.mark.parametrize("types,field,phrase", [
    ({"recv_buf_ptrs": ("uint32_t[16]", 64)}, "recv_buf_ptrs", "found 16 x 4-byte unsigned integer"),
    ({"n_ranks": ("uint64_t", 8)}, "n_ranks", "found 8-byte unsigned integer"),
    ({"trace_ptr": ("double", 8)}, "trace_ptr", "floating point"),
], ids=["u32[16]", "uint64_t for Int", "double"])
def test_json_c_types_are_checked(tmp_path, cli, types, field, phrase):
    path = tmp_path / "decl.json"
    path.write_text(_json_with(**types))
    rc, out = cli("conform", path)
    assert rc == 1 and f"- {field}: type expected" in out and phrase in out, out


# ---------------------------------------------------------------- unusable input

def _json_edit(fn):
    d = json.loads(render("json"))
    fn(d)
    return json.dumps(d)


UNUSABLE = [  # (id, suffix, text, extra args, phrase the one-line error must contain)
    ("compile error", ".h", GOOD_C.replace("int64_t top_k;", "int64_tt top_k;"), (),
     "line 9: unknown type name 'int64_tt'"),
    ("c no struct", ".h", GOOD_C.replace("P3PeerSendConfig", "Other"), (),
     "no struct 'P3PeerSendConfig' found (structs seen: Other)"),
    ("bit-field", ".h", GOOD_C.replace("int64_t trace_on;", "int64_t trace_on : 1;"), (), "bit-field"),
    ("namespace compile error", ".hpp", _cxx(CXX_MEMBERS.replace("std::int64_t top_k", "std::int64_tt top_k")),
     (), "the compiler rejects it as C++ (and as C): line 11: "),   # the line of int64_tt
    ("private members", ".hpp", _cxx(keyword="class").replace("  public:\n", ""), (),
     ("class max::ep::P3PeerSendConfig: data member(s) atomic_counter, src_info_ptr, row_base_ptr and "
      "13 more are not public")),
    ("base class", ".hpp",
     _cxx().replace("struct P3PeerSendConfig {", "struct Base {};\nstruct P3PeerSendConfig : Base {"),
     (), "derives from Base"),
    ("ambiguous", ".hpp", _cxx() + "namespace other {\n" + GOOD_C.split("\n", 2)[2] + "}\n", (),
     "struct 'P3PeerSendConfig' is ambiguous (max::ep::P3PeerSendConfig, other::P3PeerSendConfig)"),
    ("declared only", ".hpp", "namespace max { namespace ep { struct P3PeerSendConfig; } }\n",
     ("--struct", "max::ep::P3PeerSendConfig"), "is only declared here, not defined"),
    ("unclosed", ".h", GOOD_C.replace("};", ""), (),
     "struct P3PeerSendConfig: the '{' on line 3 is never closed"),
    ("mojo unknown type", ".mojo", GOOD_MOJO.replace("var top_k: Int", "var top_k: Tensor[DType.int64]"), (),
     "field top_k: unknown type 'Tensor[DType.int64]'"),
    ("mojo no struct", ".mojo", GOOD_MOJO.replace("struct P3PeerSendConfig", "struct Other"), (),
     "no struct 'P3PeerSendConfig' found (structs seen: Other)"),
    ("mojo unknown count", ".mojo", GOOD_MOJO.replace("Int(8)", "Int(K)"), (),
     "field recv_buf_ptrs: element count 'Int(K)': 'K' is not a comptime/alias of this file"),
    ("bad json", ".json", "{not json", (), "not valid JSON"),
    ("json no fields", ".json", '{"name": "P3PeerSendConfig", "size": 184}', (), '"fields" must be a non-empty list'),
    ("json unknown type", ".json", _json_with(n_ranks=("Int65", 8)), (), "field n_ranks: unknown type 'Int65'"),
    ("json type vs size", ".json", _json_with(recv_buf_ptrs=("uint64_t[8]", 32)), (),
     "field recv_buf_ptrs: type 'uint64_t[8]' is 64 bytes, but \"size\" says 32"),
    ("json no type", ".json", _json_edit(lambda d: d["fields"][4].pop("type")), (),
     'field n_ranks: "type" must be a string'),
    ("json string offset", ".json", _json_edit(lambda d: d["fields"][4].update(offset="88")), (),
     'field n_ranks: "offset" must be an integer >= 0, got "88"'),
    ("json bool size", ".json", _json_edit(lambda d: d["fields"][4].update(size=True)), (),
     'field n_ranks: "size" must be an integer >= 1, got true'),
    ("json no name", ".json", _json_edit(lambda d: d["fields"][2].pop("name")), (),
     'fields[2]: "name" must be a non-empty string, got null'),
    ("json entry not an object", ".json", _json_edit(lambda d: d["fields"].__setitem__(2, [16, 8])), (),
     'fields[2]: expected an object {"name", "offset", "size", "type"}, got [16, 8]'),
    ("json fields not a list", ".json", _json_edit(lambda d: d.update(fields={"n_ranks": 88})), (),
     '"fields" must be a non-empty list'),
    ("json align string", ".json", _json_edit(lambda d: d.update(align="8")), (),
     '"align" must be an integer >= 1, got "8"'),
    ("json duplicate", ".json", _json_edit(lambda d: d["fields"].append(dict(d["fields"][0]))), (),
     "field(s) atomic_counter appear twice"),
    ("json not an object", ".json", "[1, 2]", (), "expected an object"),
    ("json too deep", ".json", "[" * 100_000, (), "not usable JSON: nested too deeply"),
    ("needs a library", ".h", GOOD_C.replace("struct P3", "extern int64_t lib_var;\n"
                                             "int64_t *lib_addr(void) { return &lib_var; }\nstruct P3"), (),
     "conform's probe built but does not load (undefined symbol: lib_var)"),
    ("json no such name", ".json", render("json").replace('"P3PeerSendConfig"', '"Other"'), (),
     "no struct 'P3PeerSendConfig' found (names seen: Other)"),
]


@pytest.mark.parametrize("suffix,text,args,phrase", [c[1:] for c in UNUSABLE], ids=[c[0] for c in UNUSABLE])
def test_unusable_input_exits_2_with_one_clean_line(tmp_path, cli, suffix, text, args, phrase):
    path = tmp_path / ("decl" + suffix)
    path.write_text(text)
    rc, out = cli("conform", path, *args)
    assert rc == 2, out
    assert out.count("\n") == 1 and out.startswith(f"p3send conform: error: {path}: "), out
    assert phrase in out.replace("\u2018", "'").replace("\u2019", "'"), out   # gcc's quotes vary by locale
    for noise in ("Traceback", "KeyError", "TypeError", "ValueError", "_p3conform_", "p3conform-",
                  "CompileError", "distutils", "cffi"):
        assert noise not in out, out


def test_missing_file_exits_2(tmp_path, cli):
    rc, out = cli("conform", tmp_path / "nope.h")
    assert rc == 2 and "cannot read" in out


# ---------------------------------------------------------------- header

HEADER_PROGRAM = """\
#include "p3send.h"
#include <stdio.h>

int main(void)
{
    P3PeerSendConfig cfg = p3_config_disabled();
    const unsigned char *b = (const unsigned char *)&cfg;
    size_t i;
    for (i = 0; i < sizeof cfg; ++i)
        printf("%02x", b[i]);
    cfg.n_ranks = 8;
    cfg.top_k = 8;
    cfg.msg_bytes = 14336;
    printf("\\n%lld %lld\\n", (long long)p3_recv_count_layout(&cfg, 2, 3),
           (long long)p3_recv_buf_layout(&cfg, 3, 2, 16));
    printf("%d %d %d %d %d %d\\n", P3_MAX_RANKS, P5_SEND_MBX_INTS, P5_SEND_MBX_STRIDE,
           P3_TRACE_SLOTS, P3_CONFIG_SIZE, P3_RANGE_READY_FLAG);
    return 0;
}
"""


@pytest.mark.parametrize("compiler,std", [("gcc", "c11"), ("g++", "c++11"), ("g++", "c++17")])
def test_header_builds_and_runs(tmp_path, compiler, std):
    out = compile_and_run(tmp_path, compiler, std, HEADER_PROGRAM, "hdr").split("\n")
    assert out[0] == DISABLED_HEX                       # p3_config_disabled() == Mojo's disabled()
    assert out[1] == "19 372752"                        # the [MAX] formulas, same as layout.py
    assert out[2] == "8 32 4 16 184 1024"


def test_header_static_asserts_catch_a_swap(tmp_path):
    # The header must refuse to build if its own struct drifts, in C and in C++.
    broken = _swap_lines(HEADER.read_text(), "int64_t  top_k", "int64_t  msg_bytes")
    (tmp_path / "p3send.h").write_text(broken)
    import subprocess
    for compiler, std in (("gcc", "c11"), ("g++", "c++11")):
        src = tmp_path / ("t.c" if compiler == "gcc" else "t.cpp")
        src.write_text('#include "p3send.h"\nint main(void) { return 0; }\n')
        r = subprocess.run([compiler, f"-std={std}", f"-I{tmp_path}", "-fsyntax-only", str(src)],
                           capture_output=True, text=True, check=False)
        assert r.returncode != 0 and "top_k must be at offset 104" in r.stderr, r.stderr


def test_header_ends_with_kernel_section():
    text = HEADER.read_text()
    tail = text[text.index("Kernel entry points"):]
    assert "docs/KERNELS.md" in tail and "P3PeerSendConfig" not in tail


# ---------------------------------------------------------------- layout

def test_layout_json_matches_fields(cli):
    rc, out = cli("layout", "--format", "json")
    assert rc == 0
    assert json.loads(out) == {
        "name": "P3PeerSendConfig", "size": 184, "align": 8,
        "fields": [{"name": f.name, "offset": f.offset, "size": f.size, "type": f.mojo} for f in FIELDS]}


@pytest.mark.parametrize("compiler,std", [("gcc", "c11"), ("g++", "c++11")])
def test_layout_c_compiles(tmp_path, cli, compiler, std):
    rc, out = cli("layout", "--format", "c")
    assert rc == 0
    (tmp_path / "gen.h").write_text(out)
    prog = ('#include "gen.h"\n#include <stdio.h>\n'
            'int main(void) { printf("%d", (int)sizeof(P3PeerSendConfig)); return 0; }\n')
    assert compile_and_run(tmp_path, compiler, std, prog, "gen", include=tmp_path) == "184"


@pytest.mark.parametrize("fmt,suffix", [("c", ".h"), ("mojo", ".mojo"), ("json", ".json")])
def test_layout_output_conforms(tmp_path, cli, fmt, suffix):
    rc, out = cli("layout", "--format", fmt)
    path = tmp_path / ("gen" + suffix)
    path.write_text(out)
    rc, report = cli("conform", path)
    assert rc == 0, report


def test_layout_mojo_keeps_the_fields_types(cli):
    rc, out = cli("layout", "--format", "mojo")
    assert rc == 0, out
    decls = re.findall(r"^    var (\w+): (.+?)  #", out, flags=re.MULTILINE)
    assert [n for n, _ in decls] == [f.name for f in FIELDS]
    assert dict(decls)["atomic_counter"] == "UnsafePointer[Int32, Mut]"
    assert dict(decls)["send_mbx"] == "P5SendMailboxPtr"
    assert "comptime P5SendMailboxPtr = UnsafePointer[Int32, SHARED]" in out


def test_layout_numpy_builds_the_dtype(tmp_path, cli):
    rc, out = cli("layout", "--format", "numpy")
    assert rc == 0, out
    (tmp_path / "gen_dtype.py").write_text(out)
    dt = runpy.run_path(str(tmp_path / "gen_dtype.py"))["P3_PEER_SEND_CONFIG_DTYPE"]
    assert dt == CONFIG_DTYPE and dt.itemsize == 184
    assert np.zeros(1, dt)["recv_buf_ptrs"].shape == (1, 8)


def test_layout_table_lists_every_field(cli):
    rc, out = cli("layout", "--format", "table")
    assert rc == 0 and "184 bytes" in out
    for f in FIELDS:
        assert re.search(rf"^\| {f.offset} \| {f.size} \| {f.name} \|", out, flags=re.MULTILINE), f.name


def test_docs_table_is_the_layout_table():
    # docs/ABI.md is normative for outsiders: its table must be FIELDS, row for row.
    docs = (ROOT / "docs" / "ABI.md").read_text().replace("\\*", "*")   # markdown escapes
    rows = [ln for ln in render("table").splitlines() if ln.startswith("| ")]
    missing = [r for r in rows if r not in docs]
    assert not missing, "docs/ABI.md lacks these rows of `p3send layout`:\n" + "\n".join(missing)
    dump = re.findall(r"^ *(\d+): ([0-9a-f ]+)$", docs, flags=re.MULTILINE)   # "OFF: hex hex" lines
    assert [int(off) for off, _ in dump] == list(range(0, 184, 16))
    assert "".join(h.replace(" ", "") for _, h in dump) == DISABLED_HEX
    assert "docs/KERNELS.md" in docs, "docs/ABI.md does not point at the kernels' launch contracts"


def test_render_rejects_unknown_format():
    with pytest.raises(ValueError, match="expected one of table, json, c, mojo, numpy"):
        render("yaml")


# ---------------------------------------------------------------- declarations as code bases write them
#
# tests/cpu/data/conform/ holds declarations in the styles real code bases use. Each verdict
# must be the one a compiler's view of the declaration gives.

DATA = ROOT / "tests" / "cpu" / "data" / "conform"
_CUDA = find_cuda_headers()
needs_cuda_headers = pytest.mark.skipif(not _CUDA.runtime_api, reason="no CUDA headers (cuda_runtime_api.h) here")
BOTH = "checked: without __CUDACC__ (as C), with __CUDACC__ (as C++)"

# C/C++ styles: file -> the configurations line its verdict must print.
C_STYLES = {
    "c_ifdef_else.h": BOTH,              # fields under #ifndef/#else
    "c_if0.h": BOTH,                     # an old definition and a retired field under #if 0
    "c_both_branches.h": BOTH,           # the same field names in both branches of an #if
    "c_xmacro.h": BOTH,                  # fields generated by an X-macro list
    "c_xmacro_include.h": BOTH,          # X-macro fields from an #include inside the struct
    "c_macro_sizes.h": BOTH,             # array lengths, types and the alignment from macros
}


@pytest.mark.parametrize("name", list(C_STYLES))
def test_c_styles_conform_as_the_compiler_sees_them(cli, name):
    rc, out = cli("conform", DATA / name)
    assert rc == 0, out
    assert C_STYLES[name] in out, out


@pytest.mark.parametrize("name,options,field,phrase", [
    ("c_ifdef_else.h", ["-D", "P3_NO_STAMPS"], "send_stamp_ptr", "missing"),
    ("c_ifdef_else.h", ["-D", "P3_NO_STAMPS"], "send_stamp_reserved", "extra field at offset 144"),
    ("c_macro_sizes.h", ["-DEP_MAX_PEERS=4"], "recv_buf_ptrs", "size expected 64, found 32"),
    ("c_xmacro.h", ["-D", "P3_RANKS=2"], "recv_buf_ptrs", "size expected 64, found 16"),
    ("c_xmacro_include.h", ["-D", "P3_MAX_RANKS=4"], "recv_buf_ptrs", "size expected 64, found 32"),
], ids=["-D takes the #else branch", "-D: the branch's field", "-D=VALUE sizes an array", "-D into an X-macro",
        "-D reaches an included .def"])
def test_c_macros_decide_what_the_compiler_sees(cli, name, options, field, phrase):
    rc, out = cli("conform", DATA / name, *options)
    assert rc == 1, out
    assert any(ln.strip().startswith(f"- {field}") and phrase in ln for ln in out.splitlines()), out


def test_c_undefine_after_define_applies_in_order(cli):
    rc, out = cli("conform", DATA / "c_ifdef_else.h", "-D", "P3_NO_STAMPS", "-U", "P3_NO_STAMPS")
    assert rc == 0, out
    rc, out = cli("conform", DATA / "c_ifdef_else.h", "-U", "P3_NO_STAMPS", "-D", "P3_NO_STAMPS")
    assert rc == 1, out


def test_c_cuda_h_found_through_dash_i(cli):
    # --cuda-include none: only -I can provide <cuda.h> (a stand-in written for this test).
    path = DATA / "c_cuda_h.h"
    rc, out = cli("conform", path, "--cuda-include", "none")
    assert rc == 2 and out.count("\n") == 1, out
    assert "line 3: cuda.h: No such file or directory" in out and "pass --cuda-include DIR or -I DIR" in out, out
    rc, out = cli("conform", path, "--cuda-include", "none", "-I", DATA / "include")
    assert rc == 0, out
    assert "CUDA headers: not used (--cuda-include none)" in out, out


def test_c_cuda_h_from_the_cuda_headers_found(cli):
    rc, out = cli("conform", DATA / "c_cuda_h.h")
    if _CUDA.include:
        assert rc == 0 and f"CUDA headers: {_CUDA.include} (from {_CUDA.how})" in out, out
    else:
        assert rc == 2 and "CUDA headers: not found" in out, out


@pytest.fixture
def no_cuda_anywhere(monkeypatch, tmp_path):
    """An environment where no CUDA toolkit can be found: PATH holds only the C compilers."""
    import shutil

    from p3send.conform import toolchain
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cc", "gcc", "c++", "g++", "as", "ld"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(toolchain, "CUDA_ROOTS", ())
    monkeypatch.setattr(toolchain, "CUDA_WHEEL_PACKAGE", "p3send_no_such_wheel")


def test_cuda_headers_not_found_is_said(cli, no_cuda_anywhere):
    assert find_cuda_headers().include is None
    rc, out = cli("conform", HEADER)   # p3send.h needs __device__ only under __CUDACC__
    assert rc == 0, out
    assert "checked: without __CUDACC__ (as C)" in out, out
    assert re.search(r"^  with __CUDACC__: not checked: .*line \d+: .*__device__", out, flags=re.M), out
    assert "CUDA headers: not found (looked at $CUDA_HOME" in out, out
    rc, out = cli("conform", DATA / "c_cuda_h.h")
    assert rc == 2 and "line 3: cuda.h: No such file or directory (CUDA headers: not found; pass" in out, out


@needs_cuda_headers
def test_the_shipped_header_is_checked_with_and_without_cudacc(cli):
    rc, out = cli("conform", HEADER)
    assert rc == 0, out
    assert BOTH in out and f"CUDA headers: {_CUDA.include}" in out, out


@needs_cuda_headers
def test_cudacc_dependent_layout_is_named_per_configuration(cli):
    path = DATA / "c_cudacc.h"
    rc, out = cli("conform", path)
    assert rc == 1, out
    lines = out.splitlines()
    assert "  without __CUDACC__ (as C++): conforms" in lines, out
    at = lines.index("  with __CUDACC__ (as C++): 2 problem(s):")
    assert lines[at + 1].startswith("  - n_ranks: size expected 8, found 4"), out
    assert lines[at + 2].startswith("  - top_k: size expected 8, found 4"), out
    assert cli("conform", path, "--cudacc", "without")[0] == 0
    rc, out = cli("conform", path, "--cudacc", "with")
    assert rc == 1 and "  - n_ranks: size expected 8, found 4" in out and "checked: with __CUDACC__ (as C++)" in out
    problems = check_path(path)
    assert problems[0].startswith("with __CUDACC__ (as C++): n_ranks: size expected 8, found 4"), problems


@needs_cuda_headers
def test_cuda_only_header_is_checked_with_cudacc(cli):
    # __align__ and __device__ with no include of their own: nvcc's view only.
    rc, out = cli("conform", DATA / "c_cuda_only.cuh")
    assert rc == 0, out
    assert "checked: with __CUDACC__ (as C++)" in out, out
    assert re.search(r"^  without __CUDACC__: not checked: struct P3PeerSendConfig: the compiler rejects it "
                     r"as C\+\+ \(and as C\): line 5: ", out, flags=re.M), out
    rc, out = cli("conform", DATA / "c_cuda_only.cuh", "--cudacc", "without")
    assert rc == 2 and "line 5: " in out and out.count("\n") == 1, out


@pytest.mark.skipif(not (_CUDA.runtime_api and _CUDA.nvcc), reason="needs the CUDA headers and nvcc")
def test_header_including_cuda_runtime_is_built_by_nvcc(cli):
    # cuda_runtime.h's device overloads build only through nvcc's front end.
    rc, out = cli("conform", DATA / "c_cuda_runtime.cuh")
    assert rc == 0, out
    assert "checked: without __CUDACC__ (as C++), with __CUDACC__ (as C++ by nvcc)" in out, out


def test_an_error_in_an_included_file_names_that_file(tmp_path, cli):
    (tmp_path / "c_xmacro_include.h").write_text((DATA / "c_xmacro_include.h").read_text())
    fields = (DATA / "c_xmacro_fields.def").read_text().replace("P3_FIELD(int64_t, n_ranks)",
                                                                "P3_FIELD(int64_tt, n_ranks)")
    (tmp_path / "c_xmacro_fields.def").write_text(fields)
    rc, out = cli("conform", tmp_path / "c_xmacro_include.h", "--cudacc", "without")
    assert rc == 2 and out.count("\n") == 1, out
    assert "c_xmacro_fields.def:5: unknown type name 'int64_tt'" in out.replace("\u2018", "'").replace(
        "\u2019", "'"), out


@pytest.mark.parametrize("args,phrase", [
    (["-D", "1X"], "'-D1X': expected -DNAME, -DNAME=VALUE or -UNAME"),
    (["-D", "__CUDACC__"], "-D__CUDACC__: __CUDACC__ is set by --cudacc"),
    (["-U", "A=1"], "'-UA=1': expected"),
    (["-I", "/no/such/folder"], "-I /no/such/folder: no such folder"),
    (["--cuda-include", "/no/such/cuda"], "--cuda-include /no/such/cuda: no such folder"),
])
def test_bad_compiler_options_exit_2_with_one_line(cli, args, phrase):
    rc, out = cli("conform", HEADER, *args)
    assert rc == 2 and out.count("\n") == 1 and phrase in out, out


# ---------------------------------------------------------------- Mojo as MAX and others write it

MOJO_STYLES = [
    "mojo_max_style.mojo",        # a comptime alias whose bracketed type wraps, decorators, methods
    "mojo_alias_keyword.mojo",    # `alias` with wrapped types and a parenthesised constant, @value
    "mojo_parametric.mojo",       # parametric aliases (PerPeer[T], DevicePtr[dtype, //, origin])
    "mojo_traits_and_docs.mojo",  # traits over lines, comments and docstrings between fields
    "mojo_named_counts.mojo",     # StaticTuple[T, Self.MAX_RANKS]: a struct-level constant
    "mojo_more_after.mojo",       # a trait and other structs (with their own N) after it
]


@pytest.mark.parametrize("name", MOJO_STYLES)
def test_mojo_styles_conform(tmp_path, cli, name):
    rc, out = cli("conform", DATA / name)
    assert rc == 0, out
    broken = re.sub(r"(var n_ranks: )\w+", r"\g<1>Int32", (DATA / name).read_text())
    (tmp_path / name).write_text(broken)
    rc, out = cli("conform", tmp_path / name)   # the fields are really read
    assert rc == 1 and "- n_ranks: size expected 8, found 4" in out, out


@pytest.mark.parametrize("old,new,phrase", [
    ("comptime P5SendMailboxPtr = UnsafePointer[", "comptime P5SendMailboxPtr = SharedBuffer[",
     "line 5: P5SendMailboxPtr = SharedBuffer[ Int32, MutAnyOrigin, address_space = AddressSpace.SHARED, ]: "
     "unknown type"),
    ("    address_space = AddressSpace.SHARED,\n]\n", "    address_space = AddressSpace.SHARED,\n\n",
     "line 5: the '[' opened here is never closed"),
    ("comptime P3_MAX_RANKS = 8", "comptime P3_MAX_RANKS = MAX_PEERS",
     "line 12: P3_MAX_RANKS = MAX_PEERS: element count 'MAX_PEERS': 'MAX_PEERS' is not a comptime/alias of this "
     "file (the type of field recv_buf_ptrs, line 25)"),
], ids=["unknown type in a wrapped alias", "unclosed alias bracket", "unknown count in an alias"])
def test_mojo_errors_name_the_line_of_their_cause(tmp_path, cli, old, new, phrase):
    text = (DATA / "mojo_max_style.mojo").read_text()
    assert old in text
    path = tmp_path / "decl.mojo"
    path.write_text(text.replace(old, new))
    rc, out = cli("conform", path)
    assert rc == 2 and out.count("\n") == 1, out
    assert phrase in out, out
    # An error in the field's own type still names the field's line.
    path.write_text(text.replace("var top_k: Int", "var top_k: Tensor[DType.int64]"))
    rc, out = cli("conform", path)
    assert rc == 2 and "line 31: field top_k: unknown type 'Tensor[DType.int64]'" in out, out


# ---------------------------------------------------------------- JSON with C++ types

@pytest.mark.parametrize("name", ["json_std_types.json", "json_c_spellings.json"])
def test_json_std_and_c_spellings_conform(tmp_path, cli, name):
    rc, out = cli("conform", DATA / name)
    assert rc == 0, out
    d = json.loads((DATA / name).read_text())
    d["fields"][4].update(type="std::int32_t", size=4)
    (tmp_path / name).write_text(json.dumps(d))
    rc, out = cli("conform", tmp_path / name)
    assert rc == 1 and "- n_ranks: size expected 8, found 4" in out, out


# ---------------------------------------------------------------- files that are no declaration

def _conform_subprocess(path, timeout=60):
    """``p3send conform PATH`` in a fresh process with a wall-clock bound and a memory cap."""
    import resource
    import subprocess
    import sys

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    return subprocess.run([sys.executable, "-m", "p3send", "conform", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap_memory)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os
    fifo = tmp_path / "decl.h"
    os.mkfifo(fifo)
    r = _conform_subprocess(fifo)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == f"p3send conform: error: {fifo}: cannot read: is a FIFO (named pipe); expected a regular file\n"


def test_dev_zero_is_refused_without_reading_it():
    r = _conform_subprocess("/dev/zero")
    assert r.returncode == 2, r
    assert r.stderr == "p3send conform: error: /dev/zero: cannot read: is a character device; expected a regular file\n"


def test_a_folder_is_refused(tmp_path, cli):
    rc, out = cli("conform", tmp_path)
    assert rc == 2 and out == f"p3send conform: error: {tmp_path}: cannot read: is a folder; expected a regular file\n"


@pytest.mark.parametrize("suffix,cases", [
    (".h", [("#include <stdint.h>\nstruct P3PeerSendConfig {\n" + "{" * 200_000 + "\n",
             "line 3: brackets nested more than 256 deep"),
            ("}" * 100_000 + ")" * 100_000 + "\n", "no struct 'P3PeerSendConfig' found")]),
    (".mojo", [("struct P3PeerSendConfig:\n    var x: StaticTuple[" + "[" * 200_000 + "\n",
                "line 2: brackets nested more than 256 deep"),
               ("struct P3PeerSendConfig:\n    var x: Int\n" + "]" * 200_000, "line 3: ']' closes nothing")]),
], ids=["c", "mojo"])
def test_huge_unbalanced_brackets_answer_fast(tmp_path, cli, suffix, cases):
    import time
    for text, phrase in cases:
        path = tmp_path / ("decl" + suffix)
        path.write_text(text)
        start = time.monotonic()
        rc, out = cli("conform", path)
        elapsed = time.monotonic() - start
        assert rc == 2 and out.count("\n") == 1 and phrase in out, out
        assert elapsed < 5, f"{elapsed:.1f} s for {len(text)} characters"


def test_paths_with_quotes_and_spaces_reach_the_compiler(tmp_path, cli):
    folder = tmp_path / 'my "runtime" dir'
    folder.mkdir()
    (folder / "c_xmacro_fields.def").write_text((DATA / "c_xmacro_fields.def").read_text())
    header = folder / 'p3 "config" v2.h'
    header.write_text((DATA / "c_xmacro_include.h").read_text())
    rc, out = cli("conform", header)
    assert rc == 0, out
    assert BOTH in out or "checked: without __CUDACC__ (as C)" in out, out
    rc, out = cli("conform", header, "-I", folder, "-D", "P3_MAX_RANKS=4")
    assert rc == 1 and "- recv_buf_ptrs: size expected 64, found 32" in out, out
    plain = folder / 'plain "x" \\ $HOME.h'   # quotes, a backslash, a dollar: no shell, nothing quoted
    plain.write_text(render("c"))
    rc, out = cli("conform", plain)
    assert rc == 0, out


# ---------------------------------------------------------------- the package

def test_conform_package_imports_only_abi_and_the_standard_library():
    import ast
    import sys
    for path in sorted((ROOT / "p3send" / "conform").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 or (node.level == 2 and (node.module or "").startswith("abi")), \
                    (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] in sys.stdlib_module_names | {"__future__", "numpy", "cffi"}, \
                    (path.name, node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name.split(".")[0] in sys.stdlib_module_names | {"numpy", "cffi"}, (path.name, a.name)


def test_declaration_file_errors_are_input_file_errors(tmp_path):
    from p3send.abi.errors import InputFileError, P3SendError
    from p3send.conform import DeclarationError, DeclarationFileError, check
    with pytest.raises(DeclarationFileError) as e:
        check(tmp_path)
    assert isinstance(e.value, InputFileError) and isinstance(e.value, DeclarationError)
    assert isinstance(e.value, P3SendError) and e.value.path == str(tmp_path)
