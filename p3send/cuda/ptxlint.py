"""The PTX linter behind ``p3send check-ptx``: lint a PTX file's documented interface,
assemble it for every target and judge its resources. CPU only: nvJitLink (a pip wheel,
through ``driver.nvjitlink_link``) in-process and, when on PATH, the system ``ptxas``;
never the CUDA driver.

A file fails on an assembler error, a register spill, any stack frame or local memory in
an ``.entry`` (p3send kernels must not touch local memory: it is slow and hides spills),
a ``.version`` newer than ``MAX_PTX_VERSION``, a missing ``.version``/``.target``, and on
any :func:`lint` problem.

Linkable ``.func`` files. nvJitLink compiles each input as relocatable code (as
``ptxas -c`` does) and then links, so an entry calling an unresolved ``.extern .func``
fails to link. A file with extern references is therefore linked together with the PTX
files beside it that define them (its report lists only its own functions), and an
extern that no file there defines is a problem of its own, checked without the linker,
which accepts unresolved externs in a file without entries. ``ptxas`` compiles a file
with no ``.entry`` or with extern references with ``-c`` (as it will be linked) and a
self-contained file as a whole program, as the driver JIT does when it loads that file.
The two modes allocate registers differently: a kernel at its register ceiling may
spill in one and not in the other, hence both tools.

Only the files named are judged. The files beside one are read only when it links them
(``.extern .func`` references, ``.visible .func`` prototypes); one that is not PTX text
there is skipped, and named in the message if a function it might define is missing.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..abi.config import FIELDS, P3_CONFIG_SIZE
from ..abi.errors import ConfigError, InputFileError, NoDeviceError
from ..abi.files import read_bytes
from . import driver, ptxdoc
from .ptxdoc import Decl, declarations

__all__ = ["DEFAULT_ARCHS", "MAX_PTX_VERSION", "Decl", "Report", "Resources", "assemble", "assemble_ptxas",
           "assembly_unit", "check_archs", "check_file", "constant_problems", "declarations", "file_problems",
           "header_constants", "links_siblings", "lint", "nvjitlink_missing", "parse_resources", "providers",
           "read_ptx", "siblings", "targets"]

DEFAULT_ARCHS = ("sm_90", "sm_100")

#: Newest PTX ISA the oldest supported driver loads. A driver JIT-compiles PTX up to the
#: ISA of its CUDA release: 7.8 needs driver >= 520 (CUDA 11.8), 8.0 >= 525 (12.0),
#: 8.1 >= 530, 8.2 >= 535, 8.3 >= 545, 8.4 >= 550, 8.5 >= 555 (12.5/12.6), 8.6 (12.7) and
#: 8.7 >= 570 (12.8), 8.8 >= 575 (12.9), 9.0 >= 580 (13.0). Driver 580 rejects 9.1+ with
#: CUDA_ERROR_UNSUPPORTED_PTX_VERSION, and nvJitLink >= 13.1 would assemble it silently.
MAX_PTX_VERSION = (9, 0)

#: The form of a target: a real architecture, optionally arch- or family-specific (a/f).
_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_ARCH_FORM = "sm_<number> with an optional 'a' or 'f' suffix (e.g. sm_90, sm_90a, sm_100)"


# ----------------------------------------------------------------------------- inputs

def check_archs(archs, what: str = "arch") -> list[str]:
    """The targets to assemble for, checked before any work.

    Args:
        archs: target names, e.g. ``["sm_90", "sm_100"]``; repeats are dropped.
        what: how the caller names them in messages (the command passes ``--arch``).

    Returns:
        ``archs`` in order, without repeats.

    Raises:
        ConfigError: a name not of the form ``sm_<number>[a|f]``, or one the installed
            nvJitLink refuses; the message names it and the accepted form.
    """
    out = []
    for arch in archs:
        if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
            raise ConfigError(f"expected {_ARCH_FORM}, got {arch!r}", what)
        if arch not in out:
            out.append(arch)
    if nvjitlink_missing() is None:
        for arch in out:
            why = driver.nvjitlink_refuses([f"-arch={arch}"])
            if why:
                raise ConfigError(why, what)
    return out


def read_ptx(path) -> str:
    """The text of a PTX file.

    Args:
        path: a path (str or ``os.PathLike``) to a regular file of at most
            ``abi.files.MAX_TEXT_BYTES``.

    Returns:
        The file's text.

    Raises:
        InputFileError: the path is missing, not a regular file (a folder, a FIFO, a
            device), too large, binary (a NUL byte) or not UTF-8; one line naming it.
    """
    data = read_bytes(path, what="PTX file")
    nul = data.find(b"\0")
    if nul >= 0:
        raise InputFileError(f"PTX file {path}: a binary file (NUL at byte {nul}), not PTX text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"PTX file {path}: not PTX text: byte {e.start} ({data[e.start]:#04x}) is not "
                             "UTF-8 (PTX is ASCII)") from None


def links_siblings(text: str) -> bool:
    """Whether the PTX ``text`` needs functions from other files: ``.extern .func``
    references (linked) or ``.visible .func`` prototypes (appended, see ``assembly_unit``)."""
    return any(d.extern for d in declarations(text)) or bool(ptxdoc.prototypes(text))


def siblings(path) -> tuple[list[tuple[str, str]], list[str]]:
    """The other PTX files in the folder of ``path``, for the functions it links.

    Args:
        path: the PTX file whose folder is searched (``*.ptx``, sorted by name).

    Returns:
        ((name, text) of each readable PTX file other than ``path``, one line per file
        skipped because it is not PTX text or not a regular file).
    """
    path = Path(path)
    found, skipped = [], []
    for other in sorted(path.parent.glob("*.ptx")):
        if other.resolve() == path.resolve():
            continue
        try:
            found.append((other.name, read_ptx(other)))
        except InputFileError as e:
            skipped.append(str(e))
    return found, skipped


def _not_read(skipped: list[str]) -> str:
    return f" (not read: {'; '.join(skipped)})" if skipped else ""


def providers(path, text: str, sibling_files=None) -> tuple[list[tuple[str, str]], set[str]]:
    """The PTX files beside ``path`` that define its ``.extern`` functions.

    Args:
        path: the PTX file (its folder is searched unless ``sibling_files`` is given).
        text: its text.
        sibling_files: (name, text) pairs to search instead (from ``siblings``).

    Returns:
        ((name, text) of each file defining one of them, the names none defines). A file
        without extern references reads nothing.
    """
    wanted = {d.name for d in declarations(text) if d.extern}
    if not wanted:
        return [], set()
    if sibling_files is None:
        sibling_files = siblings(path)[0]
    out, missing = [], set(wanted)
    for name, other in sibling_files:
        defined = wanted & {d.name for d in declarations(other) if not d.extern}
        if defined:
            out.append((name, other))
            missing -= defined
    return out, missing


def assembly_unit(path, text: str, sibling_files=None) -> tuple[str, list[str]]:
    """What is assembled for ``path``, and the nvJitLink options for it.

    A file declaring ``.visible .func`` prototypes becomes one module with the sibling
    files defining them appended (what the loader JIT-compiles, whole-program, calls
    inlined). nvJitLink compiles relocatably, so there its callees must fit the caller's
    register budget (65536 / .maxntid) and its call-ABI frames are not what runs.

    Args:
        path: the PTX file (its folder is searched unless ``sibling_files`` is given).
        text: its text.
        sibling_files: (name, text) pairs to search instead (from ``siblings``).

    Returns:
        (the module text: ``text`` itself, the same object, when it declares no
        prototypes; the nvJitLink options, e.g. ``["-maxrregcount=168"]``).

    Raises:
        ConfigError: (a ValueError) no sibling defines a prototype.
    """
    if not ptxdoc.prototypes(text):
        return text, []
    skipped = []
    if sibling_files is None:
        sibling_files, skipped = siblings(path)
    try:
        whole = ptxdoc.module_text(text, sibling_files)
    except ConfigError as e:
        if not skipped:
            raise
        raise ConfigError([p + _not_read(skipped) for p in e.problems], e.what) from None
    m = re.search(r"\.maxntid\s+(\d+)", whole)
    opts = [f"-maxrregcount={min(255, 65536 // int(m.group(1)) // 8 * 8)}"] if whole is not text and m else []
    return whole, opts


def targets(text: str, archs) -> list[str]:
    """The archs to assemble ``text`` for.

    Args:
        text: PTX text.
        archs: the targets asked for.

    Returns:
        ``archs``, except that a file whose ``.target`` is arch-specific (``sm_90a``:
        wgmma) assembles for that target alone.
    """
    specific = re.search(r"^\s*\.target\s+(sm_\d+a)\b", text, re.M)
    return [specific.group(1)] if specific else list(archs)


# ----------------------------------------------------------------------------- lint

def _cfg_slots() -> tuple[tuple[int, int, str], ...]:
    """(offset, size, label) of each unit an ``ld.param`` may load from P3PeerSendConfig:
    every field, with ``recv_buf_ptrs`` split into its eight 8-byte elements."""
    slots = []
    for f in FIELDS:
        if f.kind == "ptr[8]":
            slots += [(f.offset + 8 * i, 8, f"{f.name}[{i}]") for i in range(f.size // 8)]
        else:
            slots.append((f.offset, f.size, f.name))
    return tuple(slots)


_CFG_SLOTS = _cfg_slots()
#: send_mbx is a 32-bit .shared address on the device; the other 4 bytes are padding.
_NARROW_OK = {("send_mbx", 4)}
_LD_MNEMONIC = re.compile(r"\bld\.param\S*")


def _check_cfg_load(what: str, pname: str, off: int, width: int) -> str | None:
    """Why a load of ``width`` bytes at ``off`` in a P3PeerSendConfig is wrong, or None."""
    for s_off, s_size, label in _CFG_SLOTS:
        if s_off <= off < s_off + s_size:
            if off != s_off:
                return f"{what} is inside {label} (offset {s_off}, {s_size} bytes)"
            if width == s_size or (label, width) in _NARROW_OK:
                return None
            return f"{what} is {width} bytes wide but {label} (offset {s_off}) is {s_size} bytes"
    return f"{what} is outside {pname} (P3PeerSendConfig, {P3_CONFIG_SIZE} bytes)"


def _check_plain_load(what: str, p: ptxdoc.Param, off: int, width: int) -> str | None:
    """Why a load from a scalar or array parameter is wrong, or None."""
    elem = ptxdoc.scalar_size(p.type.split("[")[0])
    if off < 0 or off + width > p.size:
        return f"{what} reaches outside {p.name} ({p.type}, {p.size} bytes)"
    if elem is not None and width != elem:
        return f"{what} is {width} bytes wide but {p.name} ({p.type}) has {elem}-byte elements"
    if elem is not None and off % elem:
        return f"{what} straddles two elements of {p.name} ({p.type})"
    return None


def _check_params(name: str, hdr: ptxdoc.Entry, declared: list[ptxdoc.Param],
                  decl_line: int) -> list[tuple[int, str]]:
    """The header's PARAMS table against the declared parameters, row by row."""
    out = []
    for i in range(max(len(hdr.params), len(declared))):
        h = hdr.params[i] if i < len(hdr.params) else None
        d = declared[i] if i < len(declared) else None
        if h is None:
            out.append((decl_line, f"{name}: parameter {d.name} (offset {d.offset}, {d.size} bytes) "
                                   f"is declared but not documented in PARAMS"))
            continue
        at = h.line or hdr.line
        if d is None:
            out.append((at, f"{name}: PARAMS documents {h.name}, which is not declared"))
            continue
        if h.name != d.name:
            out.append((at, f"{name}: parameter {i} is declared as {d.name} but documented as {h.name}"))
        if h.offset != d.offset:
            out.append((at, f"{name}: {h.name} is documented at offset {h.offset} but declared at offset {d.offset}"))
        if h.size != d.size:
            out.append((at, f"{name}: {h.name} is documented as {h.size} bytes but declared as {d.size}"))
        if h.type not in ptxdoc.PARAM_TYPES:
            out.append((at, f"{name}: {h.name} has unknown type {h.type} "
                            f"(known: {', '.join(ptxdoc.PARAM_TYPES)})"))
            continue
        size, align = ptxdoc.PARAM_TYPES[h.type]
        if h.size != size:
            out.append((at, f"{name}: {h.name} is documented as {h.size} bytes but {h.type} is {size}"))
        if h.offset % align:
            out.append((at, f"{name}: {h.name} at offset {h.offset} is not {align}-byte aligned "
                            f"as {h.type} must be"))
    return out


