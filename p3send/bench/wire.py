"""Section ``wire`` (10): the bf16 and FP8 wires side by side in one run, each contender
timed in turns with the others after warm-up (``Timer.interleaved``, medians):

- decode round (the ``decode`` section's shape, CUDA-graph replays): the round and its sends
  alone on each wire, and a bf16 round whose rows are as long as the FP8 row (hidden =
  msg_bytes/2 of the FP8 row: the same bytes on the wire and in the reduce's reads). The
  FP8 round minus that round is what the quantiser and the dequantiser cost (their
  compute, and the sends' reading the full bf16 row); its sends minus that round's sends
  is the quantiser's share, the rest the dequantiser's. Every round is checked first: the
  bf16 ones against the oracle (``check_world``), the FP8 one byte for byte (each slot =
  ``oracle.wire.encode`` of its bf16 row, unowned slots and guards the sentinel) and its
  reduce bit for bit (``reference.reduce_bits`` of the decoded slots).
- send (the prefill shape, ``p3_scatter_send`` and ``p3_scatter_send_fp8``): one rank's
  rows to 8 receive buffers, bf16, FP8, and bf16 of the FP8 row's bytes.
- fused GEMM + send (prefill shape of the ``gemm_fp8`` section; the BF16 and the FP8 GEMM):
  gated (C written, nothing sent) and fused on each wire, where the GEMM launchers take
  ``wire=``; with the FP8 GEMM's measurement variants of ``WIRE_GEMM_VARIANTS`` beside it
  when ``P3SEND_FP8_VARIANTS`` holds them, each first checked: its FP8-wire receive buffers
  (0xAB-filled before) equal to the shipped kernel's byte for byte.

Bytes: the decode round's and the send's reads and writes of the rows (C, slots, output;
not the routing inputs); the GEMM's: the bytes it sends (its reads of A and the weights are
the same on both wires).
"""
from __future__ import annotations

import os

import numpy as np

from ..abi.config import rank_config
from ..abi.errors import P3SendError
from ..abi.layout import SENTINEL
from ..abi.wire import WIRE_FP8, wire_msg_bytes
from ..cuda import driver
from ..ops.combine import Combine
from ..ops.send import ScatterSend
from ..oracle import reference as ref
from ..oracle import wire as wire_ref
from ..oracle.cases import check_world, prefill_routing, world_case, world_recv_expected
from .timing import Timer

TARGETS = {"decode round fp8 / bf16": "<= 0.75", "fused fp8-wire / gated (FP8 GEMM)": "<= 1.03",
           "fused fp8-wire / gated (BF16 GEMM)": "<= 1.03"}


def fp8_round_problems(world, comb: Combine) -> list[str]:
    """An FP8-wire round of ``comb`` (loaded with ``world``) against the oracles: every
    rank's receive buffer byte for byte (the slots a bf16 round would fill hold
    ``oracle.wire.encode`` of those bf16 rows; every other byte, guards included, the
    sentinel) and its output bit for bit (``reference.reduce_bits`` of the decoded slots)."""
    problems = []
    h, k = world.hidden, world.top_k
    mb = wire_msg_bytes(h, WIRE_FP8)
    for r in range(world.n_ranks):
        d = world.ranks[r]
        b16 = world_recv_expected(world, r, np.full(comb.max_tokens * k * 2 * h, SENTINEL, np.uint8))
        b16 = b16.reshape(comb.max_tokens * k, 2 * h)
        filled = np.zeros(comb.max_tokens * k, bool)
        t = d.topk_idx.shape[0]
        filled[: t * k] = (ref.slot_pairs(d.topk_idx, world.n_local, world.n_ranks) >= 0).reshape(-1)
        want = np.full((comb.max_tokens * k, mb), SENTINEL, np.uint8)
        if filled.any():
            want[filled] = wire_ref.encode(np.ascontiguousarray(b16[filled]).view(np.uint16))
        got = comb.recv_view(r, with_guard=True)
        inner = got[comb.guard:comb.guard + comb.recv_bytes]
        guards_ok = (got[:comb.guard] == SENTINEL).all() and (got[comb.guard + comb.recv_bytes:] == SENTINEL).all()
        if not guards_ok or not np.array_equal(inner, want.reshape(-1)):
            bad = np.nonzero(inner != want.reshape(-1))[0]
            where = f"first at slot {int(bad[0]) // mb} byte {int(bad[0]) % mb}" if len(bad) else "in a guard"
            problems.append(f"rank {r}: FP8 receive buffer differs from the wire oracle in {len(bad)} bytes, {where}")
            continue
        vals = wire_ref.decode(want[: t * k], h).reshape(t, k, h) if t else np.zeros((0, k, h), np.float32)
        exp = ref.reduce_bits(vals, d.topk_idx, d.weights, world.n_local, world.n_ranks)
        out = comb.output(r)
        nan = np.isnan(ref.bf16_to_f32(exp))
        if not (np.array_equal(out[~nan], exp[~nan]) and np.isnan(ref.bf16_to_f32(out[nan])).all()):
            problems.append(f"rank {r}: FP8 reduce differs from reference.reduce_bits in "
                            f"{int((out != exp).sum())} of {out.size} values")
    return problems


