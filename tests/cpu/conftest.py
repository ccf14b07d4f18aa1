"""Shared pieces of the CPU tests: paths, the hand-written disabled() image, a CLI driver, the
maintained tools imported as modules."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "ptx" / "p3send.h"


def tool_module(name: str):
    """``tools/<name>.py`` imported as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

# Mojo's disabled() as 23 little-endian 8-byte words, written out by hand from docs/ABI.md §3
# (not computed from abi.FIELDS, so a wrong table cannot agree with itself here).
DISABLED_HEX = "".join([
    "0400000000000000",  # 0   atomic_counter   dangling Int32*  -> 4
    "0400000000000000",  # 8   src_info_ptr     dangling Int32*  -> 4
    "0800000000000000",  # 16  row_base_ptr     dangling UInt64* -> 8
    "0100000000000000" * 8,  # 24 recv_buf_ptrs dangling UInt8*  -> 1, eight times
    "0000000000000000",  # 88  n_ranks 0
    "0100000000000000",  # 96  p2p_world_size 1
    "0100000000000000",  # 104 top_k 1
    "0000000000000000",  # 112 msg_bytes 0
    "0000000000000000",  # 120 max_tokens_per_rank 0
    "0000000000000000",  # 128 my_rank 0
    "0400000000000000",  # 136 send_mbx dangling Int32* -> 4
    "0800000000000000",  # 144 send_stamp_ptr -> 8
    "0000000000000000",  # 152 send_stamp_on 0
    "0800000000000000",  # 160 trace_ptr -> 8
    "0000000000000000",  # 168 trace_on 0
    "ffffffffffffffff",  # 176 send_trace_slot -1
])


@pytest.fixture
def disabled_image() -> bytes:
    image = bytes.fromhex(DISABLED_HEX)
    assert len(image) == 184   # guards the literal above, not the code under test
    return image


@pytest.fixture
def cli(capsys):
    """Run ``p3send ARGS`` in-process; returns (exit status, stdout + stderr)."""
    from p3send.cli import main

    def run(*args):
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out + out.err
    return run


def compile_and_run(tmp_path: Path, compiler: str, std: str, source: str, name: str,
                    include: Path = HEADER.parent) -> str:
    """Build ``source`` with -Wall -Wextra -Werror -pedantic and return the program's stdout."""
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    ext = ".cpp" if compiler in ("g++", "c++", "clang++") else ".c"
    src = tmp_path / (name + ext)
    src.write_text(source)
    exe = tmp_path / name
    build = subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-pedantic",
                            f"-I{include}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"{compiler} -std={std} failed:\n{build.stderr}"
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
