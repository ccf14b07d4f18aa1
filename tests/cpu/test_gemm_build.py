"""ptx/p3_gemm_send.ptx (issue 18) on the CPU: it is the build of its source, its header
matches its declaration, the loaded (inlined) module assembles for sm_90a without a stack
or spills, and nvcc's -rdc form links with ptx/p3_send_rows.ptx through nvJitLink."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from p3send.cli import ptxcheck
from p3send.cuda import ptxdoc

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx" / "p3_gemm_send.ptx"
ROWS = ROOT / "ptx" / "p3_send_rows.ptx"


def _text() -> str:
    return PTX.read_text()


def test_shipped_ptx_is_the_build_of_its_source():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    if "release 13.0" not in version:
        pytest.skip("the shipped PTX is nvcc 13.0's (PTX ISA 9.0, loadable by driver 580); this nvcc differs")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_gemm.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_header_target_and_lint():
    text = _text()
    assert ptxdoc.ptx_target(text) == "sm_90a" and ptxdoc.ptx_version(text) <= ptxcheck.MAX_PTX_VERSION
    assert not ptxcheck.file_problems(text, PTX.name) + ptxcheck.lint(text, PTX.name)
    assert sorted(ptxdoc.prototypes(text)) == ["p3_send_flush", "p3_send_rows"]


def test_inlined_module_has_no_stack_or_spills():
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on PATH")
    whole = ptxdoc.module_text(_text(), [(ROWS.name, ROWS.read_text())])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.ptx"
        src.write_text(whole)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "m.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    entry = log[log.index("Function properties for p3_gemm_send"):]
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", entry.splitlines()[1]), log
    assert "C7509" not in log and "C7504" not in log, log       # no wgmma serialisation, no ignored setmaxnreg


def test_rdc_form_links_with_p3_send_rows_through_nvjitlink():
    try:
        ptxcheck._nvjitlink()
    except Exception as e:  # the wheel is optional on the CPU tier
        pytest.skip(f"nvJitLink unavailable: {e}")
    extern = _text().replace(".visible .func p3_send_", ".extern .func p3_send_")
    rep = ptxcheck.assemble(extern, PTX.name, "sm_90a", deps=[(ROWS.name, ROWS.read_text())],
                            options=["-maxrregcount=168"], judge_resources=False)
    assert not rep.error, rep.error
    alone = ptxcheck.assemble(extern, PTX.name, "sm_90a", options=["-maxrregcount=168"], judge_resources=False)
    assert alone.error and "p3_send_rows" in alone.error, "an unresolved p3_send_rows must fail to link"
