"""The bf16 wire's modules hold no FP8 code: ``ptxdoc.without_fp8`` drops the lines between a
file's ``// FP8 ONLY {`` / ``// FP8 ONLY }`` markers and makes their ``//BF16`` lines code;
the grouped GEMMs load ``p3_send_rows.ptx`` that way for their bf16-wire kernels and whole for
the fp8 wire's (``wire_kernel()``); ``prepare`` binds a block to the kernel its wire and tile
height need, and a launch refuses a block marked for the fp8 wire of a kernel that cannot
quantise."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from p3send.abi.errors import ConfigError
from p3send.abi.wire import wire_msg_bytes
from p3send.cuda import driver, ptxdoc
from p3send.cuda.loader import ptx_dir
from p3send.ops import gemm as gemm_mod
from tests.cpu import test_gemm_wire as wire_tests
from tests.cpu.test_fp8_inputs import FakeBuffer

gpu = wire_tests.gpu                    # the stand-in driver's fixture

ROWS_PTX = ptx_dir() / "p3_send_rows.ptx"


def test_without_fp8_drops_regions_and_restores_bf16_lines():
    text = "a\n    // FP8 ONLY {\n    x\n    //BF16 y %msg;\n    // FP8 ONLY }\nb"
    assert ptxdoc.without_fp8(text) == "a\n    y %msg;\nb"
    assert ptxdoc.without_fp8("no markers\n") == "no markers\n"


@pytest.mark.parametrize("text, match", [("// FP8 ONLY {\n// FP8 ONLY {\n", "inside another"),
                                         ("// FP8 ONLY }\n", "without a begin"), ("// FP8 ONLY {\n", "never closed")])
def test_without_fp8_refuses_unbalanced_markers(text, match):
    with pytest.raises(ValueError, match=match):
        ptxdoc.without_fp8(text)


def test_the_bf16_send_rows_holds_no_fp8_code_and_the_shipped_one_does():
    whole = ptxdoc.without_nvshmem(ROWS_PTX.read_text())    # as every module loaded without the transport
    bf16 = ptxdoc.without_fp8(whole)
    code = lambda t: "\n".join(s.split("//")[0] for s in t.splitlines())   # noqa: E731
    for word in ("COPY_FP8", "e4m3", "%fp8", "%wfp8, %t2", "130150525"):     # the last: msg_bytes/33
        assert word in code(whole), word
    for word in ("COPY_FP8", "e4m3", "div.u64", "130150525"):
        assert word not in code(bf16), word
    assert whole.count("// FP8 ONLY {") >= 6
    # the functions and their parameter tables stay those of the shipped file
    assert ptxdoc.parse_decls(bf16) == ptxdoc.parse_decls(whole)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
@pytest.mark.parametrize("entry", ["p3_gemm_send", "p3_gemm_fp8_send"])
def test_both_gemm_modules_assemble(entry, tmp_path):
    for bf16_only in (True, False):
        src = tmp_path / f"{entry}.{bf16_only}.ptx"
        src.write_text(gemm_mod.module_text(entry, bf16_only=bf16_only))
        r = subprocess.run(["ptxas", "-arch=sm_90a", str(src), "-o", str(tmp_path / "out.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("gemm", sorted(wire_tests.GEMMS))
def test_the_bf16_wire_modules_hold_no_fp8_code_and_prepare_binds_the_block_to_its_kernel(gpu, gemm):
    n = 512
    g, arrays, sizes = wire_tests.GEMMS[gemm](n)
    assert g.k is g.kernel_for(64)
    for k in {g.kernel_for(64), g.kernel_for(128)}:     # the fp8 launcher's two kernels, the bf16 one's one
        assert k.module.text == gemm_mod.module_text(k.name, bf16_only=True)
        assert "COPY_FP8" not in k.module.text
    assert g.wire_kernel() is g.wire_kernel() is g.kernel_for(128, True) and g.wire_kernel() is not g.kernel_for(128)
    assert g.kernel_for(64, True).module.name == f"{g.ENTRY}.ptx"     # the shipped file, loaded by name
    cfg = wire_tests.send_cfg(wire_msg_bytes(n, "fp8"))
    peers = [FakeBuffer(8 * 2 * wire_tests.N_RANKS)] * wire_tests.N_RANKS
    # a block of a bf16-wire module given for the fp8 wire is bound to the kernel that quantises
    blk = g.prepare(cfg, *arrays, count_ptrs=peers, p3_control=0, into=g.k.params_block(), **sizes, wire="fp8")
    assert blk.kernel is g.kernel_for(128, True) and blk.fp8_wire
    own = g.prepare(cfg, *arrays, count_ptrs=peers, p3_control=0, **sizes, wire="fp8")
    assert own.kernel is g.wire_kernel()
    gated = g.prepare(cfg, *arrays, FakeBuffer(2 * wire_tests.ROWS * n), **sizes, p3_control=-1)
    assert gated.kernel is g.kernel_for(128)          # the send off: a bf16 module writes C
    gated.fp8_wire = True                             # marked for the fp8 wire, of a module that cannot quantise
    with pytest.raises(ConfigError, match="not a block of an fp8-wire kernel"):
        g.launch(None, gated)
    from tests.cpu.test_fp8_inputs import stand_in_kernel
    other = stand_in_kernel("p3_scatter_send").params_block()
    with pytest.raises(ConfigError, match="into: expected a block of .*whose parameters differ"):
        g.prepare(cfg, *arrays, count_ptrs=peers, p3_control=0, into=other, **sizes, wire="fp8")
    with pytest.raises(ConfigError, match="block: expected a block prepared by this launcher"):
        g.launch(None, other)


@pytest.mark.parametrize("gemm", sorted(wire_tests.GEMMS))
def test_launch_and_block_follow_the_last_own_prepare(gpu, gemm):
    n = 512
    g, arrays, sizes = wire_tests.GEMMS[gemm](n)
    peers = [FakeBuffer(8 * 2 * wire_tests.N_RANKS)] * wire_tests.N_RANKS
    fp8 = g.prepare(wire_tests.send_cfg(wire_msg_bytes(n, "fp8")), *arrays, count_ptrs=peers, p3_control=0,
                    **sizes, wire="fp8")
    assert g.block is fp8 and fp8.kernel is g.wire_kernel()
    bf16 = g.prepare(wire_tests.send_cfg(2 * n), *arrays, count_ptrs=peers, p3_control=0, **sizes)
    assert g.block is bf16 and bf16.kernel is g.kernel_for(128)
    # a bf16 launch may use the fp8 module's block (it sends bf16 too); not the other way round
    g.prepare(wire_tests.send_cfg(2 * n), *arrays, count_ptrs=peers, p3_control=0, **sizes,
              into=g.wire_kernel().params_block())


@pytest.mark.parametrize("gemm", sorted(wire_tests.GEMMS))
def test_a_variant_gets_both_modules_of_its_own_text(gpu, gemm, monkeypatch):
    n = 512
    cls = type(wire_tests.GEMMS[gemm](n)[0])
    text = (ptx_dir() / f"{cls.ENTRY}.ptx").read_text() + "\n// a variant\n"
    g = cls(2, device=wire_tests.DEV, variant_ptx=text)
    assert g.k.module.text == gemm_mod.module_text(cls.ENTRY, text, bf16_only=True)
    assert g.wire_kernel().module.text == gemm_mod.module_text(cls.ENTRY, text)


@pytest.mark.parametrize("gemm", sorted(wire_tests.GEMMS))
def test_a_linked_launcher_has_one_module_for_both_wires(gpu, gemm, monkeypatch):
    from tests.cpu.test_fp8_inputs import StandInModule
    seen = []
    monkeypatch.setattr(gemm_mod, "link", lambda sources, **kw: seen.append(sources) or StandInModule("linked"))
    n = 512
    cls = type(wire_tests.GEMMS[gemm](n)[0])
    g = cls(2, device=wire_tests.DEV, linked=True)
    assert "p3_send_rows" in seen[0]            # the shipped file whole, by name
    assert g.wire_kernel() is g.k
    g2, arrays, sizes = wire_tests.GEMMS[gemm](n)
    blk = g.prepare(wire_tests.send_cfg(wire_msg_bytes(n, "fp8")), *arrays,
                    count_ptrs=[FakeBuffer(8 * 2 * wire_tests.N_RANKS)] * wire_tests.N_RANKS, p3_control=0,
                    into=g.k.params_block(), **sizes, wire="fp8")
    assert blk.kernel is g.k and blk.fp8_wire
    gpu.shapes.clear()
    g.launch(driver.Stream(), blk)          # the one module quantises: the fp8-wire block launches
    assert gpu.shapes == [(g.ENTRY, (g.THREADS,), g.SMEM)], gpu.shapes
