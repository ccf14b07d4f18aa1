"""JSON declarations: the format ``p3send layout --format json`` prints, each field's
``type`` either Mojo (as printed) or C/C++ (``int64_t``, ``std::uint64_t[8]``,
``unsigned long long``, ``void *``, ``std::array<T, N>``), whose size must agree with the
entry's ``size``."""
from __future__ import annotations

import json
import re

from ..abi.files import MAX_JSON_DEPTH, json_depth_problem
from .model import STRUCT, DeclarationError, Layout, Member, ParseError
from .mojo import MOJO_KNOWN, mojo_type
from .source import read_declaration

# C spellings accepted in JSON "type" strings, with the sizes of a 64-bit Linux host
# (``std::`` is dropped before the look-up: ``std::int64_t`` is ``int64_t``).
_C_SCALARS = {f"{u}int{n}_t": (n // 8, "uint" if u else "int") for u in ("", "u") for n in (8, 16, 32, 64)}
_C_SCALARS.update({
    "size_t": (8, "uint"), "ptrdiff_t": (8, "int"), "intptr_t": (8, "int"), "ssize_t": (8, "int"),
    "uintptr_t": (8, "uint"), "CUdeviceptr": (8, "uint"), "CUdeviceptr_v2": (8, "uint"),
    "float": (4, "float"), "double": (8, "float"), "bool": (1, "bool"), "_Bool": (1, "bool"),
    "byte": (1, "uint"),
})
_INT_WORDS = frozenset({"signed", "unsigned", "short", "long", "int", "char"})
_JSON_KNOWN = (f"a Mojo type ({MOJO_KNOWN}) or a C type (int64_t, std::uint64_t, unsigned long long, "
               "uint64_t[8], void *, std::array<T, N>)")
_MAX_TYPE_CHARS = 200


def _c_integer(words: list[str]) -> tuple[int, str] | None:
    """``unsigned long long int`` and the other spellings of C's integer types."""
    if not words or not set(words) <= _INT_WORDS or words.count("long") > 2:
        return None
    if any(words.count(w) > 1 for w in set(words) - {"long"}) or {"signed", "unsigned"} <= set(words):
        return None
    cls = "uint" if "unsigned" in words else "int"
    if "char" in words:
        return (1, cls) if not set(words) & {"short", "long"} else None
    if "short" in words:
        return (2, cls) if "long" not in words else None
    return (8 if "long" in words else 4), cls


def c_type(t: str) -> Member | None:
    """Size, class and shape of a C/C++ type as JSON writes it (``uint64_t[8]``, ``void *``,
    ``std::array<std::uint64_t, 8>``), or None when ``t`` is not one.

    Args:
        t: the type string.

    Returns:
        Member | None: size, class, element count and size (name and offset unset).
    """
    t = " ".join(re.sub(r"\b(?:const|volatile|struct)\b", " ", t).split())
    t = re.sub(r"(?<![\w:])(?:::\s*)?std\s*::\s*", "", t)
    m = re.fullmatch(r"(.+?) ?\[ ?(\d+) ?\]", t) or re.fullmatch(r"array ?< ?(.+?) ?, ?(\d+) ?>", t)
    if m:
        elem, n = c_type(m.group(1)), int(m.group(2))
        return Member("", 0, elem.size * n, elem.cls, n, elem.size) if elem and n > 0 else None
    if t.endswith("*"):
        return Member("", 0, 8, "ptr", None, 8)
    size, cls = _C_SCALARS.get(t) or _c_integer(t.split()) or (0, None)
    return Member("", 0, size, cls, None, size) if cls else None


def _json_get(obj: dict, key: str, want: str, ok, where: str = "") -> object:
    """``obj[key]`` if ``ok`` accepts it; else ParseError: which key, what it must be, what it is."""
    value = obj.get(key)
    if not ok(value):
        raise ParseError(f'{where}"{key}" must be {want}, got {json.dumps(value)[:60]}')
    return value


def _is_int(low: int):
    return lambda v: type(v) is int and v >= low


def _json_field(f, i: int) -> Member:
    """One ``{"name", "offset", "size", "type"}`` entry, checked; the error says what is wrong."""
    if not isinstance(f, dict):
        raise ParseError(f'fields[{i}]: expected an object {{"name", "offset", "size", "type"}}, '
                         f"got {json.dumps(f)[:60]}")
    name = _json_get(f, "name", "a non-empty string", lambda v: isinstance(v, str) and v, f"fields[{i}]: ")
    where = f"field {name}: "
    offset = _json_get(f, "offset", "an integer >= 0", _is_int(0), where)
    size = _json_get(f, "size", "an integer >= 1", _is_int(1), where)
    typ = _json_get(f, "type", f"a string, {_JSON_KNOWN}", lambda v: isinstance(v, str), where)
    if len(typ) > _MAX_TYPE_CHARS:
        raise ParseError(f"{where}type {typ[:40]!r}...: longer than {_MAX_TYPE_CHARS} characters")
    t = c_type(typ)
    if t is None:
        try:
            t = mojo_type(typ)
        except ParseError:
            raise ParseError(f"{where}unknown type {typ!r}; expected {_JSON_KNOWN}") from None
    if t.size != size:
        raise ParseError(f'{where}type {typ!r} is {t.size} bytes, but "size" says {size}')
    return Member(name, offset, size, t.cls, t.count, t.elem)


def json_layout(path, struct: str = STRUCT, text: str | None = None) -> Layout:
    """The layout as stated by a ``render("json")``-shaped file (a list of them is fine).

    Args:
        path: the JSON file.
        struct: the ``"name"`` of the declaration to check.
        text: the file's text if already read (else it is read from ``path``).

    Returns:
        Layout: the fields as the file states them.

    Raises:
        DeclarationError: the file cannot be read, is not valid JSON (or nests deeper than
            ``MAX_JSON_DEPTH``), has no such declaration, or an entry is malformed: a
            field's ``type`` unknown or disagreeing with its ``size``.
    """
    if text is None:
        text = read_declaration(path)
    problem = json_depth_problem(text, MAX_JSON_DEPTH)
    if problem:
        raise DeclarationError(path, f"not usable JSON: nested too deeply ({problem})")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeclarationError(path, f"not valid JSON: {e}") from None
    decls = data if isinstance(data, list) else [data]
    if not all(isinstance(d, dict) for d in decls):
        raise DeclarationError(path, 'expected an object {"name", "size", "align", "fields"} or a list '
                               f"of them, got {json.dumps(data)[:60]}")
    decl = next((d for d in decls if d.get("name") == struct), None)
    if decl is None:
        seen = [str(d["name"]) for d in decls if "name" in d]
        raise DeclarationError(path, f"no struct {struct!r} found (names seen: {', '.join(seen) or 'none'})")
    try:
        _json_get(decl, "fields", 'a non-empty list of {"name", "offset", "size", "type"}',
                  lambda v: isinstance(v, list) and v)
        for key in ("size", "align"):
            _json_get(decl, key, "an integer >= 1", _is_int(1))
        members = [_json_field(f, i) for i, f in enumerate(decl["fields"])]
    except ParseError as e:   # our own messages: what is wrong, where
        raise DeclarationError(path, f"struct {struct}: {e}") from None
    counts: dict[str, int] = {}
    for m in members:
        counts[m.name] = counts.get(m.name, 0) + 1
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice:
        raise DeclarationError(path, f"struct {struct}: field(s) {', '.join(twice)} appear twice")
    return Layout(tuple(members), decl["size"], decl["align"])
