"""Mojo declarations, laid out by Mojo's rules: declaration order, natural alignment.

There is no Mojo compiler here, so the (simple) layout rules are modelled; the reading is
not a guess of the syntax line by line but a small lexer: one linear pass turns the file
into logical lines the way Mojo (like Python) joins them, inside brackets and after a
backslash, with comments and strings (docstrings too) taken out, brackets paired at most
``MAX_NESTING`` deep. On those lines: module-level and struct-level ``comptime``/``alias``
(parametric ones too), ``struct Name[...](Traits...):`` with decorators, and its ``var``
fields; methods, docstrings, other structs and traits are skipped. Every error names the
line of its cause: an alias's own line when the alias is wrong, not the field's that uses it.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .model import STRUCT, DeclarationError, Layout, Member, ParseError, split_mojo_note
from .source import read_declaration

#: The deepest bracket nesting read.
MAX_NESTING = 256
#: The longest chain of aliases followed (A = B, B = C, ...).
MAX_ALIAS_DEPTH = 32

# (size, class) of Mojo's scalar types; natural alignment = size.
_MOJO_SCALARS = {
    "Int": (8, "int"), "Int64": (8, "int"), "UInt": (8, "uint"), "UInt64": (8, "uint"),
    "Float64": (8, "float"), "Int32": (4, "int"), "UInt32": (4, "uint"),
    "Float32": (4, "float"), "Int16": (2, "int"), "UInt16": (2, "uint"),
    "Float16": (2, "float"), "BFloat16": (2, "float"),
    "Int8": (1, "int"), "UInt8": (1, "uint"), "Bool": (1, "bool"),
}
_DTYPES = {f"DType.{k.lower()}": v for k, v in _MOJO_SCALARS.items() if k not in ("Int", "UInt")}
_DTYPES.update({"DType.index": (8, "int"), "DType.bool": (1, "bool")})
_MOJO_POINTERS = {"UnsafePointer", "Pointer", "LegacyUnsafePointer", "OpaquePointer"}
MOJO_KNOWN = ("Int/UInt/IntN/UIntN/FloatN/Bool, UnsafePointer/Pointer/OpaquePointer/*Ptr, "
              "StaticTuple/InlineArray[T, N], SIMD[DType.x, N]")

_LEX = re.compile(r"""
 (?P<nl>\r?\n)