def lint(text: str, name: str = "<ptx>") -> list[str]:
    """Problems with the documented interface of one PTX file.

    Checks that every defined ``.entry``/``.func`` has a header block with all sections and
    vice versa, that each PARAMS table equals the declaration, that every ``ld.param``
    of a documented parameter loads exactly one ABI field (P3PeerSendConfig) or one
    element, and the header's CONSTANTS (``constant_problems``).

    Args:
        text: the PTX text.
        name: the file name the messages start with.

    Returns:
        One ``name:line: message`` per problem, by line; empty when it is clean.
    """
    lines = text.splitlines()
    headers = ptxdoc.parse_header(text)
    declared = ptxdoc.parse_decls(text)
    decls = declarations(text)
    protos = set(ptxdoc.prototypes(text))     # declared here, defined (and documented) elsewhere
    defined = {d.name: d for d in decls if not d.extern and d.name not in protos}
    out: list[tuple[int, str]] = []

    for d in defined.values():                                               # (a)
        h = headers.get(d.name)
        if h is None:
            out.append((d.line, f".{d.kind} {d.name} has no '// {d.kind.upper()} {d.name}' header block"))
        elif h.kind != d.kind:
            out.append((h.line, f"{d.name} is a .{d.kind} but its header says {h.kind.upper()}"))
    for h in headers.values():
        if h.name not in defined:
            out.append((h.line, f"header {h.kind.upper()} {h.name} documents no "
                                f".{h.kind} {h.name} defined in this file"))
            continue
        missing = [s for s in ptxdoc.HEADER_SECTIONS if s not in h.sections]      # (e)
        empty = [s for s in ptxdoc.HEADER_SECTIONS[1:] if s in h.sections and not h.sections[s]]
        if missing:
            out.append((h.line, f"header of {h.name} lacks section(s) {', '.join(missing)}"))
        if empty:
            out.append((h.line, f"header of {h.name} has empty section(s) {', '.join(empty)}"))
        out += _check_params(h.name, h, declared.get(h.name, []), defined[h.name].line)  # (b)

    parsed = {}
    for ln, pname, off, width in ptxdoc.parse_param_loads(text):                # (c), (d)
        parsed[ln] = parsed.get(ln, 0) + 1
        owner = next((d for d in reversed(decls) if d.line <= ln), None)
        hdr = headers.get(owner.name) if owner and not owner.extern else None
        p = next((p for p in hdr.params if p.name == pname), None) if hdr else None
        if p is None:
            continue   # a call-site .param inside a body, or an undocumented one (reported above)
        mnem = _LD_MNEMONIC.search(lines[ln - 1]).group()
        what = f"{mnem} [{pname}+{off}]"
        why = (_check_cfg_load(what, pname, off, width) if p.type == "P3PeerSendConfig"
               else _check_plain_load(what, p, off, width))
        if why:
            out.append((ln, why))
    # A load the parser cannot read would escape (c)/(d): insist on [param+offset] form.
    for ln, s in enumerate(lines, 1):
        if len(_LD_MNEMONIC.findall(s.split("//", 1)[0])) > parsed.get(ln, 0):
            out.append((ln, f"cannot check '{s.strip()}': load parameters as [name+offset]"))
    out += constant_problems(lines)                                             # (f)
    return [f"{name}:{ln}: {msg}" for ln, msg in sorted(out, key=lambda x: x[0])]


