"""The documentation cannot drift from the PTX, and stands alone (CPU only, no CUDA).

docs/KERNELS.md has one level-2 section per shipped kernel and per linkable device
function (``// FUNC`` headers), headed by its name, holding a markdown table with the
columns ``off | size | type | name | meaning``: its rows must be the PARAMS rows of that
PTX file's header (``ptxdoc.parse_header``), in order, field for field. The layout
tables of the send functions' structs (``off | size | type | field | meaning``) must be
``abi.P3SendCtx`` and ``P3_SEND_ACCT_SIZE``. docs/ABI.md holds the struct only.
docs/PROTOCOL.md must name every shipped entry and function. The tables are parsed as
markdown (cells split on unescaped ``|``, backticks and backslash escapes removed,
whitespace collapsed), so formatting may change freely while the content may not.

The repository stands alone: docs/README.md lists every document, every ``docs/<doc>.md``
named anywhere exists (and a quoted section title after it is one of its headings),
every ``p3send/...`` path named in the docs exists, and nothing cites the design notes
the project was specified from. The register argument of docs/PROTOCOL.md ("Scheduling
on one GPU") is checked against the assembler's numbers.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from p3send.cuda import ptxdoc
from p3send.ops import send as send_ops

ROOT = Path(__file__).resolve().parents[2]
PTX_DIR = ROOT / "ptx"
DOCS = ROOT / "docs"
ABI = DOCS / "ABI.md"
KERNELS = DOCS / "KERNELS.md"
PROTOCOL = DOCS / "PROTOCOL.md"
PARAM_COLUMNS = ["off", "size", "type", "name", "meaning"]
KNOWN_ENTRIES = {"p3_abi_echo", "p3_scatter_send", "p3_recv_reduce", "p3_epilogue_send", "p3_pingpong"}
KNOWN_FUNCS = {"p3_send_rows", "p3_send_flush"}
#: Entries outside the protocol that take no P3PeerSendConfig (a cross-GPU clock probe, the
#: FP8 activation quantiser).
NO_CONFIG = {"p3_pingpong", "p3_quant_fp8"}
STRUCT_COLUMNS = ["off", "size", "type", "field", "meaning"]


def _shipped(kind: str = "entry"):
    """(file name, ptxdoc.Entry) for every documented .entry (or .func) of every shipped PTX file."""
    out = []
    for path in sorted(PTX_DIR.glob("*.ptx")):
        for entry in ptxdoc.parse_header(path.read_text()).values():
            if entry.kind == kind:
                out.append((path.name, entry))
    return out


SHIPPED = _shipped()
IDS = [e.name for _, e in SHIPPED]
FUNCS = _shipped("func")
FUNC_IDS = [e.name for _, e in FUNCS]


# ---------------------------------------------------------------- markdown helpers

def _norm(cell: str) -> str:
    """A table cell as plain text: no backticks, no backslash escapes, single spaces."""
    cell = cell.replace("`", "")
    cell = re.sub(r"\\(.)", r"\1", cell)
    return " ".join(cell.split())


def md_tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text`` as rows of normalised cells (separator rows dropped)."""
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        s = line.strip()
        if s.startswith("|"):
            cells = re.split(r"(?<!\\)\|", s)[1:]
            if cells and cells[-1].strip() == "":
                cells = cells[:-1]
            cells = [_norm(c) for c in cells]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def kernel_subsection(section: str, entry: str) -> str | None:
    """The ``## ...`` section of docs/KERNELS.md whose heading names ``entry`` (as a whole word)."""
    heads = list(re.finditer(r"^## (.*)$", section, flags=re.M))
    for i, h in enumerate(heads):
        if re.search(rf"(?<![\w]){re.escape(entry)}(?![\w])", h.group(1)):
            end = heads[i + 1].start() if i + 1 < len(heads) else len(section)
            return section[h.end():end]
    return None


def documented_params(section: str, entry: str) -> list[list[str]]:
    """The rows of ``entry``'s parameter table (the one table with PARAM_COLUMNS)."""
    sub = kernel_subsection(section, entry)
    assert sub is not None, f"docs/KERNELS.md has no '## {entry}' section"
    tables = [t for t in md_tables(sub) if t and [c.lower() for c in t[0]] == PARAM_COLUMNS]
    assert len(tables) == 1, (f"docs/KERNELS.md, {entry}: expected one table with columns "
                              f"{' | '.join(PARAM_COLUMNS)}, found {len(tables)}")
    return tables[0][1:]


