// p3_gemm_fp8_send.cu: the MoE down-projection as DeepSeek-V3 serves it, an FP8 block-scaled
// grouped GEMM for Hopper (sm_90a), with p3send's peer send in its epilogue. Built to
// ptx/p3_gemm_fp8_send.ptx by tools/build_gemm_fp8.py (nvcc -rdc: p3_send_rows / p3_send_flush
// stay .extern, resolved at load time from ptx/p3_send_rows.ptx, inlined whole-program or
// linked with cuLink/nvJitLink), as ptx/cuda/p3_gemm_send.cu is built.
//
// C[r, n] = sum over kb of sa[r, kb] * sb[e, n/128, kb] * sum_{k in kb} A[r, k] * B[e, n, k] for
// every absolute row r of expert e (expert_offsets[e] <= r < expert_offsets[e+1]): A e4m3 (rows,
// K), its scales sa float32 per (row, 128 of K) in DeepGEMM's TMA-aligned MN-major layout; B
// e4m3 (E, N, K) (K contiguous), its scales sb float32 (E, N/128, K/128); C bf16.
//
// Structure: that of the bf16 kernel (a persistent grid, 384 threads, 168 registers at most,
// no setmaxnreg: the send warps need theirs). Warp 0 is the producer: one thread streams, per
// 128-wide k-block (one scale block), A (BM x 128 bytes), B (128 x 128 bytes) and the tile's
// activation scales (BM + 4 floats from row m0 rounded down to 4: the tensor memory
// accelerator traps on an inner coordinate that is not 16-byte aligned) into a 4-stage ring.
// Tiles are BM x 256 (the last of a row of tiles 128 columns when N is an odd multiple of 128),
// each computed as two 128-column mainloops one after the other (the 64 accumulators + 64 sums
// of one per thread), the producer streaming A and B's 128 rows of the first, then the
// second. Warpgroups 1 and 2 are the consumers. BM = 128: each owns 64 rows x 128 columns
// (m64n128k32); BM = 64 (decode): each owns the 64 rows x 64 of the columns (m64n64k32).
// Per k-block a consumer runs its four k32 wgmmas into a fresh accumulator, waits for them,
// releases the stage and promotes: sum = fma(acc, sa[row] * sb, sum) in fp32 (DeepSeek-V3's
// promotion every 128 of K, which the scales force anyway). The two warpgroups issue their
// k-blocks in turns (two named barriers, as FlashAttention-3's ping-pong: warpgroup 0's kb,
// then 1's kb, then 0's kb + 1), so one promotes while the other's wgmmas run. The weights'
// scale of the mainloop (one per k-block: its 128 columns are one scale block) is read with
// ld.global.nc two k-blocks ahead. Rows past an expert's end are computed and masked, as in
// the bf16 kernel.
//
// Epilogue: the bf16 kernel's (p3_gemm_send.cu), the same code (p3_gemm_common.cuh), with its
// 256-column tiles: the consumers stage each mainloop's 128 columns as bf16 into one 128 x 256
// staged tile (528-byte rows: conflict-free), three send warps store the valid rows into C
// (send off: ctx->p3_control < 0 or cfg.n_ranks == 0) or send them with p3_send_rows /
// p3_send_flush (seg_bytes 512 per tile, 256 for a 128-column last tile), overlapped with the
// next tile's mainloops. The set-up, the producer's A and B loads and a consumer's wgmmas of
// a k-block are the shared ones too. Measured against the earlier 128 x 128 tiles (variant
// tile128): the same C bit for bit; half the p3_send_rows calls per row of C.
//
// Two shipped kernels are built from this source: p3_gemm_fp8_send (ptx/p3_gemm_fp8_send.ptx,
// no macro: 384 threads, the structure above) and p3_gemm_fp8_send_wide
// (ptx/p3_gemm_fp8_send_wide.ptx, -DP3F_WIDE = P3F_DUAL + P3F_NO_TURNS + P3F_SEND_WG3 +
// P3F_ELECT + P3G_DESC32, setmaxnreg 24 / 88 / 200: 512 threads, two accumulator sets per
// consumer, four send warps in a warpgroup of their own). The wide kernel is the faster one at
// 128-row tiles inlined (docs/PERF.md: its two accumulators overlap each warpgroup's promotion
// with its own wgmmas, and
// the fused launch, bound by three send warps once the mainloop is that fast, needs more send
// warps, with the registers p3_send_rows needs: 88, not the 56 that seven of them share); the
// 384-thread kernel is the one for 64-row tiles and for the linked route (ptxas drops setmaxnreg
// in a kernel that calls an extern function: C7504, measured 7.5x slower).
//
// Variants for measurement only (tools/build_gemm_fp8.py --variant; the shipped PTX is built
// with none of these macros but P3F_WIDE):
// - -DP3F_TILE128: the kernel shipped before (up to fbb32ce): 128 x 128 tiles, one mainloop
//   each, 5 stages, the staged tile 272-byte rows, 256-byte send segments, no turns (-DP3F_TURNS
//   adds them). The other variants combine with it.
// - -DP3F_NO_TURNS: the consumers' k-blocks not in turns.
// - -DP3F_NO_PROMOTE: the tensor cores accumulate all of K with the last k-block's scales
//   applied once (wrong unless every scale is equal); the difference in time is the cost of
//   the promotion. With P3F_DUAL each accumulator set accumulates its own k-blocks and the two
//   are added at the end.
// - -DP3F_DUAL: two accumulator sets per consumer warpgroup: k-block kb + 1's wgmmas are issued
//   into one before k-block kb's are waited for (wgmma.wait_group 1) and promoted from the
//   other, so a warpgroup's promotion overlaps its own tensor work. 3 x 64 accumulator
//   registers: setmaxnreg moves registers from warpgroup 0 (the producer and the send warps,
//   p3_send_rows included) to the consumers (P3F_REGS_PRODUCER / P3F_REGS_CONSUMER).
// - -DP3F_OUTLINE: the consumer's mainloop in a function of its own (not inlined), for the
//   linked route: ptxas serialises every wgmma of a function that makes extern calls (C7509:
//   each wgmma waited for at once), and with -c the kernel's calls of p3_send_rows are extern;
//   the outlined consumer makes none, so its wgmmas stay asynchronous there. Whole-program
//   (the loader's inlined module) the call into it serialises them instead (C7510): linked only.
// - -DP3F_SEND_WG: 512 threads, four more send warps (warps 12..15, a fourth warpgroup: seven in
//   all), one accumulator set; setmaxnreg: 160 registers for the consumers, 96 for the rest.
// - -DP3F_SEND_WG3: 512 threads, the send warps are the four of a fourth warpgroup (warps
//   12..15) with registers of their own (P3F_REGS_WG3), warps 1..3 exit after the set-up and the
//   producer's warpgroup keeps P3F_REGS_PRODUCER (24: one thread issuing copies).
// - -DP3F_WIDE_BODY: the wide kernel's macros above under p3_gemm_fp8_send's name (-DP3F_WIDE
//   is this and the name p3_gemm_fp8_send_wide), for variants of the wide kernel; with
//   P3F_TILE128 (variant wide_t128) on 128 x 128 tiles, 5 stages, 202,660 bytes.
// - -DP3F_ELECT: no register holds the lane through the mainloops (an elected lane arrives on
//   the empty barrier, the lane and the staged tile's address read afresh): at 200 registers
//   per consumer ptxas spilled them otherwise.
// - -DP3F_MCAST (with P3F_WIDE_BODY): clusters of two CTAs (__cluster_dims__: a plain launch
//   makes them); with N a multiple of 512 tiles t and t ^ 1 of a round are one m-tile, so A's
//   k-blocks come in turns from either CTA, multicast into both (else each tile loads its own),
//   and each CTA's consumers release a stage in both CTAs (DeepGEMM multicasts B over its
//   clusters of two the same way). Measured slower (docs/PERF.md). With P3F_TILE128 too
//   (variant mcast_t128) the pairs are adjacent 128-column tiles (N a multiple of 256), 5 stages.
// Internally P3F_PAIR (the 256-column tiles) is defined unless P3F_TILE128, P3F_PINGPONG (the
// turns) unless P3F_NO_TURNS or P3F_TILE128 without P3F_TURNS.
// setmaxnreg.inc waits until the CTA's pool has the registers: the pool is what the launch
// allocated, THREADS x the kernel's register count (384 x 168 = 64,512, not 65,536; 512 x 128),
// so a split over it never completes (it hung once: static_assert below).
//
// The header of ptx/p3_gemm_fp8_send.ptx (its interface) is the block between the two marker
// lines below: tools/build_gemm_fp8.py copies it verbatim. Every line is a // comment, and
// none may end in a backslash.
// ---- begin ptx/p3_gemm_fp8_send.ptx header ----
//
// p3_gemm_fp8_send.ptx: the MoE down-projection as an FP8 block-scaled grouped GEMM for
// Hopper (sm_90a: TMA, wgmma e4m3, mbarriers, warp specialisation) with p3send's peer send in
// its epilogue (DeepSeek-V3's recipe: activations scaled per 1 x 128, weights per 128 x 128).
// GENERATED by tools/build_gemm_fp8.py from ptx/cuda/p3_gemm_fp8_send.cu (nvcc -rdc, sm_90a):
// edit the source, not this file.
//
// ENTRY p3_gemm_fp8_send
// C[r, n] = sum_kb sa[r, kb] * sb[e, n/128, kb] * (A[r, 128kb:128kb+128] . B[e, n, 128kb:128kb+128])
// for every absolute row r of local expert e (expert_offsets[e] <= r < expert_offsets[e+1]);
// A e4m3 (rows, K) row-major, sa float32 (row, kb) at sa + kb*col_stride + 4*row (DeepGEMM's
// TMA-aligned MN-major layout), B e4m3 (E, N, K) (K contiguous), sb float32 (E, N/128, K/128)
// contiguous, C bf16 rounded to nearest even. Each 128-wide k-block is summed by the tensor
// cores and promoted into an fp32 sum with its scales (one fma per element and k-block).
// A persistent grid: CTA b takes tiles b, b + grid, ... of BM x 256 output tiles (the last of
// each row of tiles BM x 128 when N is an odd multiple of 128) numbered (expert, m-tile,
// n-tile), m-tile major, each computed as two 128-column mainloops in turn. Warp 0 streams
// k-blocks of A (BM x 128), B (128 x 128) and the activation scales (BM + 4 floats) through
// tensor maps into a 4-stage mbarrier ring; warpgroups 1 and 2 multiply with wgmma (BM = 128:
// 64 rows x 128 each; BM = 64: 64 x 64 each), issuing their k-blocks in turns (named barriers
// 1 and 2), and stage each finished mainloop as bf16 into the tile's half of shared memory;
// warps 1..3 (send warps) handle the staged tile while the consumers run the next tile's.
// Rows past an expert's end are computed and masked (in DeepGEMM's contiguous layout each
// span's padding rows are computed and, with the send on, owned by no rank: never sent). Send
// off (ctx.p3_control < 0 or cfg.n_ranks == 0): 16-byte stores of the valid rows into C. Send
// on: p3_send_rows by each send warp (warp_rank 0..2 of 3, its own P3SendAcct, 512-byte
// column tiles, 256 for a last 128-column one; p3_send_flush right after the warp's last tile
// of each expert; an expert with no rows is flushed empty by send warp 0 of CTA e % grid):
// the receive buffers and counts then hold exactly what p3_scatter_send writes from that C
// (on the FP8 wire: p3_scatter_send_fp8, unless FLAG_WIRE_FP8_STAGED, below), and C is not
// written. The FP8 wire (FLAG_WIRE_FP8 in ctx.flags): the send warps' p3_send_rows
// quantises the staged bf16 tile, or, with FLAG_WIRE_FP8_STAGED (128) too, the consumers quantise
// their fp32 sums into the staged tile (codes, then scales) and p3_send_rows copies it
// (bm 128 only: with bm 64 the flag makes the launch send nothing and set diag[2]).
// PARAMS
//   off  size  type              name          meaning
//     0   184  P3PeerSendConfig  cfg           the ABI struct, by value (send_mbx ignored); read by the send only
//   184     8  u64               ctx           ptr: P3SendCtx (104 bytes): expert_offsets, n_experts (1..128), p3_control, and the send's count_ptrs, state, diag, flags
//   192     8  u64               tmaps         ptr: three CUtensorMap (384 bytes, 64-byte aligned, device memory): [0] A as e4m3 bytes 2-D (K, rows), box (128, bm), 128-byte swizzle; [1] B as e4m3 bytes 2-D (K, E*N), box (128, 128), 128-byte swizzle; [2] sa as float32 2-D (m_pad, K/128) at col_stride bytes, box (bm + 4, 1), no swizzle (loaded from row m0 rounded down to 4: TMA needs a 16-byte aligned inner coordinate); zero fill
//   200     8  u64               sb            ptr: float32 weight scales (E, N/128, K/128), contiguous, 4-byte aligned
//   208     8  u64               c_ptr         ptr: C, bf16 rows of 2*n_cols bytes at c_row_stride, 16-byte aligned; written only with the send off
//   216     8  u64               c_row_stride  bytes between rows of C; multiple of 16, >= 2*n_cols
//   224     4  u32               n_cols        N: a positive multiple of 128 (cfg.msg_bytes = 2*N with the send on)
//   228     4  u32               k_dim         K: a positive multiple of 128
//   232     4  u32               bm            rows per tile: 128, or 64 for few rows per expert (decode)
// LAUNCH grid (1..number of SMs, 1, 1) (any size is correct; one CTA per SM), block (384, 1, 1),
// dynamic shared memory 201956 bytes (allow it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
// module: this file with ptx/p3_send_rows.ptx appended (minus its .version, .target and
// .address_size lines), or linked with it.
// ORDERING C: weak 16-byte stores, visible after the kernel (stream order). The send: as
// p3_send_rows / p3_send_flush (weak peer stores released by the flush of the expert's last
// warp, fence.acq_rel + st.release of the counts; .gpu with FLAG_SCOPE_GPU); ctx, cfg, A, B,
// the scales, expert_offsets, the tensor maps and the routing inputs must be complete before
// the launch and unchanged during it.
// REQUIRES sm_90a: compute capability 9.0 exactly (H100, H200, GH200); PTX ISA 9.0 (driver >=
// 580). Other GPUs cannot load it. Bad n_experts, bm, n_cols or k_dim: the kernel does nothing.
// TIMEOUT none: never waits on another kernel or GPU (mbarrier waits are on its own copies).
//
// ---- end ptx/p3_gemm_fp8_send.ptx header ----
// The header of ptx/p3_gemm_fp8_send_wide.ptx (the -DP3F_WIDE build), copied the same way:
// ---- begin ptx/p3_gemm_fp8_send_wide.ptx header ----
//
// p3_gemm_fp8_send_wide.ptx: p3_gemm_fp8_send's GEMM and send (ptx/p3_gemm_fp8_send.ptx: the
// same parameters, C and receive buffers bit for bit) as a 512-thread kernel, the faster at
// 128-row tiles with the module inlined (docs/PERF.md).
// GENERATED by tools/build_gemm_fp8.py from ptx/cuda/p3_gemm_fp8_send.cu (nvcc -rdc, sm_90a,
// -DP3F_WIDE): edit the source, not this file.
//
// ENTRY p3_gemm_fp8_send_wide
// C[r, n] = sum_kb sa[r, kb] * sb[e, n/128, kb] * (A[r, 128kb:128kb+128] . B[e, n, 128kb:128kb+128])
// for every absolute row r of local expert e (expert_offsets[e] <= r < expert_offsets[e+1]):
// p3_gemm_fp8_send's product, tiles, tile order and rounding. Warp 0 streams the k-blocks into
// the 4-stage ring as there (warps 1..3 exit after the set-up); warpgroups 1 and 2 multiply with
// wgmma into two accumulator sets each (k-block kb + 1's wgmmas are issued before kb's are
// waited for and promoted: the same fma per element and k-block, in the same order), not in
// turns; setmaxnreg gives the consumer warpgroups 200 registers per thread, warpgroup 3 88 and
// warpgroup 0 24. Four send warps (warpgroup 3: warps 12..15, warp_rank 0..3 of 4, each its own
// P3SendAcct) handle the staged tiles: send off, 16-byte stores of the valid rows into C; send
// on, p3_send_rows / p3_send_flush as p3_gemm_fp8_send's send warps do (the receive buffers and
// counts then hold what p3_scatter_send writes from that C), and the FP8 wire as there
// (FLAG_WIRE_FP8_STAGED: the consumers quantise their fp32 sums).
// PARAMS
//   off  size  type              name          meaning
//     0   184  P3PeerSendConfig  cfg           the ABI struct, by value (send_mbx ignored); read by the send only
//   184     8  u64               ctx           ptr: P3SendCtx (104 bytes): expert_offsets, n_experts (1..128), p3_control, and the send's count_ptrs, state, diag, flags
//   192     8  u64               tmaps         ptr: three CUtensorMap (384 bytes, 64-byte aligned, device memory): [0] A as e4m3 bytes 2-D (K, rows), box (128, bm), 128-byte swizzle; [1] B as e4m3 bytes 2-D (K, E*N), box (128, 128), 128-byte swizzle; [2] sa as float32 2-D (m_pad, K/128) at col_stride bytes, box (bm + 4, 1), no swizzle (loaded from row m0 rounded down to 4: TMA needs a 16-byte aligned inner coordinate); zero fill
//   200     8  u64               sb            ptr: float32 weight scales (E, N/128, K/128), contiguous, 4-byte aligned
//   208     8  u64               c_ptr         ptr: C, bf16 rows of 2*n_cols bytes at c_row_stride, 16-byte aligned; written only with the send off
//   216     8  u64               c_row_stride  bytes between rows of C; multiple of 16, >= 2*n_cols
//   224     4  u32               n_cols        N: a positive multiple of 128 (cfg.msg_bytes = 2*N with the send on)
//   228     4  u32               k_dim         K: a positive multiple of 128
//   232     4  u32               bm            rows per tile: 128 (64 works and is correct; p3_gemm_fp8_send is the faster there)
// LAUNCH grid (1..number of SMs, 1, 1) (any size is correct; one CTA per SM), block (512, 1, 1),
// dynamic shared memory 202004 bytes (allow it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
// module: this file with ptx/p3_send_rows.ptx appended (minus its .version, .target and
// .address_size lines). Linking it with p3_send_rows instead loads, but ptxas then ignores its
// setmaxnreg (C7504) and spills: link ptx/p3_gemm_fp8_send.ptx instead (docs/EMBEDDING.md).
// ORDERING as p3_gemm_fp8_send.
// REQUIRES sm_90a: compute capability 9.0 exactly (H100, H200, GH200); PTX ISA 9.0 (driver >=
// 580). Other GPUs cannot load it. Bad n_experts, bm, n_cols or k_dim: the kernel does nothing.
// TIMEOUT none: never waits on another kernel or GPU (mbarrier waits are on its own copies).
//
// ---- end ptx/p3_gemm_fp8_send_wide.ptx header ----
#if defined(P3F_WIDE) || defined(P3F_WIDE_BODY)
#define P3G_DESC32                                // the wide kernel's: p3_gemm_common.cuh says what
#endif
#include "p3_gemm_common.cuh"                     // and ../p3send.h