_CONSTANTS = re.compile(r"^//\s*CONSTANTS\s+(.*)$")
_IMMEDIATE = re.compile(r"(?<![%\w.])(\d+)\b")


def header_constants(lines: list[str]) -> dict[str, int]:
    """The named constants of a file's header.

    Args:
        lines: the PTX text's lines.

    Returns:
        NAME -> value of every ``// CONSTANTS NAME=value ...`` line (decimal or 0x hex).
    """
    found = {}
    for s in lines:
        m = _CONSTANTS.match(s.strip())
        if m:
            found.update({k: int(v, 0) for k, v in re.findall(r"(\w+)=(\w+)", m.group(1))})
    return found


def constant_problems(lines: list[str]) -> list[tuple[int, str]]:
    """(f) Magic numbers tied to the header: an instruction whose comment names a constant
    of the header's CONSTANTS line (``NAME`` or ``NAME-1``) must carry that value as an
    immediate, and every constant must be used so.

    Args:
        lines: the PTX text's lines.

    Returns:
        (line, message) per problem; empty when every constant is used and matches.
    """
    consts = header_constants(lines)
    used, out = set(), []
    for ln, s in enumerate(lines, 1):
        code, _, comment = s.partition("//")
        if not code.strip():
            continue
        for m in re.finditer(r"\b(" + "|".join(map(re.escape, consts)) + r")(\s*-\s*1)?\b", comment) if consts else ():
            want = consts[m.group(1)] - (1 if m.group(2) else 0)
            used.add(m.group(1))
            if want not in {int(x) for x in _IMMEDIATE.findall(code)}:
                out.append((ln, f"'{s.strip()}': the comment names {m.group(0).replace(' ', '')} = {want} "
                                "(CONSTANTS in the header) but the instruction has no such immediate"))
    out += [(1, f"CONSTANTS {n} is used by no instruction (name it in the comment of each use)")
            for n in consts if n not in used]
    return out


