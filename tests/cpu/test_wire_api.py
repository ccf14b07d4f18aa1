"""The FP8 wire's API on the CPU: ``abi.wire`` (formats, slot sizes, the check), ``validate``
refusing a ``msg_bytes`` that is not the format's (naming the argument), the combine's
launchers refusing before anything is allocated or launched (RecvReduce, Combine, Rank on
a stand-in driver), and the reduce reference (the single-rounding fma, the k order, the
masked and padding terms, the FP8 decode) against exact arithmetic."""
from __future__ import annotations

import re
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from p3send.abi import wire
from p3send.abi.config import rank_config, validate
from p3send.abi.errors import ConfigError, ConfigTypeError
from p3send.ops import combine as combine_mod
from p3send.ops import recv as recv_mod
from p3send.oracle import reference as ref
from p3send.oracle import wire as wire_ref
from tests.cpu.test_fp8_inputs import DEV, FakeBuffer, stand_in_kernel
from tests.cpu.test_fp8_inputs import gpu as gpu  # noqa: F401  (the stand-in driver fixture)

ROOT = Path(__file__).resolve().parents[2]
BASE = 0x7F00_0000_0000


# ---------------------------------------------------------------- abi.wire

@pytest.mark.parametrize("value, code", [("bf16", 0), ("fp8", 1), ("FP8", 1), (0, 0), (1, 1)])
def test_wire_format_names_and_codes(value, code):
    assert wire.wire_format(value) == code


@pytest.mark.parametrize("value", ["fp16", "", None, 2, -1, True, 1.0, b"fp8"])
def test_wire_format_refuses_naming_wire(value):
    with pytest.raises(ConfigError, match=r"^.*wire: expected 'bf16' or 'fp8'"):
        wire.wire_format(value)


@pytest.mark.parametrize("hidden, fmt, msg", [(7168, "fp8", 7392), (512, "fp8", 528), (1024, "fp8", 1056),
                                              (3696, "bf16", 7392), (7168, "bf16", 14336), (8, "bf16", 16)])
def test_slot_sizes_and_their_inverse(hidden, fmt, msg):
    assert wire.wire_msg_bytes(hidden, fmt) == msg
    assert wire.wire_hidden(msg, fmt) == hidden
    assert wire.wire_problems(msg, hidden, fmt) == []
    assert msg % 16 == 0


def test_msg_bytes_alone_cannot_name_the_format():
    # 7,392 B: an FP8 row of 7,168 columns and a bf16 row of 3,696; the check needs both
    assert wire.wire_problems(7392, 7168, "fp8") == wire.wire_problems(7392, 3696, "bf16") == []
    assert wire.wire_problems(7392, 7168, "bf16") == ["msg_bytes: expected 14336 for 7168 columns on the bf16 "
                                                      "wire, got 7392"]
    assert wire.wire_problems(14336, 7168, "fp8") == ["msg_bytes: expected 7392 for 7168 columns on the fp8 "
                                                      "wire, got 14336"]


@pytest.mark.parametrize("hidden, fmt", [(7000, "fp8"), (256, "fp8"), (0, "fp8"), (-512, "fp8"), (12, "bf16"),
                                         (0, "bf16"), (512.0, "fp8"), (True, "bf16"), ("512", "fp8"), (None, "fp8")])
def test_a_hidden_the_format_cannot_carry_is_named(hidden, fmt):
    with pytest.raises(ConfigError, match=r"hidden: expected"):
        wire.wire_msg_bytes(hidden, fmt)
    assert wire.wire_problems(528, hidden, fmt)[0].startswith("hidden: expected")


def test_wire_hidden_and_flags():
    assert wire.wire_hidden(7392 + 16, "fp8") == 0 and wire.wire_hidden(15, "bf16") == 0
    assert wire.wire_flags("fp8") == wire.FLAG_WIRE_FP8 == 16 and wire.wire_flags("bf16") == 0
    assert wire.RECV_ENTRY == {0: "p3_recv_reduce", 1: "p3_recv_reduce_fp8"}


