"""Section ``gemm_fp8``: the down-projection as DeepSeek-V3 serves it (FP8 block-scaled grouped
GEMM, N = --hidden, K = --gemm-k) with the send in its epilogue, side by side with DeepGEMM.

Shapes (rows per expert drawn uniformly in 0.7 .. 1.3 x the mean, as DeepGEMM's tests draw
them; DeepGEMM's contiguous layout: every expert's span starts at a multiple of 128, padding
rows owned by no rank): prefill 32 experts x ~1,024 rows, 8 x ~4,096, decode 32 x ~32.
Contenders, timed in turns (``Timer.interleaved``) in ``PASSES`` passes: the quantiser
(``p3_quant_fp8``, the conversion, timed apart), the FP8 GEMM gated (C written) and fused (rows
sent to 8 receive buffers on this GPU, .gpu-scope signal) as ``GroupedGemmFp8Send`` launches it
(``p3_gemm_fp8_send_wide`` at 128-row tiles: the report's "kernels"), the 384-thread
``p3_gemm_fp8_send`` at 128-row tiles beside it (NARROW, checked as the variants), the same fused launch
linked through cuLink, a no-promotion variant of the gated GEMM when its PTX is found
(``P3SEND_FP8_VARIANTS``: a folder holding ``p3_gemm_fp8_send.no_promote.ptx`` from
tools/build_gemm_fp8.py --variant), the variants of ``SHAPE_VARIANTS`` gated and fused when
their PTX is in that folder (each checked first: fused == its gated C sent by
p3_scatter_send, and its C equal to the shipped kernel's, bit for bit), p3send's bf16 GEMM (inlined and linked), torch's
``_scaled_grouped_mm`` (rowwise scales), DeepGEMM's contiguous GEMM (and its masked one at
decode) when ``import deep_gemm`` works, DeepGEMM followed by ``p3_scatter_send``, and a
read-only kernel over the FP8 weights' bytes (the decode floor). Useful FLOPs count real rows
only (2 x real rows x N x K). Before timing: the fused launch's receive buffers and counts
against the gated C sent by p3_scatter_send, byte for byte; sampled rows of C against a
float64 reference of the dequantised inputs (the error as a fraction of
``oracle.fp8.error_bound``); C against DeepGEMM's output.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np

from ..abi.config import rank_config
from ..abi.layout import encode_range_table
from ..cuda import driver, loader
from ..ops.gemm import GroupedGemmSend
from ..ops.gemm_fp8 import GroupedGemmFp8Send
from ..ops.quant import QuantFp8, scale_layout
from ..ops.send import ScatterSend
from ..oracle import fp8 as ref8
from .gemm import fused_equals_gated_then_scatter_send, shape_results
from .timing import Timer

#: name -> (experts, mean rows per expert, seed of the rows per expert: fixed, so every run and
#: DeepGEMM's kernel cache (tools/deepgemm_prepare.py) see the same shapes; the data are random)
SHAPES = {"prefill": (32, 1024, 101), "8x4096": (8, 4096, 102), "decode": (32, 32, 103)}
PASSES = 3
VARIANTS_ENV = "P3SEND_FP8_VARIANTS"
SKIP_ENV = "P3SEND_FP8_SKIP"          # comma-separated parts of contender names to leave out
SAMPLE_ROWS = 48
#: the launch shape of the variants with seven send warps (P3F_SEND_WG): 512 threads, the
#: shipped dynamic shared memory and four more P3SendAcct of 48 bytes
SEND_WG_SHAPE = (512, 201956 + 4 * 48)
#: the wide kernel's structure at 128 x 128 tiles (P3F_TILE128: 5 stages, 272-byte staged rows,
#: and a fourth P3SendAcct)
WIDE_T128_SHAPE = (512, 202612 + 48)
#: Variants timed gated and fused beside the shipped kernel when their PTX is in the
#: P3SEND_FP8_VARIANTS folder: name -> (label (no commas: P3SEND_FP8_SKIP's separator), launch
#: shape (threads, dynamic shared memory) or None, linked through cuLink (else inlined))
SHAPE_VARIANTS = {"dual": ("dual: two accumulator sets without turns (setmaxnreg 88/208)", None, False),
                  "dual_turns": ("dual_turns: two accumulator sets in turns (setmaxnreg 88/208)", None, False),
                  "dual_104": ("dual_104: two accumulator sets without turns (setmaxnreg 104/200)", None, False),
                  "dual_96": ("dual_96: two accumulator sets without turns (setmaxnreg 96/200)", None, False),
                  "dual_sw": ("dual_sw: two accumulator sets and 7 send warps (setmaxnreg 56/200)", SEND_WG_SHAPE,
                              False),
                  "wide_no_promote": ("wide_no_promote: the wide kernel with the promotion off (wrong numbers)",
                                      GroupedGemmFp8Send.WIDE[1:], False),
                  "mcast": ("mcast: the wide kernel in clusters of two sharing A (multicast)",
                            GroupedGemmFp8Send.WIDE[1:], False),
                  "wide_t128": ("wide_t128: the wide kernel at 128 x 128 tiles (5 stages)", WIDE_T128_SHAPE, False),
                  "mcast_t128": ("mcast_t128: wide_t128 in clusters of two sharing A (multicast)", WIDE_T128_SHAPE,
                                 False),
                  "send_wg": ("send_wg: 512 threads (7 send warps)", SEND_WG_SHAPE, False),
                  "outline": ("outline: consumer outlined and linked (cuLink)", None, True),
                  "no_turns": ("no_turns: the consumers' k-blocks not in turns", None, False),
                  "tile128": ("tile128: the earlier 128 x 128 tiles (shipped up to fbb32ce)", (384, 202612), False),
                  "tile128_turns": ("tile128_turns: 128 x 128 tiles in turns", (384, 202612), False),
                  "tile128_dual": ("tile128_dual: 128 x 128 tiles with two accumulator sets", (384, 202612), False),
                  "tile128_send_wg": ("tile128_send_wg: 128 x 128 tiles and 7 send warps", (512, 202612 + 4 * 48),
                                      False)}
#: the shipped 384-thread kernel at 128-row tiles (the launcher's wide=False), timed beside the
#: default (p3_gemm_fp8_send_wide at 128-row tiles) and checked as the variants are
NARROW = "384 threads: the shipped p3_gemm_fp8_send (wide=False)"
FLOOR = "weight-read floor (FP8 weights read once)"
BF16_OUTLINED = "p3_gemm_send (bf16) fused, linked (cuLink), consumer outlined"

# The weight-read floor: every 16-byte vector of a buffer read once (4 per thread, coalesced,
# L1 bypassed), folded into one word that is stored only if it equals a constant.
READ_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry p3_bench_read(.param .u64 src, .param .u64 n_vec, .param .u64 out)
{
    .reg .pred  %p<6>;
    .reg .b32   %r<24>;
    .reg .b64   %rd<10>;
    ld.param.u64        %rd1, [src];
    ld.param.u64        %rd2, [n_vec];
    mov.u32             %r1, %ctaid.x;
    mov.u32             %r2, %tid.x;
    mul.wide.u32        %rd3, %r1, 1024;
    cvt.u64.u32         %rd4, %r2;
    add.u64             %rd3, %rd3, %rd4;
    setp.lt.u64         %p1, %rd3, %rd2;
    add.u64             %rd5, %rd3, 256;
    setp.lt.u64         %p2, %rd5, %rd2;
    add.u64             %rd5, %rd3, 512;
    setp.lt.u64         %p3, %rd5, %rd2;
    add.u64             %rd5, %rd3, 768;
    setp.lt.u64         %p4, %rd5, %rd2;
    shl.b64             %rd6, %rd3, 4;
    add.u64             %rd6, %rd1, %rd6;
    mov.b32 %r3, 0; mov.b32 %r4, 0; mov.b32 %r5, 0; mov.b32 %r6, 0;
    mov.b32 %r7, 0; mov.b32 %r8, 0; mov.b32 %r9, 0; mov.b32 %r10, 0;
    mov.b32 %r11, 0; mov.b32 %r12, 0; mov.b32 %r13, 0; mov.b32 %r14, 0;
    mov.b32 %r15, 0; mov.b32 %r16, 0; mov.b32 %r17, 0; mov.b32 %r18, 0;
    @%p1 ld.global.nc.L1::no_allocate.v4.u32 {%r3, %r4, %r5, %r6}, [%rd6];
    @%p2 ld.global.nc.L1::no_allocate.v4.u32 {%r7, %r8, %r9, %r10}, [%rd6+4096];
    @%p3 ld.global.nc.L1::no_allocate.v4.u32 {%r11, %r12, %r13, %r14}, [%rd6+8192];
    @%p4 ld.global.nc.L1::no_allocate.v4.u32 {%r15, %r16, %r17, %r18}, [%rd6+12288];
    xor.b32 %r3, %r3, %r4; xor.b32 %r5, %r5, %r6; xor.b32 %r7, %r7, %r8; xor.b32 %r9, %r9, %r10;
    xor.b32 %r11, %r11, %r12; xor.b32 %r13, %r13, %r14; xor.b32 %r15, %r15, %r16; xor.b32 %r17, %r17, %r18;
    xor.b32 %r3, %r3, %r5; xor.b32 %r7, %r7, %r9; xor.b32 %r11, %r11, %r13; xor.b32 %r15, %r15, %r17;
    xor.b32 %r3, %r3, %r7; xor.b32 %r11, %r11, %r15; xor.b32 %r3, %r3, %r11;
    setp.ne.u32         %p5, %r3, 0x9E3779B9;
    @%p5 bra            DONE;
    ld.param.u64        %rd7, [out];
    st.global.u32       [%rd7], %r3;
DONE:
    ret;
}
"""


