"""check-ptx and the PTX lint, on the shipped files and on broken copies of the echo kernel.

CPU only: needs the nvidia-nvjitlink==13.0.* wheel; the ptxas tests skip without ptxas.
"""
import shutil
import sys

import pytest

from p3send.abi.errors import ConfigError, P3SendError
from p3send.cli import app as cli
from p3send.cuda import ptxdoc, ptxlint
from p3send.cuda.loader import ptx_dir

PTX_DIR = ptx_dir()
SHIPPED = sorted(PTX_DIR.glob("*.ptx"))
ARCHS = list(ptxlint.DEFAULT_ARCHS)
ECHO = "p3_abi_echo.ptx"
needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")


@pytest.fixture
def echo():
    return (PTX_DIR / ECHO).read_text()


def mutate(text, old, new):
    """``text`` with the single occurrence of ``old`` replaced (fails loudly if the echo
    kernel changed so that the mutation no longer applies)."""
    assert text.count(old) == 1, f"mutation anchor not found exactly once: {old!r}"
    return text.replace(old, new)


def line_of(text, needle):
    return next(i for i, s in enumerate(text.splitlines(), 1) if needle in s)


# --------------------------------------------------------------------------- shipped files

def test_shipped_dir_has_the_echo_kernel():
    assert (PTX_DIR / ECHO).is_file()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_lint_shipped(path):
    text = ptxdoc.without_nvshmem(path.read_text())     # as loaded without the transport (test_nvshmem_link: with it)
    assert ptxlint.file_problems(text, path.name) + ptxlint.lint(text, path.name) == []


CASES = [(p, a) for p in SHIPPED for a in ptxlint.targets(p.read_text(), ARCHS)]
CASE_IDS = [f"{p.name}-{a}" for p, a in CASES]


@pytest.mark.parametrize(("path", "arch"), CASES, ids=CASE_IDS)
def test_assemble_shipped(path, arch):
    text = ptxdoc.without_nvshmem(path.read_text())
    whole, opts = ptxlint.assembly_unit(path, text)
    inlined = whole is not text
    r = ptxlint.assemble(whole, path.name, arch, ptxlint.providers(path, text)[0], opts,
                          judge_resources=not inlined)
    assert r.problems() == []
    entries = [d.name for d in ptxlint.declarations(text) if d.kind == "entry" and not d.extern]
    got = {f.name: f for f in r.functions}
    for e in entries:
        assert got[e].regs > 0
        if not inlined:   # a relocatable compile keeps the calls the loader inlines: judged by ptxas below
            assert got[e].stack == 0 and got[e].spill_stores == 0


@needs_ptxas
@pytest.mark.parametrize(("path", "arch"), CASES, ids=CASE_IDS)
def test_ptxas_shipped(path, arch):
    whole, _ = ptxlint.assembly_unit(path, ptxdoc.without_nvshmem(path.read_text()))
    assert ptxlint.assemble_ptxas(whole, path.name, arch).problems() == []