#ifdef P3F_WIDE                                   // the shipped wide kernel (above) ...
#define P3F_WIDE_BODY
#define P3F_ENTRY p3_gemm_fp8_send_wide
#else
#define P3F_ENTRY p3_gemm_fp8_send
#endif
#ifdef P3F_WIDE_BODY                              // ... its structure (variants: under ENTRY's name)
#define P3F_DUAL
#define P3F_NO_TURNS
#define P3F_SEND_WG3
#define P3F_ELECT
#define P3F_REGS_PRODUCER 24
#define P3F_REGS_WG3 88
#define P3F_REGS_CONSUMER 200
#endif
#define P3F_STR2(x) #x
#define P3F_STR(x) P3F_STR2(x)

#ifndef P3F_TILE128
#define P3F_PAIR
#endif
#if !defined(P3F_NO_TURNS) && (!defined(P3F_TILE128) || defined(P3F_TURNS))
#define P3F_PINGPONG
#endif

// 128 columns per mainloop and 128 e4m3 per k-block (one scale block each); after the staged
// tile, the stages of activation scales: (BM + 4) floats, 128-byte aligned, each
constexpr int SA_STAGE = 640;
constexpr int SBLK = 128;                         // the weights' scale blocks: SBLK x SBLK
#if defined(P3F_PAIR)
// two 128-column mainloops per 128 x 256 tile, staged together (528-byte rows) and sent as
// 512-byte segments: 4 stages
constexpr int P3F_BN = 256, P3F_STAGES = 4, P3F_SMEM = 201956;
#else
constexpr int P3F_BN = 128, P3F_STAGES = 5, P3F_SMEM = 202612;
#endif
#if defined(P3F_SEND_WG3)
// four send warps, all in the fourth warpgroup (warps 12..15); warps 1..3 exit after the set-up
struct Layout : GemmLayout<P3F_BN, 128, 1, P3F_STAGES, P3F_STAGES * SA_STAGE, 4, 512, 128> {
    static __device__ __forceinline__ int send_rank(int warp) { return warp >= 12 ? warp - 12 : -1; }
#ifdef P3F_MCAST
    static constexpr int EMPTY_ARRIVALS = 16;       // both CTAs' consumer warps release a stage
#endif
};
// the wide kernel's: its PTX header's LAUNCH and GroupedGemmFp8Send.WIDE
static_assert(Layout::SMEM == P3F_SMEM + 48, "the dynamic shared memory of the wide kernel's LAUNCH");
#ifndef P3F_REGS_PRODUCER
#define P3F_REGS_PRODUCER 32
#endif
#ifndef P3F_REGS_WG3
#define P3F_REGS_WG3 80
#endif
#ifndef P3F_REGS_CONSUMER
#define P3F_REGS_CONSUMER 200
#endif
#elif defined(P3F_SEND_WG)
using Layout = GemmLayout<P3F_BN, 128, 1, P3F_STAGES, P3F_STAGES * SA_STAGE, 7, 512, 128>;
static_assert(Layout::SMEM == P3F_SMEM + 4 * 48, "the variants' dynamic shared memory (bench/gemm_fp8.py)");
#ifndef P3F_REGS_PRODUCER                         // with P3F_DUAL too (variant dual_sw): 56 / 200
#define P3F_REGS_PRODUCER 96
#endif
#ifndef P3F_REGS_CONSUMER
#define P3F_REGS_CONSUMER 160
#endif
#else
using Layout = GemmLayout<P3F_BN, 128, 1, P3F_STAGES, P3F_STAGES * SA_STAGE, 3, 384, 128>;
// the shipped kernel's: its PTX header's LAUNCH and GroupedGemmFp8Send.SMEM (tile128's: the bench)
static_assert(Layout::SMEM == P3F_SMEM, "the dynamic shared memory of the PTX header's LAUNCH and of GroupedGemmFp8Send");
#endif
#if defined(P3F_DUAL) || defined(P3F_SEND_WG) || defined(P3F_SEND_WG3)
#define P3F_SET_REGS
#ifndef P3F_REGS_WG3
#define P3F_REGS_WG3 P3F_REGS_PRODUCER
#endif
#ifndef P3F_REGS_PRODUCER
#define P3F_REGS_PRODUCER 88
#endif
#ifndef P3F_REGS_CONSUMER
#define P3F_REGS_CONSUMER 208
#endif
// the registers at entry: 65536 / THREADS rounded down to 8 (what __launch_bounds__(THREADS, 1) caps at)
constexpr int ENTRY_REGS = 65536 / Layout::THREADS / 8 * 8;
static_assert(128 * P3F_REGS_PRODUCER + (Layout::THREADS == 512 ? 128 * P3F_REGS_WG3 : 0) + 256 * P3F_REGS_CONSUMER <=
              Layout::THREADS * ENTRY_REGS, "setmaxnreg: the split must fit the registers the launch allocated");
