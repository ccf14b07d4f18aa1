"""The entry points: read a declaration of any kind, lay it out, and judge it."""
from __future__ import annotations

from .cdecl import c_results
from .jsondecl import json_layout
from .model import STRUCT, DeclarationError, Layout
from .mojo import mojo_layout
from .source import check_kind, guess_kind, read_declaration
from .toolchain import CompilerOptions, CudaHeaders
from .verdict import Report, Verdict, compare


def _cuda_note(cuda: CudaHeaders) -> str:
    if cuda.include:
        return f"CUDA headers: {cuda.include} (from {cuda.how})"
    if cuda.how.startswith("not used"):
        return f"CUDA headers: {cuda.how}"
    return f"CUDA headers: not found (looked at {cuda.how}); pass --cuda-include DIR or -I DIR"


def check(path, struct: str = STRUCT, kind: str = "auto", options: CompilerOptions | None = None) -> Report:
    """Judge ``struct`` of the declaration file ``path`` against the ABI.

    Args:
        path: a C/C++ header, a Mojo file, or JSON as ``render("json")`` prints it.
        struct: the struct's name (C++: plain or qualified, ``max::ep::P3PeerSendConfig``).
        kind: ``auto`` (by the file's suffix, else its first lines), ``c``, ``mojo`` or ``json``.
        options: for C/C++: macros, include folders, the ``__CUDACC__`` configurations and the
            CUDA headers (default: both configurations, CUDA headers found automatically).

    Returns:
        Report: one verdict per configuration (C/C++) or one verdict (Mojo, JSON).

    Raises:
        DeclarationFileError: the file cannot be read (missing, a folder, a FIFO, a device,
            too large, not UTF-8).
        DeclarationError: no such struct, it cannot be parsed, or (C/C++) no configuration
            compiles it; the message names the line of the cause.
        ConfigError: an option is invalid, or no C compiler is installed.
    """
    check_kind(path, kind)
    text = read_declaration(path)
    if kind == "auto":
        kind = guess_kind(path, text)
    if kind == "mojo":
        return Report(str(path), struct, (Verdict("", tuple(compare(mojo_layout(path, struct, text)))),))
    if kind == "json":
        return Report(str(path), struct, (Verdict("", tuple(compare(json_layout(path, struct, text)))),))
    results, cuda = c_results(path, text, struct, options)
    verdicts = tuple(Verdict(r.label, tuple(compare(r.layout)) if r.layout else None, r.error) for r in results)
    if all(v.problems is None for v in verdicts):
        errors = [(r.config, r.error) for r in results]
        if len({e for _, e in errors}) == 1:
            raise DeclarationError(path, errors[0][1])
        raise DeclarationError(path, "; ".join(f"{c}: {e}" for c, e in errors))
    return Report(str(path), struct, verdicts, (_cuda_note(cuda),))


def check_path(path, struct: str = STRUCT, kind: str = "auto", options: CompilerOptions | None = None) -> list[str]:
    """The problems of ``struct`` in ``path`` against the ABI; an empty list means it conforms.

    Args:
        path, struct, kind, options: as ``check``.

    Returns:
        list[str]: ``Report.problems``: one message per problem (prefixed with the
        configuration when the C/C++ configurations disagree).

    Raises:
        DeclarationError, DeclarationFileError, ConfigError: as ``check``.
    """
    return check(path, struct, kind, options).problems


def read_layout(path, struct: str = STRUCT, kind: str = "auto", options: CompilerOptions | None = None) -> Layout:
    """Lay out ``struct`` from ``path``: C/C++ in the first configuration that compiles it.

    Args:
        path, struct, kind, options: as ``check``.

    Returns:
        Layout: the struct as its reader lays it out.

    Raises:
        DeclarationError, DeclarationFileError, ConfigError: as ``check``.
    """
    check_kind(path, kind)
    text = read_declaration(path)
    if kind == "auto":
        kind = guess_kind(path, text)
    if kind == "mojo":
        return mojo_layout(path, struct, text)
    if kind == "json":
        return json_layout(path, struct, text)
    results, _ = c_results(path, text, struct, options)
    for r in results:
        if r.layout is not None:
            return r.layout
    raise DeclarationError(path, results[0].error)