def file_problems(text: str, name: str = "<ptx>") -> list[str]:
    """Module-level rules: ASCII only, ``.version`` present and loadable by the oldest
    supported driver (``MAX_PTX_VERSION``), ``.target`` present, 64-bit addresses, and one
    ``.entry`` named like the file.

    Args:
        text: the PTX text.
        name: the file name (``p3_x.ptx`` must define ``.entry p3_x`` if any entry).

    Returns:
        One ``name: message`` per problem; empty when it is clean.
    """
    out = []
    bad = [i for i, line in enumerate(text.splitlines(), 1) if not line.isascii()]
    if bad:  # ptxas refuses the whole file ("Unexpected non-ASCII character")
        out.append(f"{name}:{bad[0]}: non-ASCII character (ptxas rejects the file)")
    v = ptxdoc.ptx_version(text)
    if v is None:
        out.append(f"{name}: no .version directive")
    elif v > MAX_PTX_VERSION:
        out.append(f"{name}: .version {v[0]}.{v[1]} is newer than {MAX_PTX_VERSION[0]}.{MAX_PTX_VERSION[1]}, "
                   f"the newest PTX ISA driver 580 (CUDA 13.0) loads")
    if ptxdoc.ptx_target(text) is None:
        out.append(f"{name}: no .target directive")
    # Without .address_size 64, PTX addresses are 32 bits and every u64 pointer is truncated.
    if not re.search(r"^\s*\.address_size\s+64\b", text, re.M):
        out.append(f"{name}: no '.address_size 64' directive")
    entries = [d.name for d in declarations(text) if d.kind == "entry"]
    if name.endswith(".ptx") and entries and entries != [name[:-4]]:
        out.append(f"{name}: defines .entry {', '.join(entries)}; a file holds one .entry named like the file")
    return out


