"""The two receive entries are one kernel: tools/build_recv.py derives both shipped files
from ptx/cuda/p3_recv_reduce_source.ptx (the bf16 entry without the FP8-only lines, the FP8
entry with every line and WIRE = 1), nothing else changed; both have the same parameter
table; both pass the PTX lint; the bf16 entry holds no FP8 code."""
from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from p3send.cuda import ptxdoc, ptxlint
from tests.cpu.conftest import tool_module

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx"
TOOL = ROOT / "tools" / "build_recv.py"
SOURCE = PTX / "cuda" / "p3_recv_reduce_source.ptx"


def build_module():
    return tool_module("build_recv")


@pytest.mark.parametrize("name, derive", [("p3_recv_reduce.ptx", "derive_bf16"),
                                          ("p3_recv_reduce_fp8.ptx", "derive_fp8")])
def test_both_entries_are_generated_from_the_one_source(name, derive):
    want = getattr(build_module(), derive)(SOURCE.read_text())
    got = (PTX / name).read_text()
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "derived", "shipped", n=1))
    assert got == want, f"ptx/{name} differs from tools/build_recv.py's output (run it):\n" + diff[:3000]
    assert subprocess.run([sys.executable, str(TOOL), "--check"]).returncode == 0


def test_the_bf16_entry_holds_no_fp8_code():
    text = (PTX / "p3_recv_reduce.ptx").read_text()
    code = [s.split("//")[0] for s in text.splitlines()]
    for word in ("%fp8", "%wire", "%orow", "K_FP8", "e4m3", "FP8 ONLY"):
        assert not any(word in c for c in code), word
    assert not any(s.strip() in ("// FP8 ONLY {", "// FP8 ONLY }") for s in text.splitlines())
    assert sum("FP8 ONLY {" in s for s in SOURCE.read_text().splitlines()) >= 4


def test_the_fp8_entry_is_the_source_renamed_with_wire_1():
    src = [s for s in SOURCE.read_text().splitlines() if "FP8 ONLY" not in s and not s.strip().startswith("//BF16")]
    b = (PTX / "p3_recv_reduce_fp8.ptx").read_text().splitlines()
    start_a = next(i for i, s in enumerate(src) if s.startswith("// ENTRY"))
    start_b = next(i for i, s in enumerate(b) if s.startswith("// ENTRY"))
    changed = [(x, y) for x, y in zip(src[start_a:], b[start_b:]) if x != y]
    assert len(src) - start_a == len(b) - start_b
    assert [y.split()[:3] for _, y in changed] == [
        ["//", "ENTRY", "p3_recv_reduce_fp8"], ["//", "216", "8"], [".visible", ".entry", "p3_recv_reduce_fp8("],
        ["mov.u32", "%wire,", "1;"]], changed


@pytest.mark.parametrize("text, match", [("    // FP8 ONLY {\n    // FP8 ONLY {\n", "inside another"),
                                         ("    // FP8 ONLY }\n", "without a begin"),
                                         ("    // FP8 ONLY {\n", "never closed")])
def test_unbalanced_markers_are_refused(text, match):
    with pytest.raises(SystemExit, match=match):
        build_module().derive_bf16("//\n// p3_recv_reduce.ptx: x\n//\n" + text)


def test_an_unknown_argument_never_rewrites():
    before = [(PTX / n).read_bytes() for n in ("p3_recv_reduce.ptx", "p3_recv_reduce_fp8.ptx")]
    r = subprocess.run([sys.executable, str(TOOL), "--chek"], capture_output=True, text=True)
    assert r.returncode == 2
    assert [(PTX / n).read_bytes() for n in ("p3_recv_reduce.ptx", "p3_recv_reduce_fp8.ptx")] == before


def test_both_entries_share_one_parameter_table():
    ha = ptxdoc.parse_header((PTX / "p3_recv_reduce.ptx").read_text())["p3_recv_reduce"]
    hb = ptxdoc.parse_header((PTX / "p3_recv_reduce_fp8.ptx").read_text())["p3_recv_reduce_fp8"]
    assert [(p.offset, p.size, p.type, p.name) for p in ha.params] == \
        [(p.offset, p.size, p.type, p.name) for p in hb.params]
    assert ptxdoc.parse_decls((PTX / "p3_recv_reduce.ptx").read_text())["p3_recv_reduce"] == \
        ptxdoc.parse_decls((PTX / "p3_recv_reduce_fp8.ptx").read_text())["p3_recv_reduce_fp8"]


def test_both_pass_the_lint():
    for name in ("p3_recv_reduce.ptx", "p3_recv_reduce_fp8.ptx"):
        text = (PTX / name).read_text()
        assert ptxlint.lint(text, name) == [] and ptxlint.file_problems(text, name) == []
