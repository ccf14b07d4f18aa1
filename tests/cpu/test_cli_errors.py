"""The CLI on bad input: exit 2 and one line naming what was wrong, checked up front by the
rules the GPU path applies, for files that are not what they seem (a FIFO, a device, a
folder, deep JSON, a binary sibling) too; check-ptx degrades with a note where a tool is
absent; --version and --help."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p3send import cli
from tests.cpu.test_ptx import LIB


@pytest.mark.parametrize("args, wanted", [
    (["--ranks", "0"], "--ranks: expected 1..8, got 0"), (["--ranks", "-1"], "--ranks: expected 1..8, got -1"),
    (["--ranks", "9"], "--ranks: expected 1..8, got 9"), (["--experts", "0"], "--experts: expected >= 1, got 0"),
    (["--tokens", "-5"], "--tokens: expected >= 1"), (["--hidden", "0"], "--hidden: expected a positive multiple"),
    (["--hidden", "7"], "--hidden: expected a positive multiple of 8"), (["--seed", "-1"], "--seed: expected >= 0"),
    (["--top-k", "0"], "--top-k: expected 1..32, got 0"), (["--top-k", "100"], "--top-k: expected 1..32, got 100"),
    (["--ranks", "1", "--experts", "2", "--top-k", "3"], "--top-k: expected at most the 2 experts"),
])
@pytest.mark.parametrize("cmd", ["demo", "trace"])
def test_bad_world_shape_exits_2_with_one_line(cmd, args, wanted, capsys, tmp_path):
    extra = ["--out", str(tmp_path / "t")] if cmd == "trace" else []
    assert cli.main([cmd, *args, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"p3send {cmd}: error: {wanted}"), err


def test_output_paths_are_checked_before_the_run(capsys, tmp_path):
    assert cli.main(["trace", "--out", str(tmp_path / "missing" / "t")]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli.main(["bench", "--json", str(tmp_path / "missing" / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err and "does not exist" in err


@pytest.mark.parametrize("data, wanted", [(b"\x7fELF\x02\x01\x01\x00\x00", "a binary file (NUL at byte 7)"),
                                          (".version 8.0 // caf\xe9\n".encode("latin-1"), "is not UTF-8")])
def test_check_ptx_on_a_file_that_is_not_ptx(data, wanted, capsys, tmp_path):
    path = tmp_path / "x.ptx"
    path.write_bytes(data)
    assert cli.main(["check-ptx", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and wanted in err


def test_check_ptx_without_ptxas_notes_what_it_skipped(capsys):
    assert cli.main(["check-ptx", "--no-ptxas"]) == 0
    out = capsys.readouterr().out
    assert "NOTE p3_epilogue_send.ptx: registers, spills and stack NOT checked" in out
    assert out.rstrip().endswith("check(s) skipped")


def test_check_ptx_without_any_assembler_lints_and_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvjitlink", None)   # nvJitLink import fails
    assert cli.main(["check-ptx", "--no-ptxas"]) == 0
    out = capsys.readouterr().out
    assert "NOTE nothing assembled (lint only): check-ptx needs nvJitLink" in out
    assert "pip install nvidia-nvjitlink==13.0.*" in out


def test_demo_without_a_gpu_runs_the_oracle_and_says_what_it_skipped(capsys):
    from p3send.cuda import driver
    if driver.available()[0]:
        pytest.skip("a GPU is present: the demo runs the real round")
    assert cli.main(["demo", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED: the GPU round" in out and "pass the demo's own verification" in out


# ---------------------------------------------------------------- files that are not what they seem

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "ptx" / "p3_abi_echo.ptx"


def run_p3send(*args, timeout_s: float = 15.0) -> subprocess.CompletedProcess:
    """``python -m p3send ARGS`` in a child process, killed after ``timeout_s``: a hang or a
    runaway read fails this test instead of stalling the suite."""
    return subprocess.run([sys.executable, "-m", "p3send", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def one_error_line(res, wanted: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert wanted in res.stderr, res.stderr


@pytest.mark.timeout(20)
def test_check_ptx_on_a_fifo_refuses_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.ptx"
    os.mkfifo(fifo)
    one_error_line(run_p3send("check-ptx", fifo), f"PTX file {fifo}: is a FIFO (named pipe); expected a regular file")


@pytest.mark.timeout(20)
def test_check_ptx_on_dev_zero_refuses_without_reading(tmp_path):
    one_error_line(run_p3send("check-ptx", "/dev/zero"), "PTX file /dev/zero: is a character device")


def test_check_ptx_on_a_folder(capsys, tmp_path):
    assert cli.main(["check-ptx", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"{tmp_path}: is a folder" in err, err


def test_check_ptx_refuses_a_bad_file_before_assembling_any(capsys, tmp_path):
    assert cli.main(["check-ptx", str(ECHO), str(tmp_path / "missing.ptx")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "missing.ptx: cannot be read" in err, (out, err)


@pytest.mark.timeout(60)
def test_trace_from_deeply_nested_json(capsys, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    assert cli.main(["trace", "--from", str(deep), "--out", str(tmp_path / "t")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--from: timeline" in err and "nested more than" in err, err


@pytest.mark.parametrize("arch, wanted", [
    ("foo", "invalid --arch: expected sm_<number> with an optional 'a' or 'f' suffix (e.g. sm_90, sm_90a, "
            "sm_100), got 'foo'"),
    ("sm_90;rm", "got 'sm_90;rm'"), ("", "got ''"),
])
def test_check_ptx_bad_arch_exits_2_before_any_work(arch, wanted, capsys):
    assert cli.main(["check-ptx", "--arch", "sm_90", "--arch", arch]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and wanted in err, err


def test_check_ptx_arch_nvjitlink_does_not_know(capsys):
    from p3send.cuda import ptxlint
    if ptxlint.nvjitlink_missing():
        pytest.skip(ptxlint.nvjitlink_missing())
    assert cli.main(["check-ptx", "--arch", "sm_11"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "invalid --arch: nvJitLink refuses -arch=sm_11" in err, err


def test_check_ptx_judges_only_the_files_given(capsys, tmp_path):
    # A binary .ptx and a FIFO beside a self-contained file are never read.
    shutil.copy(ECHO, tmp_path / ECHO.name)
    (tmp_path / "junk.ptx").write_bytes(b"\x7fELF\x02\x01\x01\x00")
    os.mkfifo(tmp_path / "pipe.ptx")
    assert cli.main(["check-ptx", str(tmp_path / ECHO.name), "--arch", "sm_90"]) == 0, capsys.readouterr()
    assert "check-ptx: 1 file(s), sm_90: ok" in capsys.readouterr().out


def test_check_ptx_reads_siblings_only_for_what_a_file_links(capsys, tmp_path):
    # p3_epilogue_send.ptx declares p3_send_rows/p3_send_flush, defined in p3_send_rows.ptx:
    # that sibling is read, the binary one beside it is skipped ...
    for name in ("p3_epilogue_send.ptx", "p3_send_rows.ptx"):
        shutil.copy(ROOT / "ptx" / name, tmp_path / name)
    (tmp_path / "junk.ptx").write_bytes(b"\x7fELF\x02\x01\x01\x00")
    args = ["check-ptx", str(tmp_path / "p3_epilogue_send.ptx"), "--arch", "sm_90", "--no-ptxas"]
    assert cli.main(args) == 0, capsys.readouterr().out
    capsys.readouterr()
    # ... and named when the function it might have defined is missing.
    (tmp_path / "p3_send_rows.ptx").unlink()
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "no PTX file defines p3_send_flush, p3_send_rows (not read: PTX file" in out
    assert "junk.ptx: a binary file (NUL at byte 7)" in out


def test_check_ptx_paths_with_spaces_quotes_and_a_leading_dash(capsys, tmp_path):
    # Each name reaches ptxas (and nvJitLink) as one argument: no shell, no option parsing.
    folder = tmp_path / "a 'quoted' \"folder\" $(touch PWNED); `touch PWNED`"
    folder.mkdir()
    shutil.copy(ECHO, folder / ECHO.name)
    lib = folder / "-o it's a \"lib\" $(touch PWNED).ptx"
    lib.write_text(LIB)             # a linkable .func file with its header
    assert cli.main(["check-ptx", str(folder / ECHO.name), str(lib), "--arch", "sm_90"]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out
    assert "check-ptx: 2 file(s), sm_90: ok" in out and lib.name in out
    if shutil.which("ptxas"):
        assert "ptxas -c" in out        # the library went through ptxas, relocatable
    assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()


# ---------------------------------------------------------------- --version, --help

@pytest.mark.timeout(30)
def test_version():
    import p3send
    res = run_p3send("--version")
    assert res.returncode == 0 and res.stdout == f"p3send {p3send.__version__}\n", res


@pytest.mark.timeout(30)
def test_help_is_one_clean_description_and_lists_every_command():
    from p3send.cli.app import DESCRIPTION
    res = run_p3send("--help")
    assert res.returncode == 0, res
    text = res.stdout
    assert DESCRIPTION in text.replace("\n", " ") and DESCRIPTION.endswith(".") and "\n" not in DESCRIPTION
    assert "``" not in text and "--version" in text
    listed = text[text.index("commands:"):text.index("examples:")]
    commands = re.findall(r"^    (\S+)", listed, re.M)      # argparse's list of the subcommands
    assert set(commands) == {"layout", "conform", "check-ptx", "demo", "bench", "trace"}, listed
    epilog = text[text.index("examples:"):]
    for name in commands:
        assert f"p3send {name}" in epilog, name


def test_demo_without_a_gpu_says_what_it_capped(capsys, monkeypatch):
    from p3send.cli import check_ptx
    from p3send.cuda import driver
    monkeypatch.setattr(driver, "available", lambda: (False, "no GPU (test)"))
    monkeypatch.setattr(check_ptx, "main", lambda args: 0)      # the PTX check has its own tests
    assert cli.main(["demo", "--seed", "3", "--ranks", "2", "--experts", "4", "--top-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "CAPPED for the CPU oracle: --tokens 512 to 64, --hidden 7168 to 512" in out
    assert cli.main(["demo", "--seed", "3", "--ranks", "2", "--experts", "4", "--top-k", "2", "--tokens", "16",
                     "--hidden", "64"]) == 0
    out = capsys.readouterr().out
    assert "CAPPED" not in out and "2 ranks x 16 tokens" in out and "pass the demo's own verification" in out