def param_drift(entry: ptxdoc.Entry, rows: list[list[str]]) -> list[str]:
    """Differences between the PTX header's PARAMS and the documented rows (empty = none)."""
    want = [[str(p.offset), str(p.size), p.type, p.name] for p in entry.params]
    got = [r[:4] for r in rows]
    problems = [f"row {i}: documented {g}, PTX header {w}"
                for i, (g, w) in enumerate(zip(got, want)) if g != w]
    problems += [f"row {i}: in the PTX header but not documented: {w}" for i, w in enumerate(want) if i >= len(got)]
    problems += [f"row {i}: documented but not in the PTX header: {g}" for i, g in enumerate(got) if i >= len(want)]
    problems += [f"row {i}: expected 5 cells, got {len(r)}: {r}" for i, r in enumerate(rows) if len(r) != 5]
    return problems


@pytest.fixture(scope="module")
def abi_doc() -> str:
    return ABI.read_text()


@pytest.fixture(scope="module")
def section() -> str:
    return KERNELS.read_text()


# ---------------------------------------------------------------- docs/KERNELS.md

def test_every_known_kernel_is_shipped_and_documented_in_its_ptx():
    # Guards the parametrised tests below against an empty list (a renamed directory,
    # a header the parser no longer reads).
    assert KNOWN_ENTRIES <= set(IDS), f"shipped entries with a PTX header: {IDS}"
    for name, entry in SHIPPED:
        if entry.name in NO_CONFIG:
            assert entry.params and all(p.type != "P3PeerSendConfig" for p in entry.params), name
            continue
        assert entry.params and entry.params[0].offset == 0 and entry.params[0].type == "P3PeerSendConfig", name


def test_every_known_function_is_shipped_and_documented_in_its_ptx():
    # A FUNC header the parser stops reading would silently drop the function tests below.
    assert KNOWN_FUNCS <= set(FUNC_IDS), f"shipped functions with a PTX header: {FUNC_IDS}"
    for name, func in FUNCS:
        assert [p.name for p in func.params[:3]] == ["cfg", "ctx", "acct"], name


def test_abi_doc_is_the_struct_only(abi_doc):
    # The split: launch contracts live in docs/KERNELS.md, not in docs/ABI.md as well.
    assert not [t for t in md_tables(abi_doc) if t and [c.lower() for c in t[0]] == PARAM_COLUMNS]
    assert not re.findall(r"^#+ `p3_\w+`", abi_doc, flags=re.M)
    assert "docs/KERNELS.md" in abi_doc


@pytest.mark.parametrize("fname,entry", SHIPPED + FUNCS, ids=IDS + FUNC_IDS)
def test_param_table_matches_the_ptx_header(section, fname, entry):
    rows = documented_params(section, entry.name)
    problems = param_drift(entry, rows)
    assert not problems, f"docs/KERNELS.md table of {entry.name} differs from {fname}:\n" + "\n".join(problems)


@pytest.mark.parametrize("fname,entry", SHIPPED + FUNCS, ids=IDS + FUNC_IDS)
def test_param_meanings_match_the_ptx_header(section, fname, entry):
    rows = documented_params(section, entry.name)
    got = {r[3]: r[4] for r in rows if len(r) == 5}
    drift = [f"{p.name}:\n  PTX:  {_norm(p.meaning)}\n  docs: {got.get(p.name)}"
             for p in entry.params if got.get(p.name) != _norm(p.meaning)]
    assert not drift, f"docs/KERNELS.md meanings of {entry.name} differ from {fname}:\n" + "\n".join(drift)


def test_documented_kernels_are_shipped(section):
    # A kernel removed from ptx/ must not leave a stale subsection behind.
    named = re.findall(r"^## `(p3_\w+)`", section, flags=re.M)
    assert set(named) == set(IDS) | set(FUNC_IDS), f"subsections {named}, shipped {IDS + FUNC_IDS}"


def _struct_table(section: str, first_field: str) -> list[list[str]]:
    tables = [t for t in md_tables(section) if t and [c.lower() for c in t[0]] == STRUCT_COLUMNS
              and len(t) > 1 and t[1][3] == first_field]
    assert len(tables) == 1, (f"docs/KERNELS.md: expected one struct table starting with {first_field}, "
                              f"found {len(tables)}")
    return tables[0][1:]


def test_send_ctx_table_matches_ctypes(section):
    from p3send.abi.config import P3SendCtx
    rows = _struct_table(section, "count_ptrs")
    want = [[str(getattr(P3SendCtx, n).offset), str(getattr(P3SendCtx, n).size), n] for n, _ in P3SendCtx._fields_]
    assert [[r[0], r[1], r[3]] for r in rows] == want


