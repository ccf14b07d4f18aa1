"""ptx/p3_gemm_fp8_send.ptx and ptx/p3_quant_fp8.ptx on the CPU: the GEMM's PTX is the build of
its source (tools/build_gemm_fp8.py), its header matches its declaration, the loaded (inlined)
module assembles for sm_90a without a stack, spills or serialised wgmma, nvcc's -rdc form
links with ptx/p3_send_rows.ptx through nvJitLink, and its measurement variants build (those with
setmaxnreg within the registers their launch allocates, assembled without spills or serialised wgmma). The build
and the assembly use the pinned nvcc (tools/build_gemm.py's ``toolkit()``, the test extra's wheel),
as tests/cpu/test_gemm_build.py does for the bf16 GEMM, so CI regenerates and compares both."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from p3send.cuda import ptxdoc, ptxlint
from tests.cpu.conftest import tool_module

ROOT = Path(__file__).resolve().parents[2]
PTX = ROOT / "ptx" / "p3_gemm_fp8_send.ptx"
WIDE = ROOT / "ptx" / "p3_gemm_fp8_send_wide.ptx"
ROWS = ROOT / "ptx" / "p3_send_rows.ptx"
TOOL = ROOT / "tools" / "build_gemm_fp8.py"


def _build_gemm():
    """tools/build_gemm.py, whose ``toolkit()`` both build scripts use."""
    return tool_module("build_gemm")


bg = _build_gemm()


def _pinned_toolkit():
    """The pinned nvcc the build uses; skips (with build_gemm's reason) only where there is none,
    and never in CI, whose install of the test extra always brings it."""
    try:
        return bg.toolkit()
    except bg.NvccNotFound as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the test extra, which pins the nvcc: {e}")
        pytest.skip(str(e))


def test_shipped_ptx_is_the_build_of_its_source():
    tk = _pinned_toolkit()
    r = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ptx/p3_gemm_fp8_send.ptx is up to date" in r.stdout, r.stdout
    assert "ptx/p3_gemm_fp8_send_wide.ptx is up to date" in r.stdout, r.stdout
    assert f"build_gemm_fp8: using {tk.origin}" in r.stderr, r.stderr   # the same nvcc, and it says so


def test_header_target_and_lint():
    text = PTX.read_text()
    assert ptxdoc.ptx_target(text) == "sm_90a" and ptxdoc.ptx_version(text) <= ptxlint.MAX_PTX_VERSION
    assert not ptxlint.file_problems(text, PTX.name) + ptxlint.lint(text, PTX.name)
    assert sorted(ptxdoc.prototypes(text)) == ["p3_send_flush", "p3_send_rows"]
    params = ptxdoc.parse_header(text)["p3_gemm_fp8_send"].params
    assert [p.name for p in params] == ["cfg", "ctx", "tmaps", "sb", "c_ptr", "c_row_stride", "n_cols", "k_dim", "bm"]
    from p3send.ops import gemm_fp8
    assert f"dynamic shared memory {gemm_fp8.SMEM} bytes" in text


def test_wide_header_target_and_lint():
    """The wide kernel: its own header (its launch shape: the launcher's WIDE), the parameters
    of p3_gemm_fp8_send, and the setmaxnreg split of the .cu's P3F_WIDE (24 for the producer's
    warpgroup, 88 for the send warps', 200 for each consumer's) within what its 512-thread
    launch allocates (512 x 128 registers)."""
    from p3send.ops import gemm_fp8
    text = WIDE.read_text()
    entry, threads, smem = gemm_fp8.WIDE
    assert WIDE.name == f"{entry}.ptx"
    assert ptxdoc.ptx_target(text) == "sm_90a" and ptxdoc.ptx_version(text) <= ptxlint.MAX_PTX_VERSION
    assert not ptxlint.file_problems(text, WIDE.name) + ptxlint.lint(text, WIDE.name)
    assert sorted(ptxdoc.prototypes(text)) == ["p3_send_flush", "p3_send_rows"]
    narrow = ptxdoc.parse_header(PTX.read_text())["p3_gemm_fp8_send"].params
    wide = ptxdoc.parse_header(text)[entry].params
    assert [(p.offset, p.size, p.type, p.name) for p in wide] == [(p.offset, p.size, p.type, p.name) for p in narrow]
    assert ptxdoc.parse_decls(text)[entry] == ptxdoc.parse_decls(PTX.read_text())["p3_gemm_fp8_send"]
    assert f"block ({threads}, 1, 1)" in text and f"dynamic shared memory {smem} bytes" in text
    assert f".maxntid {threads}, 1, 1" in text
    dec = sorted(int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", text))
    inc = [int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", text)]
    assert dec == [24, 88] and inc == [200], (dec, inc)
    assert 128 * sum(dec) + 2 * 128 * inc[0] <= threads * (65536 // threads // 8 * 8)


def test_wide_inlined_module_has_no_stack_spills_or_serialised_wgmma():
    """ptxas on the loaded module: no stack or spills (the send warps' 88 registers hold
    p3_send_rows), <= 128 registers (512 threads), setmaxnreg kept (no C7504), no serialised
    wgmma (C7509 / C7510), no C7514."""
    log = _assemble(WIDE.read_text())
    entry = _no_spill(log, "p3_gemm_fp8_send_wide")
    _no_spill(log, "p3_send_rows")
    assert int(re.search(r"Used (\d+) registers", entry).group(1)) <= 128, log
    _none_of(log, "C7504", "C7509", "C7510", "C7514")


def _ptxas():
    """The pinned nvcc wheel's ptxas, else one on PATH; skips (with the reason) without either."""
    try:
        return bg.toolkit().ptxas
    except bg.NvccNotFound:
        ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas: neither the pinned nvcc wheel's nor one on PATH")
    return ptxas


def _no_spill(log: str, func: str) -> str:
    """Asserts ptxas ``-v``'s ``log`` gives function ``func`` no stack and no spill; returns
    the log from that function's properties on (its register count follows)."""
    at = log[log.index(f"Function properties for {func}"):]
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", at.splitlines()[1]), log
    return at


def _none_of(log: str, *codes: str) -> None:
    """Asserts no ptxas advisory of ``codes`` (C7504: setmaxnreg dropped; C7509 / C7510: wgmma
    serialised around a call; C7514: serialised for accumulator reads) is in ``log``."""
    assert not [c for c in codes if c in log], log


def _assemble(text: str) -> str:
    ptxas = _ptxas()
    whole = ptxdoc.module_text(text, [(ROWS.name, ROWS.read_text())])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.ptx"
        src.write_text(whole)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "m.cubin")],
                           capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    return log


