"""Reading a declaration file, and telling which language it is written in.

Every read goes through ``p3send.abi.files.read_text``: regular files only (a FIFO would
block, ``/dev/zero`` never ends), at most ``MAX_DECLARATION_BYTES``, UTF-8.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..abi.errors import InputFileError
from ..abi.files import MAX_TEXT_BYTES, read_text
from .model import DeclarationError, DeclarationFileError

#: The largest declaration file accepted (the same cap as every user file).
MAX_DECLARATION_BYTES = MAX_TEXT_BYTES

CXX_SUFFIXES = frozenset({".hpp", ".hh", ".hxx", ".h++", ".cpp", ".cc", ".cxx", ".cu", ".cuh", ".inl"})
C_SUFFIXES = frozenset({".h", ".c"}) | CXX_SUFFIXES
MOJO_SUFFIXES = frozenset({".mojo", ".🔥"})
KINDS = ("auto", "c", "mojo", "json")


def read_declaration(path) -> str:
    """The text of the declaration file ``path``.

    Args:
        path: the file (str or ``os.PathLike``).

    Returns:
        str: its text.

    Raises:
        DeclarationFileError: ``path`` is missing, not a regular file (a folder, a FIFO,
            a device), larger than ``MAX_DECLARATION_BYTES``, or not UTF-8 text; the
            message names the path and what was wrong.
    """
    name = os.fspath(path)
    try:
        return read_text(name, what="declaration", cap=MAX_DECLARATION_BYTES)
    except InputFileError as e:
        why = str(e).removeprefix(f"declaration {name}: ")
        why = re.sub(r"^cannot be (?:read|opened) (?=\()", "", why)
        raise DeclarationFileError(path, f"cannot read {why}" if why.startswith("(")
                                   else f"cannot read: {why}") from None


def guess_kind(path, text: str) -> str:
    """``"c"``, ``"mojo"`` or ``"json"``: by the file's suffix, else by its first lines.

    Args:
        path: the file's name (only its suffix is used).
        text: its text.

    Returns:
        str: the kind.
    """
    suffix = Path(path).suffix.lower()
    if suffix in C_SUFFIXES:
        return "c"
    if suffix in MOJO_SUFFIXES:
        return "mojo"
    if suffix == ".json":
        return "json"
    head = text.lstrip()
    if head.startswith(("{", "[")):
        return "json"
    # Mojo's `struct Name(Traits):` (the list may wrap); C has `{` or `;` before any `:` line end.
    return "mojo" if re.search(r"^[ \t]*struct[ \t]+\w+[^{};\n]*(?:\n[^{};\n]*){0,20}:[ \t]*(?:#[^\n]*)?$",
                               head, flags=re.MULTILINE) else "c"


def check_kind(path, kind: str) -> None:
    """Refuse a ``kind`` that is none of ``KINDS``.

    Raises:
        DeclarationError: naming the kinds accepted and the one given.
    """
    if kind not in KINDS:
        raise DeclarationError(path, f"kind: expected one of {', '.join(KINDS)}; got {kind!r}")