def test_send_acct_table_covers_its_size(section):
    from p3send.abi.config import P3_SEND_ACCT_SIZE
    rows = _struct_table(section, "expert")
    assert [r[3] for r in rows] == ["expert", "ready", "units", "pair"]
    ends = [int(r[0]) + int(r[1]) for r in rows]
    assert [int(r[0]) for r in rows[1:]] == ends[:-1] and ends[-1] == P3_SEND_ACCT_SIZE, rows


@pytest.mark.parametrize("path", sorted(PTX_DIR.glob("*.ptx")), ids=lambda p: p.name)
def test_supported_drivers_name_the_ptx_version_and_target(section, path):
    text = path.read_text()
    major, minor = ptxdoc.ptx_version(text)
    target = ptxdoc.ptx_target(text)
    assert f".version {major}.{minor}" in section and f".target {target}" in section, (
        f"{path.name} is .version {major}.{minor} .target {target}; docs/KERNELS.md does not say so")


def test_flags_agree_between_ptx_launcher_and_docs(section):
    send = next(e for _, e in SHIPPED if e.name == "p3_scatter_send")
    meaning = next(p.meaning for p in send.params if p.name == "flags")
    in_ptx = {name: 1 << int(bit) for bit, name in re.findall(r"bit(\d+)\s+(FLAG_\w+)", meaning)}
    in_code = {n: getattr(send_ops, n) for n in dir(send_ops) if n.startswith("FLAG_")}
    sub = kernel_subsection(section, "p3_scatter_send")
    flag_tables = [t for t in md_tables(sub) if t and [c.lower() for c in t[0][:3]] == ["bit", "value", "name"]]
    assert len(flag_tables) == 1, "docs/KERNELS.md p3_scatter_send: expected one flags table (bit | value | name | ...)"
    in_docs = {r[2]: int(r[1]) for r in flag_tables[0][1:]}
    assert all(int(r[1]) == 1 << int(r[0]) for r in flag_tables[0][1:]), flag_tables[0]
    assert in_ptx == in_code == in_docs, f"PTX header {in_ptx}, p3send/ops/send.py {in_code}, docs {in_docs}"


# ---------------------------------------------------------------- the matcher itself

def test_the_matcher_sees_a_drifted_row(section):
    # The comparison must fail on a wrong offset, a wrong type and a missing row,
    # or the tests above would pass on any document.
    send = next(e for _, e in SHIPPED if e.name == "p3_scatter_send")
    rows = documented_params(section, "p3_scatter_send")
    assert param_drift(send, rows) == []
    moved = [list(r) for r in rows]
    moved[2][0] = str(int(moved[2][0]) - 8)
    assert any("row 2" in p for p in param_drift(send, moved))
    retyped = [list(r) for r in rows]
    retyped[-1][2] = "u32"
    assert param_drift(send, retyped)
    assert any("not documented" in p for p in param_drift(send, rows[:-1]))


def test_markdown_cells_unescape_and_split_only_on_real_pipes():
    tables = md_tables("text\n| off | name | meaning |\n| ---: | --- | --- |\n"
                       "| 8 | `x` | a \\* b \\| c |\n\nmore\n")
    assert tables == [[["off", "name", "meaning"], ["8", "x", "a * b | c"]]]


# ---------------------------------------------------------------- docs/PROTOCOL.md

@pytest.mark.parametrize("fname,entry", SHIPPED, ids=IDS)
def test_protocol_names_every_kernel(fname, entry):
    text = PROTOCOL.read_text()
    assert re.search(rf"(?<![\w]){re.escape(entry.name)}(?![\w])", text), (
        f"docs/PROTOCOL.md does not mention {entry.name} ({fname})")


@pytest.mark.parametrize("fname,func", FUNCS, ids=FUNC_IDS)
def test_protocol_names_every_function(fname, func):
    text = PROTOCOL.read_text()
    assert re.search(rf"(?<![\w]){re.escape(func.name)}(?![\w])", text), (
        f"docs/PROTOCOL.md does not mention {func.name} ({fname})")


