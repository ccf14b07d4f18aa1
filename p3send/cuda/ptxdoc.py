"""Read the documented interface of p3send's PTX files (CPU only, no CUDA).

Every PTX file opens with a header per entry point::

    // ENTRY p3_abi_echo
    // <what it does>
    // PARAMS
    //   off  size  type              name   meaning
    //     0   184  P3PeerSendConfig  cfg    the ABI struct, by value
    //   184     8  u64               out    ptr: ...
    // LAUNCH ... / ORDERING ... / REQUIRES ... / TIMEOUT ...

(``// FUNC name`` for linkable ``.func`` entry points.) This module parses those
tables, the ``.entry``/``.func`` declarations and every ``ld.param`` so that the
loader, ``check-ptx`` and the CPU lint compare the three against each other and
against ``abi.FIELDS``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..abi.errors import ConfigError

#: Parameter types a header may use, with (size, alignment).
PARAM_TYPES = {
    "P3PeerSendConfig": (184, 8),
    "u64[8]": (64, 8),
    "u64": (8, 8), "s64": (8, 8), "u32": (4, 4), "s32": (4, 4), "f32": (4, 4),
}
HEADER_SECTIONS = ("PARAMS", "LAUNCH", "ORDERING", "REQUIRES", "TIMEOUT")


@dataclass
class Param:
    offset: int
    size: int
    type: str
    name: str
    meaning: str = ""
    line: int = field(default=0, compare=False)    # of its PARAMS row (0: from a declaration)


@dataclass
class Entry:
    name: str
    kind: str                       # "entry" or "func"
    params: list[Param] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)
    line: int = field(default=0, compare=False)    # of its '// ENTRY name' line


_HDR_START = re.compile(r"^//\s*(ENTRY|FUNC)\s+(\w+)\s*$")
_ROW = re.compile(r"^//\s+(\d+)\s+(\d+)\s+(\S+)\s+(\w+)\s*(.*)$")
_SECTION = re.compile(r"^//\s*(PARAMS|LAUNCH|ORDERING|REQUIRES|TIMEOUT)\b\s*(.*)$")


def parse_header(text: str) -> dict[str, Entry]:
    """The documented entries of a PTX file, by name, in file order."""
    out: dict[str, Entry] = {}
    cur: Entry | None = None
    section = None
    for ln, line in enumerate(text.splitlines(), 1):
        s = line.rstrip()
        m = _HDR_START.match(s)
        if m:
            cur = Entry(m.group(2), "entry" if m.group(1) == "ENTRY" else "func", line=ln)
            out[cur.name] = cur
            section = None
            continue
        if cur is None or not s.startswith("//"):
            if not s.startswith("//"):
                cur, section = None, None
            continue
        m = _SECTION.match(s)
        if m:
            section = m.group(1)
            cur.sections[section] = m.group(2).strip()
            continue
        if section == "PARAMS":
            r = _ROW.match(s)
            if r:
                cur.params.append(Param(int(r.group(1)), int(r.group(2)), r.group(3), r.group(4),
                                        r.group(5).strip(), line=ln))
                continue
        if section:
            cur.sections[section] = (cur.sections[section] + " " + s[2:].strip()).strip()
    return out


# Group 1 holds every linkage directive (".visible .extern ..."); a plain ".entry" has none.
_DECL = re.compile(r"((?:\.(?:visible|extern|weak)\s+)*)\.(entry|func)\s*(\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)", re.S)
_PDECL = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\w+)(?:\[(\d+)\])?")
_SCALAR = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4,
           "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8, "bf16": 2, "b128": 16}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_decls(text: str) -> dict[str, list[Param]]:
    """The parameters each ``.entry``/``.func`` actually declares, with offsets laid out
    by the PTX rules (each parameter aligned to its ``.align`` or element size)."""
    out = {}
    for m in _DECL.finditer(_strip_comments(text)):
        params, off = [], 0
        for p in _PDECL.finditer(m.group(5)):
            elem = _SCALAR[p.group(2)]
            align = int(p.group(1) or elem)
            size = elem * int(p.group(4) or 1)
            off = (off + align - 1) // align * align
            params.append(Param(off, size, p.group(2) + (f"[{p.group(4)}]" if p.group(4) else ""), p.group(3)))
            off += size
        out[m.group(4)] = params
    return out


# Destination: a register or a vector "{%a, %b}"; state space may be ".param::entry"/"::func";
# offsets may be decimal or hex. A load this does not match is not checked (ptxlint.lint flags it).
_LDPARAM = re.compile(r"\bld\.param(?:::\w+)?((?:\.v[248])?)\.(\w+)\s+(?:\{[^}]*\}|[^,{]+),"
                      r"\s*\[\s*(\w+)\s*(?:\+\s*(0[xX][0-9a-fA-F]+|\d+))?\s*\]")


@dataclass
class Decl:
    name: str
    kind: str       # "entry" or "func"
    extern: bool    # an ``.extern .func`` reference, defined in another file
    line: int


def _blank_comments(text: str) -> str:
    """``text`` with comments replaced by spaces, newlines kept, so offsets map to lines."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)