def rows_per_expert(name: str) -> np.ndarray:
    """The shape's real rows per expert: uniform in 0.7 .. 1.3 x the mean (DeepGEMM's tests' draw)."""
    n_experts, mean, seed = SHAPES[name]
    return np.round(np.random.default_rng(seed).uniform(0.7, 1.3, n_experts) * mean).astype(np.int64)


def routing(rng, off: np.ndarray, rpe: np.ndarray, ranks: int, top_k: int):
    """Each real row of each expert owned by a random rank (ranks' rows contiguous in rank
    order, as a dispatch lays them), unique (token, k) slots per rank; the padding rows of
    each span owned by none. Returns (rows per (expert, rank), src_info (rows, 2), max tokens
    per rank)."""
    counts = np.stack([np.bincount(rng.integers(0, ranks, int(n)), minlength=ranks) for n in rpe])
    real = int(rpe.sum())
    max_tok = -(-real // top_k) + 1
    src = np.full((int(off[-1]), 2), -1, np.int32)
    for rk in range(ranks):
        rows = np.concatenate([np.arange(off[e] + counts[e, :rk].sum(), off[e] + counts[e, :rk + 1].sum())
                               for e in range(len(rpe))]).astype(np.int64)
        slots = rng.permutation(max_tok * top_k)[: len(rows)]
        src[rows, 0], src[rows, 1] = slots // top_k, slots % top_k
    return counts, src, max_tok


STALE: dict[str, str] = {}       # variant file -> why it was left out (built from another source)


def _header(text: str) -> str:
    """A PTX file's leading comment block (the build scripts copy it from the source)."""
    lines = text.splitlines()
    n = next((i for i, line in enumerate(lines) if not line.startswith("//")), len(lines))
    return "\n".join(lines[:n])


def variant_text(name: str, entry: str = "p3_gemm_fp8_send") -> str | None:
    """The text of variant ``name`` from the P3SEND_FP8_VARIANTS folder, or None: absent, or
    built from another version of the source than the shipped PTX (its header differs: its
    launch shape may not be the one the bench gives it; noted in STALE)."""
    d = os.environ.get(VARIANTS_ENV)
    p = Path(d) / f"{entry}.{name}.ptx" if d else None
    if p is None or not p.is_file():
        return None
    text = p.read_text()
    if _header(text) != _header((loader.ptx_dir() / f"{entry}.ptx").read_text()):
        STALE[p.name] = "left out: its header differs from the shipped PTX's (built from another source: rebuild it)"
        return None
    return text


def variant_gemm(E: int, dev, vname: str, text: str) -> GroupedGemmFp8Send:
    """A launcher of measurement variant ``vname`` (its PTX ``text``) with the launch shape and
    route of SHAPE_VARIANTS."""
    _, shape, linked = SHAPE_VARIANTS[vname]
    return GroupedGemmFp8Send(E, device=dev, variant_ptx=text, linked=linked, variant_shape=shape)


def _deep_gemm():
    if os.environ.get("P3SEND_NO_DEEPGEMM"):
        return None, f"P3SEND_NO_DEEPGEMM={os.environ['P3SEND_NO_DEEPGEMM']}"
    try:
        import deep_gemm
        return deep_gemm, None
    except Exception as e:  # noqa: BLE001 -- absent or broken: the bench notes why and goes on
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def _reference_rows(torch, a, sa, bw, sb, off, rows_sel, n_cols, k_dim):
    """float64 C and the error bound for the sampled rows (on the GPU, in float64)."""
    from ..ops.gemm_fp8 import BK
    e_of = np.searchsorted(off, rows_sel, side="right") - 1
    out_ref, out_bound = [], []
    lut = torch.from_numpy(ref8.e4m3_to_f32(np.arange(256, dtype=np.uint8)).astype(np.float64)).cuda()
    for e in np.unique(e_of):
        rs = rows_sel[e_of == e]
        ri = torch.from_numpy(rs).cuda()
        av = lut[a.view(torch.uint8)[ri].long()] * sa[ri].double().repeat_interleave(BK, dim=1)
        bv = lut[bw[e].view(torch.uint8).long()] * \
            sb[e].double().repeat_interleave(128, dim=0).repeat_interleave(BK, dim=1)
        r = av @ bv.T
        m = av.abs() @ bv.abs().T
        out_ref.append(r.cpu().numpy())
        out_bound.append(ref8.error_bound(r.cpu().numpy(), m.cpu().numpy(), k_dim))
        del av, bv
    order = np.argsort(np.concatenate([rows_sel[e_of == e] for e in np.unique(e_of)]), kind="stable")
    return np.concatenate(out_ref)[order], np.concatenate(out_bound)[order]


def gemm_inputs(torch, seed: int, rows: int, E: int, N: int, K: int):
    """The section's random inputs on the GPU (torch generator seeded with ``seed``): the scale
    layout of ``rows`` rows, X bf16 (rows, K) normal, A e4m3 (rows, K) and its scales sa
    (rows, K/128, MN-major) left for the quantiser to fill, B e4m3 (E, N, K) random finite codes
    of either sign, sb float32 (E, N/128, K/128) in [2^-2, 2^2] / 448.
    Returns (layout, x, a, sa, b, sb)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lay = scale_layout(rows, K)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    aq = torch.empty(rows, K, device="cuda", dtype=torch.float8_e4m3fn)
    sa = torch.empty(lay.kb, lay.m_pad, device="cuda", dtype=torch.float32).t()[:rows]   # MN-major
    codes = torch.randint(0, 126, (E, N, K), device="cuda", dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, (E, N, K), device="cuda", dtype=torch.uint8, generator=gen) << 7
    sb = torch.exp2(torch.rand(E, N // 128, K // 128, device="cuda", generator=gen) * 4 - 2) / 448
    return lay, x, aq, sa, codes.view(torch.float8_e4m3fn), sb


def _bf16_rows(torch, t, rows_sel):
    return t[torch.from_numpy(rows_sel).cuda()].float().double().cpu().numpy()


def measure_shape(ctx, name: str) -> dict:
    """One shape: every contender's times per pass, useful TFLOP/s, the checks and the ratios."""
    torch, a, dev, rng = ctx.torch, ctx.args, ctx.dev, ctx.rng
    E, mean_rows, _ = SHAPES[name]
    N, K, ranks, top_k = a.hidden, a.gemm_k, a.ranks, a.top_k
    rpe = rows_per_expert(name)
    off, m_idx = ref8.contiguous_layout(rpe)
    rows, real = int(off[-1]), int(rpe.sum())
    flops = 2.0 * real * N * K
    counts_er, src, max_tok = routing(rng, off, rpe, ranks, top_k)
    table = encode_range_table(off, counts_er)
    s = ctx.stream
    ts = torch.cuda.ExternalStream(int(s))
    lay, x, aq, sa, bw, sb = gemm_inputs(torch, int(rng.integers(1 << 31)), rows, E, N, K)
    m_dev = torch.from_numpy(off).cuda()
    offsets = driver.DeviceBuffer.from_array(off)
    table_buf, src_buf = driver.DeviceBuffer.from_array(table), driver.DeviceBuffer.from_array(src)
    msg = 2 * N
    recv_bytes = max_tok * top_k * msg
    recvs = [[driver.DeviceBuffer(recv_bytes, fill=0xAB) for _ in range(ranks)] for _ in range(2)]
    counts = [[driver.DeviceBuffer(8 * E * ranks, fill=0xFF) for _ in range(ranks)] for _ in range(2)]
    cfgs = [rank_config(n_ranks=ranks, recv_bufs=recvs[i], top_k=top_k, msg_bytes=msg, max_tokens=max_tok,
                        range_table=table_buf, src_info=src_buf) for i in range(2)]
    cptr = [[b.ptr for b in counts[i]] for i in range(2)]
    c = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = {"experts": E, "rows": rows, "real_rows": real, "n": N, "k": K, "gflop_useful": flops / 1e9,
           "weights_mb": E * N * K / 1e6}
    quant = QuantFp8(dev)
    q_blk = quant.prepare(x, aq, sa)
    quant.launch(s, q_blk)
    s.synchronize()
    gem = GroupedGemmFp8Send(E, device=dev)
    closers = [gem]
    sender = ScatterSend(E, device=dev)
    closers.append(sender)
    common = dict(expert_offsets_host=off)
    bms = (128,)
    blocks = {}
    for bm in bms:
        blocks[f"gated bm={bm}"] = gem.prepare(cfgs[0], aq, sa, bw, sb, offsets, c, bm=bm,
                                               into=gem.k.params_block(), **common)
        blocks[f"fused bm={bm}"] = gem.prepare(cfgs[1], aq, sa, bw, sb, offsets, bm=bm, count_ptrs=cptr[1],
                                               p3_control=0, same_gpu=True, into=gem.k.params_block(), **common)
    bm0 = 128
    fns = {"quantiser p3_quant_fp8 (bf16 -> e4m3 + scales)": lambda i: quant.launch(s, q_blk)}
    try:
        # checks before timing: fused == gated C sent by p3_scatter_send, byte for byte
        out["fused_equals_gated_then_scatter_send"] = fused_equals_gated_then_scatter_send(
            torch, s, gem, blocks, bms, sender, cfgs[0], c, offsets, off, recvs, counts)
        gem.launch(s, blocks[f"gated bm={bm0}"])
        s.synchronize()
        real_rows = np.flatnonzero(m_idx >= 0)
        sel = np.sort(rng.choice(real_rows, size=min(SAMPLE_ROWS, real), replace=False))
        r64, bound = _reference_rows(torch, aq, sa, bw, sb, off, sel, N, K)
        got = _bf16_rows(torch, c, sel)
        err = np.abs(got - r64)
        out["error"] = {"sampled_rows": len(sel), "max_err_over_bound": float((err / bound).max()),
                        "within_bound": bool((err <= bound).all()),
                        "rel_norm": float(np.linalg.norm(err) / np.linalg.norm(r64))}
        for bm, blk in blocks.items():
            fns[f"p3_gemm_fp8_send {bm}"] = lambda i, blk=blk: gem.launch(s, blk)
        # the fused launch resolving rows through the row cache (zeroed before every launch, as
        # its contract asks; the memset is in the time): what the routing lookups cost
        row_cache = torch.zeros(rows, dtype=torch.int64, device="cuda")
        cfg_rc = rank_config(n_ranks=ranks, recv_bufs=recvs[1], top_k=top_k, msg_bytes=msg, max_tokens=max_tok,
                             range_table=table_buf, src_info=src_buf, row_base=row_cache.data_ptr())
        rc_blk = gem.prepare(cfg_rc, aq, sa, bw, sb, offsets, bm=bm0, count_ptrs=cptr[1], p3_control=0,
                             same_gpu=True, row_cache=True, into=gem.k.params_block(), **common)

        def fused_rc(i):
            with torch.cuda.stream(ts):
                row_cache.zero_()
            gem.launch(s, rc_blk)
        fns[f"p3_gemm_fp8_send fused bm={bm0}, row cache"] = fused_rc
        skip = [t for t in os.environ.get(SKIP_ENV, "").split(",") if t]

        def skipped(key: str) -> bool:       # left out before its module is loaded (a JIT each)
            if any(t in key for t in skip):
                out.setdefault("skipped", []).append(f"{key} ({SKIP_ENV})")
                return True
            return False
        if not skipped(f"p3_gemm_fp8_send fused bm={bm0}, linked (cuLink)"):
            lk = GroupedGemmFp8Send(E, device=dev, linked=True)
            closers.append(lk)
            lk_blk = lk.prepare(cfgs[1], aq, sa, bw, sb, offsets, bm=bm0, count_ptrs=cptr[1], p3_control=0,
                                same_gpu=True, into=lk.k.params_block(), **common)
            out["linked_registers"] = {"inlined": gem.kernel_for(bm0).num_regs, "linked": lk.k.num_regs}
            fns[f"p3_gemm_fp8_send fused bm={bm0}, linked (cuLink)"] = lambda i: lk.launch(s, lk_blk)
        else:
            out["linked_registers"] = {"inlined": gem.kernel_for(bm0).num_regs}
        npv = variant_text("no_promote")
        if npv is not None:
            npg = GroupedGemmFp8Send(E, device=dev, variant_ptx=npv)
            closers.append(npg)
            np_blk = npg.prepare(cfgs[0], aq, sa, bw, sb, offsets, c, bm=bm0, into=npg.k.params_block(), **common)
            # bound now: the variants' loop below rebinds gv (a late-bound name launched another
            # launcher's kernel with this block: CUDA_ERROR_INVALID_VALUE)
            fns[f"p3_gemm_fp8_send gated bm={bm0}, promotion off (wrong numbers)"] = \
                lambda i, g=npg, b=np_blk: g.launch(s, b)
        else:
            out["no_promote"] = f"skipped: no {VARIANTS_ENV} folder with p3_gemm_fp8_send.no_promote.ptx"
        c_ref = c.clone()
        out["kernels"] = {f"bm={b}": gem.kernel_for(b).name for b in (128, 64)}
        for vname, (label, _, _) in {"narrow": (NARROW, None, False), **SHAPE_VARIANTS}.items():
            narrow = vname == "narrow"              # the shipped 384-thread kernel, not a variant
            vt = None if narrow else variant_text(vname)
            if vt is None and not narrow:
                out[vname] = f"skipped: no {VARIANTS_ENV} folder with p3_gemm_fp8_send.{vname}.ptx"
                continue
            if any(t in label for t in skip):
                out[vname] = f"skipped ({SKIP_ENV})"
                continue
            # its checks launch it first: a variant that fails or hangs there is named by this line
            print(f"[probe] {name}: {label}", flush=True)
            gv = GroupedGemmFp8Send(E, device=dev, wide=False) if narrow else variant_gemm(E, dev, vname, vt)
            closers.append(gv)
            vb = {f"gated bm={bm0}": gv.prepare(cfgs[0], aq, sa, bw, sb, offsets, c, bm=bm0,
                                                into=gv.k.params_block(), **common),
                  f"fused bm={bm0}": gv.prepare(cfgs[1], aq, sa, bw, sb, offsets, bm=bm0, count_ptrs=cptr[1],
                                                p3_control=0, same_gpu=True, into=gv.k.params_block(), **common)}
            same = fused_equals_gated_then_scatter_send(torch, s, gv, vb, (bm0,), sender, cfgs[0], c, offsets, off,
                                                        recvs, counts)
            out[vname] = {"fused_equals_gated_then_scatter_send": same,
                          "c_equals_shipped": bool(torch.equal(c.view(torch.int16), c_ref.view(torch.int16)))}
            fns[f"p3_gemm_fp8_send gated bm={bm0}, {label}"] = lambda i, gv=gv, b=vb[f"gated bm={bm0}"]: gv.launch(s, b)
            fns[f"p3_gemm_fp8_send fused bm={bm0}, {label}"] = lambda i, gv=gv, b=vb[f"fused bm={bm0}"]: gv.launch(s, b)
        c.copy_(c_ref)
        # p3send's bf16 GEMM on the same rows (the weights dequantised to bf16)
        if not skipped("p3_gemm_send (bf16) gated, fused, linked"):
            wb = (bw.float() * sb.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.bfloat16)
            cb = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
            g16 = GroupedGemmSend(E, device=dev)
            g16l = GroupedGemmSend(E, device=dev, linked=True)
            closers += [g16, g16l]
            b16 = dict(expert_offsets_host=off, rows=rows, n_cols=N, k_dim=K, bm=bm0)
            g16_gated = g16.prepare(cfgs[0], x, wb, offsets, cb, into=g16.k.params_block(), **b16)
            g16_fused = g16.prepare(cfgs[1], x, wb, offsets, count_ptrs=cptr[1], p3_control=0, same_gpu=True,
                                    into=g16.k.params_block(), **b16)
            g16_link = g16l.prepare(cfgs[1], x, wb, offsets, count_ptrs=cptr[1], p3_control=0, same_gpu=True,
                                    into=g16l.k.params_block(), **b16)
            fns["p3_gemm_send (bf16) gated"] = lambda i: g16.launch(s, g16_gated)
            fns["p3_gemm_send (bf16) fused"] = lambda i: g16.launch(s, g16_fused)
            fns["p3_gemm_send (bf16) fused, linked (cuLink)"] = lambda i: g16l.launch(s, g16_link)
            b16v = variant_text("outline", "p3_gemm_send")
            if b16v is not None:      # the linked route with the consumers' mainloop outlined (no C7509)
                g16o = GroupedGemmSend(E, device=dev, linked=True, variant_ptx=b16v)
                closers.append(g16o)
                g16_out = g16o.prepare(cfgs[1], x, wb, offsets, count_ptrs=cptr[1], p3_control=0, same_gpu=True,
                                       into=g16o.k.params_block(), **b16)
                fns[BF16_OUTLINED] = lambda i: g16o.launch(s, g16_out)
        # torch's FP8 grouped GEMM (rowwise scales: another recipe, timed only)
        ends = torch.from_numpy(off[1:].astype(np.int32)).cuda()
        ra, rb = torch.ones(rows, device="cuda"), torch.ones(E, N, device="cuda")

        def tsg(i):
            with torch.cuda.stream(ts):
                return torch._scaled_grouped_mm(aq, bw.transpose(-2, -1), ra, rb, offs=ends, out_dtype=torch.bfloat16)
        try:
            tsg(0)
            fns["torch._scaled_grouped_mm (rowwise scales)"] = tsg
        except (RuntimeError, TypeError, AttributeError) as e:
            out["torch_scaled_grouped_mm"] = f"skipped: {type(e).__name__}: {str(e)[:160]}"
        # the decode floor: one read of the FP8 weights
        rk = loader.load(READ_PTX, device=dev, name="bench weight read")["p3_bench_read"]
        sink = driver.DeviceBuffer(16, fill=0)
        closers.append(sink)
        nvec = E * N * K // 16
        rblk = rk.params_block(src=bw.data_ptr(), n_vec=nvec, out=sink.ptr)
        fns[FLOOR] = lambda i: rblk.launch((-(-nvec // 1024),), (256,), s)
        if name == "decode":
            _packed_variant(ctx, fns, closers, x, bw, sb, rpe, m_idx, counts_er, src, cfgs[1], cptr[1])
        dg, why = _deep_gemm()
        if dg is not None:
            d = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
            mi = torch.from_numpy(m_idx).cuda()

            def dgc(i):
                with torch.cuda.stream(ts):
                    dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((aq, sa), (bw, sb), d, mi)
            dg_send = sender.prepare(cfgs[0], d.view(torch.uint8), offsets, expert_offsets_host=off,
                                     count_ptrs=cptr[0], same_gpu=True, into=sender.k.params_block())

            def dgc_send(i):
                dgc(i)
                sender.launch(s, dg_send)
            dgc(0)
            s.synchronize()
            dgot = _bf16_rows(torch, d, sel)
            mine = c[torch.from_numpy(real_rows).cuda()].float()
            theirs = d[torch.from_numpy(real_rows).cuda()].float()
            diff = (mine - theirs).abs()
            out["deepgemm"] = {"commit": getattr(dg, "__commit__", os.environ.get("P3SEND_DEEPGEMM_COMMIT", "?")),
                               "max_abs_diff_vs_p3": float(diff.max()),
                               "max_rel_diff_vs_p3": float((diff / theirs.abs().clamp_min(1e-30)).max()),
                               "rel_norm_diff_vs_p3": float(diff.norm() / theirs.norm()),
                               "its_max_err_over_bound": float((np.abs(dgot - r64) / bound).max()),
                               "its_rel_norm": float(np.linalg.norm(dgot - r64) / np.linalg.norm(r64))}
            fns["DeepGEMM contiguous"] = dgc
            fns["DeepGEMM contiguous + p3_scatter_send"] = dgc_send
            if name == "decode":
                cap = 128
                am = aq.view(E, cap, K)
                sam = torch.empty(E, lay.kb, cap, device="cuda", dtype=torch.float32)
                sam.copy_(sa.reshape(E, cap, lay.kb).transpose(1, 2))
                samv = sam.transpose(1, 2)                       # (E, cap, K/128), per-expert MN-major
                dm = torch.empty(E, cap, N, device="cuda", dtype=torch.bfloat16)
                mm = torch.from_numpy(rpe.astype(np.int32)).cuda()

                def dgm(i):
                    with torch.cuda.stream(ts):
                        dg.m_grouped_gemm_fp8_fp8_bf16_nt_masked((am, samv), (bw, sb), dm, mm, mean_rows)
                dgm(0)
                fns["DeepGEMM masked"] = dgm
        else:
            out["deepgemm"] = f"skipped: {why}"
        skip = [t for t in os.environ.get(SKIP_ENV, "").split(",") if t]
        for k in [k for k in fns if any(t in k for t in skip)]:
            fns.pop(k)
            out.setdefault("skipped", []).append(f"{k} ({SKIP_ENV})")
        for k, fn in fns.items():   # one launch each, alone: a contender that fails is named here
            print(f"[probe] {name}: {k}", flush=True)
            fn(0)
            s.synchronize()
        passes = [Timer(s).interleaved(fns, rounds=max(3, a.iters // 8), per_round=4, warmup=a.warmup)
                  for _ in range(PASSES)]
        res = {}
        for k in fns:
            meds = [p[k]["median_us"] for p in passes]
            res[k] = {"median_us": statistics.median(meds), "pass_medians_us": meds,
                      "min_us": min(p[k]["min_us"] for p in passes), "max_us": max(p[k]["max_us"] for p in passes),
                      "n": sum(p[k]["n"] for p in passes)}
            res[k]["TFLOPs"] = flops / (res[k]["median_us"] * 1e-6) / 1e12
        out["results"] = res
        if STALE:
            out["stale_variants"] = dict(STALE)
        out["ratios"] = _ratios(res, name, bm0, passes)
    finally:
        for cl in closers:
            (cl.free if isinstance(cl, driver.DeviceBuffer) else cl.close)()
        for b in [x for r in recvs for x in r] + [x for r in counts for x in r] + [table_buf, src_buf, offsets]:
            b.free()
        del m_dev
    return out


def _packed_variant(ctx, fns, closers, x, bw, sb, rpe, m_idx, counts_er, src, cfg, cptr) -> None:
    """The decode variant: the real rows packed (expert e's rows start where e-1's end, no
    padding), 64-row tiles; gated and fused, added to ``fns``."""
    torch, dev, s = ctx.torch, ctx.dev, ctx.stream
    E, K = bw.shape[0], bw.shape[2]
    real_rows = torch.from_numpy(np.flatnonzero(m_idx >= 0)).cuda()
    off_p = np.concatenate([[0], np.cumsum(rpe)]).astype(np.int32)
    rows_p = int(off_p[-1])
    lay = scale_layout(rows_p, K)
    xp = x[real_rows].contiguous()
    ap = torch.empty(rows_p, K, device="cuda", dtype=torch.float8_e4m3fn)
    sap = torch.empty(lay.kb, lay.m_pad, device="cuda", dtype=torch.float32).t()[:rows_p]
    QuantFp8(dev)(xp, ap, sap, stream=s)
    s.synchronize()
    bufs = [driver.DeviceBuffer.from_array(v) for v in
            (off_p, encode_range_table(off_p, counts_er), src[m_idx >= 0].copy())]
    closers += bufs
    cfg_p = rank_config(n_ranks=cfg.n_ranks, recv_bufs=list(cfg.recv_buf_ptrs)[:cfg.n_ranks], top_k=cfg.top_k,
                        msg_bytes=cfg.msg_bytes, max_tokens=cfg.max_tokens_per_rank, range_table=bufs[1],
                        src_info=bufs[2])
    cp = torch.empty(rows_p, bw.shape[1], device="cuda", dtype=torch.bfloat16)
    g = GroupedGemmFp8Send(E, device=dev)
    closers.append(g)
    common = dict(expert_offsets_host=off_p, expert_align=1, bm=64)
    gated = g.prepare(cfg_p, ap, sap, bw, sb, bufs[0], cp, into=g.k.params_block(), **common)
    fused = g.prepare(cfg_p, ap, sap, bw, sb, bufs[0], count_ptrs=cptr, p3_control=0, same_gpu=True,
                      into=g.k.params_block(), **common)
    fns["p3_gemm_fp8_send gated bm=64, packed rows"] = lambda i: g.launch(s, gated)
    fns["p3_gemm_fp8_send fused bm=64, packed rows"] = lambda i: g.launch(s, fused)


def _ratios(res: dict, name: str, bm0: int, passes: list) -> dict:
    """Each target's ratio from the medians, with its spread over the passes."""
    def r(a_key, b_key, op="/"):
        if a_key not in res or b_key not in res:
            return None
        per = [(p[a_key]["median_us"] / p[b_key]["median_us"]) if op == "/" else
               (p[a_key]["median_us"] - p[b_key]["median_us"]) for p in passes]
        return {"value": statistics.median(per), "passes": per}
    gated, fused = f"p3_gemm_fp8_send gated bm={bm0}", f"p3_gemm_fp8_send fused bm={bm0}"
    out = {"gemm_over_deepgemm": r(gated, "DeepGEMM contiguous"),
           "fused_over_gemm": r(fused, gated),
           "fused_row_cache_over_gemm": r(f"p3_gemm_fp8_send fused bm={bm0}, row cache", gated),
           "fused_minus_gemm_us": r(fused, gated, "-"),
           "fused_over_deepgemm_then_send": r(fused, "DeepGEMM contiguous + p3_scatter_send"),
           "gemm_over_read_floor": r(gated, FLOOR),
           # the promotion's cost on each kernel: its gated GEMM over its own no-promotion variant
           "promotion_cost": r(f"{gated}, {NARROW}", f"p3_gemm_fp8_send gated bm={bm0}, promotion off (wrong numbers)"),
           "wide_promotion_cost": r(gated, f"{gated}, {SHAPE_VARIANTS['wide_no_promote'][0]}"),
           "fp8_linked_over_inlined": r(f"p3_gemm_fp8_send fused bm={bm0}, linked (cuLink)", fused),
           "bf16_linked_over_inlined": r("p3_gemm_send (bf16) fused, linked (cuLink)", "p3_gemm_send (bf16) fused"),
           "bf16_linked_outlined_over_inlined": r(BF16_OUTLINED, "p3_gemm_send (bf16) fused"),
           "fp8_over_bf16": r(gated, "p3_gemm_send (bf16) gated")}
    for label in (NARROW, *(v[0] for v in SHAPE_VARIANTS.values())):
        g_v, f_v = f"{gated}, {label}", f"{fused}, {label}"
        out[f"[{label}] gemm_over_deepgemm"] = r(g_v, "DeepGEMM contiguous")
        out[f"[{label}] gemm_over_shipped_gemm"] = r(g_v, gated)
        out[f"[{label}] fused_over_gemm"] = r(f_v, g_v)
        out[f"[{label}] fused_over_shipped_fused"] = r(f_v, fused)
        out[f"[{label}] fused_over_deepgemm_then_send"] = r(f_v, "DeepGEMM contiguous + p3_scatter_send")
    if name == "decode":
        out["packed_bm64_over_read_floor"] = r("p3_gemm_fp8_send gated bm=64, packed rows", FLOOR)
        out["packed_fused_minus_gemm_us"] = r("p3_gemm_fp8_send fused bm=64, packed rows",
                                              "p3_gemm_fp8_send gated bm=64, packed rows", "-")
        out["masked_deepgemm_over_read_floor"] = r("DeepGEMM masked", FLOOR)
    return {k: v for k, v in out.items() if v is not None}


def measure(ctx) -> dict:
    if ctx.torch is None:
        return {"skipped": "needs torch (the inputs, DeepGEMM and torch._scaled_grouped_mm use it)"}
    if tuple(ctx.dev.cc) != (9, 0):
        return {"skipped": f"p3_gemm_fp8_send is Hopper-only (sm_90a); {ctx.dev.name} is "
                           f"sm_{ctx.dev.cc[0]}{ctx.dev.cc[1]}"}
    shapes = os.environ.get("P3SEND_FP8_SHAPES")
    names = [n for n in SHAPES if shapes is None or n in shapes.split(",")]
    return {n: measure_shape(ctx, n) for n in names}


def run(ctx, out: dict) -> None:
    """Section ``gemm_fp8``: every shape into out["gemm_fp8"]."""
    out["gemm_fp8"] = measure(ctx)


TARGETS = {"gemm_over_deepgemm": "<= 1.00 (prefill shapes)", "fused_over_gemm": "<= 1.03 prefill",
           "fused_row_cache_over_gemm": "(measured)",
           "fused_minus_gemm_us": "<= 5 us decode", "fused_over_deepgemm_then_send": "<= 0.85 prefill",
           "gemm_over_read_floor": "<= 1.30 decode", "promotion_cost": "(measured: the 384-thread kernel)",
           "wide_promotion_cost": "(measured: the wide kernel)",
           "fp8_linked_over_inlined": "<= 1.05", "bf16_linked_over_inlined": "<= 1.05", "fp8_over_bf16": "(measured)",
           "bf16_linked_outlined_over_inlined": "<= 1.05 (the outline variant)",
           "packed_bm64_over_read_floor": "<= 1.30 decode (the decode variant)",
           "packed_fused_minus_gemm_us": "<= 5 us decode (the decode variant)",
           "masked_deepgemm_over_read_floor": "(DeepGEMM)"}


def table(out: dict) -> str:
    g, instead = shape_results(out, "gemm_fp8", "9. FP8 grouped GEMM + send")
    if g is None:
        return instead
    L = []
    for shape, r in g.items():
        L.append(f"\n9. FP8 grouped GEMM + send, {shape}: {r['real_rows']} real rows ({r['rows']} with padding) over "
                 f"{r['experts']} experts, K={r['k']}, N={r['n']} ({r['gflop_useful']:.1f} useful GFLOP, "
                 f"{r['weights_mb']:.0f} MB of FP8 weights); fused == gated C then p3_scatter_send: "
                 f"{r['fused_equals_gated_then_scatter_send']}; C error on {r['error']['sampled_rows']} sampled rows: "
                 f"max {r['error']['max_err_over_bound']:.3g} of the bound, rel norm {r['error']['rel_norm']:.3g}")
        for k in ("deepgemm", "no_promote", *SHAPE_VARIANTS, "torch_scaled_grouped_mm", "skipped", "stale_variants"):
            if k in r:
                L.append(f"   {k}: {r[k]}")
        if "linked_registers" in r:
            L.append(f"   registers: {r['linked_registers']}")
        n = next(iter(r["results"].values()))["n"]
        L.append(f"   contenders timed in turns, {PASSES} passes, {n} launches each (median of the pass medians; "
                 f"pass medians; min .. max)")
        for k, v in r["results"].items():
            pm = " ".join(f"{m:.1f}" for m in v["pass_medians_us"])
            L.append(f"   {k:<62} {v['median_us']:9.1f} us {v['TFLOPs']:7.1f} TFLOP/s  [{pm}]  "
                     f"({v['min_us']:.0f} .. {v['max_us']:.0f})")
        for k, v in r["ratios"].items():
            ps = " ".join(f"{p:.3f}" for p in v["passes"])
            L.append(f"   {k:<34} {v['value']:8.3f}  [{ps}]  target {TARGETS.get(k, '')}")
    return "\n".join(L)
