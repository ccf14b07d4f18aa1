"""The optional NVSHMEM transport on CPU: the shim's shipped PTX is a fresh build of its source
against the pinned wheel, a sending module links with it and libnvshmem_device.a for sm_90 and
sm_100 (nvJitLink, no GPU), a missing or other-version wheel is a named P3SendError before any
link, and the NVLink-domain rule fills recv_buf_ptrs as MAX does.

The links need the nvidia-nvshmem-cu13 wheel at the pinned version (the test extra pins it) and
nvJitLink; without them those tests skip with the reason.
"""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from p3send.abi.errors import ConfigError, P3SendError
from p3send.cuda import nvshmem_link, ptxdoc, ptxinline, ptxlint
from p3send.cuda.nvshmem_link import (
    NVSHMEM_VERSION,
    NVSHMEM_WHEEL,
    NvshmemLinkError,
    NvshmemUnavailable,
    NvshmemVersionError,
)
from p3send.ops import nvshmem

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "ptx" / nvshmem_link.SHIM
SENDER = ROOT / "tests" / "gpu" / "data" / "p3_nvshmem_put_rows.ptx"


def _why_no_link() -> str | None:
    try:
        nvshmem_link.wheel()
    except P3SendError as e:
        return str(e)
    try:
        from p3send.cuda import driver
        driver.nvjitlink_version()
    except P3SendError as e:
        return str(e)
    return None


WHY = _why_no_link()
needs_wheel = pytest.mark.skipif(WHY is not None, reason=f"no NVSHMEM link here: {WHY}")


# ---------------------------------------------------------------- the link, per arch

@needs_wheel
@pytest.mark.parametrize("arch", nvshmem_link.ARCHS)
def test_a_sending_module_links_with_the_shim_and_the_device_library(arch):
    image, _ = nvshmem_link.link_cubin([(SENDER.name, SENDER.read_text())], arch)
    assert image[:4] == b"\x7fELF"
    # the entry, the shim's put, and the device state nvshmemx_cumodule_init fills
    for symbol in (b"p3_nvshmem_put_rows", b"p3_nvshmem_put_signal_warp", b"nvshmemi_device_state_d"):
        assert symbol in image, symbol


SHIPPED = [(e, a) for e in nvshmem_link.SENDERS
           for a in (["sm_90a"] if ptxdoc.ptx_target((ROOT / "ptx" / f"{e}.ptx").read_text()).endswith("a")
                     else nvshmem_link.ARCHS)]


@needs_wheel
@pytest.mark.parametrize("entry, arch", SHIPPED, ids=[f"{e}-{a}" for e, a in SHIPPED])
def test_every_shipped_sender_links_with_the_shim_and_the_device_library(entry, arch):
    # the put path of p3_send_rows (its NVSHMEM regions) calls the shim's put, signal and quiet;
    # their weak stubs give way to the shim's definitions
    name, text = nvshmem_link.shipped_module(entry)
    assert ".visible .func" not in text and f".visible .entry {entry}(" in text
    put_path = entry in nvshmem_link.PUT_PATH
    code = "\n".join(s.split("//")[0] for s in text.splitlines())
    assert ("call.uni        p3_nvshmem_put_rows_warp" in code or "call.uni p3_nvshmem_put_rows_warp" in code) \
        == put_path
    # inlined where INLINED says (the body in the entry, no call of p3_send_rows left)
    assert (re.search(r"call\.uni\s+p3_send_rows\s*,", code) is None) == (entry in nvshmem_link.INLINED
                                                                          or "p3_send_rows" not in code)
    image, _ = nvshmem_link.link_cubin([(name, text)], arch)
    assert image[:4] == b"\x7fELF" and entry.encode() in image and b"nvshmemi_device_state_d" in image
    for fn in (b"p3_nvshmem_put_rows_warp", b"p3_nvshmem_signal", b"p3_nvshmem_quiet"):
        assert (fn in image) == put_path, fn
    if put_path:   # the shim's code, not the stub's (a trap): the put is NVSHMEM's, thousands of bytes
        assert _text_section_size(image, "p3_nvshmem_put_rows_warp") > 1000


def _text_section_size(image: bytes, func: str) -> int:
    """The size of the cubin's ``.text.<func>`` section (ELF64 section headers)."""
    import struct
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    for sec in secs:
        end = image.index(b"\0", names + sec[0])
        if image[names + sec[0]:end].decode() == f".text.{func}":
            return sec[5]
    return 0


