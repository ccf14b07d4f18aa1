"""The compiler probe: a small shared library built next to the declaration that reports
``sizeof``, ``_Alignof``/``alignof`` and, per member, ``offsetof``, size, type class and
array shape, all as the compiler sees them.

The header reaches the probe through ``-include PATH`` (an argv element: any file name
works, quotes and spaces included); the probe's own source names no user path. The
library is loaded with lazy binding, so functions the header defines may call into
libraries that are not linked here; C++ static initialisers of the header do run.
"""
from __future__ import annotations

import ctypes
import os
import re
import tempfile
from pathlib import Path

from .model import Layout, Member
from .toolchain import COMPILE_TIMEOUT_S, RunResult, ToolFailure, run_tool

_PRELUDE = r"""
#include <stddef.h>
#ifdef __cplusplus
#include <type_traits>
template <class T> static long long p3_cls() {
    return std::is_same<T, bool>::value ? 'b'
         : std::is_floating_point<T>::value ? 'f'
         : std::is_pointer<T>::value ? 'p'
         : std::is_integral<T>::value || std::is_enum<T>::value
               ? (std::is_signed<T>::value ? 's' : 'u')
         : 'o';
}
#define P3_CLS(x) p3_cls<std::remove_cv<std::remove_reference<decltype(x)>::type>::type>()
#define P3_ALIGN(T) alignof(T)
#define P3_EXPORT extern "C"
#else
#if defined(__GNUC__)
#define P3_OTHER(x) (__builtin_classify_type(x) == 5 ? 'p' : 'o')
#else
#define P3_OTHER(x) 'o'
#endif
#define P3_CLS(x) _Generic((x), _Bool: 'b', char: 's', signed char: 's', short: 's', \
    int: 's', long: 's', long long: 's', unsigned char: 'u', unsigned short: 'u', \
    unsigned int: 'u', unsigned long: 'u', unsigned long long: 'u', float: 'f', \
    double: 'f', long double: 'f', default: P3_OTHER(x))
#define P3_ALIGN(T) _Alignof(T)
#define P3_EXPORT
#endif
"""
_CLS_CODES = {"s": "int", "u": "uint", "p": "ptr", "f": "float", "b": "bool", "o": "other"}
PROBE_NAME = "p3conform_probe"


def probe_source(type_expr: str, names: list[tuple[str, int]]) -> str:
    """The probe's C/C++ source for the type ``type_expr`` and its members ``names``.

    Args:
        type_expr: how the probe names the struct (``struct Tag``, ``Name``, ``::ns::Name``).
        names: (member name, array rank) in declaration order.

    Returns:
        str: source defining ``p3_layout(long long *out)``; ``out`` receives
        ``2 + 5 * len(names)`` values: size, alignment, then per member offset, size,
        class code, is-array, element size.
    """
    lines = [_PRELUDE, f"typedef {type_expr} p3_probe_t;",
             "P3_EXPORT void p3_layout(long long *out) {",
             "    out[0] = (long long)sizeof(p3_probe_t);",
             "    out[1] = (long long)P3_ALIGN(p3_probe_t);"]
    for i, (name, rank) in enumerate(names):
        member = f"((p3_probe_t *)0)->{name}"
        elem = member + "[0]" * rank
        k = 2 + 5 * i
        lines += [f"    out[{k}] = (long long)offsetof(p3_probe_t, {name});",
                  f"    out[{k + 1}] = (long long)sizeof({member});",
                  f"    out[{k + 2}] = P3_CLS({elem});",
                  f"    out[{k + 3}] = {int(rank > 0)};",
                  f"    out[{k + 4}] = (long long)sizeof({elem});"]
    return "\n".join([*lines, "}"]) + "\n"


class ProbeError(Exception):
    """The probe did not build or load; ``message`` is one line for the header's author."""

    def __init__(self, message: str, stage: str, in_cuda: bool = False):
        self.message, self.stage, self.in_cuda = message, stage, in_cuda
        super().__init__(message)


_DIAGNOSTIC = re.compile(r"^(?P<file>[^\n:]+?):(?P<line>\d+):(?:\d+:)?\s*(?:fatal )?error:\s*(?P<msg>[^\n]*)",
                         flags=re.MULTILINE)