def test_p3send_h_states_the_same_constants():
    text = (ROOT / "ptx" / "p3send.h").read_text()
    defines = dict(re.findall(r"^#define (P3_\w+) (\"?\w+\"?)", text, flags=re.M))
    assert defines["P3_FLAG_WIRE_FP8"] == str(wire.FLAG_WIRE_FP8)
    assert (defines["P3_WIRE_BF16"], defines["P3_WIRE_FP8"]) == (str(wire.WIRE_BF16), str(wire.WIRE_FP8))
    assert defines["P3_WIRE_FP8_BLOCK"] == str(wire.FP8_BLOCK)
    assert defines["P3_WIRE_FP8_HIDDEN_MULTIPLE"] == str(wire.FP8_HIDDEN_MULTIPLE)
    assert (defines["P3_RECV_ENTRY_BF16"], defines["P3_RECV_ENTRY_FP8"]) == tuple(
        f'"{wire.RECV_ENTRY[c]}"' for c in (wire.WIRE_BF16, wire.WIRE_FP8))
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the macros are not evaluated")
    hiddens = [512, 1024, 4096, 7168, 16384]
    src = ('#include <stdio.h>\n#include "p3send.h"\nint main(void){\n' + "".join(
        f'printf("%d %d %d\\n", (int)P3_WIRE_FP8_MSG_BYTES({h}), (int)P3_WIRE_BF16_MSG_BYTES({h}), '
        f'(int)P3_WIRE_FP8_HIDDEN(P3_WIRE_FP8_MSG_BYTES({h})));\n' for h in hiddens) + "return 0;}\n")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "m.c").write_text(src)
        subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(ROOT / "ptx"), "m.c", "-o", "m"], cwd=d,
                       check=True)
        out = subprocess.run([str(Path(d) / "m")], capture_output=True, text=True, check=True).stdout.split("\n")
    for h, line in zip(hiddens, out):
        assert line.split() == [str(wire.wire_msg_bytes(h, "fp8")), str(wire.wire_msg_bytes(h, "bf16")), str(h)]


# ---------------------------------------------------------------- validate

def cfg_of(msg_bytes: int, **kw):
    return rank_config(n_ranks=2, recv_bufs=[BASE, BASE + 0x100000], top_k=8, msg_bytes=msg_bytes, max_tokens=64,
                       range_table=BASE + 0x200000, src_info=BASE + 0x300000, **kw)


def test_validate_takes_the_format_and_hidden():
    assert validate(cfg_of(7392), wire="fp8", hidden=7168) == []
    assert validate(cfg_of(14336), wire="bf16", hidden=7168) == []
    assert validate(cfg_of(7392)) == []                       # bf16 without hidden: msg_bytes' own rule only
    with pytest.raises(ConfigError, match=r"msg_bytes: expected 7392 for 7168 columns on the fp8 wire, got 14336"):
        validate(cfg_of(14336), wire="fp8", hidden=7168)
    got = validate(cfg_of(7392), wire="bf16", hidden=7168, raise_on_error=False)
    assert got == ["msg_bytes: expected 14336 for 7168 columns on the bf16 wire, got 7392"]


@pytest.mark.parametrize("kw, exc, name", [
    ({"wire": "fp8"}, ConfigError, "hidden: expected the row's columns with wire='fp8'"),
    ({"wire": "e5m2", "hidden": 7168}, ConfigError, "wire: expected 'bf16' or 'fp8'"),
    ({"wire": "fp8", "hidden": 7168.0}, ConfigTypeError, "hidden: expected an integer"),
    ({"wire": "fp8", "hidden": True}, ConfigTypeError, "hidden: expected an integer"),
])
def test_validate_refuses_bad_format_arguments_even_without_raise_on_error(kw, exc, name):
    with pytest.raises(exc, match=re.escape(name)):
        validate(cfg_of(7392), raise_on_error=False, **kw)


def test_validate_names_a_hidden_the_fp8_wire_cannot_carry():
    got = validate(cfg_of(7392), wire="fp8", hidden=7000, raise_on_error=False)
    assert got == ["hidden: expected a positive multiple of 512 for the fp8 wire, got 7000"]


def test_a_disabled_send_is_not_checked_against_the_format():
    off = rank_config(n_ranks=0, top_k=1, msg_bytes=0, max_tokens=0, p2p_world_size=1)
    assert validate(off, wire="fp8", hidden=7168) == []
    assert validate(cfg_of(14336), wire="fp8", hidden=7168, p3_control=-1) == []


# ---------------------------------------------------------------- the launchers refuse before launching

@pytest.fixture
def fake(gpu, monkeypatch):   # noqa: F811  (the imported fixture, as a parameter)
    monkeypatch.setattr(recv_mod, "kernel", lambda entry, dev=None: stand_in_kernel(entry))
    return gpu


def launches(g) -> list:
    return [e for e in g.log if e[0] == "launch"]