static_assert(P3F_REGS_PRODUCER % 8 == 0 && P3F_REGS_CONSUMER % 8 == 0 && P3F_REGS_WG3 % 8 == 0 &&
              P3F_REGS_PRODUCER >= 24 && P3F_REGS_WG3 >= 24 &&
              P3F_REGS_CONSUMER <= 256, "setmaxnreg: multiples of 8 in 24..256");
#endif

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, e4m3 from shared memory, K-major, 128-byte swizzle.
template <> __device__ __forceinline__ void wgmma_kstep<128>(float (&d)[64], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 64] (+)= A[64 x 32] * B[64 x 32]^T, e4m3 from shared memory, K-major, 128-byte swizzle.
template <> __device__ __forceinline__ void wgmma_kstep<64>(float (&d)[32], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}

#ifdef P3F_OUTLINE
#define P3F_CONSUMER_INLINE __device__ __noinline__
#else
#define P3F_CONSUMER_INLINE __device__ __forceinline__
#endif

#ifdef P3F_PINGPONG
// The consumers' turns (P3F_PINGPONG): named barrier TURN + w, 256 threads (warpgroup w waits
// on it, the other warpgroup arrives), means "warpgroup w may issue its next k-block". Barrier 0
// is __syncthreads; p3_send_rows uses none. Immediate ids (a register id reserves all 16).
constexpr int TURN = 1;
__device__ __forceinline__ void turn_wait(int w)
{
    if (w == 0)
        asm volatile("bar.sync %0, 256;" :: "n"(TURN) : "memory");
    else
        asm volatile("bar.sync %0, 256;" :: "n"(TURN + 1) : "memory");
}
__device__ __forceinline__ void turn_give(int w)
{
    if (w == 0)
        asm volatile("bar.arrive %0, 256;" :: "n"(TURN) : "memory");
    else
        asm volatile("bar.arrive %0, 256;" :: "n"(TURN + 1) : "memory");
}
#endif

