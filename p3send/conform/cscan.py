"""Reading a preprocessed C/C++ translation unit: the structs it defines and the names of
their data members, as the compiler will see them.

The input is what the real preprocessor printed (``cc -E``): ``#if`` branches are decided,
macros and X-macros expanded, ``#include`` files inlined, each piece marked with the file and
line it came from. Text from system headers is dropped (their structs are not the user's),
the rest is read in one linear pass: tokens, then every bracket's partner (at most
``MAX_NESTING`` deep), then namespaces, classes and declarations. The compiler probe then
measures what is found here; nothing here decides a size or an offset.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .model import ParseError

#: The deepest bracket nesting read; deeper input is refused (the compiler's own limit is alike).
MAX_NESTING = 256

_LINEMARKER = re.compile(r'^# (\d+) "((?:[^"\\\n]|\\.)*)"([ 0-9]*)$', flags=re.MULTILINE)
_TOKEN = re.compile(r"""
 (?P<nl>\n)
|[ \t\r\f\v]+
|(?P<dir>\#[^\n]*)
|(?P<raw>(?:u8|[uUL])?R")
|(?P<str>(?:u8|[uUL])?"(?:[^"\\\n]|\\.)*"?)
|(?P<chr>(?:u8|[uUL])?'(?:[^'\\\n]|\\.)*'?)
|(?P<id>[A-Za-z_$][\w$]*)
|(?P<num>\.?\d(?:[eEpP][+-]|[\w.'])*)
|(?P<op>::|->|\.\.\.|>>|<<|[-+*/%&|^!=<>]=|&&|\|\||\+\+|--|[^\s\w])
""", flags=re.VERBOSE)
# The same tokens, for a line without raw strings (findall: no Python per token).
_FAST_TOKEN = re.compile(r"""(?:u8|[uUL])?"(?:[^"\\\n]|\\.)*"?|(?:u8|[uUL])?'(?:[^'\\\n]|\\.)*'?"""
                         r"|[A-Za-z_$][\w$]*|\.?\d(?:[eEpP][+-]|[\w.'])*"
                         r"|::|->|\.\.\.|>>|<<|[-+*/%&|^!=<>]=|&&|\|\||\+\+|--|[^\s\w]")
_IDENT = re.compile(r"[A-Za-z_$][\w$]*")
_OPEN = {"{": "}", "(": ")", "[": "]"}
_CLOSE = {"}": "{", ")": "(", "]": "["}
_ATTRIBUTES = frozenset({"__attribute__", "__declspec", "alignas", "_Alignas", "__align__", "__asm__",
                         "__asm", "asm"})
_ACCESS = frozenset({"public", "private", "protected"})
_TYPE_OPERATORS = frozenset({"decltype", "typeof", "__typeof__", "__typeof", "_Atomic", "sizeof", "alignof",
                             "_Alignof", "__alignof__"})
_NOT_DATA = frozenset({"static", "typedef", "using", "friend", "template", "static_assert", "_Static_assert"})
_QUALIFIERS = frozenset({"const", "volatile", "override", "final", "noexcept", "throw", "default", "delete",
                         "mutable", "constexpr", "consteval", "constinit", "requires"})
_KEYWORDS = frozenset({"int", "char", "short", "long", "signed", "unsigned", "float", "double", "void", "bool",
                       "_Bool", "const", "volatile", "struct", "class", "union", "enum", "auto", "register",
                       "restrict", "__restrict", "__restrict__", "inline", "extern", "mutable", "typename"})


def _unescape(name: str) -> str:
    """A file name as a linemarker writes it (``\\"``, ``\\\\``, octal bytes) -> the name."""
    if "\\" not in name:
        return name
    out = bytearray()
    i = 0
    while i < len(name):
        c = name[i]
        if c == "\\" and i + 1 < len(name):
            octal = re.match(r"[0-7]{3}", name[i + 1:i + 4])
            if octal:
                out.append(int(octal.group(), 8))
                i += 4
                continue
            out += name[i + 1].encode()
            i += 2
            continue
        out += c.encode()
        i += 1
    return out.decode(errors="replace")