def recv_args(msg: int, tokens: int = 16, top_k: int = 8, n_local: int = 4, n_ranks: int = 2, out_cols=None):
    cfg = rank_config(n_ranks=n_ranks, top_k=top_k, msg_bytes=msg, max_tokens=tokens)
    bufs = [FakeBuffer(tokens * top_k * msg), FakeBuffer(8 * n_local * n_ranks), FakeBuffer(4 * tokens * top_k),
            FakeBuffer(4 * tokens * top_k), FakeBuffer(2 * tokens * (out_cols or 1))]
    return cfg, bufs


def test_the_fp8_receiver_is_its_own_entry(fake):
    assert recv_mod.RecvReduce(device=DEV, wire="fp8").k.name == "p3_recv_reduce_fp8"
    assert recv_mod.RecvReduce(device=DEV).k.name == "p3_recv_reduce"
    with pytest.raises(ConfigError, match=r"wire: expected 'bf16' or 'fp8', got 'fp4'"):
        recv_mod.RecvReduce(device=DEV, wire="fp4")


def test_the_fp8_receive_prepares_its_row_shape(fake):
    rv = recv_mod.RecvReduce(device=DEV, wire="fp8")
    cfg, (recv, counts, topk, w, out) = recv_args(7392, out_cols=7168)
    blk = rv.prepare(cfg, recv, counts, topk, w, out, n_tokens=16, n_experts=4, timeout_ns=1, hidden=7168,
                     wire="fp8")
    assert blk.get("out_ptr").value == out.ptr and blk.get("n_tokens").value == 16
    assert rv.grid == 16 * 28 // 8           # one warp per (token, 256 output columns), 8 warps a CTA
    assert not launches(fake)


@pytest.mark.parametrize("what, kw, msg, want", [
    ("no hidden", {}, 7392, "hidden: expected the row's columns on the fp8 wire"),
    ("a bf16 slot size", {"hidden": 7168}, 14336, "msg_bytes: expected 7392 for 7168 columns on the fp8 wire"),
    ("hidden not a multiple of 512", {"hidden": 7000}, 7392, "hidden: expected a positive multiple of 512"),
    ("another format", {"hidden": 7168, "wire": "bf16"}, 7392, "wire: this launcher reduces the fp8 wire"),
    ("an output of msg_bytes/2 columns", {"hidden": 7168, "out_cols": 3696}, 7392, "out: expected at least"),
])
def test_the_fp8_receive_refuses_before_anything_is_launched(fake, what, kw, msg, want):
    rv = recv_mod.RecvReduce(device=DEV, wire="fp8")
    cfg, (recv, counts, topk, w, out) = recv_args(msg, out_cols=kw.pop("out_cols", 7168))
    with pytest.raises(ConfigError, match=re.escape(want)):
        rv.prepare(cfg, recv, counts, topk, w, out, n_tokens=16, n_experts=4, timeout_ns=1, **kw)
    assert not launches(fake), what


def test_the_bf16_receive_checks_hidden_when_given(fake):
    rv = recv_mod.RecvReduce(device=DEV)
    cfg, (recv, counts, topk, w, out) = recv_args(7392, out_cols=3696)
    rv.prepare(cfg, recv, counts, topk, w, out, n_tokens=16, n_experts=4, timeout_ns=1)          # msg/2 columns
    with pytest.raises(ConfigError, match=r"msg_bytes: expected 14336 for 7168 columns on the bf16 wire"):
        rv.prepare(cfg, recv, counts, topk, w, out, n_tokens=16, n_experts=4, timeout_ns=1, hidden=7168)


@pytest.mark.parametrize("kw, want", [
    ({"wire": "fp8", "hidden": 7000}, "hidden: expected a positive multiple of 512 for the fp8 wire, got 7000"),
    ({"wire": "fp16", "hidden": 7168}, "wire: expected 'bf16' or 'fp8', got 'fp16'"),
])
def test_combine_and_rank_refuse_a_format_before_allocating(fake, kw, want):
    shape = dict(max_tokens=8, top_k=2, n_local_experts=2, **kw)
    with pytest.raises(ConfigError, match=re.escape(want)):
        combine_mod.Combine(2, device=DEV, **shape)
    from p3send.ops.rank import Rank
    with pytest.raises(ConfigError, match=re.escape(want)):
        Rank(0, 1, SimpleNamespace(rank=0, n_ranks=1), **shape)
    assert not fake.mem, "something was allocated before the refusal"


