"""Copy the dispatch's token pass from ptx/p3_dispatch_count.ptx into ptx/p3_dispatch_tally.ptx.

The count kernel's own token pass (a rank's tokens in one CTA, chunk after chunk) and
p3_dispatch_tally (one CTA per chunk) run the same per-chunk code: the bitmaps of the
chunk's copies, the checks and their record words. It is written once, between the lines
``// BEGIN token pass`` and ``// END token pass`` of p3_dispatch_count.ptx; this script puts
that text between the same markers of p3_dispatch_tally.ptx (whose other lines are its own),
so the two never drift apart (tests/cpu/test_dispatch_tally_ptx.py runs ``--check``).

    python tools/build_dispatch_tally.py           # rewrite the region of p3_dispatch_tally.ptx
    python tools/build_dispatch_tally.py --check   # exit 1 if it differs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PTX = Path(__file__).resolve().parent.parent / "ptx"
SOURCE, TARGET = PTX / "p3_dispatch_count.ptx", PTX / "p3_dispatch_tally.ptx"
BEGIN, END = "    // BEGIN token pass", "    // END token pass"


def split(text: str, name: str) -> tuple[list[str], list[str], list[str]]:
    """(lines before the region incl. its BEGIN line, the region, its END line and after)."""
    lines = text.split("\n")
    begins = [i for i, s in enumerate(lines) if s.startswith(BEGIN)]
    ends = [i for i, s in enumerate(lines) if s == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise SystemExit(f"build_dispatch_tally: {name} needs one '{BEGIN.strip()}' line and one "
                         f"'{END.strip()}' line after it (found {len(begins)} and {len(ends)})")
    b, e = begins[0], ends[0]
    return lines[:b + 1], lines[b + 1:e], lines[e:]


def derive(source: str, target: str) -> str:
    """``target`` with its token-pass region replaced by the one of ``source``."""
    _, region, _ = split(source, SOURCE.name)
    head, _, tail = split(target, TARGET.name)
    return "\n".join(head + region + tail)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    a = ap.parse_args(argv)             # an unknown argument exits 2, never rewrites the file
    have = TARGET.read_text()
    want = derive(SOURCE.read_text(), have)
    if a.check:
        if have != want:
            print(f"{TARGET.name}'s token pass differs from {SOURCE.name}'s: run tools/build_dispatch_tally.py",
                  file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(want)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