def decode_round(ctx) -> dict:
    a, dev = ctx.args, ctx.dev
    seed = int(ctx.rng.integers(1 << 31))
    h8 = wire_msg_bytes(a.hidden, WIRE_FP8) // 2                  # the bf16 row as long as the FP8 row
    plans = {"bf16": (a.hidden, "bf16"), "fp8": (a.hidden, "fp8"), "bf16, the fp8 row's length": (h8, "bf16")}
    worlds = {h: world_case(n_ranks=a.ranks, tokens=a.decode_tokens, top_k=a.top_k, n_local=a.experts, hidden=h,
                            seed=seed) for h in {h for h, _ in plans.values()}}
    combs, graphs, res, first = {}, [], {"checks": {}, "bytes": {}}, {}
    s = ctx.stream
    try:
        for name, (h, w) in plans.items():
            comb = combs[name] = Combine(a.ranks, max_tokens=a.decode_tokens, top_k=a.top_k, hidden=h,
                                         n_local_experts=a.experts, device=dev, stamps=False, guard=True, wire=w)
            comb.load(worlds[h])
            comb.round()
            world = worlds[h]
            p = fp8_round_problems(world, comb) if w == "fp8" else check_world(
                world, lambda r, c=comb: c.recv_view(r, with_guard=True), comb.output, guard=comb.guard,
                recv_bytes=comb.recv_bytes)
            res["checks"][name] = p or "exact"
            first[name] = [(comb.recv_view(r, with_guard=True), comb.output(r)) for r in range(a.ranks)]
            rows = sum(len(d.c) for d in world.ranks)
            res["bytes"][f"round, {name}"] = (rows * 2 * h + rows * comb.msg + a.ranks * a.decode_tokens * a.top_k
                                              * comb.msg + a.ranks * a.decode_tokens * 2 * h)
            graphs += [comb.capture(), comb.capture(receive=False)]
        fns = {}
        for i, name in enumerate(plans):
            fns[f"round, {name}"] = lambda i_, g=graphs[2 * i]: g.launch(s)
            fns[f"sends, {name}"] = lambda i_, g=graphs[2 * i + 1]: g.launch(s)
        turns = Timer(s, hold=True).interleaved(fns, rounds=a.iters, per_round=4, warmup=a.warmup)
        for name, comb in combs.items():                 # a last full round of each: the bytes checked first
            comb.round()
            same = all(np.array_equal(comb.recv_view(r, with_guard=True), first[name][r][0]) and
                       np.array_equal(comb.output(r), first[name][r][1]) for r in range(a.ranks))
            res["checks"][name + ", after the timing"] = "the same bytes" if same else "DIFFERENT bytes"
    finally:
        for g in graphs:
            g.close()
        for c in combs.values():
            c.close()
    res.update(times=turns, ratios=round_ratios({k: v["median_us"] for k, v in turns.items()}, res["bytes"],
                                                  list(plans)))
    return res