def test_combine_on_the_fp8_wire_sizes_slots_rows_and_entries(fake):
    comb = combine_mod.Combine(2, device=DEV, max_tokens=8, top_k=2, hidden=512, n_local_experts=2, wire="fp8",
                               stamps=False)
    assert comb.msg == 528 and comb.recv_bytes == 8 * 2 * 528
    assert comb.cfgs[0].msg_bytes == 528
    assert {rv.k.name for rv in comb.receivers} == {"p3_recv_reduce_fp8"}
    assert comb.c[0].nbytes == comb.max_rows * 1024 and comb.out[0].nbytes == 8 * 1024   # C and out stay bf16
    assert comb.send_wire == {"wire": "fp8", "hidden": 512}
    assert not launches(fake)


def test_the_combine_asks_its_senders_for_the_format_by_keyword():
    assert combine_mod.send_wire_options(wire.WIRE_BF16, 512) == {}
    assert combine_mod.send_wire_options(wire.WIRE_FP8, 512) == {"wire": "fp8", "hidden": 512}


def test_the_scatter_send_checks_an_explicit_hidden_on_either_wire(fake):
    from p3send.ops.send import ScatterSend
    s = ScatterSend(2, device=DEV)
    cfg = rank_config(n_ranks=2, top_k=8, msg_bytes=1024, max_tokens=16)
    c, offs = FakeBuffer(1 << 16), FakeBuffer(12)
    s.prepare(cfg, c, offs, p3_control=-1, expert_offsets_host=np.array([0, 1, 2]), hidden=512)
    with pytest.raises(ConfigError, match=r"msg_bytes: expected 14336 for 7168 columns on the bf16 wire, got 1024"):
        s.prepare(cfg, c, offs, p3_control=-1, expert_offsets_host=np.array([0, 1, 2]), hidden=7168)
    assert not launches(fake)


@pytest.mark.parametrize("hidden", [np.int64(7168), np.int32(7168), np.uint16(7168)])
def test_numpy_integers_are_columns(hidden):
    assert wire.wire_msg_bytes(hidden, "fp8") == 7392 and wire.wire_problems(7392, hidden, "fp8") == []


def test_the_fp8_receive_takes_a_numpy_hidden(fake):
    rv = recv_mod.RecvReduce(device=DEV, wire="fp8")
    cfg, (recv, counts, topk, w, out) = recv_args(7392, out_cols=7168)
    rv.prepare(cfg, recv, counts, topk, w, out, n_tokens=16, n_experts=4, timeout_ns=1, hidden=np.int64(7168))
    assert rv.grid == 16 * 28 // 8 and not launches(fake)


# ---------------------------------------------------------------- the reduce reference

