"""The dispatch's token pass is written once: p3_dispatch_tally.ptx holds, between its markers,
exactly the lines of p3_dispatch_count.ptx's (tools/build_dispatch_tally.py copies them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.cpu.conftest import tool_module

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx"
TOOL = ROOT / "tools" / "build_dispatch_tally.py"


def build_module():
    return tool_module("build_dispatch_tally")


def test_the_tally_holds_the_count_kernels_token_pass():
    b = build_module()
    count, tally = (PTX / "p3_dispatch_count.ptx").read_text(), (PTX / "p3_dispatch_tally.ptx").read_text()
    region = b.split(count, "count")[1]
    assert len(region) > 50, "the token pass is the per-chunk code, not a stub"
    assert b.split(tally, "tally")[1] == region
    assert b.derive(count, tally) == tally
    assert subprocess.run([sys.executable, str(TOOL), "--check"]).returncode == 0


def test_a_drifted_copy_is_found_and_rewritten_from_the_count_kernel():
    b = build_module()
    count, tally = (PTX / "p3_dispatch_count.ptx").read_text(), (PTX / "p3_dispatch_tally.ptx").read_text()
    head, region, tail = b.split(tally, "tally")
    drifted = "\n".join(head + region[:-1] + ["    add.u32             %j, %j, 1;"] + tail)
    assert drifted != tally and b.derive(count, drifted) == tally


@pytest.mark.parametrize("text", ["no markers at all", "    // BEGIN token pass\nx\n",
                                  "    // END token pass\n    // BEGIN token pass\n"])
def test_missing_or_misordered_markers_are_refused(text):
    b = build_module()
    with pytest.raises(SystemExit, match="needs one"):
        b.split(text, "x.ptx")


def test_an_unknown_argument_never_rewrites():
    before = (PTX / "p3_dispatch_tally.ptx").read_bytes()
    r = subprocess.run([sys.executable, str(TOOL), "--chek"], capture_output=True, text=True)
    assert r.returncode == 2 and (PTX / "p3_dispatch_tally.ptx").read_bytes() == before
