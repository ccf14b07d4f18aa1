"""Copy the code p3_dispatch_tally shares with p3_dispatch_count from ptx/p3_dispatch_count.ptx
into ptx/p3_dispatch_tally.ptx.

The count kernel's own token pass (a rank's tokens in one CTA, chunk after chunk) and
p3_dispatch_tally (one CTA per chunk) run the same per-chunk code: the bitmaps of the
chunk's copies with the checks and their record words ("token pass"), the prefix over an
expert's bitmap words ("prefix words") and each copy's position among its expert's copies
("copy positions"). Each is written once, between the lines ``// BEGIN <name>...`` and
``// END <name>`` of p3_dispatch_count.ptx; this script puts that text between the same
markers of p3_dispatch_tally.ptx (whose other lines are its own), so the two never drift
apart (tests/cpu/test_dispatch_tally_ptx.py runs ``--check``).

    python tools/build_dispatch_tally.py           # rewrite the regions of p3_dispatch_tally.ptx
    python tools/build_dispatch_tally.py --check   # exit 1 if they differ
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PTX = Path(__file__).resolve().parent.parent / "ptx"
SOURCE, TARGET = PTX / "p3_dispatch_count.ptx", PTX / "p3_dispatch_tally.ptx"
BEGIN = re.compile(r"^    // BEGIN ([a-z ]+?)(?::.*)?$")
END = re.compile(r"^    // END ([a-z ]+)$")


def regions(text: str, name: str) -> dict[str, tuple[int, int]]:
    """region name -> (index of its BEGIN line, index of its END line); refuses a region
    opened twice, never closed, closed without a begin or nested in another."""
    out, open_ = {}, None
    for i, s in enumerate(text.split("\n")):
        m, n = BEGIN.match(s), END.match(s)
        if m:
            if open_ is not None or m.group(1) in out:
                raise SystemExit(f"build_dispatch_tally: {name} line {i + 1}: region '{m.group(1)}' nested or "
                                 f"opened twice")
            open_ = (m.group(1), i)
        elif n:
            if open_ is None or open_[0] != n.group(1):
                raise SystemExit(f"build_dispatch_tally: {name} line {i + 1}: 'END {n.group(1)}' without its BEGIN")
            out[open_[0]] = (open_[1], i)
            open_ = None
    if open_ is not None or not out:
        raise SystemExit(f"build_dispatch_tally: {name} needs its BEGIN/END regions balanced "
                         f"({'never closed: ' + open_[0] if open_ else 'none found'})")
    return out


def split(text: str, name: str) -> tuple[list[str], list[str], list[str]]:
    """(lines before the token pass incl. its BEGIN line, the token pass, its END line and
    after): the first region, for the tests."""
    lines = text.split("\n")
    b, e = regions(text, name)["token pass"]
    return lines[:b + 1], lines[b + 1:e], lines[e:]


def derive(source: str, target: str) -> str:
    """``target`` with each region's lines replaced by the same region's of ``source``."""
    src, tgt = regions(source, SOURCE.name), regions(target, TARGET.name)
    if set(src) != set(tgt):
        raise SystemExit(f"build_dispatch_tally: the regions differ: {SOURCE.name} has {sorted(src)}, "
                         f"{TARGET.name} {sorted(tgt)}")
    s_lines, t_lines = source.split("\n"), target.split("\n")
    for name, (b, e) in sorted(tgt.items(), key=lambda kv: -kv[1][0]):      # from the bottom
        sb, se = src[name]
        t_lines[b + 1:e] = s_lines[sb + 1:se]
    return "\n".join(t_lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    a = ap.parse_args(argv)             # an unknown argument exits 2, never rewrites the file
    have = TARGET.read_text()
    want = derive(SOURCE.read_text(), have)
    if a.check:
        if have != want:
            print(f"{TARGET.name}'s shared regions differ from {SOURCE.name}'s: run tools/build_dispatch_tally.py",
                  file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(want)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