def exact_f32(v: Fraction) -> np.float32:
    """The float32 nearest to ``v`` (ties to even), by exact arithmetic."""
    f = np.float32(float(v))          # within an ulp; then choose among the neighbours exactly
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    dist = [abs(Fraction(float(c)) - v) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def test_fma_f32_rounds_once():
    rng = np.random.default_rng(7)
    n = 4000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    # ties and near-ties of the double rounding: c cancels most of a*b, or sits half an ulp off
    c[:500] = (-(a[:500].astype(np.float64) * b[:500])).astype(np.float32)
    a[500:1000], b[500:1000] = np.float32(1 + 2.0 ** -12), np.float32(1 + 2.0 ** -12)
    c[500:1000] = np.float32(2.0 ** -48) * rng.choice([-1, 1, 3], 500).astype(np.float32)
    got = ref.fma_f32(a, b, c)
    for i in range(n):
        want = exact_f32(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        assert got[i].view(np.uint32) == want.view(np.uint32), (i, a[i], b[i], c[i], got[i], want)
    assert ref.fma_f32(np.float32(0), np.float32(0), np.float32(-0.0)).view(np.uint32) == 0   # -0 + 0*0 = +0
    assert np.isnan(ref.fma_f32(np.float32(np.inf), np.float32(0), np.float32(1)))


def test_reduce_bits_follows_the_k_order_and_pads_to_four():
    # 1 + 2^-24 + 2^-24 in k order rounds twice to 1, in the other order... the same; use a
    # case where the order changes the bits: big, -big, small.
    vals = np.array([[[1.0], [2.0 ** 24], [-(2.0 ** 24)]]], np.float32)        # (1 token, 3 slots, 1 col)
    w = np.ones((1, 3), np.float32)
    topk = np.array([[0, 1, 2]], np.int32)
    out = ref.reduce_bits(np.repeat(vals, 8, axis=2), topk, w, 4, 1)
    assert (ref.bf16_to_f32(out) == 0).all()             # (1 + 2^24) rounds to 2^24 in fp32, minus 2^24: 0
    rev = ref.reduce_bits(np.repeat(vals[:, ::-1], 8, axis=2), topk, w, 4, 1)
    assert (ref.bf16_to_f32(rev) == 1).all()             # the other order keeps the 1
    # masked slots contribute nothing, whatever they hold; a -0 sum is +0 after the padding terms
    vals = np.array([[[-0.0], [np.nan], [np.nan]]], np.float32).repeat(8, axis=2)
    masked = np.array([[0, -1, 99]], np.int32)
    out = ref.reduce_bits(vals, masked, np.ones((1, 3), np.float32), 4, 1)
    assert (out == 0).all()


def test_reduce_bits_of_bf16_slots_is_within_the_bound_of_the_exact_sum():
    rng = np.random.default_rng(11)
    t, k, h, L, R = 32, 8, 256, 4, 4
    x = ref.f32_to_bf16(rng.standard_normal((t * k, h)).astype(np.float32) * 3)
    topk = np.stack([rng.choice(L * R, k, replace=False) for _ in range(t)]).astype(np.int32)
    topk[rng.random((t, k)) < 0.1] = -1
    w = rng.random((t, k), dtype=np.float32)
    recv = x.view(np.uint8).reshape(-1)
    bits = ref.reduce_bits(ref.bf16_slot_values(recv, t, k, h), topk, w, L, R)
    exact, absmax = ref.reduce(recv, topk, w, L, R, 2 * h, with_bound=True)
    assert ref.bf16_close(bits, exact, k, absmax).all()


def test_the_fp8_reduce_reference_is_the_decode_then_the_same_chain():
    rng = np.random.default_rng(12)
    t, k, h = 6, 4, 512
    x = ref.f32_to_bf16(rng.standard_normal((t * k, h)).astype(np.float32))
    slots = wire_ref.encode(x)
    dec = wire_ref.decode(slots, h)
    # decode = e4m3 value times the block scale, in float32 (one rounding)
    from p3send.oracle import fp8
    codes, scales = slots[:, :h], np.ascontiguousarray(slots[:, h:]).view("<f4")
    assert (dec == (fp8.e4m3_to_f32(codes) * np.repeat(scales, 128, axis=1)).astype(np.float32)).all()
    topk = np.tile(np.arange(k, dtype=np.int32), (t, 1))
    w = rng.random((t, k), dtype=np.float32)
    bits = ref.reduce_bits(dec.reshape(t, k, h), topk, w, k, 1)
    acc = np.zeros((t, h), np.float32)
    for j in range(k):
        acc = ref.fma_f32(w[:, j, None], dec.reshape(t, k, h)[:, j], acc)
    assert (bits == ref.f32_to_bf16(acc)).all()
    # within the format's error of the bf16 rows' own reduce
    b16 = ref.bf16_to_f32(ref.reduce_bits(ref.bf16_to_f32(x).reshape(t, k, h), topk, w, k, 1)).astype(np.float64)
    mag = np.einsum("tk,tkh->th", w.astype(np.float64), np.abs(ref.bf16_to_f32(x).reshape(t, k, h)))
    assert (np.abs(ref.bf16_to_f32(bits) - b16) <= (2.0 ** -4 + 2.0 ** -7) * mag + 1e-6).all()


# ---------------------------------------------------------------- the bench's FP8 round check

def oracle_fp8_round(world, guard: int = 64):
    """What a correct FP8-wire round leaves: per rank the receive buffer (guards included)
    and the output, from the oracles alone; as an object with Combine's read-back methods."""
    from p3send.abi.layout import SENTINEL
    from p3send.oracle.cases import world_recv_expected
    h, k, t_max = world.hidden, world.top_k, max(d.topk_idx.shape[0] for d in world.ranks)
    mb = wire.wire_msg_bytes(h, "fp8")
    recvs, outs = [], []
    for r, d in enumerate(world.ranks):
        b16 = world_recv_expected(world, r, np.full(t_max * k * 2 * h, SENTINEL, np.uint8)).reshape(-1, 2 * h)
        filled = np.zeros(t_max * k, bool)
        t = d.topk_idx.shape[0]
        filled[: t * k] = (ref.slot_pairs(d.topk_idx, world.n_local, world.n_ranks) >= 0).reshape(-1)
        slots = np.full((t_max * k, mb), SENTINEL, np.uint8)
        slots[filled] = wire_ref.encode(np.ascontiguousarray(b16[filled]).view(np.uint16))
        recvs.append(np.concatenate([np.full(guard, SENTINEL, np.uint8), slots.reshape(-1),
                                     np.full(guard, SENTINEL, np.uint8)]))
        vals = wire_ref.decode(slots[: t * k], h).reshape(t, k, h)
        outs.append(ref.reduce_bits(vals, d.topk_idx, d.weights, world.n_local, world.n_ranks))
    return SimpleNamespace(max_tokens=t_max, guard=guard, recv_bytes=t_max * k * mb,
                           recv_view=lambda r, with_guard=True: recvs[r], output=lambda r: outs[r],
                           recvs=recvs, outs=outs)


def test_the_bench_check_of_an_fp8_round_accepts_the_oracle_and_names_a_wrong_byte():
    from p3send.bench.wire import fp8_round_problems
    from p3send.oracle.cases import world_case
    world = world_case(n_ranks=4, tokens=12, top_k=4, n_local=2, hidden=512, seed=5, masked=0.1)
    comb = oracle_fp8_round(world)
    assert fp8_round_problems(world, comb) == []
    comb.recvs[2][comb.guard + 528 * 3 + 520] ^= 1                  # a scale byte of slot 3 of rank 2
    comb.outs[1][0, 0] ^= 1
    got = fp8_round_problems(world, comb)
    assert len(got) == 2 and got[0].startswith("rank 1: FP8 reduce differs")
    assert got[1].startswith("rank 2: FP8 receive buffer differs from the wire oracle in 1 bytes, first at slot 3 "
                             "byte 520")
    comb.recvs[0][0] = 0                                             # a guard byte
    assert fp8_round_problems(world, comb)[0] == "rank 0: FP8 receive buffer differs from the wire oracle in 0 " \
                                                  "bytes, in a guard"


def test_the_wire_section_renders_what_it_measured():
    from p3send.bench.wire import table
    t = {"median_us": 100.0}
    out = {"wire": {"decode": {"checks": {"fp8": "exact"}, "bytes": {"round, fp8": 2e8}, "times": {"round, fp8": t},
                               "ratios": {"decode round fp8 / bf16": 0.7}},
                    "send": {"skipped": "no sender"}, "gemm": {"skipped": "no wire="}}}
    text = table(out)
    assert "round, fp8" in text and "200.0 MB" in text and "target <= 0.75" in text and "skipped (no sender)" in text
    assert table({}) == ""


def test_the_decode_rounds_byte_floor_is_the_bf16_rounds_line_at_the_fp8_bytes():
    """FLOOR: the fp8 round's bytes on the line through the two bf16 rounds (bytes, time): a
    round on that line is at its floor (ratio = its own over bf16), one above it is not; the
    shares are as their formulas say."""
    from p3send.bench.wire import FLOOR, round_ratios
    names = ["bf16", "fp8", "short"]
    nbytes = {"round, bf16": 300e6, "round, fp8": 200e6, "round, short": 150e6}

    def line(b):                                                  # 20 us fixed, 3 MB per us
        return 20.0 + b / 3e6
    med = {"round, bf16": line(300e6), "round, short": line(150e6), "round, fp8": line(200e6),
           "sends, bf16": 60.0, "sends, short": 30.0, "sends, fp8": 50.0}
    r = round_ratios(med, nbytes, names)
    assert r[FLOOR] == pytest.approx(line(200e6) / line(300e6)) == pytest.approx(r["decode round fp8 / bf16"])
    med["round, fp8"] = 100.0                                     # slower than its bytes: above the floor
    r = round_ratios(med, nbytes, names)
    assert r[FLOOR] == pytest.approx(line(200e6) / 120.0)
    assert r[FLOOR] < r["decode round fp8 / bf16"] == pytest.approx(100 / 120)
    assert r["bytes fp8 / bf16"] == pytest.approx(2 / 3)
    assert r["quantise + dequantise share of the fp8 round"] == pytest.approx((100 - line(150e6)) / 100)
    assert r["quantise share (sends fp8 - sends at the fp8 row's length) / fp8 round"] == pytest.approx(0.2)
    assert r["receive fp8 / receive bf16 (round minus sends)"] == pytest.approx(50 / 60)
    assert r["dequantise share (receive fp8 - receive at the fp8 row's length) / fp8 round"] == \
        pytest.approx((50 - (line(150e6) - 30)) / 100)