// A consumer's wgmmas of one k-block (mma_kblock: a fresh accumulator), in its warpgroup's turn
// with P3F_PINGPONG: warpgroup w waits for turn w, issues, gives the other its turn.
template <int WN>
__device__ __forceinline__ void issue(float (&acc)[WN / 2], uint32_t base, uint32_t full, uint32_t s, uint32_t ph,
                                      uint32_t a_off, uint32_t b_off, int wg, int acc_kb = 0)
{
#ifdef P3F_PINGPONG
    turn_wait(wg);
#endif
    mma_kblock<Layout, WN>(acc, base, full, s, ph, a_off, b_off, acc_kb);
#ifdef P3F_PINGPONG
    turn_give(wg ^ 1);
#endif
}

// The turns' first and last (P3F_PINGPONG; nothing without): warpgroup 1 gives warpgroup 0 the
// first turn, warpgroup 0 takes the turn warpgroup 1 gives after its last k-block, so every
// give meets a wait and none is pending at exit. Only in a CTA with tiles (has).
__device__ __forceinline__ void turns_begin(int wg, bool has)
{
#ifdef P3F_PINGPONG
    if (wg == 1 && has)
        turn_give(0);
#endif
}
__device__ __forceinline__ void turns_end(int wg, bool has)
{
#ifdef P3F_PINGPONG
    if (wg == 0 && has)
        turn_wait(0);
#endif
}

// Where a consumer thread works (both consumers): its warpgroup's rows of the A or B stage
// (a_off, b_off: with WN 128 the two warpgroups split the tile's rows, else its columns), its
// tile rows (r0 and r0 + 8), the pipeline's mbarriers and its place in the staged bf16 tile.
template <int WN> struct ConsumerAt {
    uint32_t a_off, b_off, full, empty, staged, freed, stg;
    int r0;
    template <class Lane>     // int or uint32_t: each consumer keeps its own shift of lane
    __device__ __forceinline__ ConsumerAt(uint32_t base, int wg, int wq, Lane lane)
    {
        a_off = WN == 128 ? wg * 64 * Layout::BK : 0;
        b_off = WN == 128 ? 0 : wg * 64 * Layout::BK;
        const int row_off = WN == 128 ? wg * 64 : 0, col_off = WN == 128 ? 0 : wg * 64;
        r0 = row_off + wq * 16 + (lane >> 2);
        full = base + Layout::OFF_BAR;
        empty = full + 8 * Layout::STAGES;
        staged = empty + 8 * Layout::STAGES;
        freed = staged + 8;
        stg = base + Layout::OFF_STG + r0 * Layout::STG_PITCH + 2 * col_off + (lane & 3) * 4;
    }
};