@needs_wheel
def test_linked_alone_the_send_rows_file_keeps_its_weak_stubs():
    # p3_send_rows.ptx links on its own (EMBEDDING.md): its stubs trap if the flag is set there
    rows = (ROOT / "ptx" / "p3_send_rows.ptx").read_text()
    assert rows.count(".weak .func p3_nvshmem_") == 3
    r = ptxlint.assemble(rows, "p3_send_rows.ptx", "sm_90")
    assert r.ok, r.error


# ---------------------------------------------------------------- the text without the transport

def test_every_default_loaded_text_holds_no_put_path():
    """What the loaders build for a module loaded without the transport: no NVSHMEM region, no
    shim call, no weak stub (the cubins are those of the text before the put path was added)."""
    from p3send.cuda.loader import ptx_dir
    from p3send.ops import gemm as gemm_mod
    texts = {}
    for path in sorted(ptx_dir().glob("*.ptx")):
        sib = [(p.name, p.read_text()) for p in sorted(ptx_dir().glob("*.ptx")) if p != path]
        texts[path.name] = ptxdoc.module_text(path.read_text(), sib)
    for entry in ("p3_gemm_send", "p3_gemm_fp8_send"):
        texts[f"{entry} bf16-only"] = gemm_mod.module_text(entry, bf16_only=True)
        texts[f"{entry} fp8"] = gemm_mod.module_text(entry)
    code = lambda t: "\n".join(s.split("//")[0] for s in t.splitlines())   # noqa: E731
    for name, text in texts.items():
        assert not [s for s in text.splitlines() if s.strip() in (ptxdoc.NVSHMEM_ONLY_BEGIN, ptxdoc.NVSHMEM_ONLY_END)
                    or s.strip().startswith("//DIRECT")], name
        assert "p3_nvshmem" not in code(text) and "%nvs" not in code(text), name
    assert "p3_nvshmem_put_rows_warp" in code(nvshmem_link.shipped_module("p3_scatter_send_fp8")[1])


