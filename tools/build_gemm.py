"""Regenerate ptx/p3_gemm_send.ptx from ptx/cuda/p3_gemm_send.cu with nvcc (no GPU needed).

    python tools/build_gemm.py            # write ptx/p3_gemm_send.ptx
    python tools/build_gemm.py --check    # exit 1 if the shipped file differs from a fresh build
    python tools/build_gemm.py --ptxas    # also assemble the loaded (inlined) module, print resources
    python tools/build_gemm.py --variant outline -o OUT.ptx   # a measurement variant (never shipped)

The shipped file is nvcc 13.0.88's output byte for byte, so only that nvcc builds it: the
one of the pinned nvidia-cuda-nvcc wheel (``pip install -e '.[test]'`` installs it and the
wheels it compiles with, at the versions of TOOLKIT), else the system nvcc (on PATH, or
--nvcc) when it reports exactly that version. Any other version is refused: it writes other
bytes (and may write a newer PTX ISA than driver 580 loads).

nvcc compiles the kernel as relocatable device code (-rdc, sm_90a), so p3_send_rows and
p3_send_flush stay declared, not defined. The shipped text declares them as
``.visible .func`` prototypes, like p3_epilogue_send.ptx: the loader appends
ptx/p3_send_rows.ptx and the driver compiles the module whole-program, the calls inlined
(ptxas: 0 bytes stack, no spills). The same text with ``.extern .func`` is nvcc's own
output, which a runtime links with p3_send_rows.ptx through cuLink/nvJitLink (the route of
docs/EMBEDDING.md (c); there ptxas serialises the wgmma around the real calls and drops
setmaxnreg, so it is the slow form, kept as the test of that route). The file's header
comment is the block of the .cu between HEADER_BEGIN and HEADER_END, copied verbatim.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from p3send.cuda import ptxdoc  # noqa: E402

NVCC_FLAGS = ["-rdc=true", "-ptx", "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17"]

#: The nvcc whose output the shipped file is (``nvcc --version``: "V13.0.88").
NVCC_VERSION = "13.0.88"
#: The wheels that make up that nvcc, at the versions released with it (one CUDA 13.0
#: toolkit); the test extra of pyproject.toml pins exactly these: nvcc itself (and ptxas),
#: cicc (nvvm), the crt headers, cuda_bf16.h (runtime) and <nv/target>, which cuda_bf16.h
#: includes (cccl). The headers and cicc shape the output as much as nvcc does.
TOOLKIT = {
    "nvidia-cuda-nvcc": NVCC_VERSION,
    "nvidia-nvvm": "13.0.88",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cuda-cccl": "13.0.85",
}
NVCC_WHEEL = "nvidia-cuda-nvcc"

WHY = (f"ptx/p3_gemm_send.ptx is nvcc {NVCC_VERSION}'s output byte for byte, and another version writes other "
       f"bytes")
INSTALL = f"pip install -e '.[test]' (it pins {NVCC_WHEEL}=={NVCC_VERSION} and the wheels it compiles with)"


class BuildError(RuntimeError):
    """The build cannot run (a refused nvcc, a malformed source) or nvcc failed."""


class NvccNotFound(BuildError):
    """No nvcc of NVCC_VERSION: neither the pinned wheel nor a system nvcc of that version."""


class Toolkit(NamedTuple):
    nvcc: Path
    ptxas: Path | None
    origin: str     # which nvcc this is and why it was taken, for the user


def nvcc_version(nvcc: str | Path) -> str | None:
    """The version ``nvcc --version`` reports ("13.0.88"), or None when it does not run or say."""
    try:
        r = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bV(\d+\.\d+\.\d+)\b", r.stdout)
    return m.group(1) if r.returncode == 0 and m else None


def _beside(nvcc: Path) -> Path | None:
    ptxas = nvcc.with_name("ptxas")
    return ptxas if ptxas.is_file() else (Path(p) if (p := shutil.which("ptxas")) else None)


def _wheel() -> tuple[Toolkit | None, str]:
    """The pinned wheel's nvcc, or None and why not."""
    try:
        dist = importlib.metadata.distribution(NVCC_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None, f"the {NVCC_WHEEL} wheel is not installed"
    if dist.version != NVCC_VERSION:
        return None, f"the installed {NVCC_WHEEL} wheel is {dist.version}, not {NVCC_VERSION}"
    wrong = []
    for name, want in TOOLKIT.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "not installed"
        if have != want:
            wrong.append(f"{name} is {have}, not {want}")
    if wrong:   # nvcc is the pinned one, its parts are not: a broken install, not a missing one
        raise BuildError(f"build_gemm: the {NVCC_WHEEL} {NVCC_VERSION} wheel is installed, but {'; '.join(wrong)} "
                         f"({WHY}, headers and cicc included): {INSTALL}")
    files = [f for f in dist.files or () if f.parts[-2:] == ("bin", "nvcc")]
    if not files:
        raise BuildError(f"build_gemm: the {NVCC_WHEEL} {NVCC_VERSION} wheel lists no bin/nvcc among its files")
    nvcc = Path(dist.locate_file(files[0])).resolve()
    got = nvcc_version(nvcc)
    if got != NVCC_VERSION:
        raise BuildError(f"build_gemm: {nvcc} (of the {NVCC_WHEEL} {NVCC_VERSION} wheel) reports version {got}")
    return Toolkit(nvcc, _beside(nvcc), f"nvcc {NVCC_VERSION} of the {NVCC_WHEEL} {NVCC_VERSION} wheel ({nvcc})"), ""


def toolkit(nvcc: str | Path | None = None) -> Toolkit:
    """The nvcc that builds the shipped text: ``nvcc`` if given (when it is NVCC_VERSION), else
    the pinned wheel's, else the system nvcc on PATH when it is NVCC_VERSION. Raises
    BuildError for a given nvcc of another version, NvccNotFound when there is none."""
    if nvcc is not None:
        path = Path(shutil.which(str(nvcc)) or nvcc)
        got = nvcc_version(path)
        if got != NVCC_VERSION:
            raise BuildError(f"build_gemm: refusing --nvcc {nvcc}: it is nvcc {got or '(no version: does it run?)'}, "
                             f"not {NVCC_VERSION} ({WHY}); {INSTALL}")
        return Toolkit(path, _beside(path), f"nvcc {NVCC_VERSION} given with --nvcc ({path})")
    found, why_not = _wheel()
    if found is not None:
        return found
    system = shutil.which("nvcc")
    if system is None:
        raise NvccNotFound(f"build_gemm: no nvcc {NVCC_VERSION}: {why_not} and there is no nvcc on PATH ({WHY}); "
                           f"{INSTALL}")
    got = nvcc_version(system)
    if got != NVCC_VERSION:
        raise NvccNotFound(f"build_gemm: no nvcc {NVCC_VERSION}: {why_not}, and the system nvcc {system} is "
                           f"{got or '(no version: does it run?)'}, so it is refused ({WHY}); {INSTALL}")
    return Toolkit(Path(system), _beside(Path(system)),
                   f"the system nvcc {system} (version {NVCC_VERSION}, the pinned one; {why_not})")


def header_block(source: str, begin: str, end: str, tool: str, src_name: str) -> str:
    """The PTX header a .cu carries for its generated file: the lines of ``source`` between one
    line ``begin`` and one later line ``end``, verbatim, each a ``//`` comment not ending in a
    backslash (so nvcc sees only comments there). ``tool`` and ``src_name`` name the build
    script and the .cu in the BuildError."""
    lines = source.splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines) if line.rstrip("\n") in (begin, end)]
    if [lines[i].rstrip("\n") for i in marks] != [begin, end]:
        raise BuildError(f"{tool}: {src_name} must hold the PTX header between one line {begin!r} "
                         f"and one later line {end!r}")
    block = lines[marks[0] + 1:marks[1]]
    for n, line in enumerate(block, marks[0] + 2):
        if not line.startswith("//") or line.rstrip("\n").endswith("\\"):
            raise BuildError(f"{tool}: {src_name}:{n}: each line of the PTX header is a // comment "
                             f"not ending in a backslash, got {line.rstrip()!r}")
    return "".join(block)


