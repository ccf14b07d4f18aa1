"""The all-ranks dispatch kernels (``p3send.ops.dispatch_all``) are the shipped ones with one
rule applied, on the CPU: every ``ld.param`` of a shipped entry becomes a load from this
rank's row at the parameter's documented offset, ``%nctaid.x`` becomes the rank's own grid,
nothing else changes; the rows of 8 ranks fit PTX 8.0's parameter space; the derived text
assembles for sm_90 and sm_100; a kernel the rule does not cover is refused; and the host
rows carry each rank's block at its offsets with its own grid."""
from __future__ import annotations

import re
import types

import pytest

from p3send.abi.errors import ConfigError
from p3send.cuda import loader, ptxdoc, ptxlint
from p3send.ops import dispatch_all as da

ENTRIES = da.ENTRIES
LD = re.compile(r"ld\.param\.(\w+)\s+(%[\w$]+),\s*\[(\w+)(?:\+(\d+))?\]")


def shipped(entry: str) -> str:
    return loader.ptx_dir().joinpath(entry + ".ptx").read_text()


@pytest.mark.parametrize("mode", ["param", "table"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_parameter_load_reads_the_ranks_row_at_its_documented_offset(entry, mode):
    text = shipped(entry)
    out, stride, gofs = da.all_ranks_ptx(text, entry, mode)
    doc = {p.name: p for p in ptxdoc.parse_header(text)[entry].params}
    want = [(t, reg, doc[name].offset + int(off or 0)) for t, reg, name, off in LD.findall(text.split(".version")[1])]
    space = "ld.param" if mode == "param" else "ld.global.nc"
    got = [(t, reg, int(o)) for t, reg, o in re.findall(
        rf"{re.escape(space)}\.(\w+)\s+(%[\w$]+),\s*\[%p3all_row\+(\d+)\]", out)]
    assert got[0] == ("u32", "%p3all_g", gofs)           # the prologue's own grid
    assert got[1:] == want and len(want) > 10
    last = max(p.offset + p.size for p in doc.values())
    assert last <= gofs and gofs + 4 <= stride and stride % 8 == 0
    if mode == "param":
        assert da.MAX_RANKS * stride <= 4352, "8 rows within PTX 8.0's parameter space"
    assert "%nctaid" not in out
    assert out.count("%p3all_g") == 3 + text.count("%nctaid.x")   # decl, load, compare, each %nctaid.x
    # nothing else changed: the derived lines are the shipped ones but for the rewritten ones
    body = text[text.index(".version"):]
    def strip(s):
        return [ln for ln in s.split("\n") if "ld.param" not in ln and "ld.global.nc" not in ln
                and "%p3all" not in ln and "nctaid" not in ln and "griddepcontrol" not in ln]
    assert out.count("griddepcontrol.wait;") == 1 == out.count("griddepcontrol.launch_dependents;")
    ob, bb = strip(out), strip(body)
    entry_at = [i for i, ln in enumerate(bb) if ".entry" in ln][0]
    close_at = bb.index(")", entry_at)
    assert ob[:entry_at] == bb[:entry_at] and ob[entry_at + 3:] == bb[close_at + 1:]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_the_derived_kernels_assemble(entry, arch):
    why = ptxlint.nvjitlink_missing()
    if why:
        pytest.skip(why)
    out, _, _ = da.all_ranks_ptx(shipped(entry), entry, "param")
    rep = ptxlint.assemble(out, f"{entry}_all.ptx", arch)
    assert not rep.error, rep.error


def test_a_kernel_outside_the_rule_is_refused():
    text = shipped("p3_dispatch_wait")
    with pytest.raises(ConfigError, match="no such .entry"):
        da.all_ranks_ptx(text, "p3_dispatch_nothing")
    odd = text.replace("mov.u32             %G, %nctaid.x;", "mov.u32 %G, %nctaid.y;")
    assert odd != text
    with pytest.raises(ConfigError, match="nctaid"):
        da.all_ranks_ptx(odd, "p3_dispatch_wait")
    odd = text.replace("ld.param.u32        %L, [n_local];", "ld.param.u32 %L, [n_lokal];")
    assert odd != text
    with pytest.raises(ConfigError, match="unknown parameter n_lokal"):
        da.all_ranks_ptx(odd, "p3_dispatch_wait")
    # the rank is %ctaid.y: a kernel that reads it (or .z) itself is outside the rule
    odd = text.replace("mov.u32             %G, %nctaid.x;", "mov.u32             %G, %nctaid.x;\n"
                       "    mov.u32             %G, %ctaid.y;")
    assert odd != text
    with pytest.raises(ConfigError, match=r"reads %ctaid.y or %ctaid.z"):
        da.all_ranks_ptx(odd, "p3_dispatch_wait")
    noted = text.replace(".address_size 64", ".address_size 64\n// %ctaid.y named in a comment only", 1)
    assert noted != text
    da.all_ranks_ptx(noted, "p3_dispatch_wait")


def fake_dispatch(grids):
    """Ranks with real parameter blocks (the shipped tables, no driver) and the given send grids."""
    kernels = {e: types.SimpleNamespace(params=ptxdoc.parse_header(shipped(e))[e].params, name=e) for e in ENTRIES}
    ranks = []
    for r, g in enumerate(grids):
        rd = types.SimpleNamespace(tally_threads=256, count_threads=1024, count_smem=100, send_grid=g, wait_grid=2,
                                   tally=r % 2 == 0, tally_grid=3)
        for b, (e, attr) in da.BLOCKS.items():
            setattr(rd, attr, loader.ParamBlock(kernels[e], n_tokens=100 * r + len(b)) if "n_tokens" in
                    {p.name for p in kernels[e].params} else loader.ParamBlock(kernels[e], p3_control=-r))
        ranks.append(rd)
    a = object.__new__(da.AllRanks)
    a.d, a.mode, a.grid, a.stride, a.gofs, a.tab = types.SimpleNamespace(ranks=ranks), "param", {}, {}, {}, {}

    class Block:
        def set(self, **v):
            self.raw = v["p3_ranks"]
    a.blk = {b: Block() for b in da.BLOCKS}
    for e in ENTRIES:
        _, a.stride[e], a.gofs[e] = da.all_ranks_ptx(shipped(e), e)
    return a, ranks


def test_the_rows_hold_each_ranks_block_and_its_own_grid():
    a, ranks = fake_dispatch([5, 9, 1])
    a.refresh()
    assert a.grid == {"tally": 3, "count": 1, "push": 1, "layout": 1, "send": 9, "wait": 2, "send_quiet": 9}
    fo = da.param_offset("p3_dispatch_send", "flags")
    for b, (e, attr) in da.BLOCKS.items():
        raw, st, go = a.blk[b].raw, a.stride[e], a.gofs[e]
        assert len(raw) == da.MAX_RANKS * st
        for r, rd in enumerate(ranks):
            row = bytearray(raw[r * st:(r + 1) * st])
            want = bytearray(da.block_bytes(getattr(rd, attr), st))
            if b == "send_quiet":            # the send's block with FLAG_NO_SIGNAL added to its flags
                assert int.from_bytes(row[fo:fo + 4], "little") == int.from_bytes(want[fo:fo + 4], "little") | 4
                row[fo:fo + 4] = want[fo:fo + 4]
            # every parameter at the offset the PTX header gives it (not through block_bytes)
            for prm in ptxdoc.parse_header(shipped(e))[e].params:
                assert bytes(row[prm.offset:prm.offset + prm.size]) == bytes(getattr(rd, attr).get(prm.name)), \
                    f"{b}: rank {r}: {prm.name} at {prm.offset}"
            assert row[:go] == want[:go]
            own = {"tally": 3 if r % 2 == 0 else 0, "send": rd.send_grid, "send_quiet": rd.send_grid,
                   "wait": 2}.get(b, 1)
            assert int.from_bytes(row[go:go + 4], "little") == own
        assert raw[len(ranks) * st:] == bytes((da.MAX_RANKS - len(ranks)) * st)


def test_ranks_with_different_blocks_are_refused():
    a, ranks = fake_dispatch([1, 1])
    ranks[1].count_threads = 512
    with pytest.raises(ConfigError, match="count_threads: differs between ranks"):
        a.refresh()


def test_the_quiet_send_flag_is_the_kernels():
    """FLAG_NO_SIGNAL as p3_dispatch_send's header names it, and the kernel branches past its
    signal on it (the one branch before the signal's bar.sync)."""
    text = shipped("p3_dispatch_send")
    consts = dict(kv.split("=") for kv in re.search(r"// CONSTANTS (.*)", text).group(1).split())
    assert int(consts["FLAG_NO_SIGNAL"]) == da.FLAG_NO_SIGNAL
    sig = text.index("// ---------------------------------------------------------------- the signal")
    assert re.match(r"\s*// -+ the signal\n\s*@%quiet bra\s+EXIT;", text[sig:])
    assert "and.b32             %r2, %r1, 4;                 // FLAG_NO_SIGNAL" in text