def declarations(text: str) -> list[Decl]:
    """Every ``.entry``/``.func`` declaration, in file order (one per name), with its line."""
    code, out, seen = _blank_comments(text), [], set()
    for m in _DECL.finditer(code):
        if m.group(4) not in seen:
            seen.add(m.group(4))
            out.append(Decl(m.group(4), m.group(2), ".extern" in m.group(1),
                            code.count("\n", 0, m.start()) + 1))
    return out


def scalar_size(ptx_type: str) -> int | None:
    """Bytes of one ``ptx_type`` element (``u64``, ``b32``, ``f16``...), or None for another name."""
    return _SCALAR.get(ptx_type)


def parse_param_loads(text: str) -> list[tuple[int, str, int, int]]:
    """Every ``ld.param`` with a symbolic address: (line, param name, byte offset, width)."""
    loads = []
    for i, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0]
        for m in _LDPARAM.finditer(code):
            vec = int(m.group(1)[2:]) if m.group(1) else 1
            off = m.group(4) or "0"
            off = int(off, 16) if off[:2] in ("0x", "0X") else int(off)
            loads.append((i, m.group(3), off, _SCALAR[m.group(2)] * vec))
    return loads


def ptx_version(text: str) -> tuple[int, int] | None:
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def ptx_target(text: str) -> str | None:
    m = re.search(r"^\s*\.target\s+(\w+)", text, re.M)
    return m.group(1) if m else None


_PROTO = re.compile(r"\.visible\s+\.func\s+(?:\([^)]*\)\s*)?(\w+)\s*\([^)]*\)\s*;")
_DEFN = r"\.visible\s+\.func\s+(?:\([^)]*\)\s*)?{name}\s*\([^)]*\)\s*\{{"
_MODULE_DIRECTIVE = re.compile(r"^\s*\.(version|target|address_size)\b[^\n]*$", re.M)


def prototypes(text: str) -> list[str]:
    """Names of ``.visible .func`` prototypes (declared with ``;``, defined elsewhere)."""
    return _PROTO.findall(_strip_comments(text))


_SEND_PROTO = re.compile(r"\.(visible|extern)(\s+\.func\s+(?:\([^)]*\)\s*)?p3_send_\w*\s*\([^)]*\)\s*;)")


def set_prototype_linkage(text: str, linkage: str) -> str:
    """``text`` with its prototypes of p3send's device functions (``p3_send_*``, defined in
    p3_send_rows.ptx) declared ``.visible`` (``linkage="visible"``: the shipped form, one
    module with p3_send_rows.ptx appended, see ``module_text``) or ``.extern``
    (``"extern"``: nvcc -rdc's own output, for a linker that resolves them: cuLink,
    nvJitLink). Definitions and other functions are left alone. Raises ConfigError for
    another ``linkage`` or a text that declares no such prototype."""
    if linkage not in ("visible", "extern"):
        raise ConfigError(f"linkage: expected 'visible' or 'extern', got {linkage!r}", "PTX linkage")
    out, n = _SEND_PROTO.subn(lambda m: f".{linkage}{m.group(2)}", text)
    if not n:
        raise ConfigError("text: expected a PTX module declaring p3_send_* prototypes (.visible or .extern "
                          ".func ...;), got none", "PTX linkage")
    return out