class GemmBuild(NamedTuple):
    """One generated GEMM: ptx/<entry>.ptx, built from ptx/cuda/<source or entry>.cu with
    ``defines`` (nvcc's -D options: one source may ship several kernels). ``tool``: the
    script (its messages start with it); ``param_names``: the kernel's parameters in
    declaration order (nvcc's <entry>_param_<i> get these names); ``variants``: name -> the
    macros a measurement variant is compiled with (never shipped)."""

    tool: str
    entry: str
    param_names: tuple
    variants: dict = {}          # read only (one default shared by every instance)
    source: str = ""
    defines: tuple = ()

    @property
    def src(self) -> Path:
        return ROOT / "ptx" / "cuda" / f"{self.source or self.entry}.cu"

    @property
    def out(self) -> Path:
        return ROOT / "ptx" / f"{self.entry}.ptx"

    @property
    def header_begin(self) -> str:
        """The marker line before the PTX header in the .cu (the lines between the two are copied)."""
        return f"// ---- begin ptx/{self.entry}.ptx header ----"

    @property
    def header_end(self) -> str:
        return f"// ---- end ptx/{self.entry}.ptx header ----"

    def header(self, source: str) -> str:
        """The PTX header: the lines of ``source`` between the two marker lines, verbatim."""
        return header_block(source, self.header_begin, self.header_end, self.tool, self.src.name)

    def build(self, nvcc: str | Path | Toolkit | None = None, source: str | None = None, defines=()) -> str:
        """The shipped text (or a variant's, with ``defines``: nvcc's -D options), from the .cu
        (or ``source``, another version of it), compiled by ``toolkit(nvcc)``'s nvcc (or by the
        Toolkit given)."""
        tk = nvcc if isinstance(nvcc, Toolkit) else toolkit(nvcc)
        text_src = self.src.read_text() if source is None else source
        head = self.header(text_src)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / f"{self.entry}.ptx"
            src, inc = self.src, ["-I", str(ROOT / "ptx")]
            if source is not None:   # its relative includes still resolve from ptx/cuda
                src = Path(tmp) / self.src.name
                src.write_text(source)
                inc += ["-I", str(self.src.parent)]
            cmd = [str(tk.nvcc), *NVCC_FLAGS, *self.defines, *defines, *inc, str(src), "-o", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise BuildError(f"{self.tool}: nvcc failed ({' '.join(cmd)}):\n{r.stderr}")
            text = out.read_text()
        # nvcc's banner names its build; the shipped text starts at .version.
        text = text[text.index(".version"):]
        for i, name in reversed(list(enumerate(self.param_names))):
            text = re.sub(rf"\b{self.entry}_param_{i}\b", name, text)
        if f"{self.entry}_param_" in text:
            raise BuildError(f"{self.tool}: the kernel has more parameters than PARAM_NAMES")
        return head + ptxdoc.set_prototype_linkage(text, "visible")

    def main(self, argv, description: str, also=()) -> int:
        """The script: write the shipped file (and those of the builds ``also``, from the same
        source), or --check them, or build a --variant of this one to -o; --ptxas assembles
        each loaded module. Returns the exit status."""
        ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing them")
        ap.add_argument("--ptxas", action="store_true", help="assemble the loaded module with ptxas -v")
        if self.variants:
            ap.add_argument("--variant", choices=sorted(self.variants), help="build a measurement variant (needs -o)")
            ap.add_argument("-o", "--output", type=Path, help="where --variant writes")
        ap.add_argument("--nvcc", default=None, help=f"the nvcc to use (it must be version {NVCC_VERSION}); default: "
                        f"the {NVCC_WHEEL} wheel's, else the one on PATH")
        a = ap.parse_args(argv)
        variant = getattr(a, "variant", None)
        if variant and (a.output is None or a.check):
            print(f"{self.tool}: --variant writes to -o PATH (and is never checked against the shipped file)",
                  file=sys.stderr)
            return 2
        try:
            tk = toolkit(a.nvcc)
            print(f"{self.tool}: using {tk.origin}", file=sys.stderr)
            texts = [(self, self.build(tk, defines=self.variants[variant] if variant else ()))]
            if not variant:
                texts += [(b, b.build(tk)) for b in also]
        except BuildError as e:
            print(e, file=sys.stderr)
            return 2
        rc = 0
        for b, text in texts:
            out = b.out
            if variant:
                a.output.write_text(text)
                print(f"wrote variant {variant} to {a.output} ({len(text)} bytes)")
            elif a.check:
                if not out.exists() or out.read_text() != text:
                    print(f"{out.relative_to(ROOT)} is stale: run python tools/{self.tool}.py")
                    rc = 1
                else:
                    print(f"{out.relative_to(ROOT)} is up to date")
            else:
                out.write_text(text)
                print(f"wrote {out.relative_to(ROOT)} ({len(text)} bytes)")
            if a.ptxas:
                if tk.ptxas is None:
                    print(f"{self.tool}: no ptxas beside {tk.nvcc} or on PATH", file=sys.stderr)
                    return 2
                with tempfile.TemporaryDirectory() as tmp:
                    p = Path(tmp) / "m.ptx"
                    p.write_text(inlined(text))
                    r = subprocess.run([str(tk.ptxas), "-arch=sm_90a", "-v", str(p), "-o",
                                        str(Path(tmp) / "m.cubin")], capture_output=True, text=True)
                    print(r.stdout + r.stderr)
                    if r.returncode:
                        rc = 1
        return rc


def inlined(text: str) -> str:
    """The module the loader compiles: this text with p3_send_rows.ptx appended."""
    return ptxdoc.module_text(text, [("p3_send_rows.ptx", (ROOT / "ptx" / "p3_send_rows.ptx").read_text())])


#: Measurement variants of the bf16 kernel: name -> its macros (the source says what each does).
VARIANTS = {"outline": ["-DP3G_OUTLINE"]}

GEMM = GemmBuild("build_gemm", "p3_gemm_send",
                 ("cfg", "ctx", "tmaps", "c_ptr", "c_row_stride", "n_cols", "k_dim", "bm"), VARIANTS)
SRC, OUT, HEADER_BEGIN, HEADER_END, PARAM_NAMES = GEMM.src, GEMM.out, GEMM.header_begin, GEMM.header_end, \
    GEMM.param_names
header, build = GEMM.header, GEMM.build


def main(argv=None) -> int:
    return GEMM.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