# ----------------------------------------------------------------------------- assemble

@dataclass
class Resources:
    """One function's line of the assembler's resource report (None: not reported)."""
    name: str
    kind: str = "func"
    regs: int | None = None
    barriers: int | None = None
    stack: int | None = None          # this function's own stack frame, bytes
    cum_stack: int | None = None      # with its callees (whole-program ptxas, linker)
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem: int | None = None
    lmem: int | None = None
    lines: list[str] = field(default_factory=list)


@dataclass
class Report:
    """One assembly of one file for one arch by one tool."""
    file: str
    arch: str
    tool: str                         # "nvjitlink" or "ptxas"
    functions: list[Resources]
    log: str                          # the info log
    error: str = ""                   # the error log; "" when it assembled
    # False for a relocatable compile of a module whose calls the loader inlines
    # (whole-program JIT): its call-ABI frames are not what runs, so only errors count.
    judge_resources: bool = True

    @property
    def ok(self) -> bool:
        return not self.error

    def problems(self) -> list[str]:
        """Assembler errors, spills, and stack/local memory in entries.

        Returns:
            One message per problem, each with the log lines it comes from.
        """
        at = f"{self.file} [{self.arch}, {self.tool}]"
        if self.error:
            return [f"{at}: assembler error:\n    " + "\n    ".join(self.error.strip().splitlines())]
        out = []
        for r in self.functions if self.judge_resources else ():
            stats = "\n    ".join(r.lines)
            if r.spill_stores or r.spill_loads:
                out.append(f"{at}: {r.kind} {r.name} spills registers "
                           f"({r.spill_stores} bytes stored, {r.spill_loads} loaded):\n    {stats}")
            if r.kind == "entry" and (r.stack or r.cum_stack or r.lmem):
                out.append(f"{at}: entry {r.name} uses a stack frame or local memory "
                           f"(stack {r.stack}, with callees {r.cum_stack}, lmem {r.lmem}):\n    {stats}")
        return out


