"""Every C, C++ and CUDA snippet of the docs compiles (CPU only: no GPU, no driver).

docs/KERNELS.md, docs/ABI.md and docs/EMBEDDING.md show code that readers copy: the
fenced blocks tagged ``c``, ``cpp``/``c++`` and ``cuda``/``cu`` (indented fences
included). Each block is compiled on its own, as one translation unit, with
``-I ptx`` for ``p3send.h``:

- with ``nvcc`` when it is on PATH: ``c`` as ``-x c``, ``c++`` as ``-x c++``, ``cuda`` as
  ``-x cu -rdc=true -arch=sm_90`` (the examples call the extern device functions of
  ``ptx/p3_send_rows.ptx``, which only relocatable device code may do);
- with the system C/C++ compiler (``cc``/``c++``, else ``gcc``/``g++``) when ``cuda.h`` is
  found (``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda*``, the ``nvidia`` wheels);
  ``cuda`` blocks need nvcc;

and otherwise the case is skipped with the reason. A block that includes
``<nvJitLink.h>`` is skipped when no include directory holds it (the test extra installs
``nvidia-nvjitlink``, which ships it). Host compilers run with ``-Wall -Werror``
(``-Wno-unused-function``: the snippets define helpers that nothing in the block calls).

A block that is deliberately not a whole translation unit starts with the line
``// not standalone: <why>`` (or ``/* not standalone: <why> */``). It is not compiled;
the reason is required and shows in the skip message.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["KERNELS.md", "ABI.md", "EMBEDDING.md"]
LANGS = {"c": "c", "cpp": "c++", "c++": "c++", "cuda": "cuda", "cu": "cuda"}
MARKER = re.compile(r"^\s*(?://|/\*)\s*not standalone:(.*?)(?:\*/)?\s*$")
OPTIONAL_HEADERS = ["nvJitLink.h"]
HOST_FLAGS = ["-Wall", "-Wno-unused-function", "-Werror"]
TOOLCHAINS = ["nvcc", "host"]


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int           # 1-based line of the opening fence
    lang: str           # "c", "c++" or "cuda"
    text: str
    fragment: str | None = None   # the "not standalone" reason, None for a whole unit

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def parse_snippets(doc: str, text: str) -> list[Snippet]:
    """The C/C++/CUDA fenced blocks of ``text``, dedented by their fence's indent."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.fullmatch(r"( *)```([\w+]+)\s*", lines[i])
        if not m:
            i += 1
            continue
        indent, tag, start = len(m.group(1)), m.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and not re.fullmatch(r" *```\s*", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        if tag not in LANGS:
            continue
        first = next((b for b in body if b.strip()), "")
        mk = MARKER.match(first)
        out.append(Snippet(doc, start + 1, LANGS[tag], "\n".join(body) + "\n",
                           mk.group(1).strip() if mk else None))
    return out


def all_snippets() -> list[Snippet]:
    out = []
    for doc in DOCS:
        path = ROOT / "docs" / doc
        if path.exists():
            out += parse_snippets(doc, path.read_text())
    return out


SNIPPETS = all_snippets()


# ---------------------------------------------------------------- toolchains

def _include_candidates() -> list[Path]:
    dirs = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs += [Path("/usr/local/cuda/include")] + sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    for base in sys.path:
        nv = Path(base) / "nvidia"
        if nv.is_dir():
            dirs += sorted(nv.glob("*/include")) + sorted(nv.glob("*/*/include"))
    dirs.append(Path("/usr/include"))
    return [d for d in dirs if d.is_dir()]


@cache
def find_header(name: str) -> Path | None:
    return next((d for d in _include_candidates() if (d / name).is_file()), None)


@cache
def host_compiler(lang: str) -> str | None:
    names = ["cc", "gcc", "clang"] if lang == "c" else ["c++", "g++", "clang++"]
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


def command(sn: Snippet, toolchain: str, src: Path, obj: Path) -> tuple[list[str] | None, str]:
    """The compile command for ``sn``, or (None, why it cannot be compiled here)."""
    inc = ["-I", str(ROOT / "ptx")]
    for h in OPTIONAL_HEADERS:
        if re.search(rf"#\s*include\s*[<\"]{re.escape(h)}[>\"]", sn.text):
            d = find_header(h)
            if d is None:
                return None, f"{h} not found (install the test extra: nvidia-nvjitlink ships it)"
            inc += ["-I", str(d)]
    if toolchain == "nvcc":
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            return None, "nvcc is not on PATH"
        lang = {"c": ["-x", "c"], "c++": ["-x", "c++"],
                "cuda": ["-x", "cu", "-rdc=true", "-arch=sm_90", "-Werror", "all-warnings"]}[sn.lang]
        return [nvcc, *lang, "-c", *inc, "-Xcompiler", ",".join(HOST_FLAGS), str(src), "-o", str(obj)], ""
    if sn.lang == "cuda":
        return None, "a CUDA block needs nvcc"
    cc = host_compiler(sn.lang)
    if cc is None:
        return None, f"no {sn.lang} compiler on PATH"
    cuda_h = find_header("cuda.h")
    if cuda_h is None:
        return None, "cuda.h not found (no CUDA toolkit include directory)"
    std = ["-x", "c", "-std=c11"] if sn.lang == "c" else ["-x", "c++", "-std=c++17"]
    return [cc, *std, *HOST_FLAGS, "-c", *inc, "-I", str(cuda_h), str(src), "-o", str(obj)], ""


def compile_snippet(sn: Snippet, toolchain: str, workdir: Path) -> tuple[str, str]:
    """("ok" | "skip" | "fail", message)."""
    stem = re.sub(r"\W", "_", f"{sn.id}_{toolchain}")
    src = workdir / (stem + {"c": ".c", "c++": ".cpp", "cuda": ".cu"}[sn.lang])
    src.write_text(sn.text)
    cmd, why = command(sn, toolchain, src, workdir / (stem + ".o"))
    if cmd is None:
        return "skip", why
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "fail", f"{' '.join(cmd)}: timed out"
    if r.returncode != 0:
        return "fail", f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    return "ok", ""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    """Every (snippet, toolchain) compiled once, in parallel."""
    work = tmp_path_factory.mktemp("doc_snippets")
    jobs = [(sn, tc) for sn in SNIPPETS if sn.fragment is None for tc in TOOLCHAINS]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        done = pool.map(lambda j: compile_snippet(j[0], j[1], work), jobs)
        return {(sn.id, tc): res for (sn, tc), res in zip(jobs, done)}


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("toolchain", TOOLCHAINS)
@pytest.mark.parametrize("sn", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_doc_snippet_compiles(results, sn, toolchain):
    if sn.fragment is not None:
        pytest.skip(f"{sn.id}: marked not standalone: {sn.fragment}")
    status, msg = results[(sn.id, toolchain)]
    if status == "skip":
        pytest.skip(f"{sn.id} ({toolchain}): {msg}")
    assert status == "ok", f"{sn.id} ({sn.lang}) does not compile with {toolchain}:\n{msg}"


def test_the_docs_have_the_snippets_a_reader_needs():
    # Guards the parametrised test against a parser that silently finds nothing: the
    # round from C++ (KERNELS.md), the by-value launch (ABI.md), the C loader, the module
    # text, the CUDA epilogue and the nvJitLink link (EMBEDDING.md).
    per_doc = {d: sorted(s.lang for s in SNIPPETS if s.doc == d and s.fragment is None) for d in DOCS}
    assert "c++" in per_doc["KERNELS.md"], per_doc
    assert "c" in per_doc["ABI.md"], per_doc
    assert {"c", "c++", "cuda"} <= set(per_doc["EMBEDDING.md"]), per_doc
    assert all(s.fragment for s in SNIPPETS if s.fragment is not None), "a not-standalone marker without a reason"


def test_the_parser_reads_indented_fences_and_markers():
    text = ("x\n  ```c\n  int a;\n    int b;\n  ```\n\n```cpp\n// not standalone: a fragment\nf();\n```\n"
            "```python\nprint()\n```\n```cuda\n/* not standalone: */\n```\n")
    got = parse_snippets("T.md", text)
    assert [(s.line, s.lang, s.text, s.fragment) for s in got] == [
        (2, "c", "int a;\n  int b;\n", None),
        (7, "c++", "// not standalone: a fragment\nf();\n", "a fragment"),
        (14, "cuda", "/* not standalone: */\n", ""),
    ]


def test_a_broken_snippet_fails(tmp_path):
    # The harness must report a compile error, or every snippet would "pass".
    bad = Snippet("T.md", 1, "c++", '#include <cuda.h>\n#include "p3send.h"\n'
                  "int f() { P3PeerSendConfig c = p3_config_disabled(); return c.no_such_field; }\n")
    outcomes = [compile_snippet(bad, tc, tmp_path) for tc in TOOLCHAINS]
    if all(s == "skip" for s, _ in outcomes):
        pytest.skip("; ".join(m for _, m in outcomes))
    assert all(s in ("fail", "skip") for s, _ in outcomes) and any(s == "fail" for s, _ in outcomes), outcomes
    assert any("no_such_field" in m for s, m in outcomes if s == "fail"), outcomes
