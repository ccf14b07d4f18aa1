"""C/C++ declarations, laid out the way the compiler sees them.

For each configuration (by default once without and once with ``__CUDACC__`` defined) the
header is run through the real preprocessor with the user's ``-D``/``-U``/``-I`` and the
CUDA headers, the struct and its member names are read from what the preprocessor printed
(``cscan``), and a probe built with the same flags measures it (``cprobe``). So ``#if``
branches, macros, X-macros and included files count exactly as they do in a build.

Without ``__CUDACC__`` the header is compiled as the language it looks like (C or C++), then
as the other if that fails. With ``__CUDACC__`` it is compiled as C++ the way nvcc's host
pass sees it: ``__CUDACC__`` and ``__NVCC__`` defined and ``cuda_runtime_api.h`` included
first (the CUDA keywords, ``__align__``, the vector types). Where that is not enough (the
header includes ``cuda_runtime.h``, whose device overloads only nvcc's front end accepts),
the probe is built by nvcc itself when there is one.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..abi.config import FIELDS
from ..abi.errors import ConfigError
from .cprobe import ProbeError, first_error, measure
from .cscan import Unit
from .model import STRUCT, DeclarationError, Layout, ParseError
from .source import CXX_SUFFIXES, read_declaration
from .toolchain import (
    MAX_PREPROCESSED_BYTES,
    PREPROCESS_TIMEOUT_S,
    CompilerOptions,
    CudaHeaders,
    ToolFailure,
    compiler,
    cuda_headers,
    run_tool,
)

WITHOUT_CUDACC = "without __CUDACC__"
WITH_CUDACC = "with __CUDACC__"


@dataclass(frozen=True)
class CResult:
    """One configuration's outcome: a layout, or why there is none.

    Attributes:
        config: ``"without __CUDACC__"`` or ``"with __CUDACC__"``.
        language: how the probe was built: "C", "C++" or "C++ by nvcc"; "" if it was not.
        layout: the struct as the compiler lays it out, or None.
        error: why there is no layout ("" when there is one).
    """
    config: str
    language: str
    layout: Layout | None
    error: str = ""

    @property
    def label(self) -> str:
        """``"without __CUDACC__ (as C)"``: the configuration and how it was compiled."""
        return f"{self.config} (as {self.language})" if self.language else self.config


class _Failed(Exception):
    def __init__(self, stage: str, message: str, in_cuda: bool = False, what: str = ""):
        self.stage, self.message, self.in_cuda, self.what = stage, message, in_cuda, what
        super().__init__(message)


def looks_cxx(path, text: str) -> bool:
    """Whether a header looks like C++, so that it is compiled as C++ first.

    Args:
        path: the header's name (its suffix counts: ``.hpp``, ``.cu``, ...).
        text: its text (``namespace``, ``template``, ``class``, ``constexpr`` or a
            ``<cNAME>`` include count).

    Returns:
        bool: True for C++.
    """
    return os.path.splitext(str(path))[1].lower() in CXX_SUFFIXES or bool(
        re.search(r"\b(?:namespace|template|class|constexpr)\b|#\s*include\s*<c[a-z]+>", text))


def _flags(config: str, options: CompilerOptions, cuda: CudaHeaders, pre_include: str | None) -> list[str]:
    out = []
    if config == WITH_CUDACC:
        out += ["-D__CUDACC__", "-D__NVCC__"]
        if cuda.version:
            out += [f"-D__CUDACC_VER_MAJOR__={cuda.version[0]}", f"-D__CUDACC_VER_MINOR__={cuda.version[1]}"]
    out += list(options.macros)
    out += [f"-I{d}" for d in options.include_dirs]
    if cuda.include:
        out += ["-isystem", cuda.include]
    if pre_include:
        out += ["-include", pre_include]
    return out


def _scan(unit: Unit, struct: str):
    """The struct's definition(s) and member names, refusing what offsetof cannot measure."""
    hits = unit.pick(struct)
    s = hits[0]
    what = f"{s.keyword} {s.qualname}"
    if s.unclosed:
        raise _Failed("scan", f"{what}: the '{{' on {s.unclosed} is never closed")
    try:
        parsed = [unit.members(h) for h in hits]
    except ParseError as e:
        raise _Failed("scan", f"{what}: {e}") from None
    names, hidden = parsed[0]
    if any(p[0] != names for p in parsed):
        raise _Failed("scan", f"{what} is defined {len(hits)} times with different members")
    if s.base:
        raise _Failed("scan", f"{what} derives from {s.base}: conform reads only the members the "
                      f"{s.keyword} declares itself; declare all {len(FIELDS)} fields in it")
    if s.template:
        raise _Failed("scan", f"{what} is a class template: conform measures a complete type; "
                      "declare the struct itself")
    if hidden:
        shown = ", ".join(hidden[:3]) + (f" and {len(hidden) - 3} more" if len(hidden) > 3 else "")
        raise _Failed("scan", f"{what}: data member(s) {shown} are not public; conform measures each "
                      "member with offsetof from outside, so the data members must be public (make it "
                      "a struct, or add `public:`)")
    if not names:
        raise _Failed("scan", f"{what} declares no data members")
    return s, what, names