#: the decode round's floor on the FP8 wire: what its bytes take at the bf16 rounds' cost per byte
FLOOR = "fp8 round's bytes at the bf16 rounds' cost per byte / bf16 round"


def round_ratios(med: dict, nbytes: dict, names: list) -> dict:
    """The decode part's ratios from its medians (``round, NAME`` and ``sends, NAME`` in us)
    and round bytes (``round, NAME``), names = [bf16, fp8, bf16 of the fp8 row's length].

    FLOOR: the two bf16 rounds (the same kernels, no conversion) give the round's time as a
    line in its bytes, a fixed cost plus a cost per byte; the FP8 round's bytes on that line
    are what it would take with a free quantiser and dequantiser, over the bf16 round. That
    is a floor for an FP8 round of this structure if every kind of byte costs the same (so
    roughly when all ranks share one GPU's memory, as in this bench)."""
    b16, f8, same = (med[f"round, {n}"] for n in names)
    s16, s8, ssame = (med[f"sends, {n}"] for n in names)
    B16, B8, Bsame = (nbytes[f"round, {n}"] for n in names)
    floor = same + (b16 - same) * (B8 - Bsame) / (B16 - Bsame)
    return {"decode round fp8 / bf16": f8 / b16,
            "bytes fp8 / bf16": B8 / B16,
            FLOOR: floor / b16,
            "quantise + dequantise share of the fp8 round": (f8 - same) / f8,
            "quantise share (sends fp8 - sends at the fp8 row's length) / fp8 round": (s8 - ssame) / f8,
            "dequantise share (receive fp8 - receive at the fp8 row's length) / fp8 round":
                ((f8 - s8) - (same - ssame)) / f8,
            "receive fp8 / receive bf16 (round minus sends)": (f8 - s8) / (b16 - s16)}


