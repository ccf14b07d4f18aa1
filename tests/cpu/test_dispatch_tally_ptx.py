"""The code the dispatch's tally shares with its count kernel is written once:
p3_dispatch_tally.ptx holds, between each pair of markers, exactly the lines of
p3_dispatch_count.ptx's same region (tools/build_dispatch_tally.py copies them)."""
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


def test_every_shared_region_is_the_count_kernels():
    b = build_module()
    count, tally = (PTX / "p3_dispatch_count.ptx").read_text(), (PTX / "p3_dispatch_tally.ptx").read_text()
    rc, rt = b.regions(count, "count"), b.regions(tally, "tally")
    assert set(rc) == set(rt) == {"token pass", "prefix words", "copy positions"}
    cl, tl = count.split("\n"), tally.split("\n")
    for name in rc:
        (cb, ce), (tb, te) = rc[name], rt[name]
        assert ce - cb > 10 and cl[cb + 1:ce] == tl[tb + 1:te], name


@pytest.mark.parametrize("text, match", [
    ("no markers at all", "none found"),
    ("    // BEGIN token pass\nx\n", "never closed"),
    ("    // END token pass\n    // BEGIN token pass\n", "without its BEGIN"),
    ("    // BEGIN a\n    // BEGIN b\n", "nested"),
    ("    // BEGIN a\n    // END a\n    // BEGIN a\n    // END a\n", "opened twice")])
def test_missing_or_misordered_markers_are_refused(text, match):
    b = build_module()
    with pytest.raises(SystemExit, match=match):
        b.regions(text, "x.ptx")


def test_a_region_missing_from_one_file_is_refused():
    b = build_module()
    count, tally = (PTX / "p3_dispatch_count.ptx").read_text(), (PTX / "p3_dispatch_tally.ptx").read_text()
    cut = tally.replace("    // BEGIN copy positions", "    // copy positions", 1).replace(
        "    // END copy positions", "    // (end)", 1)
    with pytest.raises(SystemExit, match="the regions differ"):
        b.derive(count, cut)


def test_an_unknown_argument_never_rewrites():
    before = (PTX / "p3_dispatch_tally.ptx").read_bytes()
    r = subprocess.run([sys.executable, str(TOOL), "--chek"], capture_output=True, text=True)
    assert r.returncode == 2 and (PTX / "p3_dispatch_tally.ptx").read_bytes() == before