def test_inlined_module_has_no_stack_spills_or_serialised_wgmma():
    log = _assemble(PTX.read_text())
    entry = _no_spill(log, "p3_gemm_fp8_send")
    regs = int(re.search(r"Used (\d+) registers", entry).group(1))
    assert regs <= 168, f"{regs} registers: 384 threads launch only with <= 168"
    _none_of(log, "C7509", "C7510", "C7504")


def _variant(tmp_path, name: str, *, own_funcs: bool = False) -> str:
    """The text of measurement variant ``name``, built and linted (``own_funcs``: its outlined
    functions have no header block of their own, the one problem the linter may report)."""
    _pinned_toolkit()
    out = tmp_path / f"{name}.ptx"
    r = subprocess.run([sys.executable, str(TOOL), "--variant", name, "-o", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    problems = ptxlint.lint(text, PTX.name)
    if own_funcs:
        problems = [p for p in problems if "header block" not in p]
    assert text != PTX.read_text() and not problems, problems
    return text


def test_no_promote_variant_builds(tmp_path):
    _variant(tmp_path, "no_promote")


@pytest.mark.parametrize("name", ["mcast", "mcast_t128"])
def test_multicast_variant_is_a_cluster_pair_releasing_at_cta_scope(tmp_path, name):
    """The mcast variants (docs/PERF.md: measured slower, kept to reproduce it; mcast_t128 on
    128 x 128 tiles): clusters of two CTAs fixed in the entry (so a plain cuLaunchKernel
    launches them), A multicast into both, each stage released in both CTAs at CTA scope (a
    .release.cluster arrive is a MEMBAR.GPU that waited for the wgmmas in flight: twice the
    time), the cluster barrier at set-up and exit; assembled whole-program with no wgmma
    serialised."""
    text = _variant(tmp_path, name)
    assert ".reqnctapercluster 2, 1, 1" in text and ".explicitcluster" in text
    assert "complete_tx::bytes.multicast::cluster" in text
    assert "mbarrier.arrive.shared::cluster.b64" in text and ".release.cluster.shared::cluster" not in text
    assert text.count("barrier.cluster.arrive") == 2 and text.count("barrier.cluster.wait") == 2
    log = _assemble(text)
    _none_of(log, "C7509", "C7510", "C7514")


def test_wide_kernel_broadcasts_the_warpgroup_index():
    """The wide kernel's consumers take their warpgroup index from lane 0 by a shuffle: what lets
    ptxas compute the A stage's descriptors in uniform registers (docs/PERF.md: with the stepped
    scale pointer, 0.93x the time of the kernel before). The 384-thread kernel has no shuffle."""
    assert "shfl.sync.idx.b32" in WIDE.read_text()
    assert "shfl.sync.idx.b32" not in PTX.read_text()


#: the setmaxnreg variants: name -> (threads, registers of the producer's (and a fourth)
#: warpgroup, of each consumer warpgroup)
SETMAXNREG = {"dual": (384, 88, 208), "send_wg": (512, 96, 160)}


@pytest.mark.parametrize("name", sorted(SETMAXNREG))
def test_setmaxnreg_variant_fits_the_launch_and_assembles_clean(tmp_path, name):
    """setmaxnreg.inc waits for registers the CTA's pool lacks: the split must fit what the
    launch allocated (threads x the entry's register count), else the consumers never start (a
    split over 65,536 but not over 384 x 168 = 64,512 hung on the GPU)."""
    text = _variant(tmp_path, name)
    threads, producer, consumer = SETMAXNREG[name]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", text) == [str(producer)], name
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", text) == [str(consumer)], name
    assert f".maxntid {threads}, 1, 1" in text
    entry_regs = 65536 // threads // 8 * 8
    assert (threads // 128 - 2) * 128 * producer + 2 * 128 * consumer <= threads * entry_regs
    log = _assemble(text)
    entry = _no_spill(log, "p3_gemm_fp8_send")
    assert int(re.search(r"Used (\d+) registers", entry).group(1)) <= entry_regs
    _none_of(log, "C7509", "C7510", "C7504", "C7514")


def _assemble_relocatable(text: str) -> str:
    """ptxas -c (separate compilation, what a linker is given) of the -rdc form of ``text``."""
    ptxas = _ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptxdoc.set_prototype_linkage(text, "extern"))
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-c", "-v", "-maxrregcount=168", str(src), "-o",
                            str(Path(tmp) / "k.o")], capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    return log


def test_linked_route_serialises_the_wgmma_unless_the_mainloop_is_outlined(tmp_path):
    """Why the linked route is slow (docs/EMBEDDING.md): compiled apart from p3_send_rows, the
    kernel's calls are extern, and ptxas waits for every wgmma of a function that makes extern
    calls (C7509). The outline variant keeps the consumers' mainloop in a function of its own,
    with no extern call: no C7509 (its callee-saved registers go to the stack once per call)."""
    assert "C7509" in _assemble_relocatable(PTX.read_text())
    text = _variant(tmp_path, "outline", own_funcs=True)
    log = _assemble_relocatable(text)
    _none_of(log, "C7509", "C7510", "C7514")
    missing = ptxlint.nvjitlink_missing()
    if missing:
        pytest.skip(missing)
    rep = ptxlint.assemble(ptxdoc.set_prototype_linkage(text, "extern"), PTX.name, "sm_90a",
                           deps=[(ROWS.name, ROWS.read_text())], options=["-maxrregcount=168"],
                           judge_resources=False)
    assert not rep.error, rep.error                 # and it links with p3_send_rows as the bench links it


def test_rdc_form_links_with_p3_send_rows_through_nvjitlink():
    missing = ptxlint.nvjitlink_missing()
    if missing:
        pytest.skip(missing)
    extern = ptxdoc.set_prototype_linkage(PTX.read_text(), "extern")
    rep = ptxlint.assemble(extern, PTX.name, "sm_90a", deps=[(ROWS.name, ROWS.read_text())],
                            options=["-maxrregcount=168"], judge_resources=False)
    assert not rep.error, rep.error
    alone = ptxlint.assemble(extern, PTX.name, "sm_90a", options=["-maxrregcount=168"], judge_resources=False)
    assert alone.error and "p3_send_rows" in alone.error, "an unresolved p3_send_rows must fail to link"


def test_p3send_h_constants_match_the_launchers():
    from p3send.ops import gemm_fp8, quant
    text = (ROOT / "ptx" / "p3send.h").read_text()
    got = {k: v for k, v in re.findall(r"#define (P3_(?:GEMM|QUANT)_FP8_\w+|P3_FP8_BLOCK) (\d+)", text)}
    assert got == {"P3_FP8_BLOCK": str(quant.BLOCK), "P3_QUANT_FP8_THREADS": str(quant.THREADS),
                   "P3_GEMM_FP8_THREADS": str(gemm_fp8.THREADS), "P3_GEMM_FP8_SMEM": str(gemm_fp8.SMEM),
                   "P3_GEMM_FP8_WIDE_THREADS": str(gemm_fp8.WIDE[1]),
                   "P3_GEMM_FP8_WIDE_SMEM": str(gemm_fp8.WIDE[2])}, got