def module_text(text: str, siblings, *, nvshmem: bool = False) -> str:
    """The PTX assembled as ONE module for a file that declares ``.visible .func``
    prototypes: the file itself (so JIT error lines still point into it), then the text
    of each sibling file defining those functions, minus its module directives.
    Compiled whole-program, the calls inline (no call-ABI stack). ``siblings``: iterable
    of (name, text). Every text loses its NVSHMEM regions (``without_nvshmem``) unless
    ``nvshmem`` (a module linked with the transport's shim: p3send.cuda.nvshmem_link).
    Raises ValueError naming a prototype no sibling defines."""
    keep = (lambda t: t) if nvshmem else without_nvshmem
    text = keep(text)
    wanted = prototypes(text)
    if not wanted:
        return text
    parts, found = [text], set()
    for name, other in siblings:
        other = keep(other)
        code = _strip_comments(other)
        defined = {w for w in wanted if re.search(_DEFN.format(name=re.escape(w)), code)}
        if defined - found:
            parts.append(f"\n// ---- appended from {name} ----\n" + _MODULE_DIRECTIVE.sub("", other))
            found |= defined
    missing = sorted(set(wanted) - found)
    if missing:
        raise ConfigError(f"no PTX file defines {', '.join(missing)}", "PTX module")
    return "".join(parts)


# ---------------------------------------------------------------- optional regions of a PTX text

#: A region's markers are ``// <NAME> ONLY {`` and ``// <NAME> ONLY }``, each on a line of its own;
#: a region's lines ``<alt><code>`` are what the text without the region has instead.
#: FP8: the FP8 wire's code (the bf16-only text has the ``//BF16`` lines instead);
#: NVSHMEM: the NVSHMEM transport's put path (p3_send_rows.ptx, p3_scatter_send_fp8.ptx; every
#: module loaded without the transport has the ``//DIRECT`` lines instead: no .extern calls).
REGIONS = {"FP8": "//BF16 ", "NVSHMEM": "//DIRECT "}


def region_markers(name: str) -> tuple[str, str]:
    """The begin and end marker lines of the ``name`` regions."""
    return f"// {name} ONLY {{", f"// {name} ONLY }}"


FP8_ONLY_BEGIN, FP8_ONLY_END = region_markers("FP8")
BF16_ALT = REGIONS["FP8"]
NVSHMEM_ONLY_BEGIN, NVSHMEM_ONLY_END = region_markers("NVSHMEM")


def without_region(text: str, name: str) -> str:
    """``text`` without its ``name`` regions (``REGIONS``): the lines between
    ``// <name> ONLY {`` and ``// <name> ONLY }`` are dropped, except a region's lines
    ``<alt> <code>`` (``REGIONS[name]``), which become that code. Other regions' markers
    are left alone (regions of different names may not overlap). Raises ConfigError (a
    ValueError) for an unknown name and on nested, unclosed or unopened markers."""
    if name not in REGIONS:
        raise ConfigError([f"name: expected one of {', '.join(REGIONS)}, got {name!r}"], "PTX text")
    (begin, end), alt = region_markers(name), REGIONS[name]
    out, inside = [], False
    for n, line in enumerate(text.split("\n"), 1):
        s = line.strip()
        if s == begin:
            if inside:
                raise ConfigError([f"line {n}: '{begin}' inside another"], "PTX text")
            inside = True
        elif s == end:
            if not inside:
                raise ConfigError([f"line {n}: '{end}' without a begin"], "PTX text")
            inside = False
        elif not inside:
            out.append(line)
        elif s.startswith(alt):
            out.append(line[: len(line) - len(line.lstrip())] + s[len(alt):])
    if inside:
        raise ConfigError([f"'{begin}' never closed"], "PTX text")
    return "\n".join(out)


def without_fp8(text: str) -> str:
    """``text`` without its FP8-wire code (``without_region(text, "FP8")``): what a module that
    only ever sends or receives the bf16 wire is built from (the FP8 code, though never run
    there, made such kernels slower: docs/PERF.md)."""
    return without_region(text, "FP8")


def without_nvshmem(text: str) -> str:
    """``text`` without the NVSHMEM transport's put path (``without_region(text, "NVSHMEM")``):
    what every module loaded without the transport is built from (it then calls no
    ``.extern`` shim function, and its cubin is the one of the text before the put path)."""
    return without_region(text, "NVSHMEM")
