"""The receive on the FP8 wire (``p3_recv_reduce_fp8``) alone, independent of any sender:
the slots are written by numpy (``oracle.wire.encode`` of random bf16 rows) into a
0xAB-filled receive buffer with guards, the counts set as the protocol says (each pair's
row count, 0 included; a missing pair left all-ones), and the output compared BIT FOR BIT
with ``reference.reduce_bits`` (decode, the kernel's fp32 FMA chain in k order, one bf16
rounding). The bf16 entry runs through the same harness against the same reference.

Edge families: all-zero and -0 rows, a block of bf16's largest value, bf16 subnormals,
blocks holding NaN or +-Inf (what the wire makes of them is ``oracle.fp8``'s docstring:
a NaN block's scale is NaN, an Inf block's +Inf with NaN codes for the infinities and
zeros elsewhere, so every decoded value of such a block is NaN, 0 * Inf included, and the
token's output columns of that block are NaN whatever the weight, 0 included), masked
slots of both kinds holding 0xFF bytes (NaN if ever read), a missing pair (the wait times
out, its tokens are not written, the pairs are named, the next launch is exact).

Then the error the FP8 wire adds to the reduced output, at DeepSeek-V3's shape (hidden
7168, top-8 of 256 experts over 8 ranks), against the bf16 wire's output of the same rows,
under the bound ``fp8_wire_bound`` derives.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from p3send.abi.config import rank_config
from p3send.abi.errors import ArrivalTimeout
from p3send.abi.layout import NOT_ARRIVED
from p3send.abi.wire import WIRE_FP8, wire_format, wire_msg_bytes
from p3send.cuda import driver
from p3send.ops.combine import arrival_status
from p3send.ops.recv import RecvReduce
from p3send.oracle import reference as ref
from p3send.oracle import wire as wire_ref
from tests.gpu.conftest import fresh_seed

GUARD = 4096
SENTINEL = 0xAB
MASKED_FILL = 0xFF                      # e4m3 NaN codes and a NaN scale: shows any read of a masked slot
BF16_MAX, BF16_INF, BF16_NAN = 0x7F7F, 0x7F80, 0x7FC0


def bf16_rows(rng, n: int, hidden: int, spread: float = 6.0) -> np.ndarray:
    """bf16 bits (n, hidden): normal values, each row scaled by 2^U(-spread, spread)."""
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    x *= np.exp2(rng.uniform(-spread, spread, (n, 1))).astype(np.float32)
    return ref.f32_to_bf16(x)


def make_problem(seed: int, *, n_ranks: int, n_local: int, tokens: int, top_k: int, hidden: int,
                 max_tokens: int | None = None, masked: float = 0.1) -> dict:
    rng = np.random.default_rng(seed)
    n_exp = n_ranks * n_local
    topk = np.stack([rng.choice(n_exp, top_k, replace=False) for _ in range(tokens)]).astype(np.int32) \
        if tokens else np.zeros((0, top_k), np.int32)
    mask = rng.random((tokens, top_k)) < masked
    kinds = rng.random(int(mask.sum())) < 0.5              # both kinds of masked slot: -1, an id past the last
    topk[mask] = np.where(kinds, -1, n_exp + rng.integers(0, 7, int(mask.sum())))
    w = rng.random((tokens, top_k), dtype=np.float32)
    w[rng.random((tokens, top_k)) < 0.1] *= -1                 # signed weights: cancellation too
    x = bf16_rows(rng, tokens * top_k, hidden).reshape(tokens, top_k, hidden)
    return {"seed": seed, "rng": rng, "n_ranks": n_ranks, "n_local": n_local, "tokens": tokens, "top_k": top_k,
            "hidden": hidden, "max_tokens": max_tokens or max(tokens, 1) + 3, "topk": topk, "w": w, "x": x}


def slots_of(prob: dict, wire) -> np.ndarray:
    """The slot bytes (tokens*top_k, msg_bytes) numpy writes: the wire format of each row,
    masked slots filled with MASKED_FILL."""
    t, k, h = prob["tokens"], prob["top_k"], prob["hidden"]
    rows = prob["x"].reshape(t * k, h)
    if wire_format(wire) == WIRE_FP8:
        s = wire_ref.encode(rows) if len(rows) else np.zeros((0, wire_msg_bytes(h, WIRE_FP8)), np.uint8)
    else:
        s = np.ascontiguousarray(rows).view(np.uint8).reshape(t * k, 2 * h).copy()
    masked = (ref.slot_pairs(prob["topk"], prob["n_local"], prob["n_ranks"]) < 0).reshape(-1)
    s[masked] = MASKED_FILL
    return s


def expected(prob: dict, slots: np.ndarray, wire) -> np.ndarray:
    t, k, h = prob["tokens"], prob["top_k"], prob["hidden"]
    if wire_format(wire) == WIRE_FP8:
        values = wire_ref.decode(slots, h).reshape(t, k, h) if len(slots) else np.zeros((t, k, h), np.float32)
    else:
        values = ref.bf16_slot_values(slots.reshape(-1), t, k, h)
    return ref.reduce_bits(values, prob["topk"], prob["w"], prob["n_local"], prob["n_ranks"])


def run_reduce(dev, prob: dict, wire, *, missing=(), unreduced=False, timeout_ms: float = 2000.0,
               receiver: RecvReduce | None = None, slots: np.ndarray | None = None) -> dict:
    """One launch over numpy-written slots; everything read back (guards included)."""
    t, k, h, R, L = prob["tokens"], prob["top_k"], prob["hidden"], prob["n_ranks"], prob["n_local"]
    msg = wire_msg_bytes(h, wire)
    slots = slots_of(prob, wire) if slots is None else slots
    recv_host = np.full(2 * GUARD + prob["max_tokens"] * k * msg, SENTINEL, np.uint8)
    recv_host[GUARD:GUARD + slots.size] = slots.reshape(-1)
    pairs = ref.slot_pairs(prob["topk"], L, R)
    counts_host = np.bincount(pairs[pairs >= 0], minlength=L * R).astype(np.uint64)   # 0 for an empty pair
    for m in missing:
        counts_host[m] = NOT_ARRIVED
    cfg = rank_config(n_ranks=R, top_k=k, msg_bytes=msg, max_tokens=prob["max_tokens"])
    bufs = []

    def buf(n, fill=None):
        bufs.append(driver.DeviceBuffer(n, fill=fill))
        return bufs[-1]
    recv = buf(recv_host.size)
    recv.upload(recv_host)
    counts = buf(8 * L * R)
    counts.upload(counts_host)
    topk_b = buf(max(4 * t * k, 4))
    w_b = buf(max(4 * t * k, 4))
    if t:
        topk_b.upload(prob["topk"])
        w_b.upload(prob["w"])
    out = buf(2 * GUARD + 2 * t * h, SENTINEL)
    rv = receiver or RecvReduce(device=dev, wire=wire)
    s = driver.Stream()
    try:
        rv.prepare(cfg, recv.ptr + GUARD, counts, topk_b.ptr, w_b.ptr, None if unreduced else out.ptr + GUARD,
                   n_tokens=t, n_experts=L, timeout_ns=int(timeout_ms * 1e6), hidden=h, wire=wire)
        t0 = time.monotonic()
        rv.launch(s)
        s.synchronize()
        elapsed = time.monotonic() - t0
        rec = rv.record()
        missing_named, _ = arrival_status(0, rv, counts, R)
        raw_out = out.download()
        return {"rec": rec, "elapsed": elapsed, "slots": slots, "missing": missing_named,
                "recv": recv.download(), "recv_host": recv_host, "counts": counts.download(np.uint64),
                "counts_host": counts_host, "out_guard": np.concatenate([raw_out[:GUARD], raw_out[GUARD + 2 * t * h:]]),
                "out": raw_out[GUARD:GUARD + 2 * t * h].view(np.uint16).reshape(t, h), "receiver": rv}
    finally:
        s.close()
        for b in bufs:
            b.free()
        if receiver is None:
            rv.close()


def assert_bits(got: np.ndarray, want: np.ndarray, what: str, rows=None) -> dict:
    """Bit-exact where the reference is a number; NaN where it is NaN (the bits of a NaN are the
    hardware's). Returns counts of NaN / Inf outputs for the log."""
    if rows is not None:
        got, want = got[rows], want[rows]
    wf, gf = ref.bf16_to_f32(want), ref.bf16_to_f32(got)
    nan = np.isnan(wf)
    assert np.isnan(gf[nan]).all(), f"{what}: {int((~np.isnan(gf[nan])).sum())} outputs not NaN where the reference is"
    bad = np.nonzero((got != want) & ~nan)
    assert not len(bad[0]), (f"{what}: {len(bad[0])} outputs differ from the reference, first at token "
                             f"{bad[0][0]} column {bad[1][0]}: got {got[bad][0]:#06x}, want {want[bad][0]:#06x}")
    return {"nan": int(nan.sum()), "inf": int(np.isinf(wf).sum()),
            "nan_bits": sorted({int(b) for b in got[nan][:64]})}


def check_clean(r: dict, what: str) -> None:
    assert not r["rec"]["rejected"] and r["rec"]["timeouts"] == 0, f"{what}: record {r['rec']}"
    assert (r["recv"] == r["recv_host"]).all(), f"{what}: the receive buffer (or its guards) was written"
    assert (r["counts"] == NOT_ARRIVED).all(), f"{what}: counts not re-armed: {r['counts'][:8]}"
    assert (r["out_guard"] == SENTINEL).all(), f"{what}: a guard of the output was written"
    assert r["elapsed"] < 10.0, f"{what}: took {r['elapsed']:.1f} s"


SHAPES = {
    "ep8-k8": dict(n_ranks=8, n_local=4, tokens=64, top_k=8, hidden=512),
    "k5-uneven": dict(n_ranks=2, n_local=3, tokens=37, top_k=5, hidden=1024),
    "one-token-k1": dict(n_ranks=1, n_local=1, tokens=1, top_k=1, hidden=512),
    "k32": dict(n_ranks=8, n_local=8, tokens=9, top_k=32, hidden=1536),
    "dsv3-row": dict(n_ranks=8, n_local=32, tokens=24, top_k=8, hidden=7168),
    "no-tokens": dict(n_ranks=4, n_local=2, tokens=0, top_k=4, hidden=512),
}


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_reduce_is_bit_exact_against_the_reference(dev, name, wire):
    prob = make_problem(fresh_seed(f"{name}/{wire}"), **SHAPES[name])
    r = run_reduce(dev, prob, wire)
    check_clean(r, f"{name}/{wire}")
    info = assert_bits(r["out"], expected(prob, r["slots"], wire), f"{name}/{wire}")
    assert info["nan"] == 0, f"{name}/{wire}: finite rows reduced to {info['nan']} NaN"
    # replay-safe: the counts were re-armed by the kernel; set them again and launch again
    r2 = run_reduce(dev, prob, wire, slots=r["slots"])
    check_clean(r2, f"{name}/{wire} again")
    assert (r2["out"] == r["out"]).all()


def edge_problem(seed: int) -> tuple[dict, dict]:
    prob = make_problem(seed, n_ranks=4, n_local=4, tokens=40, top_k=6, hidden=1024, masked=0.15)
    x, rng = prob["x"], prob["rng"]
    t = 0
    fams = {}

    def put(name, fill):
        nonlocal t
        fams[name] = t
        for kk in range(prob["top_k"]):
            fill(x[t, kk], kk)
        t += 1
    put("zero rows", lambda row, kk: row.fill(0))
    put("-0 rows", lambda row, kk: row.fill(0x8000))
    put("a block of bf16 max", lambda row, kk: row.__setitem__(slice(128, 256), BF16_MAX))
    put("one huge value per row", lambda row, kk: row.__setitem__(kk * 7, BF16_MAX | (0x8000 * (kk % 2))))
    put("bf16 subnormals", lambda row, kk: row.__setitem__(slice(None), rng.integers(1, 0x80, row.size) |
                                                          (rng.integers(0, 2, row.size) << 15)))
    put("tiny normals (e4m3 subnormal codes)",
        lambda row, kk: row.__setitem__(slice(None), ref.f32_to_bf16(
            (rng.standard_normal(row.size) * 1e-8).astype(np.float32))))
    put("NaN in block 2", lambda row, kk: row.__setitem__(256 + kk, BF16_NAN))
    put("+Inf in block 3", lambda row, kk: row.__setitem__(384 + kk, BF16_INF))
    put("-Inf in block 5", lambda row, kk: row.__setitem__(640 + kk, BF16_INF | 0x8000))
    put("NaN with weight 0", lambda row, kk: row.__setitem__(kk, BF16_NAN))
    prob["w"][fams["NaN with weight 0"]] = 0.0
    for name in ("zero rows", "-0 rows", "NaN in block 2", "+Inf in block 3", "-Inf in block 5", "NaN with weight 0"):
        prob["topk"][fams[name]] = np.arange(prob["top_k"]) * 2   # unmasked: the family is read
    return prob, fams


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_edge_families(dev, wire):
    prob, fams = edge_problem(fresh_seed(f"edges/{wire}"))
    r = run_reduce(dev, prob, wire)
    check_clean(r, f"edges/{wire}")
    want = expected(prob, r["slots"], wire)
    info = assert_bits(r["out"], want, f"edges/{wire}")
    f = ref.bf16_to_f32(r["out"])
    for name, t in fams.items():
        row = f[t]
        print(f"[edges/{wire}] {name}: NaN {int(np.isnan(row).sum())}, Inf {int(np.isinf(row).sum())}, "
              f"zeros {int((row == 0).sum())}, max |finite| {np.nanmax(np.abs(np.where(np.isinf(row), 0, row))):.3g}")
    print(f"[edges/{wire}] NaN outputs {info['nan']} (bits seen {[hex(b) for b in info['nan_bits']]}), "
          f"Inf outputs {info['inf']}")
    assert (r["out"][fams["zero rows"]] == 0).all() and (r["out"][fams["-0 rows"]] == 0).all(), \
        "zero rows must reduce to +0 (the fp32 chain starts at +0)"
    if wire == "fp8":
        # the wire's rule for NaN/Inf blocks: the whole 128-column block decodes to NaN
        assert np.isnan(f[fams["NaN in block 2"], 256:384]).all()
        assert np.isnan(f[fams["+Inf in block 3"], 384:512]).all()
        assert np.isnan(f[fams["-Inf in block 5"], 640:768]).all()
        assert np.isnan(f[fams["NaN with weight 0"], 0:128]).all()       # NaN * 0 is NaN
        clean = np.ones(f.shape[1], bool)
        clean[384:512] = False
        assert not np.isnan(f[fams["+Inf in block 3"], clean]).any(), "an Inf block spread past its block"


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_unreduced_mode_writes_nothing_and_rearms(dev, wire):
    prob = make_problem(fresh_seed(f"unreduced/{wire}"), n_ranks=4, n_local=2, tokens=20, top_k=4, hidden=512)
    r = run_reduce(dev, prob, wire, unreduced=True)
    check_clean(r, f"unreduced/{wire}")
    assert (r["out"] == (SENTINEL << 8 | SENTINEL)).all(), "unreduced mode wrote the output"


@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_a_missing_pair_times_out_is_named_and_the_next_launch_is_exact(dev, wire):
    prob = make_problem(fresh_seed(f"timeout/{wire}"), n_ranks=4, n_local=3, tokens=48, top_k=4, hidden=1024,
                        masked=0.0)
    R, L = prob["n_ranks"], prob["n_local"]
    pairs = ref.slot_pairs(prob["topk"], L, R)
    gone = sorted({int(pairs[0, 0]), int(pairs[5, 2])})
    rv = RecvReduce(device=dev, wire=wire)
    try:
        r = run_reduce(dev, prob, wire, missing=gone, timeout_ms=50, receiver=rv)
        want_named = sorted((0, s // R, s % R) for s in gone)
        assert sorted(r["missing"]) == want_named, f"named {r['missing']}, never arrived {want_named}"
        assert r["rec"]["timeouts"] > 0 and r["rec"]["first_missing_slot"] in gone, r["rec"]
        print(f"[timeout/{wire}] {ArrivalTimeout(r['missing'], r['rec'], 50_000_000)} ({r['elapsed'] * 1e3:.0f} ms)")
        assert r["elapsed"] < 5.0
        waiting = np.isin(pairs, gone).any(axis=1)
        assert (r["out"][waiting] == (SENTINEL << 8 | SENTINEL)).all(), "a token with a missing slot was written"
        assert_bits(r["out"], expected(prob, r["slots"], wire), f"timeout/{wire} (arrived tokens)", rows=~waiting)
        c = r["counts"]
        assert (c[gone] == NOT_ARRIVED).all() and (np.delete(c, gone) == np.delete(r["counts_host"], gone)).all(), \
            "after a timeout the counts must stay as they were (not re-armed)"
        again = run_reduce(dev, prob, wire, receiver=rv, slots=r["slots"])  # every pair arrives now
        check_clean(again, f"timeout/{wire} then all")
        assert_bits(again["out"], expected(prob, r["slots"], wire), f"timeout/{wire} then all")
    finally:
        rv.close()


def test_the_device_rejects_an_fp8_msg_bytes_that_is_no_fp8_row(dev):
    # The host check (wire_problems) normally refuses first; past it, the kernel itself must
    # refuse a slot size that is not 33*hidden/32 with hidden % 512 == 0 (a C launcher).
    rv = RecvReduce(device=dev, wire="fp8")
    s = driver.Stream()
    bufs = [driver.DeviceBuffer(n, fill=SENTINEL) for n in (1 << 16, 64, 64, 64, 1 << 14)]
    try:
        bufs[1].fill(0xFF)
        good = rank_config(n_ranks=2, top_k=2, msg_bytes=528, max_tokens=8)
        blk = rv.prepare(good, bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], n_tokens=8, n_experts=2,
                         timeout_ns=10**6, hidden=512)
        for bad in (1056 - 16, 512, 2 * 512):
            blk.set(cfg=rank_config(n_ranks=2, top_k=2, msg_bytes=bad, max_tokens=8))
            rv.launch(s)
            s.synchronize()
            assert rv.record()["rejected"], f"msg_bytes {bad} accepted by p3_recv_reduce_fp8"
        assert (bufs[4].download() == SENTINEL).all() and (bufs[1].download(np.uint64) == NOT_ARRIVED).all()
    finally:
        s.close()
        for b in bufs:
            b.free()
        rv.close()


# ---------------------------------------------------------------- the error of the FP8 wire

def fp8_wire_bound(prob: dict, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, M) per output element: the largest |out_fp8 - out_bf16| the wire allows, and
    M = sum_k |w_k x_k| (x the bf16 rows). Derivation, per slot value x in a block of
    scale s = fl(amax * fl(1/448)) and multiplier m = fl(fl(1/amax) * 448):
    the code is e4m3_RNE(fl(x*m)); e4m3 keeps 3 mantissa bits, so in its normal range the
    rounding error is <= 2^-4 of the value, and below 2^-6 (subnormal codes) <= 2^-10 in
    absolute terms; decoding multiplies by s (s*m = 1 within 4 float32 roundings, 2^-21.9).
    So |x_hat - x| <= 2^-4 |x| + 2^-10 s + 2^-21 |x|. Summed with the weights:
    |S_fp8 - S_bf16| <= sum_k |w_k| (2^-4 |x_k| + 2^-10 s_k) to first order; each output adds its
    fp32 chain (<= top_k 2^-24 M each, both wires) and its bf16 rounding (<= 2^-8 |S| each,
    |S| <= (1 + 2^-4) M + ...). Hence
    B = (2^-4 + 2^-21 + 2^-8 (2 + 2^-4) + 3 top_k 2^-24) M + (2^-10 + 2^-17) sum_k |w_k| s_k
    (the last terms with room for the second-order products)."""
    t, k, h = prob["tokens"], prob["top_k"], prob["hidden"]
    valid = ref.slot_pairs(prob["topk"], prob["n_local"], prob["n_ranks"]) >= 0
    w = np.where(valid, prob["w"], 0).astype(np.float64)
    x = ref.bf16_to_f32(prob["x"]).astype(np.float64)
    scales = np.ascontiguousarray(slots[:, h:]).view("<f4").astype(np.float64).reshape(t, k, h // 128)
    M = np.einsum("tk,tkh->th", np.abs(w), np.abs(x))
    E = np.repeat(np.einsum("tk,tkb->tb", np.abs(w), scales), 128, axis=1)
    coef = 2.0 ** -4 + 2.0 ** -21 + 2.0 ** -8 * (2 + 2.0 ** -4) + 3 * k * 2.0 ** -24
    return coef * M + (2.0 ** -10 + 2.0 ** -17) * E, M


def test_fp8_wire_error_against_the_bf16_wire_at_deepseek_v3_shapes(dev):
    seed = fresh_seed("dsv3-error")
    prob = make_problem(seed, n_ranks=8, n_local=32, tokens=256, top_k=8, hidden=7168, masked=0.0)
    # router weights as a softmax over the 8 chosen experts, rows of one magnitude per token copy
    rng = np.random.default_rng(seed + 1)
    logits = rng.standard_normal((prob["tokens"], prob["top_k"])).astype(np.float32)
    prob["w"] = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
    prob["x"] = bf16_rows(rng, prob["tokens"] * prob["top_k"], prob["hidden"], spread=2.0).reshape(prob["x"].shape)
    r16 = run_reduce(dev, prob, "bf16")
    r8 = run_reduce(dev, prob, "fp8")
    for r, wname in ((r16, "bf16"), (r8, "fp8")):
        check_clean(r, f"dsv3/{wname}")
        assert_bits(r["out"], expected(prob, r["slots"], wname), f"dsv3/{wname}")
    o16 = ref.bf16_to_f32(r16["out"]).astype(np.float64)
    o8 = ref.bf16_to_f32(r8["out"]).astype(np.float64)
    exact = ref.reduce(np.ascontiguousarray(prob["x"]).view(np.uint8).reshape(-1), prob["topk"], prob["w"],
                       prob["n_local"], prob["n_ranks"], 2 * prob["hidden"])
    B, M = fp8_wire_bound(prob, r8["slots"])
    diff = np.abs(o8 - o16)
    rel_m = diff / M
    rel_e = diff / np.maximum(np.abs(o16), 1e-30)
    big = np.abs(o16) >= 2.0 ** -4 * M                          # elements not dominated by cancellation
    norm8 = np.linalg.norm(o8 - o16, axis=1) / np.linalg.norm(o16, axis=1)
    norm8x = np.linalg.norm(o8 - exact, axis=1) / np.linalg.norm(exact, axis=1)
    norm16x = np.linalg.norm(o16 - exact, axis=1) / np.linalg.norm(exact, axis=1)
    print(f"[dsv3-error] tokens {prob['tokens']} x top-{prob['top_k']} x hidden {prob['hidden']}, seed {seed}")
    print(f"[dsv3-error] |fp8 - bf16| / sum|w x|: largest {rel_m.max():.5f}, mean {rel_m.mean():.6f} "
          f"(bound's coefficient {B.flat[np.argmax(B)] / M.flat[np.argmax(B)]:.5f} at its largest)")
    print(f"[dsv3-error] |fp8 - bf16| / |bf16| where |bf16| >= sum|w x|/16: largest {rel_e[big].max():.5f}, "
          f"mean {rel_e[big].mean():.6f} ({big.mean() * 100:.1f}% of elements)")
    print(f"[dsv3-error] per token ||fp8 - bf16|| / ||bf16||: largest {norm8.max():.5f}, mean {norm8.mean():.5f}")
    print(f"[dsv3-error] against the exact sum, ||out - exact|| / ||exact||: fp8 wire mean {norm8x.mean():.5f} "
          f"(largest {norm8x.max():.5f}), bf16 wire mean {norm16x.mean():.6f}")
    worst = np.unravel_index(np.argmax(diff - B), diff.shape)
    assert (diff <= B).all(), (f"the FP8 wire's error exceeds its bound at token {worst[0]} column {worst[1]}: "
                               f"|diff| {diff[worst]:.4g} > {B[worst]:.4g}")
    # the bound is not vacuous: the wire's error is of the order it predicts
    assert rel_m.max() > 2.0 ** -8 and norm8.mean() < 2.0 ** -4


# ---------------------------------------------------------------- the combine paths on the FP8 wire

def test_combine_and_torch_combine_on_the_fp8_wire(dev):
    """The whole round with the FP8 wire's senders (where the sender takes wire=): every
    receive buffer byte for byte against ``oracle.wire.encode``, every output bit for bit
    against ``reduce_bits``, through Combine (also graph replays) and TorchCombine."""
    from types import SimpleNamespace

    from p3send.abi.errors import ConfigError
    from p3send.bench.wire import fp8_round_problems
    from p3send.ops.combine import Combine
    from p3send.oracle.cases import world_case
    seed = fresh_seed("combine-fp8")
    R, T, K, L, H = 4, 24, 4, 3, 1024
    world = world_case(n_ranks=R, tokens=T, top_k=K, n_local=L, hidden=H, seed=seed, masked=0.1)
    comb = Combine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, device=dev, guard=True, wire="fp8")
    try:
        comb.load(world)
        comb.round()
        assert fp8_round_problems(world, comb) == []
        g = comb.capture()
        for _ in range(3):
            g.launch(comb.origin)
        comb.origin.synchronize()
        comb.check()
        g.close()
        assert fp8_round_problems(world, comb) == []
    finally:
        comb.close()
    torch = pytest.importorskip("torch")
    from p3send.torch import TorchCombine
    with pytest.raises(ConfigError, match=r"hidden: expected a positive multiple of 512 for the fp8 wire, got 1000"):
        TorchCombine(R, max_tokens=T, top_k=K, hidden=1000, n_local_experts=L, wire="fp8")
    max_rows = max(len(d.c) for d in world.ranks)
    rows = torch.zeros((R, max_rows, H), dtype=torch.bfloat16, device="cuda")
    offs = torch.zeros((R, L + 1), dtype=torch.int32, device="cuda")
    table = torch.zeros((R, 2 * L * R), dtype=torch.int32, device="cuda")
    src = torch.full((R, max_rows, 2), -1, dtype=torch.int32, device="cuda")
    topk = torch.zeros((R, T, K), dtype=torch.int32, device="cuda")
    w = torch.zeros((R, T, K), dtype=torch.float32, device="cuda")
    for r, d in enumerate(world.ranks):
        n = d.c.shape[0]
        rows[r, :n].copy_(torch.from_numpy(d.c.view(np.int16)).view(torch.bfloat16))
        offs[r].copy_(torch.from_numpy(d.expert_offsets.astype(np.int32)))
        table[r].copy_(torch.from_numpy(d.range_table.astype(np.int32)))
        src[r, :n].copy_(torch.from_numpy(d.src_info.astype(np.int32)))
        topk[r].copy_(torch.from_numpy(d.topk_idx.astype(np.int32)))
        w[r].copy_(torch.from_numpy(d.weights.astype(np.float32)))
    with TorchCombine(R, max_tokens=T, top_k=K, hidden=H, n_local_experts=L, guard=True, wire="fp8") as tc:
        out = tc(rows, offs, table, src, topk, w)
        torch.cuda.synchronize()
        tc.check()
        o = out.detach().view(torch.int16).cpu().numpy().view(np.uint16)
        inner = tc.combine
        view = SimpleNamespace(recv_view=lambda r, with_guard=True: tc.recv_view(r, with_guard=with_guard),
                               output=lambda r: o[r],
                               guard=inner.guard, max_tokens=inner.max_tokens, recv_bytes=inner.recv_bytes)
        assert fp8_round_problems(world, view) == []