// The FP8 wire from the fp32 sums (ctx.flags P3_FLAG_WIRE_FP8_STAGED with the send on; 128-row
// tiles only): one mainloop's 128 columns are one scale block of the wire, and a consumer thread
// holds 32 of them for each of its rows r0 and r0 + 8 (wgmma's order: columns 8j + 2(lane%4) +
// {0, 1}), so a row's amax is its quad's: two shuffles. Then p3_quant_fp8's arithmetic on the
// fp32 values (one rounding, to e4m3, where quantising the bf16 C is two): amax NaN-propagating
// (max.NaN, then the unsigned order of |x|'s bits), clamped at 1e-4, scale amax * fl(1/448),
// multiplier fl(1/amax) * 448, x * multiplier by cvt.rn.satfinite.e4m3x2.f32. Staged as
// p3_send_rows copies under the flag: row r's codes of mainloop h at byte 128h of its staged row,
// its scale at 128 * halves + 4h; the send warps then only copy (on this wire they quantised
// the staged bf16 tile themselves, and bound the fused launch: docs/PERF.md, "The FP8 wire").
// Without this path in the outline variant: rcp.rn.f32's slow path is a subroutine call, and a
// call in the outlined consumer is what it exists to avoid (C7509); it refuses the flag.
#ifdef P3F_OUTLINE
constexpr bool STAGE_FP8 = false;
#else
constexpr bool STAGE_FP8 = true;
#endif

__device__ __forceinline__ void fp8_block(uint32_t amax_bits, float &mult, float &scale)
{
    const float a = fmaxf(__uint_as_float(amax_bits), 1e-4f);   // 1e-4f: 0x38D1B717
    scale = __fmul_rn(a, __uint_as_float(0x3B124925u));          // fl(1/448)
    mult = __fmul_rn(__frcp_rn(a), 448.0f);
    if (amax_bits > 0x7F800000u)                                 // a NaN in the block
        scale = mult = __uint_as_float(0x7FFFFFFFu);             // x * NaN: every code 0x7F
}