def prefill_send(ctx) -> dict:
    a, dev, rng, torch = ctx.args, ctx.dev, ctx.rng, ctx.torch
    h, tokens = a.hidden, a.tokens
    rows = tokens * a.top_k
    m16, m8 = 2 * h, wire_msg_bytes(h, WIRE_FP8)
    off, table, src, _ = prefill_routing(tokens, a.ranks, a.top_k, a.experts, rng)
    keep = []

    def kept(x):
        keep.append(x)
        return x
    c = kept(driver.DeviceBuffer(rows * m16))
    if torch is not None:                         # normal values (random bytes are NaN in ~40% of blocks)
        t = torch.randn(rows, h, device=f"cuda:{dev.ordinal}", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        driver.memcpy_dtod(c.ptr, t.data_ptr(), rows * m16, driver.Stream(null=True))
        dev.synchronize()
        del t
    else:
        for r0 in range(0, rows, 4096):
            c.upload(ref.f32_to_bf16(rng.standard_normal((min(4096, rows - r0), h)).astype(np.float32)),
                     offset=r0 * m16)
    recvs = [kept(driver.DeviceBuffer(tokens * a.top_k * m16, fill=SENTINEL)) for _ in range(a.ranks)]
    counts = [kept(driver.DeviceBuffer(8 * a.experts * a.ranks, fill=0xFF)) for _ in range(a.ranks)]
    tb, sb, ob = (kept(driver.DeviceBuffer.from_array(x)) for x in (table, src, off))
    s = ctx.stream
    res = {"rows": rows, "bytes": {}}
    fns = {}
    try:
        for name, msg, wire in (("bf16", m16, "bf16"), ("fp8", m8, "fp8"), ("bf16, the fp8 row's bytes", m8, "bf16")):
            sender = kept(ScatterSend(a.experts, device=dev))
            cfg = rank_config(n_ranks=a.ranks, recv_bufs=recvs, top_k=a.top_k, msg_bytes=msg, max_tokens=tokens,
                              range_table=tb, src_info=sb)
            kw = {"wire": "fp8", "hidden": h} if wire == "fp8" else {}
            blk = sender.prepare(cfg, c, ob, m16, expert_offsets_host=off, count_ptrs=counts, rows_in_c=rows,
                                 same_gpu=True, **kw)
            sender.launch(s, blk)
            s.synchronize()
            d = sender.diagnostics()
            res[f"diagnostics, {name}"] = d
            fns[f"send, {name}"] = lambda i, snd=sender, b=blk: snd.launch(s, b)
            res["bytes"][f"send, {name}"] = rows * (msg if wire == "bf16" else m16) + rows * msg   # read + write
        res["times"] = Timer(s, hold=True).interleaved(fns, rounds=max(3, a.iters // 5), per_round=2,
                                                       warmup=max(1, a.warmup // 5))
    finally:
        for x in reversed(keep):
            x.free() if isinstance(x, driver.DeviceBuffer) else x.close()
    med = {k: v["median_us"] for k, v in res["times"].items()}
    same = med["send, bf16, the fp8 row's bytes"]
    res["ratios"] = {"send fp8 / bf16": med["send, fp8"] / med["send, bf16"],
                     "send fp8 / bf16 of the fp8 row's bytes": med["send, fp8"] / same}
    res["GBps"] = {k: res["bytes"][k] / (v * 1e3) for k, v in med.items()}
    return res


def fused_gemm(ctx) -> dict:
    """The prefill shape of the ``gemm_fp8`` section: each GEMM gated and fused on each wire."""
    torch, a, dev, rng = ctx.torch, ctx.args, ctx.dev, ctx.rng
    if torch is None:
        return {"skipped": "needs torch"}
    from ..abi.layout import encode_range_table
    from ..ops.gemm import GroupedGemmSend
    from ..ops.gemm_fp8 import GroupedGemmFp8Send
    from ..ops.quant import QuantFp8, scale_layout
    from ..oracle import fp8 as ref8
    from .gemm_fp8 import SHAPES, routing, rows_per_expert, variant_gemm, variant_text
    E, _, _ = SHAPES["prefill"]
    N, K, ranks, top_k = a.hidden, a.gemm_k, a.ranks, a.top_k
    rpe = rows_per_expert("prefill")
    off, _ = ref8.contiguous_layout(rpe)
    rows = int(off[-1])
    counts_er, src, max_tok = routing(rng, off, rpe, ranks, top_k)
    table = encode_range_table(off, counts_er)
    s = ctx.stream
    closers, bufs = [], []

    def buf(x):
        bufs.append(x)
        return x
    gem8, gem16 = GroupedGemmFp8Send(E, device=dev), GroupedGemmSend(E, device=dev)
    closers += [gem8, gem16]
    try:
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
        lay = scale_layout(rows, K)
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        aq = torch.empty(rows, K, device="cuda", dtype=torch.float8_e4m3fn)
        sa = torch.empty(lay.kb, lay.m_pad, device="cuda", dtype=torch.float32).t()[:rows]
        codes = torch.randint(0, 126, (E, N, K), device="cuda", dtype=torch.uint8, generator=gen)
        bw = codes.view(torch.float8_e4m3fn)
        sbw = torch.exp2(torch.rand(E, N // 128, K // 128, device="cuda", generator=gen) * 4 - 2) / 448
        wb = (bw.float() * sbw.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.bfloat16)
        quant = QuantFp8(dev)
        quant.launch(s, quant.prepare(x, aq, sa))
        s.synchronize()
        offsets = buf(driver.DeviceBuffer.from_array(off))
        tb, sb = buf(driver.DeviceBuffer.from_array(table)), buf(driver.DeviceBuffer.from_array(src))
        c = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
        recvs = [buf(driver.DeviceBuffer(max_tok * top_k * 2 * N, fill=SENTINEL)) for _ in range(ranks)]
        counts = [buf(driver.DeviceBuffer(8 * E * ranks, fill=0xFF)) for _ in range(ranks)]

        def cfg(msg):
            return rank_config(n_ranks=ranks, recv_bufs=recvs, top_k=top_k, msg_bytes=msg, max_tokens=max_tok,
                               range_table=tb, src_info=sb)
        cptr = [b.ptr for b in counts]
        m8 = wire_msg_bytes(N, WIRE_FP8)
        fns = {}
        b16 = dict(expert_offsets_host=off, rows=rows, n_cols=N, k_dim=K, bm=128)
        a8 = (aq, sa, bw, sbw, offsets)
        k8 = dict(expert_offsets_host=off, bm=128)
        plans = [("FP8 GEMM", gem8, a8, k8), ("BF16 GEMM", gem16, (x, wb, offsets), b16)]
        # the default's send warps quantising the staged bf16 tile (fp8_source="bf16", what the
        # consumers' quantiser replaced), and the 384-thread kernel at 128-row tiles
        plans.append((BF16_SOURCE, gem8, a8, dict(k8, fp8_source="bf16")))
        narrow = GroupedGemmFp8Send(E, device=dev, wide=False)
        closers.append(narrow)
        plans.append(("FP8 GEMM 384 threads", narrow, a8, k8))
        for vname in WIRE_GEMM_VARIANTS:           # measurement variants of the FP8 GEMM, when built
            vt = variant_text(vname)
            if vt is None:
                continue
            gv = variant_gemm(E, dev, vname, vt)
            closers.append(gv)
            plans.append((f"FP8 GEMM {vname}", gv, a8, k8))
        wire_bytes = {}
        for label, g, args, kw in plans:
            gated = g.prepare(cfg(2 * N), *args, c, into=g.k.params_block(), **kw)
            fused16 = g.prepare(cfg(2 * N), *args, count_ptrs=cptr, p3_control=0, same_gpu=True,
                                into=g.k.params_block(), **kw)
            fused8 = g.prepare(cfg(m8), *args, count_ptrs=cptr, p3_control=0, same_gpu=True, wire="fp8",
                               into=g.wire_kernel().params_block(), **kw)
            if label.startswith("FP8 GEMM"):   # each FP8 GEMM's FP8-wire slots, compared with the default's
                for r in recvs:
                    r.fill(SENTINEL, s)
                g.launch(s, fused8)
                s.synchronize()
                wire_bytes[label] = [r.download() for r in recvs]
            for tag, blk in (("gated", gated), ("fused bf16-wire", fused16), ("fused fp8-wire", fused8)):
                g.launch(s, blk)
                fns[f"{label} {tag}"] = lambda i, g=g, b=blk: g.launch(s, b)
        s.synchronize()
        same_as_shipped = {k: all(np.array_equal(x_, y_) for x_, y_ in zip(v, wire_bytes["FP8 GEMM"]))
                           for k, v in wire_bytes.items() if k not in ("FP8 GEMM", BF16_SOURCE)}
        # the default's wire (of the fp32 sums) against the send warps' (of their bf16 rounding, C)
        requant = [wire_ref.requantised_slots(x_, y_, N) for x_, y_ in zip(wire_bytes["FP8 GEMM"],
                                                                           wire_bytes[BF16_SOURCE])]
        wire_bytes.clear()
        for k in [k for k, ok in same_as_shipped.items() if not ok]:   # other bytes: reported, not timed
            for tag in ("gated", "fused bf16-wire", "fused fp8-wire"):
                del fns[f"{k} {tag}"]
        times = Timer(s, hold=True).interleaved(fns, rounds=max(3, a.iters // 5), per_round=2,
                                                warmup=max(1, a.warmup // 5))
    finally:
        for g in closers:
            g.close()
        for b in bufs:
            b.free()
    med = {k: v["median_us"] for k, v in times.items()}
    ratios = {}
    labels = [p[0] for p in plans if f"{p[0]} gated" in med]
    for label in labels:
        for tag in ("bf16-wire", "fp8-wire"):
            ratios[f"fused {tag} / gated ({label})"] = med[f"{label} fused {tag}"] / med[f"{label} gated"]
    for label in labels[2:]:                       # the 384-thread kernel and the variants against the default
        for tag in ("gated", "fused fp8-wire"):
            ratios[f"{tag}: {label} / FP8 GEMM"] = med[f"{label} {tag}"] / med[f"FP8 GEMM {tag}"]
    sent = {"gated": 0, "fused bf16-wire": rows * 2 * N, "fused fp8-wire": rows * m8}
    res = {"rows": rows, "n": N, "k": K, "experts": E, "times": times, "ratios": ratios,
           "bytes": {f"{label} {tag}": b for label in labels for tag, b in sent.items() if b}}
    res["checks"] = {f"{k}: fp8-wire slots equal the shipped kernel's": v for k, v in same_as_shipped.items()}
    res["checks"]["FP8 GEMM: fp8-wire slots (of the fp32 sums) requantised of the send warps' (of C)"] = \
        all(r is None for r in requant)
    if any(r is not None for r in requant):
        res["checks"]["requantised: first difference"] = next(r for r in requant if r is not None)
    return res


#: the default FP8 GEMM quantising in its send warps (fp8_source="bf16"), a contender of the fused part
BF16_SOURCE = "FP8 GEMM send-warp quantiser"


#: Measurement variants of the FP8 GEMM (tools/build_gemm_fp8.py --variant) timed in the fused
#: part beside the shipped kernel when their PTX is in the P3SEND_FP8_VARIANTS folder: until
#: the consumers quantised (FLAG_WIRE_FP8_STAGED, now every kernel's at 128-row tiles: see
#: BF16_SOURCE for the send warps' quantiser) the send warps did, hence the variant with seven
#: of them (send_wg), the one with the faster mainloop (dual) and both (dual_sw: seven send
#: warps at 56 registers); the shipped
#: wide kernel (the default: the faster mainloop, four send warps at 88) is timed beside the
#: 384-thread one ("FP8 GEMM 384 threads")
WIRE_GEMM_VARIANTS = ("send_wg", "dual", "dual_sw")

#: comma-separated parts of the section to run (decode, send, gemm); unset: all three
PARTS_ENV = "P3SEND_WIRE_PARTS"


def run(ctx, out: dict) -> None:
    """Section ``wire``: the decode round, the prefill send and the fused GEMM on both wires
    (``P3SEND_WIRE_PARTS`` names a subset: a part left out is reported as skipped)."""
    res = {}
    want = [t.strip() for t in os.environ.get(PARTS_ENV, "").split(",") if t.strip()]
    for part, fn in (("decode", decode_round), ("send", prefill_send), ("gemm", fused_gemm)):
        if want and part not in want:
            res[part] = {"skipped": f"{PARTS_ENV}={','.join(want)}"}
            continue
        try:
            res[part] = fn(ctx)
        except (P3SendError, RuntimeError, TypeError, ValueError) as e:   # one part's failure must not hide the others
            res[part] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    out["wire"] = res


def table(out: dict) -> str:
    if "wire" not in out:
        return ""
    w = out["wire"]
    L = ["\n10. the FP8 wire against the bf16 wire (contenders timed in turns, medians)"]
    for part, title in (("decode", "decode round (graph replays)"), ("send", "send, prefill shape"),
                        ("gemm", "fused GEMM + send, prefill shape")):
        r = w.get(part, {})
        if "skipped" in r:
            L.append(f"   {title}: skipped ({r['skipped']})")
            continue
        L.append(f"   {title}:" + (f" checks {r['checks']}" if "checks" in r else ""))
        by = r.get("bytes", {})
        for k, v in r["times"].items():
            b = by.get(k)
            L.append(f"     {k:<44} {v['median_us']:9.1f} us" + (f"  {b / 1e6:8.1f} MB" if b else ""))
        for k, v in r["ratios"].items():
            L.append(f"     {k:<72} {v:7.3f}" + (f"  target {TARGETS[k]}" if k in TARGETS else ""))
    return "\n".join(L)
