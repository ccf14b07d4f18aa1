"""Regenerate ptx/p3_gemm_fp8_send.ptx from ptx/cuda/p3_gemm_fp8_send.cu with nvcc (no GPU needed).

    python tools/build_gemm_fp8.py            # write ptx/p3_gemm_fp8_send.ptx
    python tools/build_gemm_fp8.py --check    # exit 1 if the shipped file differs from a fresh build
    python tools/build_gemm_fp8.py --ptxas    # also assemble the loaded (inlined) module, print resources
    python tools/build_gemm_fp8.py --variant no_promote -o OUT.ptx   # a measurement variant (never shipped)

The sibling of tools/build_gemm.py, and built the same way with the same pinned nvcc (its
``toolkit``): ``nvcc -rdc=true -ptx -gencode arch=compute_90a,code=sm_90a``, so p3_send_rows and
p3_send_flush stay declared; the shipped text declares them ``.visible .func`` (the loader
appends ptx/p3_send_rows.ptx and the driver inlines the calls), nvcc's own ``.extern`` form is
the one a runtime links. The file's header comment is the block of the .cu between
HEADER_BEGIN and HEADER_END, copied verbatim. Variants compile the same source with a macro
(VARIANTS) and keep the header, so the loader checks them like the shipped file.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_gemm  # noqa: E402  (the toolkit pin and the ptxdoc helpers are shared)

ptxdoc = build_gemm.ptxdoc
BuildError = build_gemm.BuildError

ENTRY = "p3_gemm_fp8_send"
SRC = ROOT / "ptx" / "cuda" / f"{ENTRY}.cu"
OUT = ROOT / "ptx" / f"{ENTRY}.ptx"
NVCC_FLAGS = build_gemm.NVCC_FLAGS
HEADER_BEGIN = f"// ---- begin ptx/{ENTRY}.ptx header ----"
HEADER_END = f"// ---- end ptx/{ENTRY}.ptx header ----"

#: The kernel's parameters, in declaration order: nvcc's p3_gemm_fp8_send_param_<i> get these names.
PARAM_NAMES = ["cfg", "ctx", "tmaps", "sb", "c_ptr", "c_row_stride", "n_cols", "k_dim", "bm"]

#: Measurement variants: name -> the macros they are compiled with (the source says what each does).
VARIANTS = {"no_promote": ["-DP3F_NO_PROMOTE"]}


def header(source: str) -> str:
    """The PTX header: the lines of ``source`` between HEADER_BEGIN and HEADER_END, verbatim."""
    lines = source.splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines) if line.rstrip("\n") in (HEADER_BEGIN, HEADER_END)]
    if [lines[i].rstrip("\n") for i in marks] != [HEADER_BEGIN, HEADER_END]:
        raise BuildError(f"build_gemm_fp8: {SRC.name} must hold the PTX header between one line {HEADER_BEGIN!r} "
                         f"and one later line {HEADER_END!r}")
    block = lines[marks[0] + 1:marks[1]]
    for n, line in enumerate(block, marks[0] + 2):
        if not line.startswith("//") or line.rstrip("\n").endswith("\\"):
            raise BuildError(f"build_gemm_fp8: {SRC.name}:{n}: each line of the PTX header is a // comment not "
                             f"ending in a backslash, got {line.rstrip()!r}")
    return "".join(block)


def build(nvcc=None, source: str | None = None, defines=()) -> str:
    """The shipped text (or a variant's, with ``defines``) from the source."""
    tk = nvcc if isinstance(nvcc, build_gemm.Toolkit) else build_gemm.toolkit(nvcc)
    text_src = SRC.read_text() if source is None else source
    head = header(text_src)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{ENTRY}.ptx"
        src, inc = SRC, ["-I", str(ROOT / "ptx"), "-I", str(SRC.parent)]
        if source is not None:
            src = Path(tmp) / SRC.name
            src.write_text(source)
        cmd = [str(tk.nvcc), *NVCC_FLAGS, *defines, *inc, str(src), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise BuildError(f"build_gemm_fp8: nvcc failed ({' '.join(cmd)}):\n{r.stderr}")
        text = out.read_text()
    text = text[text.index(".version"):]       # nvcc's banner names its build
    for i, name in reversed(list(enumerate(PARAM_NAMES))):
        text = re.sub(rf"\b{ENTRY}_param_{i}\b", name, text)
    if f"{ENTRY}_param_" in text:
        raise BuildError("build_gemm_fp8: the kernel has more parameters than PARAM_NAMES")
    return head + ptxdoc.set_prototype_linkage(text, "visible")


def inlined(text: str) -> str:
    """The module the loader compiles: this text with p3_send_rows.ptx appended."""
    return ptxdoc.module_text(text, [("p3_send_rows.ptx", (ROOT / "ptx" / "p3_send_rows.ptx").read_text())])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    ap.add_argument("--ptxas", action="store_true", help="assemble the loaded module with ptxas -v")
    ap.add_argument("--variant", choices=sorted(VARIANTS), help="build a measurement variant (needs -o)")
    ap.add_argument("-o", "--output", type=Path, help="where --variant writes")
    ap.add_argument("--nvcc", default=None, help="the nvcc to use (the version tools/build_gemm.py pins)")
    a = ap.parse_args(argv)
    if a.variant and (a.output is None or a.check):
        print("build_gemm_fp8: --variant writes to -o PATH (and is never checked against the shipped file)",
              file=sys.stderr)
        return 2
    try:
        tk = build_gemm.toolkit(a.nvcc)
        print(f"build_gemm_fp8: using {tk.origin}", file=sys.stderr)
        text = build(tk, defines=VARIANTS[a.variant] if a.variant else ())
    except BuildError as e:
        print(e, file=sys.stderr)
        return 2
    if a.variant:
        a.output.write_text(text)
        print(f"wrote variant {a.variant} to {a.output} ({len(text)} bytes)")
    elif a.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python tools/build_gemm_fp8.py")
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
    else:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes)")
    if a.ptxas:
        if tk.ptxas is None:
            print(f"build_gemm_fp8: no ptxas beside {tk.nvcc} or on PATH", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "m.ptx"
            p.write_text(inlined(text))
            r = subprocess.run([str(tk.ptxas), "-arch=sm_90a", "-v", str(p), "-o", str(Path(tmp) / "m.cubin")],
                               capture_output=True, text=True)
            print(r.stdout + r.stderr)
            if r.returncode:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
