"""``p3send check-ptx``: lint and assemble PTX files (``p3send.cuda.ptxlint``) and print
each function's resources and every problem."""
from __future__ import annotations

import shutil
from pathlib import Path

from ..cuda import ptxlint


def add_arguments(p) -> None:
    p.add_argument("files", nargs="*", metavar="FILE", help="PTX files (default: the shipped ptx/*.ptx)")
    p.add_argument("--arch", action="append", metavar="SM",
                   help=f"a target such as sm_90a, repeatable (default: {' and '.join(ptxlint.DEFAULT_ARCHS)})")
    p.add_argument("--no-ptxas", action="store_true", help="skip the system ptxas even if present")


def _table(reports) -> str:
    def n(v):
        return "-" if v is None else str(v)
    rows = [("file", "entry", "arch", "tool", "regs", "smem", "stack", "spills", "lmem")]
    for r in reports:
        if not r.ok:
            rows.append((r.file, "-", r.arch, r.tool, "FAILED", "", "", "", ""))
        for f in r.functions:
            stack = n(f.stack) if f.cum_stack in (None, f.stack) else f"{n(f.stack)}/{f.cum_stack}"
            spills = "-" if f.spill_stores is None else f"{f.spill_stores}/{n(f.spill_loads)}"
            rows.append((r.file, f.name if f.kind == "entry" else f"{f.name} (func)", r.arch, r.tool,
                         n(f.regs), n(f.smem), stack, spills, n(f.lmem)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(args) -> int:
    """0 when every file passes, 1 otherwise (problems printed); bad input raises before any work."""
    archs = ptxlint.check_archs(args.arch or ptxlint.DEFAULT_ARCHS, "--arch")
    if args.files:
        files = [Path(f) for f in args.files]
    else:
        from ..cuda.loader import ptx_dir
        files = sorted(ptx_dir().glob("*.ptx"))
    texts = [ptxlint.read_ptx(f) for f in files]       # every file is PTX text before any is assembled
    ptxas = None if args.no_ptxas else shutil.which("ptxas")
    no_jit = ptxlint.nvjitlink_missing()
    reports, problems, notes = [], [], []
    if no_jit:
        notes.append(("nothing assembled (lint only): " if not ptxas else "assembled by ptxas only: ")
                     + f"check-ptx needs nvJitLink to assemble PTX on the CPU; {no_jit}")
    for path, text in zip(files, texts):
        r, p = ptxlint.check_file(path, archs, ptxas, not no_jit, notes, text=text)
        reports += r
        problems += p
    print(_table(reports))
    print("stack: own frame/with callees; spills: bytes stored/loaded"
          + ("" if ptxas else "; system ptxas " + ("skipped (--no-ptxas)" if args.no_ptxas else "not on PATH")))
    for n in notes:
        print(f"NOTE {n}")
    for p in problems:
        print(f"FAIL {p}")
    print(f"check-ptx: {len(files)} file(s), {', '.join(archs)}: "
          + (f"{len(problems)} problem(s)" if problems else "ok")
          + (f", {len(notes)} check(s) skipped" if notes else ""))
    return 1 if problems else 0
