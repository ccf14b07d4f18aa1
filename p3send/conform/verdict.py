"""The verdict: every difference between a laid-out declaration and ``abi.FIELDS``, and the
report ``p3send conform`` prints (one verdict per compiler configuration for C/C++)."""
from __future__ import annotations

from dataclasses import dataclass

from ..abi.config import FIELDS, P3_CONFIG_ALIGN, P3_CONFIG_SIZE, P3_MAX_RANKS, Field
from .model import STRUCT, Layout, Member

_CLS_WORDS = {"int": "signed integer", "uint": "unsigned integer", "ptr": "pointer",
              "float": "floating point", "bool": "bool", "other": "struct/union"}


def _describe(m: Member) -> str:
    what = _CLS_WORDS.get(m.cls, "member of unknown type")
    if m.count is not None:
        return f"{m.count} x {m.elem}-byte {what}"
    return f"{m.size}-byte {what}"


def _wanted(f: Field) -> str:
    what = {"ptr": "8-byte device address (unsigned integer or pointer)",
            "i64": "8-byte signed integer",
            "ptr[8]": f"{P3_MAX_RANKS} x 8-byte device address"}[f.kind]
    return f"{what} ({f.c}; Mojo {f.mojo})"


def _type_ok(f: Field, m: Member) -> bool:
    if m.cls is None:   # unknown type: the size check is all we can do
        return True
    want = {"int"} if f.kind == "i64" else {"ptr", "uint"}
    want_count = P3_MAX_RANKS if f.kind == "ptr[8]" else None
    return m.cls in want and m.count == want_count and (m.elem or m.size) == 8


def _out_of_order(order: list[int]) -> set[int]:
    """Positions not in one longest increasing run of ``order``: the fields that moved.

    A single moved field is reported alone, instead of every field it displaced.
    ``order`` holds at most ``len(FIELDS)`` entries, so the quadratic search is cheap.
    """
    n = len(order)
    best, prev = [1] * n, [-1] * n
    for i in range(n):
        for j in range(i):
            if order[j] < order[i] and best[j] + 1 > best[i]:
                best[i], prev[i] = best[j] + 1, j
    keep, i = set(), (max(range(n), key=best.__getitem__) if n else -1)
    while i >= 0:
        keep.add(i)
        i = prev[i]
    return set(range(n)) - keep


def compare(layout: Layout) -> list[str]:
    """Every difference between ``layout`` and ``abi.FIELDS``, one message per problem.

    Args:
        layout: a declaration as one reader laid it out.

    Returns:
        list[str]: "FIELD: what is wrong" messages (missing, extra, out of order, offset,
        size, type) and the struct's size and alignment; empty when it conforms.
    """
    problems = []
    found = {m.name: m for m in layout.members}
    want_index = {f.name: i for i, f in enumerate(FIELDS)}
    for f in FIELDS:
        if f.name not in found:
            problems.append(f"{f.name}: missing (expected at offset {f.offset}, {f.size} bytes, "
                            f"{_wanted(f)})")
    for m in layout.members:
        if m.name not in want_index:
            problems.append(f"{m.name}: extra field at offset {m.offset} ({_describe(m)}); "
                            f"the ABI has no such field")
    common = [m.name for m in layout.members if m.name in want_index]
    moved = _out_of_order([want_index[n] for n in common])
    expected_order = [f.name for f in FIELDS if f.name in found]
    for pos in sorted(moved):
        name = common[pos]
        after = common[pos - 1] if pos else "the start"
        k = expected_order.index(name)
        want_after = expected_order[k - 1] if k else "the start"
        problems.append(f"{name}: out of order: declared after {after}, expected after {want_after}")
    for f in FIELDS:
        m = found.get(f.name)
        if m is None:
            continue
        if m.offset != f.offset:
            problems.append(f"{f.name}: offset expected {f.offset}, found {m.offset}")
        if m.size != f.size:
            problems.append(f"{f.name}: size expected {f.size}, found {m.size} (a {_describe(m)}; "
                            f"the ABI needs {_wanted(f)})")
        elif not _type_ok(f, m):
            problems.append(f"{f.name}: type expected {_wanted(f)}, found {_describe(m)}")
    if layout.size != P3_CONFIG_SIZE:
        problems.append(f"struct size: expected {P3_CONFIG_SIZE} bytes, found {layout.size}")
    if layout.align != P3_CONFIG_ALIGN:
        problems.append(f"struct alignment: expected {P3_CONFIG_ALIGN}, found {layout.align}")
    return problems


