"""The CLI on bad input: exit 2 and one line naming what was wrong, checked up front by the
rules the GPU path applies; check-ptx degrades with a note where a tool is absent."""
from __future__ import annotations

import sys

import pytest

from p3send import cli


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