|(?P<comment>\#[^\n]*)
|(?P<triple>\"\"\"|''')
|(?P<str>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
|(?P<open>[\[({])
|(?P<close>[\])}])
|(?P<cont>\\\r?\n)
|(?P<text>[^\n\#"'\[\](){}\\]+)
|(?P<other>.)
""", flags=re.VERBOSE)
_PAIRS = {"]": "[", ")": "(", "}": "{"}
_INDENT = re.compile(r"[ \t]*")


@dataclass(frozen=True)
class LogicalLine:
    """One statement: its indentation, first physical line (1-based), and text with comments
    removed, strings replaced by ``""`` and continuation lines joined."""
    indent: int
    line: int
    text: str


def logical_lines(text: str) -> list[LogicalLine]:
    """Split Mojo source into logical lines, in one pass.

    Args:
        text: the source.

    Returns:
        list[LogicalLine]: the non-empty statements in order.

    Raises:
        ParseError: a bracket closed by the wrong one or never closed, brackets nested
            deeper than ``MAX_NESTING``, or a triple-quoted string that never ends (the
            line of the opening one).
    """
    out: list[LogicalLine] = []
    parts: list[str] = []
    stack: list[tuple[str, int]] = []
    line, start_line, indent, at_start = 1, 1, 0, True
    pos, n = 0, len(text)

    def flush():
        s = " ".join("".join(parts).split())
        if s:
            out.append(LogicalLine(indent, start_line, s))
        parts.clear()

    while pos < n:
        m = _LEX.match(text, pos)
        kind, tok, end = m.lastgroup, m.group(), m.end()
        if kind == "nl":
            line += 1
            if not stack:
                flush()
                at_start = True
            else:
                parts.append(" ")
        elif kind == "cont":
            line += 1
            parts.append(" ")
        elif kind == "comment":
            pass
        else:
            if at_start:
                if kind == "text" and not tok.strip():   # the indentation itself
                    pos = end
                    continue
                lead = _INDENT.match(text, text.rfind("\n", 0, pos) + 1).group()
                indent, start_line, at_start = len(lead.expandtabs(8)), line, False
                if kind == "text":
                    tok = tok.lstrip()
            if kind == "triple":
                close = text.find(tok, end)
                if close < 0:
                    raise ParseError(f"line {line}: the {tok} string opened here never ends", line)
                line += text.count("\n", end, close)
                end = close + 3
                parts.append(' "" ')
            elif kind == "str":
                parts.append(' "" ')
            elif kind == "open":
                stack.append((tok, line))
                if len(stack) > MAX_NESTING:
                    raise ParseError(f"line {line}: brackets nested more than {MAX_NESTING} deep", line)
                parts.append(tok)
            elif kind == "close":
                if not stack or stack[-1][0] != _PAIRS[tok]:
                    opened = f" (the '{stack[-1][0]}' of line {stack[-1][1]} is open)" if stack else ""
                    raise ParseError(f"line {line}: '{tok}' closes nothing{opened}", line)
                stack.pop()
                parts.append(tok)
            else:
                parts.append(tok)
        pos = end
    if stack:
        tok, at = stack[0]
        raise ParseError(f"line {at}: the '{tok}' opened here is never closed", at)
    flush()
    return out


def _split_args(s: str) -> list[str]:
    """Split at top-level commas (the text's brackets are balanced: the lexer checked)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    last = s[start:].strip()
    return [*parts, last] if last else parts


def _top_level(s: str, ch: str) -> int:
    """Index of the first ``ch`` outside brackets in ``s`` (``=`` not part of ``==``), or -1."""
    depth = 0
    for i, c in enumerate(s):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == ch and depth == 0:
            if ch == "=" and (s[i + 1:i + 2] == "=" or (i > 0 and s[i - 1] in "=!<>")):
                continue
            return i
    return -1


def _brackets(s: str, at: int) -> int:
    """Index of the ``]`` closing the ``[`` at ``s[at]``."""
    depth = 0
    for i in range(at, len(s)):
        depth += s[i] == "["
        depth -= s[i] == "]"
        if depth == 0:
            return i
    return len(s)


@dataclass(frozen=True)
class Alias:
    """A ``comptime``/``alias`` of the file: ``Name[params] = value`` on ``line``."""
    name: str
    params: tuple[str, ...]
    value: str
    line: int


_ALIAS_HEAD = re.compile(r"(?:alias|comptime)\s+(\w+)\s*")


def parse_alias(ln: LogicalLine) -> Alias | None:
    """The alias a logical line declares.

    Args:
        ln: a logical line (``comptime N: Int = 8``, ``alias M = 2 * 4``,
            ``comptime Ptr[T: AnyType] = UnsafePointer[T, MutAnyOrigin]``).

    Returns:
        Alias | None: name, parameter names, value and line; None if ``ln`` is no alias.
    """
    m = _ALIAS_HEAD.match(ln.text)
    if not m:
        return None
    rest, params = ln.text[m.end():], ()
    if rest.startswith("["):
        close = _brackets(rest, 0)
        params = tuple(p.split(":")[0].split("=")[0].strip() for p in _split_args(rest[1:close]))
        rest = rest[close + 1:]
    eq = _top_level(rest, "=")
    if eq < 0:
        return None
    return Alias(m.group(1), tuple(p for p in params if p.isidentifier()), rest[eq + 1:].strip(), ln.line)


_COUNT_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__,
              ast.FloorDiv: int.__floordiv__}


class _Scope:
    """The aliases a type may use: the struct's own first, then the module's."""

    def __init__(self, module: dict[str, Alias], struct: dict[str, Alias] | None = None):
        self.module, self.struct = module, struct or {}

    def get(self, name: str) -> Alias | None:
        if name.startswith("Self."):
            return self.struct.get(name[5:])
        return self.struct.get(name) or self.module.get(name)


def _in_alias(alias: Alias, e: ParseError) -> ParseError:
    """An error met while reading ``alias``: placed on the alias's line (the cause)."""
    if e.line is not None or alias.line is None:
        return e
    value = alias.value if len(alias.value) <= 80 else alias.value[:77] + "..."
    return ParseError(f"line {alias.line}: {alias.name} = {value}: {e}", alias.line)


def _mojo_int(s: str, scope: _Scope, depth: int = 0) -> int:
    """An element count: a literal, a ``comptime``/``alias`` name (``Self.N`` too), ``Int(...)``,
    and ``+ - * //`` of those (``StaticTuple[T, Int(N)]``, ``comptime N: Int = 8``)."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Self":
            name = f"Self.{node.attr}"
        if name is not None:
            alias = scope.get(name)
            if alias is None:
                raise ParseError(f"element count {s!r}: {name!r} is not a comptime/alias of this file")
            if depth > MAX_ALIAS_DEPTH:
                raise ParseError(f"element count {s!r}: the aliases refer to each other in a loop")
            try:
                return _mojo_int(alias.value, scope, depth + 1)
            except ParseError as e:
                raise _in_alias(alias, e) from None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("Int", "UInt") and len(node.args) == 1 and not node.keywords:
            return value(node.args[0])   # MAX writes StaticTuple[..., Int(8)]
        if isinstance(node, ast.BinOp) and type(node.op) in _COUNT_OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ParseError(f"element count {s!r} divides by zero")
            return _COUNT_OPS[type(node.op)](left, right)
        raise ParseError(f"cannot evaluate the element count {s!r} (known: integers, comptime/alias "
                         "names of this file, Int(...), + - * //)")
    if len(s) > 1000:
        raise ParseError(f"element count {s[:40]!r}...: longer than 1000 characters")
    try:
        tree = ast.parse(s.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ParseError(f"cannot evaluate the element count {s!r}") from None
    return value(tree.body)


def _substitute(alias: Alias, args: list[str]) -> str:
    """``alias.value`` with its parameters replaced by ``args`` (positional or ``name=value``)."""
    given = {}
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if eq and key.strip() in alias.params:
            given[key.strip()] = val.strip()
        elif i < len(alias.params):
            given[alias.params[i]] = a
    if not given:
        return alias.value
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, given)) + r")(?!\w)")
    return pattern.sub(lambda m: given[m.group(1)], alias.value)


def mojo_type(t: str, aliases: dict | None = None, _depth: int = 0) -> Member:
    """Size, class and array shape of a Mojo type as laid out on the host (name unset).

    Args:
        t: the type as written (``StaticTuple[UnsafePointer[UInt8], 8]``, ``Int``, an alias).
        aliases: name -> ``Alias`` (or name -> its value as text) the type may use.

    Returns:
        Member: size, class, element count and element size (``name`` and ``offset`` unset).

    Raises:
        ParseError: an unknown type, or a count that cannot be evaluated; an error inside
            an alias names the alias's line.
    """
    scope = aliases if isinstance(aliases, _Scope) else _Scope(
        {k: v if isinstance(v, Alias) else Alias(k, (), str(v), None) for k, v in (aliases or {}).items()})
    t = split_mojo_note(" ".join(t.split()))[0]
    if _depth > MAX_ALIAS_DEPTH:
        raise ParseError(f"the type {t!r}: aliases refer to each other more than {MAX_ALIAS_DEPTH} deep "
                         "(a loop?)")
    m = re.fullmatch(r"([\w.]+)\s*(?:\[(.*)\])?", t, flags=re.DOTALL)
    if not m:
        raise ParseError(f"cannot parse the type {t!r}")
    head, args = m.group(1), _split_args(m.group(2) or "")
    alias = scope.get(head) if head not in _MOJO_SCALARS else None
    if alias is not None and (alias.params or not args):
        try:
            return mojo_type(_substitute(alias, args), scope, _depth + 1)
        except ParseError as e:
            raise _in_alias(alias, e) from None
    if head in _MOJO_POINTERS or head.endswith("Ptr"):
        return Member("", 0, 8, "ptr", None, 8)
    if head in _MOJO_SCALARS:
        size, cls = _MOJO_SCALARS[head]
        return Member("", 0, size, cls, None, size)
    if head in ("Scalar", "SIMD") and args and args[0] in _DTYPES:
        width = _mojo_int(args[1], scope) if len(args) > 1 else 1
        size, cls = _DTYPES[args[0]]
        return Member("", 0, size * width, cls, None if width == 1 else width, size)
    if head in ("StaticTuple", "InlineArray") and len(args) >= 2:
        elem = mojo_type(args[0], scope, _depth + 1)
        n = _mojo_int(args[1], scope)
        if n <= 0:
            raise ParseError(f"element count {args[1]!r} of {t!r} is {n}, not positive")
        return Member("", 0, elem.size * n, elem.cls, n, elem.size)
    raise ParseError(f"unknown type {t!r} (known: {MOJO_KNOWN})")


_STRUCT = re.compile(r"struct\s+(\w+)")
_VAR = re.compile(r"var\s+(\w+)\s*:\s*(.+)$")


def mojo_layout(path, struct: str = STRUCT, text: str | None = None) -> Layout:
    """Lay out a Mojo ``struct`` by Mojo's rules: declaration order, natural alignment.

    Args:
        path: the Mojo file.
        struct: the struct's name.
        text: the file's text if already read (else it is read from ``path``).

    Returns:
        Layout: the fields in declaration order, the size rounded up to the alignment.

    Raises:
        DeclarationError: the file cannot be read, has no such struct (or two), no fields,
            or a type that cannot be laid out; the message names the line of the cause.
    """
    if text is None:
        text = read_declaration(path)
    try:
        lines = logical_lines(text)
    except ParseError as e:
        raise DeclarationError(path, str(e)) from None
    module = {}
    for ln in lines:
        if ln.indent == 0:
            a = parse_alias(ln)
            if a:
                module[a.name] = a
    starts = [i for i, ln in enumerate(lines) if (m := _STRUCT.match(ln.text)) and m.group(1) == struct]
    if not starts:
        seen = [m.group(1) for ln in lines if (m := _STRUCT.match(ln.text))]
        raise DeclarationError(path, f"no struct {struct!r} found (structs seen: {', '.join(seen) or 'none'})")
    if len(starts) > 1:
        raise DeclarationError(path, f"struct {struct} is defined twice (lines "
                               f"{lines[starts[0]].line} and {lines[starts[1]].line})")
    head = lines[starts[0]]
    if not head.text.endswith(":"):
        raise DeclarationError(path, f"line {head.line}: the struct's header does not end with ':'")
    body = []
    for ln in lines[starts[0] + 1:]:
        if ln.indent <= head.indent:
            break
        body.append(ln)
    # The fields' indentation: the first statement that is not a bare (doc)string.
    member_indent = next((ln.indent for ln in body if ln.text != '""'), 0)
    own = {a.name: a for ln in body if ln.indent == member_indent and (a := parse_alias(ln))}
    scope = _Scope(module, own)
    members, offset, align = [], 0, 1
    for ln in body:
        vm = _VAR.match(ln.text) if ln.indent == member_indent else None
        if not vm:
            continue   # methods and their bodies, decorators, docstrings, aliases, pass
        name, typ = vm.group(1), vm.group(2)
        eq = _top_level(typ, "=")
        typ = typ[:eq].strip() if eq >= 0 else typ
        try:
            t = mojo_type(typ, scope)
        except ParseError as e:
            if e.line is not None:   # the cause is elsewhere: an alias the type uses
                raise DeclarationError(path, f"{e} (the type of field {name}, line {ln.line})") from None
            raise DeclarationError(path, f"line {ln.line}: field {name}: {e}") from None
        if any(mm.name == name for mm in members):
            raise DeclarationError(path, f"line {ln.line}: field {name} declared twice")
        a = t.elem or t.size   # natural alignment: an array aligns like its element
        offset = -(-offset // a) * a
        members.append(Member(name, offset, t.size, t.cls, t.count, t.elem))
        offset += t.size
        align = max(align, a)
    if not members:
        raise DeclarationError(path, f"struct {struct} declares no `var` fields")
    return Layout(tuple(members), -(-offset // align) * align, align)
