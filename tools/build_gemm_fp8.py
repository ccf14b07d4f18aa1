"""Regenerate ptx/p3_gemm_fp8_send.ptx and ptx/p3_gemm_fp8_send_wide.ptx from
ptx/cuda/p3_gemm_fp8_send.cu with nvcc (no GPU needed).

    python tools/build_gemm_fp8.py            # write both
    python tools/build_gemm_fp8.py --check    # exit 1 if a shipped file differs from a fresh build
    python tools/build_gemm_fp8.py --ptxas    # also assemble the loaded (inlined) modules, print resources
    python tools/build_gemm_fp8.py --variant no_promote -o OUT.ptx   # a measurement variant (never shipped)

The sibling of tools/build_gemm.py, and built the same way with the same pinned nvcc (its
``toolkit``): ``nvcc -rdc=true -ptx -gencode arch=compute_90a,code=sm_90a``, so p3_send_rows and
p3_send_flush stay declared; the shipped text declares them ``.visible .func`` (the loader
appends ptx/p3_send_rows.ptx and the driver inlines the calls), nvcc's own ``.extern`` form is
the one a runtime links. Each file's header comment is its block of the .cu between its two
marker lines, copied verbatim. The wide kernel is the same source with -DP3F_WIDE (the .cu says
what that is). Variants compile the same source with a macro
(VARIANTS) and keep the header, so the loader checks them like the shipped file.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_gemm  # noqa: E402  (the toolkit pin, the build and the script are shared)

ROOT = build_gemm.ROOT
BuildError = build_gemm.BuildError

#: Measurement variants: name -> the macros they are compiled with (the source says what each does).
VARIANTS = {"no_promote": ["-DP3F_NO_PROMOTE"], "dual": ["-DP3F_DUAL", "-DP3F_NO_TURNS"], "dual_turns": ["-DP3F_DUAL"],
            "dual_104": ["-DP3F_DUAL", "-DP3F_NO_TURNS", "-DP3F_REGS_PRODUCER=104", "-DP3F_REGS_CONSUMER=200"],
            "dual_96": ["-DP3F_DUAL", "-DP3F_NO_TURNS", "-DP3F_REGS_PRODUCER=96", "-DP3F_REGS_CONSUMER=200"],
            "dual_sw": ["-DP3F_DUAL", "-DP3F_NO_TURNS", "-DP3F_SEND_WG", "-DP3F_REGS_PRODUCER=56",
                        "-DP3F_REGS_CONSUMER=200"],
            "wide_no_promote": ["-DP3F_WIDE_BODY", "-DP3F_NO_PROMOTE"], "mcast": ["-DP3F_WIDE_BODY", "-DP3F_MCAST"],
            "wide_t128": ["-DP3F_WIDE_BODY", "-DP3F_TILE128"],
            "mcast_t128": ["-DP3F_WIDE_BODY", "-DP3F_TILE128", "-DP3F_MCAST"],
            "send_wg": ["-DP3F_SEND_WG"], "outline": ["-DP3F_OUTLINE"], "no_turns": ["-DP3F_NO_TURNS"],
            "tile128": ["-DP3F_TILE128"], "tile128_turns": ["-DP3F_TILE128", "-DP3F_TURNS"],
            "tile128_dual": ["-DP3F_TILE128", "-DP3F_DUAL"],
            "tile128_send_wg": ["-DP3F_TILE128", "-DP3F_SEND_WG"]}

PARAMS = ("cfg", "ctx", "tmaps", "sb", "c_ptr", "c_row_stride", "n_cols", "k_dim", "bm")
GEMM = build_gemm.GemmBuild("build_gemm_fp8", "p3_gemm_fp8_send", PARAMS, VARIANTS)
#: the 512-thread kernel of the same source (the one for 128-row tiles inlined: the .cu says why)
WIDE = build_gemm.GemmBuild("build_gemm_fp8", "p3_gemm_fp8_send_wide", PARAMS, source="p3_gemm_fp8_send",
                            defines=("-DP3F_WIDE",))
ENTRY, SRC, OUT, HEADER_BEGIN, HEADER_END, PARAM_NAMES = GEMM.entry, GEMM.src, GEMM.out, GEMM.header_begin, \
    GEMM.header_end, GEMM.param_names
header, build, inlined = GEMM.header, GEMM.build, build_gemm.inlined


def main(argv=None) -> int:
    return GEMM.main(argv, __doc__, also=(WIDE,))


if __name__ == "__main__":
    sys.exit(main())