def test_cli_check_ptx_passes(capsys):
    assert cli.main(["check-ptx"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for path in SHIPPED:
        assert path.name in out
    assert "sm_90" in out and "sm_100" in out and "nvjitlink" in out
    assert out.rstrip().endswith("ok")


# --------------------------------------------------------------------------- negative: lint

def test_wrong_header_offset(echo):
    bad = mutate(echo, "//   184     8  u64               out", "//   180     8  u64               out")
    ln = line_of(bad, "//   180     8  u64")
    assert f"{ECHO}:{ln}: p3_abi_echo: out is documented at offset 180 but declared at offset 184" \
        in ptxlint.lint(bad, ECHO)


def test_misaligned_cfg_load(echo):
    bad = mutate(echo, "[cfg+88];", "[cfg+92];")
    ln = line_of(bad, "[cfg+92]")
    assert ptxlint.lint(bad, ECHO) == [
        f"{ECHO}:{ln}: ld.param.u64 [cfg+92] is inside n_ranks (offset 88, 8 bytes)"]


def test_wrong_width_cfg_load(echo):
    bad = mutate(echo, "ld.param.u64        %rd3, [cfg+88];", "ld.param.u32        %r1, [cfg+88];")
    ln = line_of(bad, "[cfg+88]")
    assert ptxlint.lint(bad, ECHO) == [
        f"{ECHO}:{ln}: ld.param.u32 [cfg+88] is 4 bytes wide but n_ranks (offset 88) is 8 bytes"]


def test_send_mbx_may_be_loaded_as_32_bits(echo):
    ok = mutate(echo, "ld.param.u64        %rd3, [cfg+136];", "ld.param.u32        %r1, [cfg+136];")
    assert ptxlint.lint(ok, ECHO) == []


def test_plain_param_load_checked(echo):
    bad = mutate(echo, "[tag];", "[tag+4];")
    assert any("[tag+4] reaches outside tag" in p for p in ptxlint.lint(bad, ECHO))


def test_missing_header_section(echo):
    bad = mutate(echo, "// TIMEOUT none: the kernel never waits\n", "")
    assert any("lacks section(s) TIMEOUT" in p for p in ptxlint.lint(bad, ECHO))


def test_undocumented_parameter(echo):
    bad = mutate(echo, "    .param .u64 tag\n", "    .param .u64 tag,\n    .param .u64 extra\n")
    msgs = ptxlint.lint(bad, ECHO)
    assert any("parameter extra (offset 200, 8 bytes) is declared but not documented" in p for p in msgs)


def test_undocumented_entry(echo):
    bad = mutate(echo, "// ENTRY p3_abi_echo\n", "// ENTRY p3_other\n")
    msgs = ptxlint.lint(bad, ECHO)
    assert any(".entry p3_abi_echo has no '// ENTRY p3_abi_echo' header block" in p for p in msgs)
    assert any("header ENTRY p3_other documents no .entry p3_other" in p for p in msgs)


def test_unreadable_param_load_is_flagged(echo):
    bad = mutate(echo, "ld.param.u64        %rd3, [tag];", "ld.param.u64        %rd3, [%rd1];")
    assert any("cannot check" in p for p in ptxlint.lint(bad, ECHO))


# --------------------------------------------------------------------------- negative: module rules

def test_version_too_new(echo):
    bad = mutate(echo, ".version 8.0", ".version 9.1")
    assert any(".version 9.1 is newer than 9.0" in p for p in ptxlint.file_problems(bad, ECHO))


def test_missing_version_and_target(echo):
    bad = mutate(mutate(echo, ".version 8.0\n", ""), ".target sm_90\n", "")
    msgs = ptxlint.file_problems(bad, ECHO)
    assert f"{ECHO}: no .version directive" in msgs and f"{ECHO}: no .target directive" in msgs


# --------------------------------------------------------------------------- negative: assembler

def test_syntax_error_names_the_line(echo):
    bad = mutate(echo, "st.global.u64       [%rd1+96], %rd3;", "st.glob.u64         [%rd1+96], %rd3;")
    ln = line_of(bad, "st.glob.u64")
    r = ptxlint.assemble(bad, ECHO, "sm_90")
    assert not r.ok and f"line {ln}; error" in r.error and "Unknown modifier '.glob'" in r.error


@needs_ptxas
def test_syntax_error_names_the_line_ptxas(echo):
    bad = mutate(echo, "st.global.u64       [%rd1+96], %rd3;", "st.glob.u64         [%rd1+96], %rd3;")
    ln = line_of(bad, "st.glob.u64")
    r = ptxlint.assemble_ptxas(bad, ECHO, "sm_90")
    assert not r.ok and f"{ECHO}, line {ln}; error" in r.problems()[0]


def test_local_array_rejected(echo):
    # A dynamically indexed .local array cannot live in registers: it needs a stack frame.
    bad = mutate(echo, "    .reg .b64   %rd<4>;\n",
                 "    .reg .b64   %rd<4>;\n    .local .align 8 .b8 scratch[64];\n")
    bad = mutate(bad, "    ld.param.u64        %rd3, [tag];\n",
                 "    ld.param.u64        %rd3, [tag];\n"
                 "    mov.u64             %rd2, scratch;\n"
                 "    and.b64             %rd0, %rd3, 56;\n"
                 "    add.u64             %rd2, %rd2, %rd0;\n"
                 "    st.local.u64        [%rd2], %rd3;\n"
                 "    ld.local.u64        %rd3, [scratch+8];\n")
    assert ptxlint.lint(bad, ECHO) == []
    for arch in ARCHS:
        r = ptxlint.assemble(bad, ECHO, arch)
        assert r.ok, r.error
        msgs = r.problems()
        assert len(msgs) == 1 and "entry p3_abi_echo uses a stack frame or local memory" in msgs[0]
        assert "64 bytes stack frame" in msgs[0]     # the offending log line is quoted


def test_spill_in_log_is_a_problem():
    # Spills are hard to provoke on purpose; the check itself runs on the parsed log.
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 0 barriers\n")
    funcs = ptxlint.parse_resources(log)
    funcs["k"].kind = "entry"
    r = ptxlint.Report("k.ptx", "sm_90", "ptxas", [funcs["k"]], log)
    msgs = r.problems()
    assert any("spills registers (8 bytes stored, 8 loaded)" in m and "8 bytes spill stores" in m for m in msgs)


def test_cli_fails_on_bad_file(echo, tmp_path, capsys):
    bad = mutate(echo, ".version 8.0", ".version 9.1")
    path = tmp_path / ECHO
    path.write_text(bad)
    assert cli.main(["check-ptx", str(path), "--arch", "sm_90", "--no-ptxas"]) == 1
    out = capsys.readouterr().out
    assert "FAIL p3_abi_echo.ptx: .version 9.1 is newer than 9.0" in out
    assert "not assembled: .version 9.1" in out


# --------------------------------------------------------------------------- linkable .func files

LIB = """//
// FUNC p3_test_add1
// Returns a + 1.
// PARAMS
//   off  size  type  name  meaning
//     0     8  u64   a     any value
// LAUNCH called by one thread
// ORDERING none
// REQUIRES sm_90
// TIMEOUT none
//
.version 8.0
.target sm_90
.address_size 64

.visible .func (.param .b64 rv) p3_test_add1(.param .b64 a)
{
    .reg .b64 %rd<3>;
    ld.param.b64        %rd1, [a];
    add.u64             %rd2, %rd1, 1;
    st.param.b64        [rv], %rd2;
    ret;
}
"""

CALLER = """//
// ENTRY p3_test_caller
// Stores p3_test_add1(out) at out.
// PARAMS
//   off  size  type  name  meaning
//     0     8  u64   out   ptr: global u64[1]
// LAUNCH grid (1,1,1), block (1,1,1)
// ORDERING plain store
// REQUIRES sm_90
// TIMEOUT none
//
.version 8.0
.target sm_90
.address_size 64

.extern .func (.param .b64 rv) p3_test_add1(.param .b64 a);

.visible .entry p3_test_caller(.param .u64 out)
{
    .reg .b64 %rd<3>;
    ld.param.u64        %rd1, [out];
    {
    .param .b64 arg;
    .param .b64 ret;
    st.param.b64        [arg], %rd1;
    call (ret), p3_test_add1, (arg);
    ld.param.b64        %rd2, [ret];
    }
    st.global.u64       [%rd1], %rd2;
    ret;
}
"""


def test_func_library_and_extern_caller(tmp_path, capsys):
    (tmp_path / "p3_test_lib.ptx").write_text(LIB)
    (tmp_path / "p3_test_caller.ptx").write_text(CALLER)
    files = [str(tmp_path / "p3_test_lib.ptx"), str(tmp_path / "p3_test_caller.ptx")]
    assert cli.main(["check-ptx", *files]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "p3_test_add1 (func)" in out and "p3_test_caller" in out
    # Alone, the caller cannot link: check-ptx names the extern nobody defines.
    (tmp_path / "p3_test_lib.ptx").unlink()
    assert cli.main(["check-ptx", files[1], "--arch", "sm_90"]) == 1
    out = capsys.readouterr().out
    assert "FAIL p3_test_caller.ptx: .extern .func p3_test_add1 is defined by no PTX file" in out


def test_version_too_new_is_not_given_to_nvjitlink(echo):
    # nvJitLink 13.0.88 would fail fatally and then stop reporting undefined externs.
    r = ptxlint.assemble(mutate(echo, ".version 8.0", ".version 9.1"), ECHO, "sm_90")
    assert r.error.startswith("not assembled: .version 9.1 is newer than 9.0")
    r = ptxlint.assemble(CALLER, "p3_test_caller.ptx", "sm_90")
    assert "Undefined reference to 'p3_test_add1'" in r.error


def test_missing_nvjitlink_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvjitlink", None)   # import now fails
    with pytest.raises(P3SendError, match=r"pip install nvidia-nvjitlink==13\.0\.\*"):
        ptxlint.assemble(".version 8.0\n", "x.ptx", "sm_90")


# --------------------------------------------------------------------------- (f) constants

def test_header_constants_tie_the_magic_numbers():
    text = (PTX_DIR / "p3_scatter_send.ptx").read_text()
    consts = ptxlint.header_constants(text.splitlines())
    assert consts["CHUNK_VECTORS"] == 192 and consts["RANGE_AT"] == 136
    from p3send.ops import send
    assert {k: v for k, v in consts.items() if k.startswith("FLAG_")} == {   # no put path: p3_scatter_send_fp8's
        n: getattr(send, n) for n in dir(send) if n.startswith("FLAG_") and not n.startswith("FLAG_NVSHMEM")}
    assert ptxlint.constant_problems(text.splitlines()) == []
    # a drifted immediate and an unnamed constant are both reported
    bad = mutate(text, "div.u32             %cpr, %cpr, 192;", "div.u32             %cpr, %cpr, 190;")
    got = ptxlint.constant_problems(bad.splitlines())
    assert len(got) == 1 and "CHUNK_VECTORS = 192" in got[0][1], got
    unused = text.replace("RANGE_AT=136", "RANGE_AT=136 SPARE=7", 1)
    assert any("SPARE is used by no instruction" in m for _, m in ptxlint.constant_problems(unused.splitlines()))


def test_the_linter_reaches_nvjitlink_only_through_the_driver():
    # driver.py is the one module importing cuda.bindings (nvjitlink included)
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(ptxlint))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.startswith("cuda")}, names
    assert "cuda.bindings" not in inspect.getsource(ptxlint) and "importlib" not in names


def test_check_archs():
    assert ptxlint.check_archs(["sm_90", "sm_100", "sm_90"]) == ["sm_90", "sm_100"]
    for bad in ("sm90", "compute_90", "sm_90 ", "-arch=sm_90", 90):
        with pytest.raises(ConfigError, match=r"expected sm_<number> with an optional 'a' or 'f' suffix"):
            ptxlint.check_archs([bad])
