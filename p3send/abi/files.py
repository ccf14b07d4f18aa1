"""Reading files that users name (declarations, PTX, saved timelines): never hang, never
grow without bound, never recurse without a limit.

Every reader of a user file goes through ``read_text`` (or ``read_bytes``): it refuses what
is not a regular file (a FIFO would block the reader, ``/dev/zero`` would never end)
before opening it, opens without blocking, checks the size again on the open file, and
reads at most ``cap`` bytes. ``load_json`` bounds the nesting depth in one linear scan
before ``json`` sees the text (its recursion would otherwise end in a RecursionError).
"""
from __future__ import annotations

import json
import os
import stat

from .errors import InputFileError

#: The default cap of a text file a reader accepts: 16 MiB (the largest shipped PTX is 0.2 MiB).
MAX_TEXT_BYTES = 16 << 20
#: The deepest nesting ``load_json`` accepts.
MAX_JSON_DEPTH = 64

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bytes(path, *, what: str = "file", cap: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``cap`` of them.

    Args:
        path: a path (str or ``os.PathLike``).
        what: what the file is, for the message (e.g. "declaration", "PTX file").
        cap: the largest size accepted, in bytes.

    Raises:
        InputFileError: ``path`` does not exist, is not a regular file, is larger than
            ``cap``, or cannot be read; the message names the path.
    """
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except OSError as e:
        raise InputFileError(f"{what} {name}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{what} {name}: is {_kind(st.st_mode)}; expected a regular file")
    if st.st_size > cap:
        raise InputFileError(f"{what} {name}: {st.st_size} bytes, larger than the {cap}-byte limit of this reader")
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, open must not block
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InputFileError(f"{what} {name}: cannot be opened ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"{what} {name}: is {_kind(st.st_mode)}; expected a regular file")
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise InputFileError(f"{what} {name}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise InputFileError(f"{what} {name}: larger than the {cap}-byte limit of this reader")
    return data


def read_text(path, *, what: str = "file", cap: int = MAX_TEXT_BYTES) -> str:
    """``read_bytes`` decoded as UTF-8 text.

    Raises:
        InputFileError: as ``read_bytes``, or the bytes are not UTF-8 text (a binary
            file): the message gives the offset of the first bad byte.
    """
    data = read_bytes(path, what=what, cap=cap)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what} {os.fspath(path)}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); "
                             "is it a binary file?") from None


def json_depth_problem(text: str, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """None when the JSON text nests at most ``max_depth`` arrays/objects deep, else a
    message with the offset where it goes deeper. One pass, strings skipped."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return f"nested more than {max_depth} levels deep (at character {i})"
        elif ch in "]}":
            depth -= 1
    return None


def load_json(path, *, what: str = "JSON file", cap: int = MAX_TEXT_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """The JSON value in the regular file ``path`` (read as ``read_text``).

    Raises:
        InputFileError: as ``read_text``; nested deeper than ``max_depth``; or not valid
            JSON (the message gives line and column).
    """
    text = read_text(path, what=what, cap=cap)
    problem = json_depth_problem(text, max_depth)
    if problem:
        raise InputFileError(f"{what} {os.fspath(path)}: {problem}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{what} {os.fspath(path)}: not valid JSON: {e.msg} at line {e.lineno} "
                             f"column {e.colno}") from None
    except RecursionError:      # unreachable below the depth limit; kept as a named error
        raise InputFileError(f"{what} {os.fspath(path)}: nested too deeply") from None