def _attempt(header: str, struct: str, config: str, language: str, options: CompilerOptions,
             cuda: CudaHeaders, nvcc: str | None) -> Layout:
    """One preprocess-scan-measure run; ``nvcc`` set: the probe is built by it."""
    x = "c" if language == "C" else "c++"
    if nvcc:
        pre_include = "cuda_runtime.h"   # what nvcc includes first in a .cu file
    else:
        pre_include = "cuda_runtime_api.h" if config == WITH_CUDACC and cuda.runtime_api else None
    flags = _flags(config, options, cuda, pre_include)
    try:
        cc = compiler(language)
    except ConfigError as e:
        raise _Failed("setup", e.problems[0]) from None
    try:
        pre = run_tool([*cc, "-E", "-x", x, *flags, header], timeout=PREPROCESS_TIMEOUT_S,
                       cap=MAX_PREPROCESSED_BYTES)
    except ToolFailure as e:
        raise _Failed("preprocess", f"the preprocessor did not finish: {e}") from None
    except OSError as e:
        raise _Failed("preprocess", f"the preprocessor {cc[0]} could not be run: {e.strerror or e}") from None
    if pre.returncode != 0:
        message, in_cuda = first_error(pre.log, header, cuda_include=cuda.include)
        raise _Failed("preprocess", message, in_cuda)
    try:
        unit = Unit(pre.stdout.decode("utf-8", errors="replace"), header)
        s, what, names = _scan(unit, struct)
    except ParseError as e:
        raise _Failed("scan", str(e)) from None
    if nvcc:
        type_expr = f"::{s.qualname}"
        argv = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-w", *options.macros,
                *(f"-I{d}" for d in options.include_dirs), "-include", header]
        suffix = ".cu"
    else:
        type_expr = (s.name if s.typedef else f"struct {s.name}") if language == "C" else f"::{s.qualname}"
        argv = [*cc, "-shared", "-fPIC", "-O0", "-w", "-x", x, *flags, "-include", header]
        suffix = ".c" if language == "C" else ".cpp"
    try:
        return measure(argv, header, type_expr, names, source_suffix=suffix, cuda_include=cuda.include)
    except ProbeError as e:
        raise _Failed(e.stage, e.message, e.in_cuda, what) from None


def _cuda_hint(message: str, cuda: CudaHeaders) -> str:
    if cuda.include is None and re.search(r"\bcuda\w*\.h\b", message):
        return f" (CUDA headers: {cuda.how if cuda.how.startswith('not used') else 'not found'}; " \
               "pass --cuda-include DIR or -I DIR)"
    return ""


def _describe(failures: list[tuple[str, _Failed]], cuda: CudaHeaders, nvcc_missing: bool) -> str:
    """One line for the failures of a configuration: the first language's, with the others named."""
    language, f = failures[0]
    others = [lang for lang, _ in failures[1:] if lang != language]
    also = f" (and as {', '.join(others)})" if others else ""
    if f.stage == "compile":
        text = f"{f.what}: the compiler rejects it as {language}{also}: {f.message}"
    elif f.stage == "preprocess":
        text = f"the preprocessor rejects it as {language}{also}: {f.message}"
    else:
        text = f.message
    if f.in_cuda and nvcc_missing:
        text += " (an error in the CUDA headers: with __CUDACC__ the host compiler cannot build them " \
                "alone, and no nvcc was found)"
    return text + _cuda_hint(f.message, cuda)


