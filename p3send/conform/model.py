"""What every reader produces and raises: a laid-out ``Member``, a ``Layout``, and the
errors of a declaration that cannot be used."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..abi.errors import ConfigError, InputFileError, P3SendError

#: The struct ``conform`` looks for unless told otherwise.
STRUCT = "P3PeerSendConfig"


@dataclass(frozen=True)
class Member:
    """One member of a foreign declaration, laid out.

    ``cls`` is "int", "uint", "ptr", "float", "bool", "other", or None when the
    reader cannot tell (then only sizes and offsets are compared). ``count`` is the
    element count of an array member, None for a scalar; ``elem`` the element size.
    """
    name: str
    offset: int
    size: int
    cls: str | None
    count: int | None = None
    elem: int = 0


@dataclass(frozen=True)
class Layout:
    """A struct as one reader lays it out: its members in declaration order, size, alignment."""
    members: tuple[Member, ...]
    size: int
    align: int


class ParseError(P3SendError, ValueError):
    """A declaration the parser cannot read; ``line`` is the line of the cause when known
    (a ``DeclarationError`` naming the file is made of it)."""

    def __init__(self, message: str, line: int | None = None):
        self.line = line
        self._init_args = (message, line)
        super().__init__(message)


class DeclarationError(ConfigError):
    """A declaration file could not be read, found, parsed or compiled.

    ``path`` is the file, ``problems`` the one message (it names the line of the cause
    where there is one).
    """

    def __init__(self, path, message):
        self.path = str(path)
        self.problems = [message]
        self._init_args = (path, message)
        # Skip ConfigError's "invalid P3PeerSendConfig" framing: the file is at fault here.
        Exception.__init__(self, f"{path}: {message}")


class DeclarationFileError(DeclarationError, InputFileError):
    """The declaration file cannot be read at all: missing, not a regular file (a folder,
    a FIFO, a device), too large, or not UTF-8 text."""


def split_mojo_note(mojo: str) -> tuple[str, str | None]:
    """``"T (AliasPtr)"`` -> ``("T", "AliasPtr")``: ``FIELDS`` notes MAX's alias name so.

    Args:
        mojo: a ``Field.mojo`` string.

    Returns:
        (str, str | None): the type, and the alias MAX names it by (None if none).
    """
    m = re.fullmatch(r"(.*\S)\s+\((\w+)\)", mojo)
    return (m.group(1), m.group(2)) if m else (mojo, None)
