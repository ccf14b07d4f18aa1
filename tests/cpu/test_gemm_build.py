"""ptx/p3_gemm_send.ptx on the CPU: it is the build of its source by the pinned nvcc (the
test extra installs it, so this runs in CI), its header is the source's, the build refuses
another nvcc, the loaded (inlined) module assembles for sm_90a without a stack or spills,
and nvcc's -rdc form (the .extern prototypes) links with ptx/p3_send_rows.ptx through
nvJitLink."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from p3send.abi.errors import ConfigError
from p3send.cuda import ptxdoc, ptxlint
from tests.cpu.conftest import tool_module

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx" / "p3_gemm_send.ptx"
ROWS = ROOT / "ptx" / "p3_send_rows.ptx"
BUILD = ROOT / "tools" / "build_gemm.py"


def _build_gemm():
    return tool_module("build_gemm")


bg = _build_gemm()


def _text() -> str:
    return PTX.read_text()


def _pinned_toolkit():
    """The pinned nvcc; skips (with build_gemm's reason) only where there is none, and never in CI,
    whose install of the test extra always brings it."""
    try:
        return bg.toolkit()
    except bg.NvccNotFound as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the test extra, which pins the nvcc: {e}")
        pytest.skip(str(e))


def _fake_nvcc(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvcc"
    exe.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                   f"echo 'Cuda compilation tools, release {version.rsplit('.', 1)[0]}, V{version}'\n")
    exe.chmod(0o755)
    return exe


# ---------------------------------------------------------------- the build and its source

def test_shipped_ptx_is_the_build_of_its_source():
    tk = _pinned_toolkit()
    r = subprocess.run([sys.executable, str(BUILD), "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is up to date" in r.stdout
    assert f"build_gemm: using {tk.origin}" in r.stderr, r.stderr   # it says which nvcc it used, and why


def test_header_is_the_sources_comment_block():
    # the interface text lives in the .cu beside the code; the build only copies it
    head = bg.header(bg.SRC.read_text())
    assert _text().startswith(head + ".version ")
    assert "// ENTRY p3_gemm_send" in head and "// TIMEOUT" in head
    assert "ENTRY p3_gemm_send" not in BUILD.read_text()


@pytest.mark.parametrize("edit, problem", [
    (lambda s: s.replace(bg.HEADER_END + "\n", ""), "between one line"),
    (lambda s: s.replace(bg.HEADER_BEGIN + "\n", bg.HEADER_BEGIN + "\n" + bg.HEADER_BEGIN + "\n"), "between one line"),
    (lambda s: s.replace("// PARAMS\n", "PARAMS\n"), "is a // comment"),
    (lambda s: s.replace("// PARAMS\n", "// PARAMS \\\n"), "not ending in a backslash"),
])
def test_header_block_is_checked(edit, problem):
    src = bg.SRC.read_text()
    changed = edit(src)
    assert changed != src
    with pytest.raises(bg.BuildError, match=re.escape(problem)):
        bg.header(changed)


def test_test_extra_pins_the_toolkit_exactly():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = {m.group(1): m.group(2) for req in extra if (m := re.fullmatch(r"([\w.-]+)==([\w.]+)", req))}
    assert {name: pins.get(name) for name in bg.TOOLKIT} == bg.TOOLKIT
    assert bg.TOOLKIT[bg.NVCC_WHEEL] == bg.NVCC_VERSION


# ---------------------------------------------------------------- which nvcc

def test_refuses_a_system_nvcc_of_another_version(tmp_path, monkeypatch):
    fake = _fake_nvcc(tmp_path / "bin", "12.8.93")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(bg, "NVCC_WHEEL", "p3send-test-no-such-wheel")   # as if the wheel were not installed
    with pytest.raises(bg.NvccNotFound) as e:
        bg.toolkit()
    msg = str(e.value)
    assert f"no nvcc {bg.NVCC_VERSION}" in msg and str(fake) in msg and "12.8.93" in msg and "refused" in msg
    assert "is not installed" in msg and "pip install -e '.[test]'" in msg


def test_refuses_a_wheel_of_another_version(tmp_path, monkeypatch):
    class Dist:
        version = "13.5.37"
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: Dist() if name == bg.NVCC_WHEEL else real(name))
    _fake_nvcc(tmp_path / "bin", "13.5.37")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    with pytest.raises(bg.NvccNotFound, match=rf"{bg.NVCC_WHEEL} wheel is 13\.5\.37, not {bg.NVCC_VERSION}"):
        bg.toolkit()


def test_takes_a_system_nvcc_of_the_pinned_version(tmp_path, monkeypatch):
    fake = _fake_nvcc(tmp_path / "bin", bg.NVCC_VERSION)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(bg, "NVCC_WHEEL", "p3send-test-no-such-wheel")
    tk = bg.toolkit()
    assert tk.nvcc == fake and "the system nvcc" in tk.origin and "the pinned one" in tk.origin


def test_cli_refuses_nvcc_of_another_version_in_one_line(tmp_path):
    fake = _fake_nvcc(tmp_path / "bin", "12.8.93")
    r = subprocess.run([sys.executable, str(BUILD), "--check", "--nvcc", str(fake)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"refusing --nvcc {fake}: it is nvcc 12.8.93, not {bg.NVCC_VERSION}" in r.stderr, r.stderr
    assert not r.stdout


# ---------------------------------------------------------------- the two linkages

def test_set_prototype_linkage_both_directions():
    shipped = _text()
    extern = ptxdoc.set_prototype_linkage(shipped, "extern")
    assert ".visible .func p3_send_" not in extern
    assert re.search(r"^\.extern \.func p3_send_rows\n\(", extern, re.M)
    assert re.search(r"^\.extern \.func p3_send_flush\n\(", extern, re.M)
    assert extern.replace(".extern .func p3_send_", ".visible .func p3_send_") == shipped  # only those words
    assert ptxdoc.set_prototype_linkage(extern, "visible") == shipped
    assert ptxdoc.set_prototype_linkage(shipped, "visible") == shipped
    assert ptxdoc.prototypes(shipped) and not ptxdoc.prototypes(extern)


def test_set_prototype_linkage_leaves_definitions_and_other_functions():
    text = (".extern .func (.param .b32 func_retval0) vprintf\n(\n\t.param .b64 a\n)\n;\n"
            ".extern .func (.param .b32 r) p3_send_x\n(\n\t.param .b64 p\n)\n;\n"
            ".visible .func p3_send_y(\n\t.param .b64 p\n)\n{\n\tret;\n}\n")
    out = ptxdoc.set_prototype_linkage(text, "visible")
    assert out == text.replace(".extern .func (.param .b32 r) p3_send_x", ".visible .func (.param .b32 r) p3_send_x")
    with pytest.raises(ConfigError, match="got none"):
        ptxdoc.set_prototype_linkage(ROWS.read_text(), "extern")     # definitions only
    with pytest.raises(ConfigError, match="expected 'visible' or 'extern', got 'weak'"):
        ptxdoc.set_prototype_linkage(_text(), "weak")


# ---------------------------------------------------------------- the module as loaded and as linked

def test_header_target_and_lint():
    text = _text()
    assert ptxdoc.ptx_target(text) == "sm_90a" and ptxdoc.ptx_version(text) <= ptxlint.MAX_PTX_VERSION
    assert not ptxlint.file_problems(text, PTX.name) + ptxlint.lint(text, PTX.name)
    assert sorted(ptxdoc.prototypes(text)) == ["p3_send_flush", "p3_send_rows"]


def test_inlined_module_has_no_stack_or_spills():
    try:
        ptxas = bg.toolkit().ptxas
    except bg.NvccNotFound:
        ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas: neither the pinned nvcc wheel's nor one on PATH")
    whole = ptxdoc.module_text(_text(), [(ROWS.name, ROWS.read_text())])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.ptx"
        src.write_text(whole)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "m.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    entry = log[log.index("Function properties for p3_gemm_send"):]
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", entry.splitlines()[1]), log
    assert "C7509" not in log and "C7504" not in log, log       # no wgmma serialisation, no ignored setmaxnreg


def test_rdc_form_links_with_p3_send_rows_through_nvjitlink():
    missing = ptxlint.nvjitlink_missing()
    if missing:   # the test extra installs it; a bare environment may not have it
        pytest.skip(f"nvJitLink unavailable: {missing}")
    extern = ptxdoc.set_prototype_linkage(_text(), "extern")
    rep = ptxlint.assemble(extern, PTX.name, "sm_90a", deps=[(ROWS.name, ROWS.read_text())],
                            options=["-maxrregcount=168"], judge_resources=False)
    assert not rep.error, rep.error
    alone = ptxlint.assemble(extern, PTX.name, "sm_90a", options=["-maxrregcount=168"], judge_resources=False)
    assert alone.error and "p3_send_rows" in alone.error, "an unresolved p3_send_rows must fail to link"


def _relocatable_log(text: str) -> str:
    """ptxas -c (separate compilation: what a linker is given) of the extern form of ``text``."""
    tk = _pinned_toolkit()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptxdoc.set_prototype_linkage(text, "extern"))
        r = subprocess.run([str(tk.ptxas), "-arch=sm_90a", "-c", "-v", "-maxrregcount=168", str(src), "-o",
                            str(Path(tmp) / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_linked_route_serialises_the_wgmma_unless_the_mainloop_is_outlined(tmp_path):
    """Linked, the kernel's p3_send_rows calls are extern and ptxas waits for every wgmma of a
    function that makes extern calls (C7509); the outline variant (the consumers' mainloop in a
    function of its own) makes none there, so its wgmmas stay asynchronous."""
    assert "C7509" in _relocatable_log(_text())
    out = tmp_path / "outline.ptx"
    r = subprocess.run([sys.executable, str(BUILD), "--variant", "outline", "-o", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = _relocatable_log(out.read_text())
    assert "C7509" not in log and "C7510" not in log and "C7514" not in log, log