def _one(header: str, text: str, struct: str, config: str, options: CompilerOptions,
         cuda: CudaHeaders) -> CResult:
    if config == WITH_CUDACC:
        languages = ["C++"]
    else:
        languages = ["C++", "C"] if looks_cxx(header, text) else ["C", "C++"]
    failures: list[tuple[str, _Failed]] = []
    for language in languages:
        try:
            return CResult(config, language, _attempt(header, struct, config, language, options, cuda, None))
        except _Failed as f:
            failures.append((language, f))
            if f.stage == "scan" and not f.message.startswith(("no struct", "struct '")):
                break   # the struct was found: what it is does not change with the language
    nvcc_missing = False
    if config == WITH_CUDACC and failures[0][1].in_cuda:
        if cuda.nvcc and cuda.include:
            try:
                layout = _attempt(header, struct, config, "C++", options, cuda, cuda.nvcc)
                return CResult(config, "C++ by nvcc", layout)
            except _Failed as f:
                failures.insert(0, ("C++ by nvcc", f))
        else:
            nvcc_missing = True
    return CResult(config, "", None, _describe(failures, cuda, nvcc_missing))


def configurations(options: CompilerOptions) -> list[str]:
    """The configurations ``options.cudacc`` asks for, in the order they are reported.

    Args:
        options: with ``cudacc`` "both", "without" or "with".

    Returns:
        list[str]: ``WITHOUT_CUDACC`` and/or ``WITH_CUDACC``.
    """
    return {"both": [WITHOUT_CUDACC, WITH_CUDACC], "without": [WITHOUT_CUDACC],
            "with": [WITH_CUDACC]}[options.cudacc]


def c_results(path, text: str, struct: str = STRUCT, options: CompilerOptions | None = None
              ) -> tuple[list[CResult], CudaHeaders]:
    """Lay out ``struct`` of a C/C++ header in each configuration ``options`` asks for.

    Args:
        path: the header (its text is ``text``; the compilers read it by this path).
        text: the header's text, as ``read_declaration`` returned it.
        struct: the struct's name, plain or qualified (``max::ep::P3PeerSendConfig``).
        options: macros, include folders, configurations and CUDA headers (default: none,
            both configurations, CUDA headers found automatically).

    Returns:
        (list[CResult], CudaHeaders): one result per configuration, and the CUDA headers used.

    Raises:
        ConfigError: an option is invalid. (A compiler that is not installed makes its
            configuration's result an error, not an exception.)
    """
    options = (options or CompilerOptions()).checked()
    cuda = cuda_headers(options)
    # An absolute path: a name starting with '-' cannot be taken for an option.
    header = os.path.abspath(os.fspath(path))
    configs = configurations(options)
    if len(configs) == 1:
        return [_one(header, text, struct, configs[0], options, cuda)], cuda
    # The compilers do the work: the configurations run side by side.
    with ThreadPoolExecutor(max_workers=len(configs)) as pool:
        return list(pool.map(lambda c: _one(header, text, struct, c, options, cuda), configs)), cuda


def c_layout(path, struct: str = STRUCT, options: CompilerOptions | None = None, *, cudacc: bool = False) -> Layout:
    """Lay out ``struct`` of a C/C++ header with the system compiler, in one configuration.

    Args:
        path: the header.
        struct: the struct's name, plain or qualified.
        options: macros and include folders (its ``cudacc`` is replaced by ``cudacc``).
        cudacc: lay it out as nvcc's host pass sees it (``__CUDACC__`` defined).

    Returns:
        Layout: as the compiler lays it out.

    Raises:
        DeclarationError: the file cannot be read, has no such struct, or does not compile
            (or no compiler is installed).
        ConfigError: an option is invalid.
    """
    text = read_declaration(path)
    base = options or CompilerOptions()
    one = CompilerOptions(base.macros, base.include_dirs, "with" if cudacc else "without", base.cuda_include)
    (result,), _ = c_results(path, text, struct, one)
    if result.layout is None:
        raise DeclarationError(path, result.error)
    return result.layout