@dataclass(frozen=True)
class CStruct:
    """A struct or class of the translation unit: its definition, or a declaration only.

    ``body`` is the token range inside its braces (None for a declaration); ``unclosed``
    says where its ``{`` is when nothing closes it.
    """
    scope: tuple[str, ...]   # enclosing namespaces and classes, outermost first
    name: str                # the tag, or the typedef name
    body: tuple[int, int] | None
    keyword: str             # "struct" or "class": the default access of the members
    typedef: bool            # named by a typedef (C writes it without `struct`)
    base: str = ""           # the base-class clause, "" if none
    unclosed: str = ""       # "line N" of its '{' when no '}' closes it
    template: bool = False   # a class template (its members cannot be measured without arguments)

    @property
    def qualname(self) -> str:
        return "::".join((*self.scope, self.name))


class Unit:
    """One preprocessed translation unit, as tokens of the files that are not system headers.

    Args:
        text: what the preprocessor printed, with its linemarkers.
        main: the path of the declaration file exactly as the preprocessor was given it.

    Raises:
        ParseError: brackets nested deeper than ``MAX_NESTING``.
    """

    def __init__(self, text: str, main: str):
        self.main = main
        self.files: list[str] = []
        self.tokens: list[str] = []
        self.file_of: list[int] = []
        self.line_of: list[int] = []
        self._read(text)
        self.match = self._pair_brackets()
        self.structs: list[CStruct] = []
        self._aliases: list[tuple[tuple[str, ...], str, str]] = []
        self._scan(0, len(self.tokens), (), 0)
        self._resolve_aliases()

    # ------------------------------------------------------------------ tokens

    def _read(self, text: str) -> None:
        index: dict[str, int] = {}
        keep, file, line, pos = True, self._file_index(index, self.main), 1, 0
        for m in _LINEMARKER.finditer(text):
            if keep:
                self._tokenize(text[pos:m.start()], file, line)
            name = _unescape(m.group(2))
            system = "3" in m.group(3).split()
            keep = name == self.main or not (system or name.startswith("<"))
            file, line, pos = self._file_index(index, name), int(m.group(1)), m.end() + 1
        if keep:
            self._tokenize(text[pos:], file, line)

    def _file_index(self, index: dict[str, int], name: str) -> int:
        if name not in index:
            index[name] = len(self.files)
            self.files.append(name)
        return index[name]

    def _tokenize(self, text: str, file: int, line: int) -> None:
        if 'R"' in text:   # a raw string may span lines: the token-by-token reader
            self._tokenize_slowly(text, file, line)
            return
        tokens, files, lines = self.tokens, self.file_of, self.line_of
        for physical in text.split("\n"):
            if not physical.lstrip().startswith("#"):   # a #pragma the preprocessor left
                found = _FAST_TOKEN.findall(physical)
                if found:
                    tokens += found
                    files += [file] * len(found)
                    lines += [line] * len(found)
            line += 1

    def _tokenize_slowly(self, text: str, file: int, line: int) -> None:
        tokens, files, lines = self.tokens, self.file_of, self.line_of
        pos, n = 0, len(text)
        while pos < n:
            m = _TOKEN.match(text, pos)
            if m is None:   # a character no alternative takes (a lone NUL or the like)
                pos += 1
                continue
            kind, end = m.lastgroup, m.end()
            if kind == "nl":
                line += 1
            elif kind in ("id", "num", "op", "str", "chr"):
                tokens.append(m.group())
                files.append(file)
                lines.append(line)
            elif kind == "raw":   # R"delim( ... )delim": found with one find, not a regex
                open_paren = text.find("(", end, end + 17)
                if open_paren < 0:
                    stop = n
                else:
                    delim = text[end:open_paren]
                    close = text.find(f"){delim}\"", open_paren)
                    stop = n if close < 0 else close + len(delim) + 2
                tokens.append('""')
                files.append(file)
                lines.append(line)
                line += text.count("\n", pos, stop)
                end = stop
            pos = end

    def where(self, i: int) -> str:
        """Where token ``i`` came from.

        Args:
            i: a token index.

        Returns:
            str: ``"line N"`` in the declaration file, ``"NAME:N"`` in another file.
        """
        if not self.tokens:
            return "line 1"
        i = min(i, len(self.tokens) - 1)
        name = self.files[self.file_of[i]]
        if name == self.main:
            return f"line {self.line_of[i]}"
        return f"{os.path.basename(name)}:{self.line_of[i]}"

    def _pair_brackets(self) -> list[int]:
        toks = self.tokens
        match = [-1] * len(toks)
        stack: list[int] = []
        open_count = dict.fromkeys(_OPEN, 0)
        for i, t in enumerate(toks):
            if t in _OPEN:
                stack.append(i)
                open_count[t] += 1
                if len(stack) > MAX_NESTING:
                    raise ParseError(f"{self.where(i)}: brackets nested more than {MAX_NESTING} deep; "
                                     f"conform reads at most {MAX_NESTING} levels")
            elif t in _CLOSE and open_count[_CLOSE[t]]:
                want = _CLOSE[t]
                while toks[stack[-1]] != want:   # openers closed by nothing keep -1
                    open_count[toks[stack.pop()]] -= 1
                j = stack.pop()
                open_count[want] -= 1
                match[i], match[j] = j, i
        return match

    def text(self, lo: int, hi: int) -> str:
        """The tokens ``lo..hi`` as one line of source (for messages)."""
        return " ".join(self.tokens[lo:hi]).replace(" :: ", "::")

    def _ident(self, i: int) -> bool:
        return i < len(self.tokens) and _IDENT.fullmatch(self.tokens[i]) is not None

    def _skip_attributes(self, i: int, hi: int) -> int:
        toks, match = self.tokens, self.match
        while i < hi:
            t = toks[i]
            if t in _ATTRIBUTES and i + 1 < hi and toks[i + 1] == "(" and match[i + 1] > 0:
                i = match[i + 1] + 1
            elif t == "[" and i + 1 < hi and toks[i + 1] == "[" and match[i] > 0:
                i = match[i] + 1
            elif t in ("__extension__", "__inline", "__inline__"):
                i += 1
            else:
                return i
        return i

    def _skip(self, i: int) -> int:
        """The index after the bracket group opened at ``i`` (or just after ``i``)."""
        close = self.match[i]
        return close + 1 if close > i else i + 1

    # ------------------------------------------------------------------ structs

    def _scan(self, lo: int, hi: int, scope: tuple[str, ...], depth: int) -> None:
        toks, match = self.tokens, self.match
        i, typedef, template = lo, False, False
        while i < hi:
            t = toks[i]
            if t == ";":
                typedef = template = False
                i += 1
            elif t == "typedef":
                typedef = True
                i += 1
            elif t == "template":
                template = True
                i += 1
            elif t == "namespace":
                i = self._namespace(i, hi, scope, depth)
            elif t == "extern" and i + 2 < hi and toks[i + 1] in ('"C"', '"C++"') and toks[i + 2] == "{":
                close = match[i + 2]
                end = close if i + 2 < close <= hi else hi
                self._scan(i + 3, end, scope, depth + 1)
                i = end + 1
            elif t in ("struct", "class", "union", "enum"):
                i = self._aggregate(i, hi, scope, depth, typedef, template)
            elif t == "{":
                close = match[i]
                i = close + 1 if i < close <= hi else i + 1   # an unclosed block: read on inside it
                template = False
            elif t in ("(", "["):
                i = self._skip(i)
            else:
                i += 1

    def _namespace(self, i: int, hi: int, scope: tuple[str, ...], depth: int) -> int:
        toks = self.tokens
        j, names = i + 1, []
        while j < hi and toks[j] not in ("{", ";", "="):
            k = self._skip_attributes(j, hi)
            if k != j:
                j = k
                continue
            if self._ident(j) and toks[j] != "inline":
                names.append(toks[j])
            j += 1
        if j < hi and toks[j] == "{":
            close = self.match[j]
            end = close if j < close <= hi else hi
            self._scan(j + 1, end, scope + tuple(names), depth + 1)
            return end + 1
        return j + 1

    def _aggregate(self, i: int, hi: int, scope: tuple[str, ...], depth: int, typedef: bool,
                   template: bool) -> int:
        toks, match = self.tokens, self.match
        kw = toks[i]
        j = i + 1
        if kw == "enum" and j < hi and toks[j] in ("class", "struct"):
            j += 1
        j = self._skip_attributes(j, hi)
        tag = None
        if self._ident(j) and toks[j] != "final":
            tag = toks[j]
            j += 1
            while j + 1 < hi and toks[j] == "::" and self._ident(j + 1):
                tag = toks[j + 1]
                j += 2
            if j < hi and toks[j] == "<":   # a specialisation `struct S<int> {`: not one we measure
                return j
        j = self._skip_attributes(j, hi)
        if j < hi and toks[j] == "final":
            j = self._skip_attributes(j + 1, hi)
        base_lo = None
        if j < hi and toks[j] == ":":
            base_lo = j + 1
            while j < hi and toks[j] not in ("{", ";"):
                j = self._skip(j) if toks[j] in ("(", "[") else j + 1
        if j >= hi:
            return hi
        if toks[j] == "{":
            close, unclosed = match[j], ""
            if not j < close <= hi:
                close, unclosed = hi, self.where(j)
            if kw in ("struct", "class"):
                names = [(tag, False)] if tag else []
                if typedef:
                    names += [(n, True) for n in self._typedef_names(close + 1, hi)]
                base = self.text(base_lo, j) if base_lo is not None else ""
                self.structs += [CStruct(scope, n, (j + 1, close), kw, td, base, unclosed, template)
                                 for n, td in names]
                if names:
                    self._scan(j + 1, close, (*scope, names[0][0]), depth + 1)   # nested types
            elif kw == "union":
                self._scan(j + 1, close, (*scope, tag) if tag else scope, depth + 1)
            return close + 1
        if kw in ("struct", "class") and tag:
            if typedef:   # typedef struct Tag Name;
                self._aliases += [(scope, tag, n) for n in self._typedef_names(j, hi)]
            elif toks[j] == ";":
                self.structs.append(CStruct(scope, tag, None, kw, False))
        return max(j, i + 1)

    def _typedef_names(self, j: int, hi: int) -> list[str]:
        """The plain names declared from ``j`` to the ``;`` (``Name, *PName`` -> ``[Name]``)."""
        toks, names, plain = self.tokens, [], True
        start = j
        while j < hi and toks[j] != ";":
            if toks[j] == ",":
                if plain and j - start == 1 and self._ident(start):
                    names.append(toks[start])
                start, plain = j + 1, True
                j += 1
                continue
            k = self._skip_attributes(j, hi)
            if k != j:
                if j == start:
                    start = k
                j = k
                continue
            if toks[j] in ("(", "["):
                plain = False
                j = self._skip(j)
                continue
            j += 1
        if plain and j - start == 1 and self._ident(start):
            names.append(toks[start])
        return names

    def _resolve_aliases(self) -> None:
        for scope, tag, name in self._aliases:   # typedef struct Tag Name;
            targets = [s for s in self.structs if s.body is not None and s.name == tag and not s.typedef]
            target = next((s for s in targets if s.scope == scope), targets[0] if targets else None)
            if target and tag != name:
                self.structs.append(CStruct(scope, name, target.body, target.keyword, True, target.base,
                                            target.unclosed, target.template))

    def pick(self, asked: str) -> list[CStruct]:
        """The definitions ``asked`` (``Name`` or ``ns::Name``) names, all of one qualified name.

        A full name matches exactly; otherwise the trailing components must match
        (``P3PeerSendConfig`` finds ``max::ep::P3PeerSendConfig``) and only one may.

        Args:
            asked: the name given (``--struct``).

        Returns:
            list[CStruct]: the definitions of that one qualified name (a typedef and its tag
            may both match).

        Raises:
            ParseError: none matches (the message lists the structs seen), only a
                declaration matches, or two qualified names do.
        """
        want = tuple(p.strip() for p in asked.strip().removeprefix("::").split("::"))
        defs = [s for s in self.structs if s.body is not None]
        hits = [s for s in defs if (*s.scope, s.name) == want] or \
            [s for s in defs if (*s.scope, s.name)[-len(want):] == want]
        if not hits:
            if any((*s.scope, s.name)[-len(want):] == want for s in self.structs):
                raise ParseError(f"struct {asked!r} is only declared here, not defined: "
                                 "conform needs the definition, with its members")
            seen = sorted({s.qualname for s in defs})
            raise ParseError(f"no struct {asked!r} found (structs seen: {', '.join(seen) or 'none'})")
        names = sorted({s.qualname for s in hits})
        if len(names) > 1:
            raise ParseError(f"struct {asked!r} is ambiguous ({', '.join(names)}): "
                             "pass --struct with the full name")
        return hits

    # ------------------------------------------------------------------ members

    def members(self, s: CStruct) -> tuple[list[tuple[str, int]], list[str]]:
        """(name, array rank) of each data member of ``s``, in order, and the names of the
        members that are not public.

        Members of anonymous nested structs/unions are members of the outer struct (C11),
        so they are listed; a named nested aggregate is one member; a nested type, a static
        member, a member function declares none. ``std::array`` counts as an array (rank 1
        per level).

        Args:
            s: a definition ``pick`` returned.

        Returns:
            (list[tuple[str, int]], list[str]): the members, and the non-public ones' names.

        Raises:
            ParseError: a bit-field (``offsetof`` cannot measure it), or a bracket of the
                body that nothing closes.
        """
        lo, hi = s.body
        return self._member_names(lo, hi, s.keyword == "struct")

    def _declarations(self, lo: int, hi: int, public: bool) -> list[tuple[bool, int, int]]:
        """The declarations of a struct body, each with whether it is public, as token ranges.

        Split at the top-level ``;``; inline function bodies (member functions,
        constructors with initialiser lists) are dropped, other braces (nested
        aggregates, ``= {}``, ``x{-1}``) stay part of their declaration.
        """
        toks, match = self.tokens, self.match
        out, start, i, kind = [], lo, lo, None
        while i < hi:
            t = toks[i]
            if t in _ACCESS and i + 1 < hi and toks[i + 1] == ":":
                public = t == "public"
                i = start = i + 2
                kind = None
            elif t == "{":
                close = match[i]
                if not i < close < hi:
                    raise ParseError(f"{self.where(i)}: this '{{' in the struct body is never closed")
                if kind is None:
                    kind = self._head_kind(start, i)
                if kind == "function" or (kind == "ctor" and toks[i - 1] in (")", "}")):
                    start, kind = close + 1, None
                i = close + 1
            elif t in ("(", "["):
                close = match[i]
                if not i < close < hi:
                    raise ParseError(f"{self.where(i)}: this '{t}' in the struct body is never closed")
                i = close + 1
            elif t == ";":
                out.append((public, start, i))
                start, kind = i + 1, None
                i += 1
            else:
                i += 1
        return out

    def _head_kind(self, lo: int, hi: int) -> str:
        """What the tokens ``lo..hi`` (a declaration, or what precedes its first ``{``) begin:
        "function", "ctor" (a constructor with an initialiser list) or "data"."""
        toks = self.tokens
        if "operator" in toks[lo:hi]:
            return "function"
        angle, k = 0, lo
        while k < hi:
            j = self._skip_attributes(k, hi)
            if j != k:
                k = j
                continue
            t = toks[k]
            if t == "<":
                angle += 1
            elif t in (">", ">>"):
                angle = max(0, angle - len(t))
            elif angle:
                if t in ("(", "["):
                    k = self._skip(k)
                    continue
            elif t in ("=", "["):
                return "data"
            elif t == "(":
                before = toks[k - 1] if k > lo else ""
                after = toks[k + 1] if k + 1 < hi else ""
                if not _IDENT.fullmatch(before) or before in _TYPE_OPERATORS or after in ("*", "&", "^", "&&"):
                    return "data"
                return self._after_parameters(self._skip(k), hi)
            k += 1
        return "data"

    def _after_parameters(self, k: int, hi: int) -> str:
        toks = self.tokens
        j = k
        while j < hi and toks[j] in ("noexcept", "throw", "const", "volatile", "&", "&&"):
            j = self._skip(j + 1) if j + 1 < hi and toks[j + 1] == "(" else j + 1
        if j < hi and toks[j] == ":":
            return "ctor"
        if "->" in toks[k:hi]:
            return "function"
        names = 0
        while k < hi:
            if toks[k] in ("(", "["):
                if toks[k] == "[":
                    return "data"
                k = self._skip(k)
                continue
            if self._ident(k) and toks[k] not in _QUALIFIERS:
                names += 1
            k += 1
        # What is left are macros that expanded to nothing visible; two names would be a
        # type and a member (`ALIGNED(8) uint64_t x`).
        return "function" if names < 2 else "data"

    def _member_names(self, lo: int, hi: int, public: bool) -> tuple[list[tuple[str, int]], list[str]]:
        toks, match = self.tokens, self.match
        out: list[tuple[str, int]] = []
        hidden: list[str] = []
        for is_public, a, b in self._declarations(lo, hi, public):
            a = self._skip_attributes(a, b)
            if a >= b:
                continue
            head_end = next((k for k in range(a, b) if toks[k] in ("=", "{", "(")), b)
            if any(t in _NOT_DATA for t in toks[a:head_end]):
                continue
            k = a
            while k < b and toks[k] in ("const", "volatile", "mutable"):
                k += 1
            if k < b and toks[k] in ("struct", "union", "class", "enum"):
                brace = next((j for j in range(k, b) if toks[j] in ("{", "=", "(")), b)
                if brace < b and toks[brace] == "{":
                    close = match[brace]
                    t = self._skip_attributes(k + 1, brace)
                    named = t < brace and self._ident(t)
                    if close + 1 >= b:   # no declarator: anonymous members are ours, a named type is not data
                        if toks[k] in ("struct", "union") and not named:
                            names, inner = self._member_names(brace + 1, close, True)
                            out += names
                            hidden += inner if is_public else [n for n, _ in names]
                        continue
                    self._declarators(close + 1, b, 0, is_public, out, hidden)
                    continue
            elif self._head_kind(a, b) == "function":
                continue
            self._declarators(a, b, None, is_public, out, hidden)
        return out, hidden

    def _declarators(self, a: int, b: int, type_rank: int | None, public: bool,
                     out: list[tuple[str, int]], hidden: list[str]) -> None:
        """Append (name, rank) of each declarator of ``a..b`` (``int64_t x, y[2] = {1, 2}``)."""
        toks = self.tokens
        parts, start, angle, k = [], a, 0, a
        while k < b:
            t = toks[k]
            if t in ("(", "[", "{"):
                k = self._skip(k)
                continue
            if t == "<":
                angle += 1
            elif t in (">", ">>"):
                angle = max(0, angle - len(t))
            elif t == "," and angle == 0:
                parts.append((start, k))
                start = k + 1
            k += 1
        parts.append((start, b))
        if type_rank is None:
            first = toks[parts[0][0]:parts[0][1]]
            type_rank = sum(1 for x, y in zip(first, first[1:]) if x == "array" and y == "<")
        for lo, hi in parts:
            hi = self._without_initialiser(lo, hi)
            name = self._declarator_name(lo, hi)
            if name:
                out.append((name[0], name[1] + type_rank))
                if not public:
                    hidden.append(name[0])

    def _without_initialiser(self, lo: int, hi: int) -> int:
        """The end of the declarator ``lo..hi`` without ``= ...`` or ``{...}``."""
        toks, angle, k = self.tokens, 0, lo
        while k < hi:
            t = toks[k]
            if angle == 0 and t in ("=", "{"):
                return k
            if t in ("(", "["):
                k = self._skip(k)
                continue
            if t == "<":
                angle += 1
            elif t in (">", ">>"):
                angle = max(0, angle - len(t))
            k += 1
        return hi

    def _declarator_name(self, lo: int, hi: int) -> tuple[str, int] | None:
        toks, match = self.tokens, self.match
        k = lo
        while k < hi:
            t = toks[k]
            if t == ":":
                raise ParseError(f"{self.where(k)}: bit-field {self.text(lo, hi)!r}: its layout cannot be "
                                 "checked by offsetof")
            if t == "(" and k + 3 < hi and toks[k + 1] == "*" and self._ident(k + 2) and toks[k + 3] in (")", "["):
                return toks[k + 2], 0   # a pointer to a function (or to an array)
            k = self._skip(k) if t in ("(", "[", "{") else k + 1
        e, rank = hi, 0
        while e > lo:   # trailing attributes and array dimensions
            t = toks[e - 1]
            if t == ")" and match[e - 1] > lo and toks[match[e - 1] - 1] in _ATTRIBUTES:
                e = match[e - 1] - 1
            elif t == "]" and match[e - 1] >= lo:
                opener = match[e - 1]
                if not (opener + 1 < e - 1 and toks[opener + 1] == "[" and toks[e - 2] == "]"):
                    rank += 1   # `[[attribute]]` is no dimension
                e = opener
            else:
                break
        if e > lo and self._ident(e - 1) and toks[e - 1] not in _KEYWORDS:
            return toks[e - 1], rank
        return None