def first_error(log: str, header: str, probe: str = "", cuda_include: str | None = None) -> tuple[str, bool]:
    """The compiler's first error as one line, placed in the header when it is there, and
    whether it lies in the CUDA headers.

    Args:
        log: what the compiler printed.
        header: the declaration file as the compiler was given it.
        probe: the probe's source file ("" if none).
        cuda_include: the CUDA include folder, if one was used.

    Returns:
        (str, bool): ``"line N: message (+K more)"`` (or ``"NAME:N: ..."`` for another
        file, ``"in conform's probe: ..."``), and True when that file is under ``cuda_include``.
    """
    def same(file: str, other: str) -> bool:
        if not other:
            return False
        try:
            return os.path.samefile(file, other)
        except OSError:
            return file == other

    errors = list(_DIAGNOSTIC.finditer(log))
    if not errors:
        lines = [ln.strip() for ln in log.splitlines() if "error" in ln.lower()]
        return (lines or [ln.strip() for ln in log.splitlines() if ln.strip()] or ["no message"])[0], False
    first = next((m for m in errors if same(m.group("file"), header)), errors[0])
    file = first.group("file")
    where = (f"line {first.group('line')}" if same(file, header)
             else "in conform's probe" if same(file, probe)
             else f"{os.path.basename(file)}:{first.group('line')}")
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    in_cuda = bool(cuda_include) and os.path.abspath(file).startswith(os.path.join(cuda_include, ""))
    return f"{where}: {first.group('msg').strip()}{more}", in_cuda


def measure(argv: list[str], header: str, type_expr: str, names: list[tuple[str, int]], *,
            source_suffix: str, cuda_include: str | None = None) -> Layout:
    """Build the probe with ``argv`` (the compiler and its flags, without source or output),
    load it, and return the layout it reports.

    Args:
        argv: compiler command and flags; ``-include HEADER`` must be among them.
        header: the declaration file (to place the compiler's errors in it).
        type_expr: the struct as the probe names it.
        names: (member name, array rank) in declaration order.
        source_suffix: ".c", ".cpp" or ".cu": the language of the probe.
        cuda_include: the CUDA include folder, if one is used (to tell its errors apart).

    Returns:
        Layout: as the compiler lays it out.

    Raises:
        ProbeError: the probe did not build (stage "compile": the first error, placed in
            the header) or did not load (stage "load": the missing symbol).
    """
    with tempfile.TemporaryDirectory(prefix="p3conform-") as tmp:
        src = Path(tmp) / f"{PROBE_NAME}{source_suffix}"
        lib = Path(tmp) / f"{PROBE_NAME}.so"
        src.write_text(probe_source(type_expr, names))
        try:
            run: RunResult = run_tool([*argv, str(src), "-o", str(lib)], timeout=COMPILE_TIMEOUT_S, cwd=tmp)
        except ToolFailure as e:
            raise ProbeError(f"the compiler did not finish: {e}", "compile") from None
        except OSError as e:
            raise ProbeError(f"the compiler {argv[0]} could not be run: {e.strerror or e}", "compile") from None
        if run.returncode != 0 or not lib.is_file():
            message, in_cuda = first_error(run.log, header, str(src), cuda_include)
            raise ProbeError(message, "compile", in_cuda)
        try:
            # Lazy binding: functions the header defines may call what is not linked here.
            so = ctypes.CDLL(str(lib), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        except OSError as e:
            why = str(e).rpartition(".so: ")[2]
            raise ProbeError(f"conform's probe built but does not load ({why}): the header needs a "
                             "library that is not linked here", "load") from None
    fn = so.p3_layout
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_longlong)], None
    out = (ctypes.c_longlong * (2 + 5 * len(names)))()
    fn(out)
    return Layout(tuple(
        Member(name, out[k], out[k + 1], _CLS_CODES[chr(out[k + 2])],
               out[k + 1] // out[k + 4] if out[k + 3] else None, out[k + 4])
        for name, k in ((n, 2 + 5 * i) for i, (n, _) in enumerate(names))), out[0], out[1])