// max(|a|, |b|) (its sign the xor of theirs: dropped at the end), a NaN if either is one: one
// instruction where |x|'s bits and an integer max are two
__device__ __forceinline__ float amax2(float a, float b)
{
    float d;
    asm("max.NaN.xorsign.abs.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// lo into the low byte (the lower column), hi into the high one
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi)
{
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// stage_tile's FP8-wire twin for WN 128 (the same waits and arrive): v as stage_tile takes it,
// row_at the thread's row r0 in the staged tile (its byte 0), half and halves as in stage_tile
// (half -1: the tile's one mainloop).
__device__ __forceinline__ void stage_tile_fp8(const float (&v)[64], uint32_t row_at, uint32_t lane,
                                               uint32_t staged, uint32_t freed, uint32_t i, int half, int halves)
{
    if (half <= 0)
        mbar_wait(freed, (i & 1) ^ 1);              // the send warps are done with the previous tile
    float f0 = amax2(v[0], v[1]), f1 = amax2(v[2], v[3]);
#pragma unroll
    for (int j = 1; j < 16; ++j) {
        f0 = amax2(f0, amax2(v[4 * j], v[4 * j + 1]));
        f1 = amax2(f1, amax2(v[4 * j + 2], v[4 * j + 3]));
    }
    // |amax|'s bits: their unsigned order is the magnitudes' (a NaN above +Inf), for the quad's max
    uint32_t m0 = __float_as_uint(f0) & 0x7FFFFFFFu, m1 = __float_as_uint(f1) & 0x7FFFFFFFu;
    m0 = max(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
    m1 = max(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
    m0 = max(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
    m1 = max(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
    float mu0, sc0, mu1, sc1;
    fp8_block(m0, mu0, sc0);
    fp8_block(m1, mu1, sc1);
    const int h = half < 0 ? 0 : half;
    const uint32_t at = row_at + 128 * h + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(at + 8 * j),
                     "h"(e4m3x2(__fmul_rn(v[4 * j], mu0), __fmul_rn(v[4 * j + 1], mu0))) : "memory");
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(at + 8 * Layout::STG_PITCH + 8 * j),
                     "h"(e4m3x2(__fmul_rn(v[4 * j + 2], mu1), __fmul_rn(v[4 * j + 3], mu1))) : "memory");
    }
    if ((lane & 3) == 0) {
        const uint32_t sat = row_at + 128 * halves + 4 * h;
        asm volatile("st.shared.f32 [%0], %1;" :: "r"(sat), "f"(sc0) : "memory");
        asm volatile("st.shared.f32 [%0], %1;" :: "r"(sat + 8 * Layout::STG_PITCH), "f"(sc1) : "memory");
    }
    if (half < 0 || half + 1 == halves)
        mbar_arrive(staged);                        // release: the send warps read the tile next
}

// A mainloop's sums (of a tile's mainloop h of halves; h -1: its only one) into the staged tile:
// the FP8 wire's row with fp8 (128-row tiles), else bf16.
template <int WN>
__device__ __forceinline__ void stage_sums(const float (&sum)[WN / 2], uint32_t stg, uint32_t lane, uint32_t staged,
                                           uint32_t freed, uint32_t i, int h, int halves, bool fp8)
{
    if constexpr (WN == 128 && STAGE_FP8) {
        if (fp8) {
            stage_tile_fp8(sum, stg - 4 * (lane & 3), lane, staged, freed, i, h, halves);
            return;
        }
    }
    stage_tile<Layout, WN>(sum, stg, staged, freed, i, h, h + 1 == halves);
}

// A consumer warpgroup: the mainloop of every tile of this CTA with the promotion, then its
// sums as bf16 into the staged tile (after the send warps have released the previous one).
template <int WN>
P3F_CONSUMER_INLINE void consumer(uint32_t base, int wg, int wq, int lane, int total, int kblocks,
                                  int n_tiles, int n_experts, const int *offs, int bm, const float *sb,
                                  int n_col_blocks, bool fp8)
{
    float acc[WN / 2], sum[WN / 2];
    const int *mp = reinterpret_cast<const int *>(smem + Layout::OFF_MPRE);
    const ConsumerAt<WN> at(base, wg, wq, lane);
    const uint32_t a_off = at.a_off, b_off = at.b_off;
    const int r0 = at.r0;
    const uint32_t full = at.full, empty = at.empty, staged = at.staged, freed = at.freed, stg = at.stg;
    uint32_t s = 0, ph = 0, i = 0;
#ifdef P3F_PINGPONG
    turns_begin(wg, (int)blockIdx.x < total);
#endif
    for (int t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        const Tile T = grouped_tile(t, n_tiles, n_experts, mp, offs, bm, Layout::BN);
#ifdef P3F_PAIR
        const int halves = min(Layout::HALVES, n_col_blocks - T.n0 / SBLK);
#pragma unroll 1
        for (int h = 0; h < halves; ++h) {          // the tile's column blocks, one mainloop each
        const float *sbt = sb + ((size_t)T.e * n_col_blocks + T.n0 / SBLK + h) * kblocks;
#else
        const float *sbt = sb + ((size_t)T.e * n_col_blocks + T.n0 / SBLK) * kblocks;
#endif
        float sb_cur = __ldg(sbt), sb_next = kblocks > 1 ? __ldg(sbt + 1) : 0.0f;
#pragma unroll
        for (int j = 0; j < WN / 2; ++j)
            sum[j] = 0.0f;
#ifdef P3F_NO_PROMOTE
        uint32_t prev = 0;
        float s0 = 0.0f, s1 = 0.0f;
#endif
        for (int kb = 0; kb < kblocks; ++kb) {
#ifdef P3F_NO_PROMOTE
            mma_kblock<Layout, WN>(acc, base, full, s, ph, a_off, b_off, kb);
#elif defined(P3F_PINGPONG)
            issue<WN>(acc, base, full, s, ph, a_off, b_off, wg);              // a fresh sum per k-block
#else
            mma_kblock<Layout, WN>(acc, base, full, s, ph, a_off, b_off, 0);   // a fresh sum per k-block
#endif
            // this thread's rows' activation scales, read before the stage is released (the
            // stage holds rows from m0 rounded down to 4: see the producer)
            const uint32_t sa_addr = base + Layout::OFF_EXTRA + s * SA_STAGE + 4 * (r0 + (T.m0 & 3));
            float sa0, sa1;
            asm volatile("ld.shared.f32 %0, [%1];" : "=f"(sa0) : "r"(sa_addr) : "memory");
            asm volatile("ld.shared.f32 %0, [%1];" : "=f"(sa1) : "r"(sa_addr + 32) : "memory");
            const float sb_k = sb_cur;
            sb_cur = sb_next;
            if (kb + 2 < kblocks)
                sb_next = __ldg(sbt + kb + 2);
#ifdef P3F_NO_PROMOTE
            s0 = sa0 * sb_k;
            s1 = sa1 * sb_k;
            if (kb > 0) {
                wgmma_wait<1>();                    // k-block kb-1 is read: its stage is free
                if (lane == 0)
                    mbar_arrive(empty + 8 * prev);
            }
            prev = s;
#else
            wgmma_wait<0>();
            fence_acc(acc);
            if (lane == 0)
                mbar_arrive(empty + 8 * s);         // A, B and the scales of this stage are read
            const float s0 = sa0 * sb_k, s1 = sa1 * sb_k;
#pragma unroll
            for (int j = 0; j < WN / 8; ++j) {
                sum[4 * j] = fmaf(acc[4 * j], s0, sum[4 * j]);
                sum[4 * j + 1] = fmaf(acc[4 * j + 1], s0, sum[4 * j + 1]);
                sum[4 * j + 2] = fmaf(acc[4 * j + 2], s1, sum[4 * j + 2]);
                sum[4 * j + 3] = fmaf(acc[4 * j + 3], s1, sum[4 * j + 3]);
            }
#endif
            if (++s == Layout::STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
#ifdef P3F_NO_PROMOTE
        wgmma_wait<0>();
        fence_acc(acc);
        if (lane == 0)
            mbar_arrive(empty + 8 * prev);
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
            sum[4 * j] = acc[4 * j] * s0;
            sum[4 * j + 1] = acc[4 * j + 1] * s0;
            sum[4 * j + 2] = acc[4 * j + 2] * s1;
            sum[4 * j + 3] = acc[4 * j + 3] * s1;
        }
#endif
#ifdef P3F_PAIR
        stage_sums<WN>(sum, stg, lane, staged, freed, i, h, halves, fp8);
        }
#else
        stage_sums<WN>(sum, stg, lane, staged, freed, i, -1, 1, fp8);
#endif
    }
#ifdef P3F_PINGPONG
    turns_end(wg, (int)blockIdx.x < total);
#endif
}

#ifdef P3F_DUAL
#define P3F_CONSUMER consumer_dual
// The weights' scale of the tile for each k-block, read with ld.global.nc two k-blocks ahead
// through a pointer stepped once per k-block (not recomputed from kb: fewer instructions in the
// consumers' stream, which bounds this kernel: docs/PERF.md).
struct ScaleB {
    const float *q;
    int kblocks;
    float cur, next;
    __device__ __forceinline__ ScaleB(const float *sbt, int kb_n)
        : q(sbt + 2), kblocks(kb_n), cur(__ldg(sbt)), next(kb_n > 1 ? __ldg(sbt + 1) : 0.0f) {}
    // the scale of k-block kb (called for kb = 0, 1, ... in order)
    __device__ __forceinline__ float take(int kb)
    {
        const float v = cur;
        cur = next;
        if (kb + 2 < kblocks)
            next = __ldg(q);
        ++q;
        return v;
    }
};

// The promotion of k-block kb, whose wgmmas into acc were committed from stage s: waits until
// at most PENDING wgmma groups of this warpgroup are in flight (the k-block's are then done),
// reads this thread's rows' activation scales from the stage, releases the stage and adds acc
// times the scale product to sum (fp32 fma: DeepSeek-V3's promotion every 128 of K).
template <int PENDING, int WN>
__device__ __forceinline__ void promote(float (&acc)[WN / 2], float (&sum)[WN / 2], uint32_t base, uint32_t empty,
                                        uint32_t s, uint32_t sa_row, float sb_k, int lane, uint32_t peer = 0)
{
    // the stage holds the scales of rows from m0 rounded down to 4: see the producer
    const uint32_t sa_addr = base + Layout::OFF_EXTRA + s * SA_STAGE + sa_row;
    float sa0, sa1;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(sa0) : "r"(sa_addr) : "memory");
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(sa1) : "r"(sa_addr + 32) : "memory");
    wgmma_wait<PENDING>();
    fence_acc(acc);
#ifdef P3F_MCAST
    // P3F_MCAST: the stage is released in this CTA and in CTA peer of the cluster (the other one
    // when the tile is paired: its producer multicast into this stage; else this CTA again),
    // whose empty barrier counts both CTAs' consumer warps. Release at CTA scope, as the local
    // arrive: .release.cluster is a MEMBAR.GPU first, which waits for the warpgroup's wgmmas in
    // flight (measured: the kernel took twice as long)
    asm volatile("{\n.reg .pred p;\n.reg .b32 r;\nelect.sync _|p, 0xffffffff;\n"
                 "mapa.shared::cluster.u32 r, %0, %1;\n"
                 "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
                 "@p mbarrier.arrive.shared::cluster.b64 _, [r];\n}"
                 :: "r"(empty + 8 * s), "r"(peer) : "memory");
#elif defined(P3F_ELECT)
    // one lane of the warp arrives, elected into a predicate: no register holds the lane in the
    // mainloop (at 200 registers ptxas spilled one around reading it)
    asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}"
                 :: "r"(empty + 8 * s) : "memory");
#else
    if (lane == 0)
        mbar_arrive(empty + 8 * s);                 // A, B and the scales of this stage are read
#endif
    const float s0 = sa0 * sb_k, s1 = sa1 * sb_k;
#ifdef P3F_NO_PROMOTE
    sum[0] = s0;                                    // the scales of the last k-block, applied once
    sum[1] = s1;
    return;
#endif
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        sum[4 * j] = fmaf(acc[4 * j], s0, sum[4 * j]);
        sum[4 * j + 1] = fmaf(acc[4 * j + 1], s0, sum[4 * j + 1]);
        sum[4 * j + 2] = fmaf(acc[4 * j + 2], s1, sum[4 * j + 2]);
        sum[4 * j + 3] = fmaf(acc[4 * j + 3], s1, sum[4 * j + 3]);
    }
}