def test_protocol_cites_only_existing_ptx_labels():
    # docs/PROTOCOL.md points reviewers at labels, e.g. `ptx/p3_recv_reduce.ptx` (`REARM`, ...):
    # a renamed label must not leave a dangling reference.
    text = PROTOCOL.read_text()
    cited = re.findall(r"`ptx/(\w+\.ptx)` \(([^)]*)\)", text)
    assert cited, "docs/PROTOCOL.md cites no PTX labels (expected its 'Where each part is implemented' table to)"
    missing = [f"{fname}: {label}" for fname, inner in cited
               for label in re.findall(r"`([A-Z][A-Z0-9_]*)`", inner)
               if not re.search(rf"^{label}:", (PTX_DIR / fname).read_text(), flags=re.M)]
    assert not missing, "docs/PROTOCOL.md cites labels that the PTX no longer has:\n" + "\n".join(missing)


# ---------------------------------------------------------------- the docs stand alone

TEXT_SUFFIXES = {".md", ".py", ".ptx", ".h", ".sh", ".toml", ".txt"}


def _project_texts():
    """(relative path, text) of the project's own text files (not build or venv output)."""
    skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "results"}
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if (path.is_file() and path.suffix in TEXT_SUFFIXES and not skip & set(rel.parts)
                and not any(part.endswith(".egg-info") for part in rel.parts)):
            yield rel.as_posix(), path.read_text(errors="replace")


def _headings(doc: Path) -> list[str]:
    return [_norm(h) for h in re.findall(r"^#+ (.*)$", doc.read_text(), flags=re.M)]