@dataclass(frozen=True)
class Verdict:
    """The verdict for one configuration.

    Attributes:
        config: "" for Mojo and JSON (one reading); for C/C++ the configuration and how it
            was compiled (``"with __CUDACC__ (as C++)"``).
        problems: ``compare``'s messages (empty: it conforms), or None when this
            configuration could not be checked.
        error: why it could not be checked ("" when it was).
    """
    config: str
    problems: tuple[str, ...] | None
    error: str = ""


@dataclass(frozen=True)
class Report:
    """What ``p3send conform`` found in one file.

    Attributes:
        path: the file.
        struct: the struct's name as asked.
        verdicts: one per configuration (one for Mojo and JSON), in order.
        notes: lines printed after the verdicts (where the CUDA headers were found).
    """
    path: str
    struct: str
    verdicts: tuple[Verdict, ...]
    notes: tuple[str, ...] = ()

    @property
    def conforms(self) -> bool:
        """True when every configuration that could be checked conforms (and one could)."""
        checked = [v for v in self.verdicts if v.problems is not None]
        return bool(checked) and not any(v.problems for v in checked)

    @property
    def status(self) -> int:
        """The exit status: 0 conforms, 1 does not."""
        return 0 if self.conforms else 1

    def _groups(self) -> list[tuple[list[str], tuple[str, ...]]]:
        groups: list[tuple[list[str], tuple[str, ...]]] = []
        for v in self.verdicts:
            if v.problems is None:
                continue
            same = next((g for g in groups if g[1] == v.problems), None)
            if same:
                same[0].append(v.config)
            else:
                groups.append(([v.config], v.problems))
        return groups

    @property
    def problems(self) -> list[str]:
        """Every problem: as ``compare`` words them when the configurations agree, else each
        prefixed with the configuration(s) it is found in."""
        groups = self._groups()
        if len(groups) == 1:
            return list(groups[0][1])
        return [f"{' and '.join(labels)}: {p}" for labels, probs in groups for p in probs]

    def lines(self) -> list[str]:
        """The report as ``p3send conform`` prints it, line by line."""
        problems = self.problems
        if self.conforms:
            out = [f"{self.path}: {self.struct} conforms to the {STRUCT} ABI ({P3_CONFIG_SIZE} bytes, "
                   f"align {P3_CONFIG_ALIGN}, {len(FIELDS)} fields)"]
        else:
            out = [f"{self.path}: {self.struct} does NOT conform to the {STRUCT} ABI "
                   f"({len(problems)} problem(s)):"]
        groups = self._groups()
        if len(groups) == 1:
            labels, probs = groups[0]
            out += [f"  - {p}" for p in probs]
            if any(labels):
                out.append(f"  checked: {', '.join(labels)}")
        else:
            for labels, probs in groups:
                name = " and ".join(labels)
                out += [f"  {name}: {len(probs)} problem(s):", *(f"  - {p}" for p in probs)] if probs \
                    else [f"  {name}: conforms"]
        out += [f"  {v.config}: not checked: {v.error}" for v in self.verdicts if v.problems is None]
        return out + [f"  {n}" for n in self.notes]

    def text(self) -> str:
        """``lines()`` joined, ending in a newline."""
        return "\n".join(self.lines()) + "\n"
