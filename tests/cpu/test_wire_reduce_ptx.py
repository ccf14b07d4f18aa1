"""The two receive entries are one kernel: ptx/p3_recv_reduce_fp8.ptx is what
tools/build_recv_fp8.py derives from ptx/p3_recv_reduce.ptx, nothing else changed; both
have the same parameter table; both pass the PTX lint."""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from p3send.cuda import ptxdoc, ptxlint

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx"


def build_module():
    spec = importlib.util.spec_from_file_location("build_recv_fp8", ROOT / "tools" / "build_recv_fp8.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_fp8_entry_is_generated_from_the_bf16_entry():
    want = build_module().derive((PTX / "p3_recv_reduce.ptx").read_text())
    got = (PTX / "p3_recv_reduce_fp8.ptx").read_text()
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "derived", "shipped", n=1))
    assert got == want, "ptx/p3_recv_reduce_fp8.ptx differs from tools/build_recv_fp8.py's output " \
                        "(run it):\n" + diff[:3000]


def test_only_the_name_the_format_and_the_output_row_differ():
    a = (PTX / "p3_recv_reduce.ptx").read_text().splitlines()
    b = (PTX / "p3_recv_reduce_fp8.ptx").read_text().splitlines()
    start_a = next(i for i, s in enumerate(a) if s.startswith("// ENTRY"))
    start_b = next(i for i, s in enumerate(b) if s.startswith("// ENTRY"))
    changed = [(x, y) for x, y in zip(a[start_a:], b[start_b:]) if x != y]
    assert len(a) - start_a == len(b) - start_b
    assert [y.split()[:3] for _, y in changed] == [
        ["//", "ENTRY", "p3_recv_reduce_fp8"], ["//", "216", "8"], [".visible", ".entry", "p3_recv_reduce_fp8("],
        ["mov.u32", "%wire,", "1;"]], changed


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