// The consumer of the P3F_DUAL variant: consumer() with two accumulator sets.
template <int WN>
__device__ __forceinline__ void consumer_dual(uint32_t, int wg, int wq, int, int total, int kblocks,
                                              int n_tiles, int n_experts, const int *offs, int bm, const float *sb,
                                              int n_col_blocks, bool fp8)
{
    float acc[WN / 2], acc2[WN / 2], sum[WN / 2];
    // the shared window's base and the lane read afresh: passed in, they stay live across the
    // setmaxnreg branch, and ptxas spilled them there and reloaded them in the mainloop
    uint32_t base, lane;
    asm volatile("mov.u32 %0, smem;" : "=r"(base));
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    const int *mp = reinterpret_cast<const int *>(smem + Layout::OFF_MPRE);
    // the warpgroup's index broadcast from lane 0: warp-uniform to ptxas, so the A stage's
    // descriptor (its offset wg * 64 rows) is computed in uniform registers (else 9 R2UR per
    // k-block; with ScaleB's stepped pointer, measured 0.93x the time: docs/PERF.md)
    wg = __shfl_sync(0xffffffffu, wg, 0);
    const ConsumerAt<WN> at(base, wg, wq, lane);
    const uint32_t a_off = at.a_off, b_off = at.b_off;
    const int r0 = at.r0;
    const uint32_t full = at.full, empty = at.empty, staged = at.staged, freed = at.freed, stg = at.stg;
    uint32_t s = 0, ph = 0, i = 0;
    int e_at = 0;                                   // grouped_tile_after's expert
    turns_begin(wg, (int)blockIdx.x < total);
    for (int t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        // (not grouped_tile: its search, on the consumers' path between two tiles, delayed the
        // next tile's first wgmmas; measured 0.98x the time: docs/PERF.md)
        const Tile T = grouped_tile_after(t, n_tiles, n_experts, mp, offs, bm, Layout::BN, e_at);
#ifdef P3F_PAIR
        const int halves = min(Layout::HALVES, n_col_blocks - T.n0 / SBLK);
#pragma unroll 1
        for (int h = 0; h < halves; ++h) {          // the tile's column blocks, one mainloop each
        ScaleB sbk(sb + ((size_t)T.e * n_col_blocks + T.n0 / SBLK + h) * kblocks, kblocks);
#else
        ScaleB sbk(sb + ((size_t)T.e * n_col_blocks + T.n0 / SBLK) * kblocks, kblocks);
#endif
        const uint32_t sa_row = 4 * (r0 + (T.m0 & 3));
#ifdef P3F_MCAST
        // the CTA whose producer may write this CTA's stages besides its own (produce's pair)
        const uint32_t peer = (blockIdx.x & 1) ^ (uint32_t)(n_col_blocks % (2 * Layout::BN / SBLK) == 0 &&
                                                           (t | 1) < total);
#else
        constexpr uint32_t peer = 0;
#endif
#pragma unroll
        for (int j = 0; j < WN / 2; ++j)
            sum[j] = 0.0f;
        // k-blocks in pairs, kb in acc and kb + 1 in acc2 (register arrays need constant
        // indices): the wgmmas of the next k-block are issued before this one is promoted
        uint32_t s1, ph1;
        const auto next = [&](uint32_t from, uint32_t from_ph) {
            s1 = from + 1 == Layout::STAGES ? 0 : from + 1;
            ph1 = from + 1 == Layout::STAGES ? from_ph ^ 1 : from_ph;
        };
        issue<WN>(acc, base, full, s, ph, a_off, b_off, wg);
        int kb = 0;
#ifdef P3F_NO_PROMOTE
        constexpr int NP = 1;                       // each set accumulates its k-blocks
#else
        constexpr int NP = 0;                       // a fresh sum per k-block
#endif
        for (; kb + 2 < kblocks; kb += 2) {
            next(s, ph);
            issue<WN>(acc2, base, full, s1, ph1, a_off, b_off, wg, NP * kb);
            promote<1, WN>(acc, sum, base, empty, s, sa_row, sbk.take(kb), lane, peer);
            next(s1, ph1);
            issue<WN>(acc, base, full, s1, ph1, a_off, b_off, wg, NP);
            promote<1, WN>(acc2, sum, base, empty, s1 == 0 ? Layout::STAGES - 1 : s1 - 1, sa_row,
                           sbk.take(kb + 1), lane, peer);
            s = s1;
            ph = ph1;
        }
        next(s, ph);
        if (kb + 1 < kblocks) {                 // two k-blocks left
            issue<WN>(acc2, base, full, s1, ph1, a_off, b_off, wg, NP * kb);
            promote<1, WN>(acc, sum, base, empty, s, sa_row, sbk.take(kb), lane, peer);
            promote<0, WN>(acc2, sum, base, empty, s1, sa_row, sbk.take(kb + 1), lane, peer);
            next(s1, ph1);
        } else {
            promote<0, WN>(acc, sum, base, empty, s, sa_row, sbk.take(kb), lane, peer);
        }
        s = s1;
        ph = ph1;
#ifdef P3F_NO_PROMOTE
        {
            const float s0 = sum[0], s1v = sum[1];
#pragma unroll
            for (int j = 0; j < WN / 8; ++j) {
                const bool two = kblocks > 1;       // acc2 holds the odd k-blocks
                sum[4 * j] = (acc[4 * j] + (two ? acc2[4 * j] : 0.0f)) * s0;
                sum[4 * j + 1] = (acc[4 * j + 1] + (two ? acc2[4 * j + 1] : 0.0f)) * s0;
                sum[4 * j + 2] = (acc[4 * j + 2] + (two ? acc2[4 * j + 2] : 0.0f)) * s1v;
                sum[4 * j + 3] = (acc[4 * j + 3] + (two ? acc2[4 * j + 3] : 0.0f)) * s1v;
            }
        }
#endif
#ifdef P3F_ELECT
        // the staged tile's address computed afresh: kept through the mainloop, ptxas spilled it
        uint32_t base_now, lane_now;
        asm volatile("mov.u32 %0, smem;" : "=r"(base_now));
        asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane_now));
        const uint32_t stg_now = ConsumerAt<WN>(base_now, wg, wq, lane_now).stg;
#else
        const uint32_t stg_now = stg, lane_now = lane;
#endif
#ifdef P3F_PAIR
        stage_sums<WN>(sum, stg_now, lane_now, staged, freed, i, h, halves, fp8);
        }
#else
        stage_sums<WN>(sum, stg_now, lane_now, staged, freed, i, -1, 1, fp8);
#endif
    }
    turns_end(wg, (int)blockIdx.x < total);
}

#endif

#ifndef P3F_CONSUMER
#define P3F_CONSUMER consumer
#endif

#ifdef P3F_ELECT
// the lane read afresh in each warpgroup's region: computed before setmaxnreg, ptxas kept it on the stack
__device__ __forceinline__ int lane_id()
{
    int l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}
#define P3F_LANE lane_id()
#else
#define P3F_LANE lane
#endif

// Whether the consumers quantise their fp32 sums (stage_tile_fp8): P3_FLAG_WIRE_FP8_STAGED and the
// send on (cfg.n_ranks loaded as the send warps load it). Read in the consumers' branch, after
// setmaxnreg: held from the entry, it would live across it.
// (The ld.param of cfg.n_ranks is written out here and at the two send-warp call sites: one
// helper shared by the three made ptxas spill 4 bytes in the wide kernel.)
__device__ __forceinline__ bool consumers_quantise(const P3SendCtx *ctx)
{
    int64_t n_ranks;
    asm("ld.param.s64 %0, [" P3F_STR(P3F_ENTRY) "_param_0+88];" : "=l"(n_ranks));
    return (ctx->flags & P3_FLAG_WIRE_FP8_STAGED) && ctx->p3_control >= 0 && n_ranks != 0;
}

#ifdef P3F_MCAST
// P3F_MCAST: clusters of two CTAs (launched so by the driver: the entry says it, no launch
// attribute), a pair of tiles' A loaded once for both (produce's pair)
#if !defined(P3F_WIDE_BODY)
#error "P3F_MCAST is a variant of the wide kernel's structure (P3F_WIDE_BODY)"
#endif
#define P3F_CLUSTER __cluster_dims__(2, 1, 1)
#else
#define P3F_CLUSTER
#endif