_FUNC_START = (re.compile(r"Compiling entry function '(\w+)'"),
               re.compile(r"Function properties for '?(\w+)'?:?\s*$"))
_STATS = {
    "regs": re.compile(r"[Uu]sed (\d+) registers"),
    "barriers": re.compile(r"used (\d+) barriers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "cum_stack": re.compile(r"(\d+) (?:bytes cumulative stack size|stack\b)"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
    "lmem": re.compile(r"(\d+) bytes lmem"),
}


def parse_resources(log: str) -> dict[str, Resources]:
    """Per-function resources from a ``ptxas -v`` or nvJitLink ``-verbose`` info log.

    Stats lines belong to the function last named. nvJitLink logs its embedded ptxas
    first, then the linker's summary; the first value of each stat wins, so both tools
    report ptxas' numbers and the linker only fills in what ptxas left out (lmem).

    Args:
        log: the assembler's info log.

    Returns:
        function name -> Resources (kind "func" until ``_own_functions`` reads the source).
    """
    out: dict[str, Resources] = {}
    cur = None
    for line in log.splitlines():
        for pat in _FUNC_START:
            m = pat.search(line)
            if m:
                cur = out.setdefault(m.group(1), Resources(m.group(1)))
        if cur is None:
            continue
        hit = False
        for key, pat in _STATS.items():
            m = pat.search(line)
            if m:
                hit = True
                if getattr(cur, key) is None:
                    setattr(cur, key, int(m.group(1)))
        if hit:
            cur.lines.append(line.strip())
    for r in out.values():
        if r.regs is not None and r.smem is None:
            r.smem = 0     # ptxas prints "N bytes smem" only when N > 0
    return out


def _own_functions(text: str, found: dict[str, Resources]) -> list[Resources]:
    """The reported functions defined in ``text``, in file order, kinds from the source."""
    out = []
    for d in declarations(text):
        if not d.extern and d.name in found:
            found[d.name].kind = d.kind
            out.append(found[d.name])
    return out



def nvjitlink_missing() -> str | None:
    """Why nvJitLink cannot assemble here.

    Returns:
        One line saying what is missing and how to install it, or None when it can.
    """
    try:
        driver.nvjitlink_version()
    except NoDeviceError as e:
        return str(e)
    return None


def assemble(ptx_text: str, name: str, arch: str, deps=(), options=(), judge_resources: bool = True) -> Report:
    """Assemble PTX for ``arch`` in-process with nvJitLink and parse its report.

    Args:
        ptx_text: the PTX module.
        name: its file name, for the logs and the report.
        arch: the target, e.g. ``"sm_90"``.
        deps: (name, text) of PTX files that define the ``.extern`` functions it calls.
        options: more nvJitLink options, e.g. ``["-maxrregcount=168"]``.
        judge_resources: False for a relocatable compile of a module the loader inlines
            (only its errors count).

    Returns:
        The Report; an assembler error is in ``Report.error`` (bad PTX never raises).

    Raises:
        NoDeviceError: nvJitLink is not installed (the message says how to install it).
    """
    v = ptxdoc.ptx_version(ptx_text)
    if v is not None and v > MAX_PTX_VERSION:
        driver.nvjitlink_version()     # a missing nvJitLink is reported as such, also here
        # nvJitLink 13.0.88 fails on it with "fatal: Unsupported .version" and from then on
        # links unresolved externs without error for the rest of the process.
        return Report(name, arch, "nvjitlink", [], "",
                      f"not assembled: .version {v[0]}.{v[1]} is newer than "
                      f"{MAX_PTX_VERSION[0]}.{MAX_PTX_VERSION[1]}")
    info, error = driver.nvjitlink_link([(name, ptx_text), *deps], [f"-arch={arch}", "-verbose", *options])
    tool = "nvjitlink" if judge_resources else "nvjitlink (relocatable, errors only)"
    return Report(name, arch, tool, _own_functions(ptx_text, parse_resources(info)), info, error,
                  judge_resources)


def assemble_ptxas(ptx_text: str, name: str, arch: str, ptxas: str = "ptxas") -> Report:
    """Assemble with the system ``ptxas -v``: ``-c`` for a file with extern references or
    without an entry (it will be linked), else whole-program, as the driver JIT does.

    Args:
        ptx_text: the PTX module.
        name: its file name: ptxas compiles a copy so named in a temporary folder, so its
            errors read "ptxas p3_x.ptx, line 57". Passed as one argument (no shell).
        arch: the target, e.g. ``"sm_90"``.
        ptxas: the ptxas executable.

    Returns:
        The Report; an assembler error (or ptxas failing to run) is in ``Report.error``.
    """
    decls = declarations(ptx_text)
    relocatable = any(d.extern for d in decls) or not any(d.kind == "entry" for d in decls)
    base = Path(name).name or "module.ptx"
    # "./" keeps a name starting with "-" from reading as an option.
    arg = f"./{base}" if base.startswith("-") else base
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / base).write_text(ptx_text)
        cmd = [ptxas, f"-arch={arch}", "-v", *(["-c"] if relocatable else []), arg, "-o", "out.cubin"]
        try:
            res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Report(name, arch, "ptxas", [], "", f"{shlex.join(cmd)}: {e}")
    log = res.stdout + res.stderr
    error = "" if res.returncode == 0 else log or f"{shlex.join(cmd)} exited with {res.returncode}"
    return Report(name, arch, "ptxas" + (" -c" if relocatable else ""),
                  _own_functions(ptx_text, parse_resources(log)), log, error)


