"""Regenerate ptx/nvshmem/p3_nvshmem_shim.ptx from ptx/cuda/p3_nvshmem_shim.cu with nvcc (no GPU needed).

    python tools/build_nvshmem_shim.py            # write ptx/nvshmem/p3_nvshmem_shim.ptx
    python tools/build_nvshmem_shim.py --check    # exit 1 if the shipped file differs from a fresh build

The shipped file is the output, byte for byte, of the nvcc that builds the GEMM's PTX
(tools/build_gemm.py's TOOLKIT: nvcc 13.0.88 and the wheels it compiles with) against the
headers of the pinned NVSHMEM wheel (p3send.cuda.nvshmem_link: NVSHMEM_WHEEL at
NVSHMEM_VERSION); another nvcc or other headers write other bytes, and another NVSHMEM's
device state (nvshmemi_device_state_d) may not match the libnvshmem_device.a it is linked with.

nvcc compiles the shim as relocatable device code (-rdc -ptx, sm_90): the NVSHMEM internals
it calls stay .extern, defined by libnvshmem_device.a at link time. Two edits make the text
reproducible: the banner before .version is dropped, and so are nvcc's declarations of unused
internal-linkage globals (``__nv_static_<hash>_...``, one byte each, from libcu++'s customisation
point objects), whose names hash the source file's absolute path. A referenced one would be
kept and refused (the build fails rather than ship a path-dependent file). The file's header
comment is the block of the .cu between its two marker lines, copied verbatim.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from build_gemm import BuildError, Toolkit, header_block, toolkit  # noqa: E402

from p3send.abi.errors import P3SendError  # noqa: E402
from p3send.cuda import nvshmem_link  # noqa: E402

SRC = ROOT / "ptx" / "cuda" / "p3_nvshmem_shim.cu"
OUT = ROOT / "ptx" / "nvshmem" / "p3_nvshmem_shim.ptx"
HEADER_BEGIN = "// ---- begin ptx/nvshmem/p3_nvshmem_shim.ptx header ----"
HEADER_END = "// ---- end ptx/nvshmem/p3_nvshmem_shim.ptx header ----"
NVCC_FLAGS = ["-rdc=true", "-ptx", "-gencode", "arch=compute_90,code=sm_90", "-std=c++17"]
#: A declaration of an internal-linkage global nvcc names after a hash of the source's path.
_STATIC_DECL = re.compile(r"^\.global \.align \d+ \.b8 (__nv_static_\w+)\[\d+\];\n", re.M)


def header(source: str) -> str:
    """The PTX header: the lines of ``source`` between the two marker lines, verbatim."""
    return header_block(source, HEADER_BEGIN, HEADER_END, "build_nvshmem_shim", SRC.name)


def drop_unused_statics(text: str) -> str:
    """``text`` without the declarations of ``__nv_static_*`` globals that nothing references."""
    for m in list(_STATIC_DECL.finditer(text)):
        if text.count(m.group(1)) != 1:
            raise BuildError(f"build_nvshmem_shim: nvcc's {m.group(1)} is referenced, so its path-dependent "
                             "name would be shipped; change the shim so that it is not")
    return _STATIC_DECL.sub("", text)


def build(nvcc: str | Path | Toolkit | None = None, source: str | None = None) -> str:
    """The shipped text, from the .cu (or ``source``, another version of it), compiled by
    ``toolkit(nvcc)``'s nvcc against the pinned NVSHMEM wheel's headers.

    Raises:
        BuildError: no nvcc of the pinned version, nvcc failed, or the NVSHMEM wheel is
            missing or not the pinned version (its P3SendError's message).
    """
    tk = nvcc if isinstance(nvcc, Toolkit) else toolkit(nvcc)
    try:
        include = nvshmem_link.wheel().include
    except P3SendError as e:
        raise BuildError(f"build_nvshmem_shim: {e}") from e
    text_src = SRC.read_text() if source is None else source
    head = header(text_src)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / SRC.name
        src.write_text(text_src)
        out = Path(tmp) / OUT.name
        cmd = [str(tk.nvcc), *NVCC_FLAGS, "-I", str(include), str(src), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise BuildError(f"build_nvshmem_shim: nvcc failed ({' '.join(cmd)}):\n{r.stderr}")
        text = out.read_text()
    return head + drop_unused_statics(text[text.index(".version"):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    ap.add_argument("--nvcc", default=None, help="the nvcc to use (it must be tools/build_gemm.py's NVCC_VERSION)")
    a = ap.parse_args(argv)
    try:
        tk = toolkit(a.nvcc)
        print(f"build_nvshmem_shim: using {tk.origin} and {nvshmem_link.wheel().origin}", file=sys.stderr)
        text = build(tk)
    except (BuildError, P3SendError) as e:
        print(e, file=sys.stderr)
        return 2
    if a.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python tools/build_nvshmem_shim.py")
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
    else:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