def test_docs_readme_lists_every_document():
    index = (DOCS / "README.md").read_text()
    files = [p.name for p in sorted(DOCS.iterdir()) if p.is_file() and p.name != "README.md"]
    missing = [f for f in files if f"`{f}`" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


def test_cited_documents_and_sections_exist():
    # `docs/<doc>.md` anywhere must exist; `docs/<doc>.md`, "Title" must name one of its
    # headings; `docs/<doc>.md` §N (or "section N") must have a heading "N. ...".
    problems = []
    for rel, text in _project_texts():
        flat = " ".join(text.split())
        for m in re.finditer(r"docs/([\w.-]+\.md)`?(?:,? \"([^\"]+)\"| (?:§|section )(\d+))?", flat):
            doc = DOCS / m.group(1)
            if not doc.exists():
                problems.append(f"{rel}: cites docs/{m.group(1)}, which does not exist")
                continue
            heads = _headings(doc)
            if m.group(2) and not any(_norm(m.group(2)) in h for h in heads):
                problems.append(f"{rel}: docs/{m.group(1)} has no heading \"{m.group(2)}\"")
            if m.group(3) and not any(h.startswith(f"{m.group(3)}.") for h in heads):
                problems.append(f"{rel}: docs/{m.group(1)} has no section {m.group(3)}")
    assert not problems, "\n".join(problems)


PATH_RE = r"(?<![\w/])((?:p3send|ptx|tests|tools)/[\w/]+\.(?:py|ptx|h|sh))"


def test_cited_package_paths_exist():
    # Module paths named in the docs move with refactors; a stale one must fail here.
    texts = [("README.md", (ROOT / "README.md").read_text())]
    texts += [(f"docs/{p.name}", p.read_text()) for p in sorted(DOCS.glob("*.md"))]
    stale = [f"{rel}: {path}" for rel, text in texts
             for path in sorted(set(re.findall(PATH_RE, text)))
             if not (ROOT / path).exists()]
    assert not stale, "the docs name files that do not exist:\n" + "\n".join(stale)


def test_nothing_cites_the_design_notes_outside_the_repository():
    # The protocol is docs/PROTOCOL.md; the notes the project was specified from are not
    # part of it. (The pattern is built so that this file does not match itself.)
    pattern = re.compile(r"\b" + "SP" + r"EC\b|\b(?:" + "SP" + "EC|ANCH" + "ORS|CUDA_" + r"NOTES)\.md\b")
    hits = [f"{rel}:{i}: {line.strip()}" for rel, text in _project_texts()
            for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not hits, "references to documents outside the repository:\n" + "\n".join(hits)


def test_a_send_cta_leaves_no_room_for_a_receive_cta():
    # docs/PROTOCOL.md, "Scheduling on one GPU": a 1024-thread send CTA and a 256-thread
    # receive CTA must not fit in one SM's 64 K registers together (registers are
    # allocated per warp, in units of 8 per thread), for the numbers the JIT gives.
    from p3send.abi.errors import P3SendError
    from p3send.cuda import ptxlint

    def regs(name: str) -> int:
        path = PTX_DIR / f"{name}.ptx"
        try:
            r = ptxlint.assemble(path.read_text(), path.name, "sm_90")
        except P3SendError as e:
            pytest.skip(str(e))
        assert r.problems() == [], r.problems()
        return next(f.regs for f in r.functions if f.name == name)

    send, recv = regs("p3_scatter_send"), regs("p3_recv_reduce")
    def alloc(n):
        return -(-n // 8) * 8
    assert alloc(send) * 1024 + alloc(recv) * 256 > 65536, (
        f"send {send} and receive {recv} registers per thread: a receive CTA now fits beside a send "
        f"CTA; update docs/PROTOCOL.md, 'Scheduling on one GPU'")


def test_the_epilogue_send_keeps_four_ctas_per_sm():
    # p3send launches p3_epilogue_send with 3 warps (2 epilogue + 1 send) per CTA by default;
    # four of them fit an SM's 64 K registers only at <= 168 registers per thread (allocated in
    # units of 8). The inlined p3_send_rows decides most of it: a 2-row copy there took the
    # module past that budget and made the send slower (docs/PERF.md, decisions).
    # The module is assembled as the driver compiles it: whole-program, by the system ptxas.
    import inspect
    import shutil

    from p3send.cuda import ptxlint
    from p3send.ops.send import EpilogueSend

    if shutil.which("ptxas") is None:
        pytest.skip("needs ptxas (the CUDA toolkit) to compile the module whole-program")
    path = PTX_DIR / "p3_epilogue_send.ptx"
    whole, _ = ptxlint.assembly_unit(path, path.read_text())
    r = ptxlint.assemble_ptxas(whole, path.name, "sm_90")
    assert not r.error, r.error
    regs = next(f.regs for f in r.functions if f.name == "p3_epilogue_send")
    defaults = inspect.signature(EpilogueSend.__init__).parameters
    threads = 32 * (defaults["epilogue_warps"].default + defaults["send_warps"].default)
    assert 4 * threads * (-(-regs // 8) * 8) <= 65536, (
        f"p3_epilogue_send with p3_send_rows inlined uses {regs} registers per thread: four CTAs of "
        f"{threads} threads no longer fit an SM (docs/PERF.md)")


def test_the_kernels_table_lists_every_shipped_ptx_file():
    # the table at the top of docs/KERNELS.md: `ptx/<file>.ptx` | `.entry name` / `.func ...` | role
    text = KERNELS.read_text()
    top = text[: text.index("\n## ")]
    rows = re.findall(r"^\| `ptx/([A-Za-z0-9_]+)\.ptx` \| ([^|]+) \|", top, flags=re.M)
    listed = {name: what for name, what in rows}
    shipped = {p.stem: p.read_text() for p in sorted(PTX_DIR.glob("*.ptx"))}
    assert sorted(listed) == sorted(shipped), (
        f"docs/KERNELS.md lists {sorted(listed)}; ptx/ holds {sorted(shipped)}")
    for name, what in listed.items():
        entries = re.findall(r"^\.(?:visible )?\.entry\s+(\w+)", shipped[name], flags=re.M)
        # defined functions only (a prototype ends in ';' before any '{')
        funcs = re.findall(r"^\.visible \.func(?:\s+\([^)]*\))?\s+(\w+)\s*\([^;{]*\)\s*\{", shipped[name],
                           flags=re.M)
        for e in entries:
            assert f".entry {e}" in what, f"docs/KERNELS.md row of {name}.ptx does not name its entry {e}"
        for f in funcs:
            assert f in what, f"docs/KERNELS.md row of {name}.ptx does not name its function {f}"
        assert entries or funcs, f"{name}.ptx has no entry and no visible function"


def test_the_glossary_defines_the_terms_the_documents_lean_on():
    index = (DOCS / "README.md").read_text()
    assert "## Glossary" in index
    glossary = index[index.index("## Glossary"):]
    terms = re.findall(r"^\| ([^|]+) \|", glossary, flags=re.M)[2:]     # skip the header rows
    defined = {t.strip() for row in terms for t in row.replace("`", "").split(",")}
    for term in ("Region A", "the MAX gate", "p3_control", "range table", "src_info", "slot", "pair",
                 "receive buffer", "p2p peer", "round", "disabled()", "mailbox (send_mbx)", "sentinel"):
        assert term in defined, f"docs/README.md's glossary does not define {term!r}"
    for term in ("Region A", "the MAX gate"):      # used in the documents, so defined at first use too
        used = [d.name for d in sorted(DOCS.glob("*.md")) if d.name != "README.md" and term in d.read_text()]
        assert used, f"{term!r} is defined but no document uses it"