def test_the_loaders_link_of_the_shipped_send_rows_is_without_the_put_path(monkeypatch):
    from p3send.cuda import driver, loader
    seen = []

    def fake_link(pairs, options, libraries):
        seen.extend(pairs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(driver, "link_ptx", fake_link)
    dev = types.SimpleNamespace(activate=lambda: None)
    with pytest.raises(RuntimeError, match="stop here"):
        loader.link(["p3_send_rows"], device=dev)
    (name, text), = seen
    code = "\n".join(s.split("//")[0] for s in text.splitlines())
    assert name == "p3_send_rows.ptx" and "p3_nvshmem" not in code and ".visible .func p3_send_rows(" in text


@pytest.mark.parametrize("name, alt", sorted(ptxdoc.REGIONS.items()))
def test_a_region_is_dropped_and_its_alternative_lines_restored(name, alt):
    other = next(n for n in ptxdoc.REGIONS if n != name)
    text = (f"a\n// {name} ONLY {{\n    x;\n    {alt}y %msg;\n// {name} ONLY }}\n"
            f"// {other} ONLY {{\n    z;\n// {other} ONLY }}\nb")
    assert ptxdoc.without_region(text, name) == f"a\n    y %msg;\n// {other} ONLY {{\n    z;\n// {other} ONLY }}\nb"
    assert ptxdoc.without_region("no markers\n", name) == "no markers\n"


@pytest.mark.parametrize("text, match", [("// NVSHMEM ONLY {\n// NVSHMEM ONLY {\n", "inside another"),
                                         ("// NVSHMEM ONLY }\n", "without a begin"),
                                         ("// NVSHMEM ONLY {\n", "never closed")])
def test_unbalanced_nvshmem_markers_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        ptxdoc.without_nvshmem(text)


def test_an_unknown_region_name_is_refused():
    with pytest.raises(ConfigError, match=r"name: expected one of FP8, NVSHMEM, got 'FP16'"):
        ptxdoc.without_region("", "FP16")


@needs_wheel
def test_a_refused_link_names_its_inputs_and_carries_the_log():
    bad = SENDER.read_text().replace("call.uni        p3_nvshmem_put_warp,", "call.uni        p3_nvshmem_put_wrap,")
    bad = bad.replace(".extern .func p3_nvshmem_put_warp(", ".extern .func p3_nvshmem_put_wrap(")
    assert "p3_nvshmem_put_wrap" in bad
    with pytest.raises(NvshmemLinkError, match=r"could not link p3_nvshmem_put_rows\.ptx, nvshmem/"
                       r"p3_nvshmem_shim\.ptx with libnvshmem_device\.a .* for sm_90") as e:
        nvshmem_link.link_cubin([(SENDER.name, bad)], "sm_90")
    assert "p3_nvshmem_put_wrap" in e.value.log


# ---------------------------------------------------------------- the shim's source and text

@pytest.mark.skipif(WHY is not None, reason=f"no NVSHMEM wheel here: {WHY}")
def test_the_shipped_shim_is_a_fresh_build_of_its_source():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_gemm
        import build_nvshmem_shim
    finally:
        sys.path.remove(str(ROOT / "tools"))
    try:
        tk = build_gemm.toolkit()
    except build_gemm.BuildError as e:
        pytest.skip(f"no pinned nvcc: {e}")
    assert build_nvshmem_shim.build(tk) == SHIM.read_text(), "stale: run python tools/build_nvshmem_shim.py"


def test_the_shim_builder_refuses_a_referenced_path_dependent_global():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_nvshmem_shim
    finally:
        sys.path.remove(str(ROOT / "tools"))
    decl = ".global .align 1 .b8 __nv_static_40__abc_x[1];\n"
    assert build_nvshmem_shim.drop_unused_statics("a\n" + decl + "b\n") == "a\nb\n"
    with pytest.raises(build_nvshmem_shim.BuildError, match="__nv_static_40__abc_x is referenced"):
        build_nvshmem_shim.drop_unused_statics(decl + "mov.u64 %rd1, __nv_static_40__abc_x;\n")


def test_the_shim_header_documents_every_function_it_defines():
    text = SHIM.read_text()
    defined = set(re.findall(r"^\.visible \.func\s+(?:\([^)]*\)\s*)?(p3_nvshmem_\w+)\(", text, re.M))
    assert defined == {"p3_nvshmem_put_signal_warp", "p3_nvshmem_put_warp", "p3_nvshmem_put_rows_warp",
                       "p3_nvshmem_signal",
                       "p3_nvshmem_fence", "p3_nvshmem_quiet", "p3_nvshmem_ptr", "p3_nvshmem_my_pe",
                       "p3_nvshmem_n_pes"}
    head = text[:text.index(".version")]
    for f in defined:
        assert f in head, f
    assert "GENERATED by tools/build_nvshmem_shim.py" in head
    assert "__nv_static_" not in text                      # no path-dependent names shipped
    assert text.splitlines()[0] == "//" and ".version 9.0" in text and ".target sm_90" in text


def test_the_test_sender_header_matches_its_code():
    text = SENDER.read_text()
    assert ptxlint.file_problems(text, SENDER.name) + ptxlint.lint(text, SENDER.name) == []


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
@pytest.mark.parametrize("arch", nvshmem_link.ARCHS)
def test_the_test_sender_assembles_relocatably(arch):
    # ptxas -c: its .extern calls are resolved by the shim at link time
    assert ptxlint.assemble_ptxas(SENDER.read_text(), SENDER.name, arch).problems() == []


# ---------------------------------------------------------------- the wheel: missing, other version

class _FakeDist:
    def __init__(self, version, root):
        self.version, self._root = version, root

    def locate_file(self, path):
        return self._root / path


def test_a_missing_wheel_is_a_named_error_that_says_what_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(NvshmemUnavailable, match=rf"needs the {NVSHMEM_WHEEL} wheel, version "
                       rf"{re.escape(NVSHMEM_VERSION)}, which is not installed: pip install 'p3send\[nvshmem\]'"):
        nvshmem_link.link_cubin([(SENDER.name, SENDER.read_text())], "sm_90")


def test_another_version_is_refused_before_any_link(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _FakeDist("3.8.0", tmp_path))
    with pytest.raises(NvshmemVersionError, match=rf"{NVSHMEM_WHEEL}: expected version "
                       rf"{re.escape(NVSHMEM_VERSION)} .* got 3\.8\.0") as e:
        nvshmem_link.link_cubin([(SENDER.name, SENDER.read_text())], "sm_90")
    assert (e.value.found, e.value.expected) == ("3.8.0", NVSHMEM_VERSION)
    assert isinstance(e.value, P3SendError)


def test_a_broken_install_names_the_missing_file(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _FakeDist(NVSHMEM_VERSION, tmp_path))
    with pytest.raises(NvshmemUnavailable, match=r"its headers .*nvshmem\.h is missing"):
        nvshmem_link.wheel()


def test_the_extras_pin_the_versions_the_code_checks():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"{NVSHMEM_WHEEL}=={NVSHMEM_VERSION}" in extras["nvshmem"]
    assert f"{nvshmem.NVSHMEM4PY}=={nvshmem.NVSHMEM4PY_VERSION}" in extras["nvshmem"]
    assert f"{NVSHMEM_WHEEL}=={NVSHMEM_VERSION}" in extras["test"]


def test_the_bindings_check_the_loaded_host_library():
    try:
        b = nvshmem.bindings()
    except NvshmemUnavailable as e:
        pytest.skip(f"no NVSHMEM host bindings here: {e}")
    assert b is nvshmem.bindings()                          # loaded once


# ---------------------------------------------------------------- the NVLink domain (MAX's rule)

class _FakeBindings:
    """nvshmem_ptr as a world of ``n`` PEs where ``reach(me, pe)`` says who is reachable by stores."""

    def __init__(self, me, reach):
        self.me, self.reach = me, reach

    def ptr(self, addr, pe):
        return addr + 0x1000_0000 * (pe + 1) if self.reach(self.me, pe) else 0


def _world(rank, n_ranks, reach=lambda me, pe: True):
    w = object.__new__(nvshmem.NvshmemWorld)
    w.rank, w.n_ranks, w.b = rank, n_ranks, _FakeBindings(rank, reach)
    return w


def test_same_domain_is_the_same_node():
    assert [nvshmem.same_domain(d, 5, 4) for d in range(8)] == [False] * 4 + [True] * 4
    assert [nvshmem.same_domain(d, 0, 8) for d in range(16)] == [True] * 8 + [False] * 8


def test_recv_buf_ptrs_hold_the_domain_peers_at_dst_mod_p2p():
    base = 0x7F00_0000_0000
    got = _world(5, 8).recv_buf_ptrs(base, 4)      # ranks 4..7 form rank 5's domain
    assert got == [base + 0x1000_0000 * (d + 1) for d in (4, 5, 6, 7)] + [0] * 4
    assert _world(1, 2).recv_buf_ptrs(base, 1) == [base + 0x1000_0000 * 2] + [0] * 7


def test_a_domain_peer_that_stores_cannot_reach_is_named():
    w = _world(1, 4, reach=lambda me, pe: pe != 2)
    with pytest.raises(nvshmem.NvshmemError, match=r"nvshmem_ptr: rank 2 is in rank 1's NVLink domain"):
        w.recv_buf_ptrs(0x7F00_0000_0000, 4)
    assert w.recv_buf_ptrs(0x7F00_0000_0000, 1)[0]   # alone in its domain, rank 1 needs only itself


@pytest.mark.parametrize("p2p", [0, 3, 9, 2.0, True])
def test_a_p2p_world_size_that_does_not_split_the_world_is_refused(p2p):
    with pytest.raises(ConfigError, match=rf"p2p_world_size: expected 1\.\.8 dividing n_ranks = 8, got {p2p}"):
        _world(0, 8).recv_buf_ptrs(0x7F00_0000_0000, p2p)


@pytest.mark.parametrize("pe", [-1, 4, 1.0, True])
def test_a_pe_outside_the_world_is_refused_by_name(pe):
    with pytest.raises(ConfigError, match=r"pe: expected an integer 0\.\.3, got "):
        _world(0, 4).ptr(0x7F00_0000_0000, pe)


def _symmetric(nbytes):
    buf = object.__new__(nvshmem.SymmetricBuffer)
    buf.nbytes, buf.ptr = nbytes, 0x7F00_0000_0000
    buf.world = types.SimpleNamespace(device=types.SimpleNamespace(activate=lambda: None))
    return buf


@pytest.mark.parametrize("offset, nbytes", [(0, 65), (64, 1), (-1, 4), (8, -8)])
def test_a_range_outside_a_symmetric_buffer_is_refused_before_any_copy(offset, nbytes):
    with pytest.raises(ConfigError, match=r"offset, nbytes: expected a range inside the 64-byte symmetric buffer"):
        _symmetric(64).download(offset=offset, nbytes=nbytes)


def test_a_download_that_is_no_whole_number_of_elements_is_refused():
    with pytest.raises(ConfigError, match=r"nbytes: expected a multiple of 8 \(uint64\), got 12"):
        _symmetric(64).download(np.uint64, nbytes=12)


@pytest.mark.parametrize("nbytes", [0, -4, 1.5, True])
def test_a_symmetric_buffer_of_no_bytes_is_refused_before_the_heap(nbytes):
    with pytest.raises(ConfigError, match=r"nbytes: expected an integer > 0"):
        nvshmem.SymmetricBuffer(None, nbytes)


# ---------------------------------------------------------------- the inliner

TOY = """.version 8.0
.target sm_90
.address_size 64
.func f(.param .b64 out, .param .b32 x);
.visible .entry k(.param .u64 o)
{
    .reg .b64   %a;
    .reg .b32   %x;
    ld.param.u64        %a, [o];
    mov.u32             %x, %laneid;
    {
        .param .b64 p_out;
        .param .b32 p_x;
        st.param.b64    [p_out], %a;
        st.param.b32    [p_x], %x;
        mov.u32         %x, 7;                  // the site's own instruction, kept in order
        call.uni        f, (p_out, p_x);
    }
    ret;
}
.func f(.param .b64 out, .param .b32 x)
{
    .reg .pred  %p;
    .reg .b64   %a;
    .reg .b32   %x;
    ld.param.b64        %a, [out];
    ld.param.b32        %x, [x];
    setp.eq.u32         %p, %x, 0;
    @%p bra             SKIP;
    st.global.u32       [%a], %x;
SKIP:
    @%p ret;
    add.u32             %x, %x, 1;
    ret;
}
"""


def test_the_inliner_renames_the_body_per_site_and_its_text_assembles(tmp_path):
    out, n = ptxinline.inline_calls(TOY, "f")
    assert n == 1 and "call.uni        f," not in out
    assert "mov.b64 %I0_f_arg_p_out, %a;" in out and "mov.b32 %I0_f_arg_p_x, %x;" in out
    assert "mov.b64 %I0_f_a, %I0_f_arg_p_out;" in out and "mov.b32 %I0_f_x, %I0_f_arg_p_x;" in out
    assert "@%I0_f_p bra             I0_f_SKIP;" in out and "I0_f_SKIP:" in out and "%I0_f_laneid" not in out
    # an unguarded ret becomes bra.uni, a guarded one (it may diverge) a plain bra
    assert out.count("bra.uni I0_f_END;") == 1 and "@%I0_f_p bra I0_f_END;" in out
    # the site's own instruction stays between the argument stores, in order
    assert out.index("mov.b32 %I0_f_arg_p_x, %x;") < out.index("mov.u32         %x, 7;")
    if shutil.which("ptxas"):
        src = tmp_path / "toy.ptx"
        src.write_text(out)
        import subprocess
        r = subprocess.run(["ptxas", "-arch=sm_90", str(src), "-o", str(tmp_path / "toy.cubin")], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr


def test_the_inlined_scatter_module_keeps_its_entry_header():
    # the loader builds the kernel's parameters (the ABI struct, count_ptrs) from the header
    name, text = nvshmem_link.shipped_module("p3_scatter_send_fp8")
    entry = ptxdoc.parse_header(text)["p3_scatter_send_fp8"]
    assert [p.type for p in entry.params[:2]] == ["P3PeerSendConfig", "u64[8]"]
    assert [p.name for p in entry.params] == [p.name for p in ptxdoc.parse_decls(text)["p3_scatter_send_fp8"]]


def test_the_inliner_refuses_a_call_site_of_another_shape():
    odd = TOY.replace("st.param.b64    [p_out], %a;", "st.param.b64    [p_out+0], %a;")
    with pytest.raises(ConfigError, match="not in the shape this inliner handles|undeclared"):
        ptxinline.inline_calls(odd, "f")
    with pytest.raises(ConfigError, match=r"no definition of \.func g"):
        ptxinline.inline_calls(TOY, "g")