def check_file(path, archs, ptxas: str | None, use_nvjitlink: bool = True, notes: list[str] | None = None,
               text: str | None = None) -> tuple[list[Report], list[str]]:
    """Lint one PTX file and assemble it for every target with the tools asked for.

    Args:
        path: the PTX file; its folder is read only when it links other files.
        archs: the targets (checked with ``check_archs``); ``targets`` narrows them.
        ptxas: the ptxas executable, or None for no ptxas.
        use_nvjitlink: assemble with nvJitLink too.
        notes: a check no available tool can make is added here (skipped, not failed).
        text: the file's text when already read (else it is read with ``read_ptx``).

    Returns:
        (the reports of every assembly, every problem as one message).

    Raises:
        InputFileError: ``path`` is not a readable PTX text file.
    """
    path = Path(path)
    text = read_ptx(path) if text is None else text
    notes = [] if notes is None else notes
    # The text every module loaded without the NVSHMEM transport gets (its put path's regions
    # dropped); the put path itself is checked by linking it with the shim and NVSHMEM's device
    # library (tests/cpu/test_nvshmem_link.py), where its calls are real calls.
    try:
        text = ptxdoc.without_nvshmem(text)
    except ConfigError as e:
        return [], [f"{path.name}: {e}"]
    problems = file_problems(text, path.name) + lint(text, path.name)
    sibling_files, skipped = siblings(path) if links_siblings(text) else ([], [])
    deps, missing = providers(path, text, sibling_files)
    # Checked here, not left to the linker: nvJitLink accepts unresolved externs in a file
    # without entries (and, after some errors, everywhere).
    problems += [f"{path.name}: .extern .func {m} is defined by no PTX file in {path.parent}{_not_read(skipped)}"
                 for m in sorted(missing)]
    try:
        whole, opts = assembly_unit(path, text, sibling_files)
    except ConfigError as e:
        problems.append(f"{path.name}: {e}{_not_read(skipped)}")
        whole, opts = text, []
    inlined = whole is not text
    if inlined and not ptxas and use_nvjitlink:
        # nvJitLink compiles relocatably, keeping the calls the loader inlines: only its errors count.
        notes.append(f"{path.name}: registers, spills and stack NOT checked: the loader inlines its calls, so "
                     "they are judged on a whole-program ptxas compile, and no ptxas is on PATH")
    reports = []
    for arch in targets(text, archs):
        if use_nvjitlink:
            reports.append(assemble(whole, path.name, arch, deps, opts, judge_resources=not inlined))
        if ptxas:
            reports.append(assemble_ptxas(whole, path.name, arch, ptxas))
    for r in reports:
        problems += r.problems()
    return reports, problems