extern "C" __global__ void __launch_bounds__(Layout::THREADS, 1) P3F_CLUSTER
P3F_ENTRY(const __grid_constant__ P3PeerSendConfig cfg, const P3SendCtx *ctx, const TmaMap *tmaps,
                 const float *sb, uint8_t *c_ptr, uint64_t c_row_stride, uint32_t n_cols, uint32_t k_dim,
                 uint32_t bm)
{
    // The tensor maps live in device memory (written before the launch): by value, their
    // 64-byte alignment would put them where the driver's parameter layout and PTX's differ.
    const TmaMap *tmap_a = tmaps, *tmap_b = tmaps + 1, *tmap_sa = tmaps + 2;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int *mpre = reinterpret_cast<const int *>(smem + Layout::OFF_MPRE);
    const int *offs = reinterpret_cast<const int *>(ctx->expert_offsets);
    const int n_experts = (int)ctx->n_experts;
    // P3_FLAG_WIRE_FP8_STAGED: the consumers quantise their fp32 sums (stage_tile_fp8), for
    // 128-row tiles only (at 64 a row's 128 columns are two warpgroups'); with 64 nothing is
    // sent and diag[2] is set, as p3_send_rows refuses (the launcher refuses it first)
    if ((ctx->flags & P3_FLAG_WIRE_FP8_STAGED) && (bm != 128 || !STAGE_FP8)) {
        if (tid == 0 && ctx->diag_ptr)
            reinterpret_cast<volatile uint32_t *>(ctx->diag_ptr)[2] = 1;
        return;
    }
    if (!gemm_setup<Layout>(base, tid, offs, n_experts, n_cols, k_dim, bm))
        return;                                     // the launcher refuses these before launch
#ifdef P3F_MCAST
    // both CTAs' barriers initialised before either multicasts into the other or releases its
    // stages; every path below ends at the second cluster barrier (at the end), so neither CTA
    // exits while the other may still arrive on its barriers
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
    // tiles per row of tiles: the last may be narrower (HALVES > 1; n_cols a multiple of BN_MMA)
    const int n_tiles = (int)((n_cols + Layout::BN - Layout::BN_MMA) / Layout::BN), kblocks = (int)(k_dim / Layout::BK);
    const int total = mpre[n_experts] * n_tiles;

#ifdef P3F_SET_REGS
#ifdef P3F_SEND_WG3
    if (warp < 4) {                                 // the producer's warpgroup: warps 1..3 exit
#else
    if (Layout::THREADS == 384 ? warp < 4 : warp < 4 || warp >= 12) {  // the producer's warpgroup (and a fourth)
#endif
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(P3F_REGS_PRODUCER));
        if (warp == 0) {                            // the producer: one thread issues every copy
            if (P3F_LANE == 0) {
                asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_a) : "memory");
                asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_b) : "memory");
                asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_sa) : "memory");
                // with A and B, the tile's activation scales: their inner coordinate must be 16-byte
                // aligned (an unaligned one is an illegal instruction), so BM + 4 rows from m0 rounded
                // down to 4
                const auto scales = [base, tmap_sa](uint32_t s, uint32_t full_s, const Tile &T, int kb) {
                    tma_load(base + Layout::OFF_EXTRA + s * SA_STAGE, tmap_sa, full_s, T.m0 & ~3, kb);
                };
#ifdef P3F_MCAST
                const bool pair = n_cols % (2 * Layout::BN) == 0;   // tiles t, t ^ 1 one m-tile, both whole
#else
                constexpr bool pair = false;
#endif
                produce<Layout>(base, tmap_a, tmap_b, bm * Layout::BK + Layout::B_STAGE + (bm + 4) * 4, total,
                                n_tiles, n_experts, mpre, offs, (int)bm, n_cols, kblocks, scales, pair);
            }
        }
#ifdef P3F_SEND_WG3
    } else if (warp >= 12) {                        // the send warps: the fourth warpgroup, its own registers
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(P3F_REGS_WG3));
        {
#else
        else {
#endif
            int64_t n_ranks;                        // cfg.n_ranks, loaded as [cfg+88] (tools/build_gemm_fp8.py names it)
            asm("ld.param.s64 %0, [" P3F_STR(P3F_ENTRY) "_param_0+88];" : "=l"(n_ranks));
            if (Layout::THREADS == 384 || Layout::send_rank(warp) >= 0)
                send_warp<Layout>(&cfg, n_ranks, ctx, c_ptr, c_row_stride, base,
                                  Layout::THREADS == 384 ? warp - 1 : Layout::send_rank(warp), P3F_LANE, total, n_tiles,
                                  n_experts, (int)bm, offs, n_cols);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(P3F_REGS_CONSUMER));
        const int wg = warp / 4 - 1, wq = warp % 4;
        const int ncb = (int)(n_cols / SBLK);
        const bool fp8 = consumers_quantise(ctx);
        if (bm == 128)
            P3F_CONSUMER<128>(base, wg, wq, lane, total, kblocks, n_tiles, n_experts, offs, (int)bm, sb, ncb, fp8);
        else
            P3F_CONSUMER<64>(base, wg, wq, lane, total, kblocks, n_tiles, n_experts, offs, (int)bm, sb, ncb, fp8);
    }
#ifdef P3F_MCAST
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
#endif
#else
    if (warp == 0) {                                // the producer: one thread issues every copy
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_a) : "memory");
            asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_b) : "memory");
            asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_sa) : "memory");
            // with A and B, the tile's activation scales: their inner coordinate must be 16-byte
            // aligned (an unaligned one is an illegal instruction), so BM + 4 rows from m0 rounded
            // down to 4
            const auto scales = [base, tmap_sa](uint32_t s, uint32_t full_s, const Tile &T, int kb) {
                tma_load(base + Layout::OFF_EXTRA + s * SA_STAGE, tmap_sa, full_s, T.m0 & ~3, kb);
            };
            produce<Layout>(base, tmap_a, tmap_b, bm * Layout::BK + Layout::B_STAGE + (bm + 4) * 4, total, n_tiles,
                            n_experts, mpre, offs, (int)bm, n_cols, kblocks, scales);
        }
    } else if (warp <= Layout::SEND_WARPS) {
        int64_t n_ranks;                            // cfg.n_ranks, loaded as [cfg+88] (tools/build_gemm_fp8.py names it)
        asm("ld.param.s64 %0, [" P3F_STR(P3F_ENTRY) "_param_0+88];" : "=l"(n_ranks));
        send_warp<Layout>(&cfg, n_ranks, ctx, c_ptr, c_row_stride, base, warp - 1, lane, total, n_tiles, n_experts,
                          (int)bm, offs, n_cols);
    } else {
        const int wg = warp / 4 - 1, wq = warp % 4;
        const int ncb = (int)(n_cols / SBLK);
        const bool fp8 = consumers_quantise(ctx);
        if (bm == 128)
            consumer<128>(base, wg, wq, lane, total, kblocks, n_tiles, n_experts, offs, (int)bm, sb, ncb, fp8);
        else
            consumer<64>(base, wg, wq, lane, total, kblocks, n_tiles, n_experts, offs, (int)bm, sb, ncb, fp8);
    }
#endif
}
