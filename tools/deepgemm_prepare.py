"""Assemble DeepGEMM as the ``gemm_fp8`` bench section's comparison (never a dependency of p3send),
and build its kernels for the section's shapes ahead of time, on a machine without a GPU.

    python tools/deepgemm_prepare.py --mirror DEEPGEMM_GIT_DIR --commit 8dfa329 \\
        --cutlass-include CUTLASS/include --out .deepgemm

DeepGEMM 8dfa329 is pure Python with a JIT: it compiles each kernel configuration with nvcc the
first time it is called, with CUTLASS's headers under deep_gemm/include. This writes
``OUT/deep_gemm`` (the package at that commit, with ``cute/`` and ``cutlass/`` from
``--cutlass-include``, e.g. the nvidia-cutlass wheel's cutlass_library/source/include),
``OUT/nvcc`` (a wrapper: DeepGEMM's cache key names the compiler's path) and, with
``--precompile`` (the default), ``OUT/cache``: the cubins of the configurations DeepGEMM picks for
the section's shapes (p3send.bench.gemm_fp8.SHAPES, 132 SMs), so the GPU machine compiles
nothing. The cache key also holds the package's path: use it as ``/tmp/dg`` on both machines
(a symbolic link or a copy) with::

    PYTHONPATH=/tmp/dg DG_JIT_CACHE_DIR=/tmp/dg/cache DG_JIT_NVCC_COMPILER=/tmp/dg/nvcc

Without torch here, a stand-in module lets DeepGEMM's Python run as far as the compiler (its
heuristics and code generation need no tensor).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = Path("/tmp/dg")
NVCC_WRAPPER = """#!/bin/sh
# DeepGEMM's JIT names its compiler in its cache key: one path on every machine (/tmp/dg/nvcc).
for n in nvcc /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc; do
    command -v "$n" >/dev/null 2>&1 && exec "$n" "$@"
done
echo "no nvcc" >&2; exit 127
"""


def _stand_in_torch() -> None:
    """Modules named torch and torch.* whose every attribute is a distinct object (dict keys,
    annotations, decorators' targets)."""
    import importlib.abc
    import importlib.machinery

    class Any(types.ModuleType):
        __path__: list = []

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            v = Any(f"{self.__name__}.{name}")
            setattr(self, name, v)
            return v

        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else self

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = Any(spec.name)
            if spec.name == "torch.utils.cpp_extension":
                m.CUDA_HOME = "/usr/local/cuda"
            return m

        def exec_module(self, module):
            pass
    sys.meta_path.insert(0, Finder())


def configs(n: int, k: int, sms: int = 132):
    """(what, kwargs for FP8GemmRuntime.generate) of every DeepGEMM call the section makes."""
    sys.path.insert(0, str(ROOT))
    from deep_gemm.jit_kernels.gemm import get_best_configs
    from deep_gemm.jit_kernels.runtime import GemmType

    from p3send.bench import gemm_fp8
    from p3send.oracle import fp8
    out = []
    for name, (e, mean, _) in gemm_fp8.SHAPES.items():
        off, _ = fp8.contiguous_layout(gemm_fp8.rows_per_expert(name))
        calls = [(f"{name} contiguous", int(off[-1]), 1, e, GemmType.GroupedContiguous, int(off[-1]),
                  dict(is_grouped_contiguous=True))]
        if name == "decode":
            calls.append((f"{name} masked", mean, e, e, GemmType.GroupedMasked, 128, dict(is_grouped_masked=True)))
        for what, m_cfg, groups_cfg, groups, kind, m_arg, flags in calls:
            _, bm, bn, stages, mc, smem = get_best_configs(m_cfg, n, k, groups_cfg, sms, **flags)
            out.append((what, {"NUM_TMA_THREADS": 128, "NUM_MATH_THREADS_PER_GROUP": 128, "M": m_arg, "N": n, "K": k,
                               "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SWIZZLE_D_MODE": smem[1],
                               "BLOCK_N_PADDING": smem[2], "NUM_GROUPS": groups, "NUM_STAGES": stages,
                               "NUM_TMA_MULTICAST": mc[0], "IS_TMA_MULTICAST_ON_A": mc[1], "GEMM_TYPE": kind}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirror", type=Path, required=True, help="a git clone of deepseek-ai/DeepGEMM")
    ap.add_argument("--commit", default="8dfa329")
    ap.add_argument("--cutlass-include", type=Path, required=True, help="a folder holding cute/ and cutlass/")
    ap.add_argument("--out", type=Path, default=ROOT / ".deepgemm")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--gemm-k", type=int, default=2048)
    a = ap.parse_args(argv)
    out = a.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    arch = subprocess.run(["git", "-C", str(a.mirror), "archive", a.commit, "deep_gemm"], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=arch, check=True)
    for d in ("cute", "cutlass"):
        shutil.copytree(a.cutlass_include / d, out / "deep_gemm" / "include" / d)
    (out / "nvcc").write_text(NVCC_WRAPPER)
    (out / "nvcc").chmod(0o755)
    (out / "COMMIT").write_text(a.commit + "\n")
    if LINK.is_symlink() or not LINK.exists():
        if LINK.is_symlink():
            LINK.unlink()
        LINK.symlink_to(out)
    if a.no_precompile:
        return 0
    os.environ.update(DG_JIT_CACHE_DIR=str(LINK / "cache"), DG_JIT_NVCC_COMPILER=str(LINK / "nvcc"))
    sys.path.insert(0, str(LINK))
    try:
        import torch  # noqa: F401
    except ImportError:
        _stand_in_torch()
    from deep_gemm.jit.compiler import build
    from deep_gemm.jit_kernels.runtime import FP8GemmRuntime
    for what, kw in configs(a.hidden, a.gemm_k):
        print(f"{what}: BLOCK_M {kw['BLOCK_M']} BLOCK_N {kw['BLOCK_N']} stages {kw['NUM_STAGES']} "
              f"multicast {kw['NUM_TMA_MULTICAST']} on {'A' if kw['IS_TMA_MULTICAST_ON_A'] else 'B'}", flush=True)
        build("m_grouped_gemm_fp8_fp8_bf16_nt", FP8GemmRuntime.generate(kw), FP8GemmRuntime, kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
