// p3_gemm_common.cuh: the Hopper pieces p3send's grouped GEMMs share (mbarriers, the tensor
// memory accelerator, wgmma's shared-memory descriptors and fences, bf16 packing, the tile
// numbering), and the parts of the two kernels (ptx/cuda/p3_gemm_send.cu, bf16, and
// p3_gemm_fp8_send.cu) that are the same: the shared-memory layout (GemmLayout), the set-up,
// the producer's A and B loads, a consumer's wgmmas of one k-block, the staging of a finished
// tile as bf16 and the send warps. Everything is __forceinline__, so each kernel's PTX holds
// only what it uses.
//
// Both kernels' shipped PTX is byte for byte what it was when each kernel held its own copy of
// these (tools/build_gemm.py --check and tools/build_gemm_fp8.py --check compare): an edit here
// changes both kernels. What the kernels still write each for itself is what could not move
// without changing their PTX: the ring's step `if (++s == STAGES) { s = 0; ph ^= 1; }` (a
// function taking s and ph by reference reorders their selects and phis) and the entry's first
// lines (a set-up that returns the tile counts, in a struct, changes the whole kernel's
// register numbering).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "../p3send.h"

struct __align__(64) TmaMap { uint64_t w[16]; };                // a CUtensorMap (128 bytes)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred p;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}

// A 2-D box of a tensor map into shared memory, completing on an mbarrier (bytes counted).
__device__ __forceinline__ void tma_load(uint32_t dst, const TmaMap *map, uint32_t bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// tma_load into the same offsets of both CTAs of a cluster of two (dst and bar this CTA's: the
// box lands, and its bytes are counted, at those offsets in each CTA of mask)
__device__ __forceinline__ void tma_load_pair(uint32_t dst, const TmaMap *map, uint32_t bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar), "h"((uint16_t)3) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart
// (rows of 128 bytes: 64 bf16 or 128 e4m3 elements of K).
__device__ __forceinline__ constexpr uint64_t sw128_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait.
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R])
{
#pragma unroll
    for (int i = 0; i < R; ++i)
        asm volatile("" : "+f"(d[i]) :: "memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

struct Tile {
    int e, m0, rows, n0;
};

// Tile t of a grouped GEMM numbered (expert, m-tile, n-tile), m-tile major: m-tile mg = t /
// n_tiles (mpre[e] m-tiles precede expert e), n-tile t % n_tiles of bn columns.
__device__ __forceinline__ Tile grouped_tile(int t, int n_tiles, int n_experts, const int *mpre, const int *offs,
                                             int bm, int bn)
{
    const int mg = t / n_tiles;
    int lo = 0, hi = n_experts;                 // the last expert with mpre[e] <= mg (it has rows)
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (mpre[mid] <= mg) lo = mid;
        else hi = mid;
    }
    Tile T;
    T.e = lo;
    T.m0 = offs[lo] + (mg - mpre[lo]) * bm;
    T.rows = min(bm, offs[lo + 1] - T.m0);
    T.n0 = (t - mg * n_tiles) * bn;
    return T;
}

// grouped_tile for a caller whose tiles t only grow (a persistent CTA's): the expert found by a
// forward scan from the last one (e, updated; 0 at first), usually no step or one, and the
// offsets read through the read-only cache (expert_offsets is unchanged during the launch),
// instead of a binary search of dependent shared loads and two generic loads per tile. Used by
// the wide FP8 kernel's consumers, on whose path between two tiles the search sat (docs/PERF.md,
// Session 9); the producer runs stages ahead and the send warps overlap the next tile, so they,
// and the other GEMMs, keep grouped_tile.
__device__ __forceinline__ Tile grouped_tile_after(int t, int n_tiles, int n_experts, const int *mpre,
                                                   const int *offs, int bm, int bn, int &e)
{
    const int mg = t / n_tiles;
    while (e + 1 < n_experts && mpre[e + 1] <= mg)
        ++e;
    Tile T;
    T.e = e;
    T.m0 = __ldg(offs + e) + (mg - mpre[e]) * bm;
    T.rows = min(bm, __ldg(offs + e + 1) - T.m0);
    T.n0 = (t - mg * n_tiles) * bn;
    return T;
}

// A kernel's tile shape and shared-memory layout. THREADS threads: warp 0 the producer, warps
// 1..SEND_WARPS the send warps, warpgroups 1 and 2 the consumers. Tiles of BM (64 or 128) x BN
// output columns; k-blocks of BK elements of ELEM bytes (A: 128 x BK, B: BN x BK per stage) in
// a ring of STAGES stages; up to MAX_EXPERTS experts. Shared memory from 0 (1024-byte
// aligned): the A stages, the B stages (OFF_B), the staged bf16 tile (OFF_STG: 128 rows of
// STG_PITCH bytes, padded: no bank conflicts), EXTRA bytes of the kernel's own (OFF_EXTRA),
// the mbarriers full[STAGES], empty[STAGES], staged, freed (OFF_BAR), the send warps'
// P3SendAcct (OFF_ACCT), the m-tile prefix, MAX_EXPERTS + 1 ints (OFF_MPRE); SMEM bytes in all
// (sm_90 opt-in: 232448).
//
// SEND_WARPS_ 3 and THREADS_ 384 by default; with THREADS_ 512 a fourth warpgroup (warps
// 12..15) holds send warps 3..SEND_WARPS-1 (send_rank: a warp's rank among the send warps, or -1;
// a kernel's Layout may derive from this one with a send_rank of its own, as
// p3_gemm_fp8_send_wide's, whose four send warps are warps 12..15: every use is L::send_rank).
// BN_MMA_ (BN by default): the columns of one mainloop; with BN = HALVES x BN_MMA a tile's
// column blocks are computed one after the other (a mainloop each, B stages of BN_MMA rows)
// into one staged tile of BN columns, which the send warps handle at once.
template <int BN_, int BK_, int ELEM_, int STAGES_, int EXTRA_, int SEND_WARPS_ = 3, int THREADS_ = 384,
          int BN_MMA_ = BN_>
struct GemmLayout {
    static constexpr int THREADS = THREADS_, SEND_WARPS = SEND_WARPS_, MAX_EXPERTS = 128;
    static_assert((THREADS == 384 && SEND_WARPS == 3) || (THREADS == 512 && SEND_WARPS > 3 && SEND_WARPS <= 7),
                  "send warps: 1..3 of the producer's warpgroup, then warps 12.. of a fourth");
    static __device__ __forceinline__ int send_rank(int warp)
    {
        return warp >= 1 && warp <= 3 ? warp - 1 : (warp >= 12 && warp < 9 + SEND_WARPS ? warp - 9 : -1);
    }
    static constexpr int BN = BN_, BK = BK_, STAGES = STAGES_, BN_MMA = BN_MMA_, HALVES = BN_ / BN_MMA_;
    static_assert(BN_ % BN_MMA_ == 0, "a tile is whole mainloops of BN_MMA columns");
    static constexpr int KSTEPS = BK * ELEM_ / 32;             // wgmma k-steps (32 bytes of K) per k-block
    static constexpr int A_STAGE = 128 * BK * ELEM_, B_STAGE = BN_MMA * BK * ELEM_, STG_PITCH = 2 * BN + 16;
    static constexpr int OFF_B = STAGES * A_STAGE, OFF_STG = OFF_B + STAGES * B_STAGE;
    static constexpr int OFF_EXTRA = OFF_STG + 128 * STG_PITCH, OFF_BAR = OFF_EXTRA + EXTRA_;
    static constexpr int OFF_ACCT = OFF_BAR + (2 * STAGES + 2) * 8;
    static constexpr int OFF_MPRE = OFF_ACCT + SEND_WARPS * (int)sizeof(P3SendAcct);
    static constexpr int SMEM = OFF_MPRE + 4 * (MAX_EXPERTS + 1);
    static constexpr int EMPTY_ARRIVALS = 8;                  // a stage's release: one arrive per consumer warp
};

extern __shared__ __align__(1024) uint8_t smem[];               // the layout: the kernel's GemmLayout

// The mainloops of tile T (of L::BN columns from T.n0, at most L::HALVES): the last tile of a row
// of tiles may be narrower, n_cols being a multiple of BN_MMA only.
template <class L>
__device__ __forceinline__ int tile_halves(const Tile &T, uint32_t n_cols)
{
    return L::HALVES == 1 ? 1 : min(L::HALVES, ((int)n_cols - T.n0) / L::BN_MMA);
}

// The launch's checks and the CTA's set-up: false (the kernel does nothing) for arguments the
// launcher refuses before launch; else thread 0 writes the m-tile prefix and initialises the
// mbarriers, the send warps (L::send_rank >= 0; warps 1..SEND_WARPS at 384 threads) reset their
// accounts, and the CTA syncs (the one CTA-wide barrier: warps with no role may exit after it).
template <class L>
__device__ __forceinline__ bool gemm_setup(uint32_t base, int tid, const int *offs, int n_experts, uint32_t n_cols,
                                           uint32_t k_dim, uint32_t bm)
{
    const int warp = tid / 32, lane = tid % 32;
    int *mpre = reinterpret_cast<int *>(smem + L::OFF_MPRE);
    if (n_experts < 1 || n_experts > L::MAX_EXPERTS || (bm != 64 && bm != 128) || k_dim == 0 ||
        k_dim % L::BK || n_cols == 0 || n_cols % L::BN_MMA)
        return false;
    if (base & 1023)
        __trap();                                   // the swizzled stages need 1024-byte alignment
    const uint32_t full = base + L::OFF_BAR, empty = full + 8 * L::STAGES;
    const uint32_t staged = empty + 8 * L::STAGES, freed = staged + 8;
    if (tid == 0) {
        int m = 0;
        mpre[0] = 0;
        for (int e = 0; e < n_experts; ++e) {
            const int r = offs[e + 1] - offs[e];
            m += r > 0 ? (r + (int)bm - 1) / (int)bm : 0;
            mpre[e + 1] = m;
        }
        for (int s = 0; s < L::STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, L::EMPTY_ARRIVALS);
        }
        mbar_init(staged, 256);                     // every consumer thread, after its stores
        mbar_init(freed, L::SEND_WARPS);            // one arrive per send warp
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (L::THREADS == 384 ? warp >= 1 && warp <= L::SEND_WARPS : L::send_rank(warp) >= 0) {
        P3SendAcct *a = reinterpret_cast<P3SendAcct *>(smem + L::OFF_ACCT) + (L::THREADS == 384 ? warp - 1 : L::send_rank(warp));
        if (lane == 0) {
            a->expert = -1;
            a->ready = 0;
            a->units = 0;
        }
        if (lane < P3_MAX_RANKS)
            a->pair[lane] = 0;
    }
    __syncthreads();
    return true;
}

// The producer (one thread), after it has prefetched the tensor maps: for every tile of this
// CTA (and each of its HALVES mainloops) and k-block, waits for the ring's next stage to be
// free and loads A (BM x BK) and B (BN_MMA x BK) into it, and what more(stage, its full
// barrier, tile, k-block) loads with them: tx bytes in all, counted on the stage's full barrier.
//
// pair (a kernel launched in clusters of two CTAs, blockIdx.x ^ 1 the other): tiles t and t ^ 1
// (the two CTAs' tiles of each round) are paired when both exist, which the caller guarantees
// is the same m-tile with the same mainloops (n_tiles even, every tile whole): A's k-blocks of
// the pair's mainloops then come in turns from either CTA, multicast into both (the stage's
// full barrier counts the same bytes; its empty barrier counts both CTAs' consumers, see
// L::EMPTY_ARRIVALS), so each CTA reads half of A from L2. An unpaired tile loads its own A.
template <class L, class More>
__device__ __forceinline__ void produce(uint32_t base, const TmaMap *tmap_a, const TmaMap *tmap_b, uint32_t tx,
                                        int total, int n_tiles, int n_experts, const int *mpre, const int *offs,
                                        int bm, uint32_t n_cols, int kblocks, More more, bool pair = false)
{
    const uint32_t full = base + L::OFF_BAR, empty = full + 8 * L::STAGES;
    uint32_t s = 0, ph = 0, g = blockIdx.x;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Tile T = grouped_tile(t, n_tiles, n_experts, mpre, offs, bm, L::BN);
        const int brow = T.e * (int)n_cols + T.n0;
        const int halves = tile_halves<L>(T, n_cols);
        const bool paired = pair && (t | 1) < total;
        for (int h = 0; h < halves; ++h)
        for (int kb = 0; kb < kblocks; ++kb, ++g) {
            mbar_wait(empty + 8 * s, ph ^ 1);
            mbar_expect_tx(full + 8 * s, tx);
            if (!paired)
                tma_load(base + s * L::A_STAGE, tmap_a, full + 8 * s, kb * L::BK, T.m0);
            else if ((g & 1) == 0)                  // the pair's k-block g: CTA g % 2 loads it for both
                tma_load_pair(base + s * L::A_STAGE, tmap_a, full + 8 * s, kb * L::BK, T.m0);
            tma_load(base + L::OFF_B + s * L::B_STAGE, tmap_b, full + 8 * s, kb * L::BK, brow + h * L::BN_MMA);
            more(s, full + 8 * s, T, kb);
            if (++s == L::STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
    }
}

// One wgmma k-step of a consumer warpgroup, D[64 x WN] (+)= A[64 x k] * B[WN x k]^T over 32 bytes
// of K (16 bf16 or 32 e4m3) from shared memory: declared here, specialised by each kernel.
template <int WN> __device__ __forceinline__ void wgmma_kstep(float (&d)[WN / 2], uint64_t da, uint64_t db, int sd);

// A consumer warpgroup's wgmmas of one k-block, once its stage s is full (phase ph): A and B
// from the stage at this warpgroup's a_off / b_off, into acc (added to it, except in the
// k-block's first k-step when acc_kb is 0: a fresh accumulator); committed, not waited for.
template <class L, int WN>
__device__ __forceinline__ void mma_kblock(float (&acc)[WN / 2], uint32_t base, uint32_t full, uint32_t s,
                                           uint32_t ph, uint32_t a_off, uint32_t b_off, int acc_kb)
{
    mbar_wait(full + 8 * s, ph);
#ifdef P3G_DESC32
    // the descriptors' low words only (sw128_desc's high word is a constant; shared-window
    // addresses are below 2^18, so the low word never carries): one 32-bit add per operand and
    // k-step, the stage's offset added to a loop-invariant base. Defined by the wide FP8 kernel,
    // whose consumers' instruction stream bounds it (docs/PERF.md, Session 9); the other GEMMs
    // keep the 64-bit form, as measured and verified
    static_assert(L::SMEM <= 1 << 18, "P3G_DESC32: shared-window addresses below 2^18");
    const uint32_t la = (((base + a_off) & 0x3FFFF) >> 4 | 1u << 16) + s * (L::A_STAGE >> 4);
    const uint32_t lb = (((base + L::OFF_B + b_off) & 0x3FFFF) >> 4 | 1u << 16) + s * (L::B_STAGE >> 4);
    constexpr uint64_t HI = sw128_desc(0) & ~0xFFFFFFFFull;
    const auto da = [=](int k) { return HI | (la + 2 * k); };
    const auto db = [=](int k) { return HI | (lb + 2 * k); };
#else
    const uint64_t a0 = sw128_desc(base + s * L::A_STAGE + a_off);
    const uint64_t b0 = sw128_desc(base + L::OFF_B + s * L::B_STAGE + b_off);
    const auto da = [=](int k) { return a0 + 2 * k; };
    const auto db = [=](int k) { return b0 + 2 * k; };
#endif
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < L::KSTEPS; ++k)
        wgmma_kstep<WN>(acc, da(k), db(k), (acc_kb | k) != 0);
    wgmma_commit();
}

// A consumer thread's part of a finished tile (its WN / 2 fp32 values of rows r and r + 8,
// in wgmma's accumulator order) as bf16 into the staged tile at stg, once the send warps have
// released the previous tile (tile i of this CTA); then arrives on `staged`. With half >= 0
// (of the tile's mainloops; -1: the whole tile at once) one mainloop's columns, at stg + 2 *
// BN_MMA * half: half 0 waits for the send warps, the last one (last) arrives.
template <class L, int WN>
__device__ __forceinline__ void stage_tile(const float (&v)[WN / 2], uint32_t stg, uint32_t staged, uint32_t freed,
                                           uint32_t i, int half = -1, bool last = true)
{
    if (half <= 0)
        mbar_wait(freed, (i & 1) ^ 1);              // the send warps are done with the previous tile
    const uint32_t at = stg + (half > 0 ? 2 * L::BN_MMA * half : 0);
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(at + j * 16), "r"(pack_bf16(v[4 * j], v[4 * j + 1]))
                     : "memory");
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(at + 8 * L::STG_PITCH + j * 16),
                     "r"(pack_bf16(v[4 * j + 2], v[4 * j + 3])) : "memory");
    }
    if (half < 0 || last)
        mbar_arrive(staged);                        // release: the send warps read the tile next
}

// A send warp (warp_rank 0..SEND_WARPS-1): every staged tile of this CTA, its share of the
// rows, to C (send off: ctx->p3_control < 0 or cfg.n_ranks == 0; 16-byte stores, a row of
// 2*BN bytes per 2*BN/16 lanes) or to the rows' owners through p3_send_rows (send on), then
// releases the staging buffer. n_ranks: cfg.n_ranks, as the kernel loads it. n_cols: read only
// with L::HALVES > 1 (a narrower last tile: its valid columns only).
template <class L>
__device__ __forceinline__ void send_warp(const P3PeerSendConfig *cfg, int64_t n_ranks, const P3SendCtx *ctx,
                                          uint8_t *c_ptr, uint64_t c_row_stride, uint32_t base, int warp_rank,
                                          int lane, int total, int n_tiles, int n_experts, int bm, const int *offs,
                                          uint32_t n_cols = 0)
{
    const bool send = ctx->p3_control >= 0 && n_ranks != 0;        // else the plain GEMM writes C
    // the send-off stores: ROW_LANES lanes (1 << ROW_SHIFT) per row, WARP_ROWS rows per warp and step
    constexpr int ROW_SHIFT = L::BN == 256 ? 5 : 4, ROW_LANES = 1 << ROW_SHIFT, WARP_ROWS = 32 / ROW_LANES;
    static_assert(2 * L::BN == 16 * ROW_LANES, "the send-off stores take 256 or 128 columns per tile");
    const int *mp = reinterpret_cast<const int *>(smem + L::OFF_MPRE);
    P3SendAcct *acct = reinterpret_cast<P3SendAcct *>(smem + L::OFF_ACCT) + warp_rank;
    const uint32_t staged = base + L::OFF_BAR + 16 * L::STAGES, freed = staged + 8;
    const uint32_t stg = base + L::OFF_STG;
    if (send && warp_rank == 0) {                   // an expert with no rows: one warp publishes 0
        for (int e = blockIdx.x; e < n_experts; e += gridDim.x) {
            if (offs[e + 1] != offs[e])
                continue;
            if (lane == 0)
                acct->expert = e;
            __syncwarp();
            p3_send_flush(cfg, ctx, acct);
        }
    }
    uint32_t i = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        const Tile T = grouped_tile(t, n_tiles, n_experts, mp, offs, bm, L::BN);
        const int seg = 2 * L::BN_MMA * tile_halves<L>(T, n_cols);     // bytes of each row of the tile
        if (send) {
            // called before the tile is staged: p3_send_rows checks and resolves the rows
            // while the consumers finish the tile, then waits on `staged` (acct.ready)
            if (lane == 0)
                acct->ready = staged | P3_READY | (i & 1);
            p3_send_rows(cfg, ctx, acct, stg, L::STG_PITCH, T.m0, T.rows, 2u * T.n0, seg, T.e, warp_rank,
                         L::SEND_WARPS);
        } else {
            mbar_wait(staged, i & 1);
            // a whole warp per row: the lane as it is (lane >> 5 and lane & 31 would change the PTX)
            const int r0 = WARP_ROWS == 1 ? warp_rank : WARP_ROWS * warp_rank + (lane >> ROW_SHIFT);
            for (int r = r0; r < T.rows; r += WARP_ROWS * L::SEND_WARPS) {
                uint32_t v0, v1, v2, v3;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                             : "r"(stg + r * L::STG_PITCH + (WARP_ROWS == 1 ? lane : lane & (ROW_LANES - 1)) * 16)
                             : "memory");
                uint8_t *dst = c_ptr + (uint64_t)(T.m0 + r) * c_row_stride + 2u * T.n0 +
                               (WARP_ROWS == 1 ? lane : lane & (ROW_LANES - 1)) * 16;
                if (L::HALVES == 1 || (WARP_ROWS == 1 ? lane : lane & (ROW_LANES - 1)) * 16 < seg)
                    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                                 :: "l"(dst), "r"(v0), "r"(v1), "r"(v2), "r"(v3) : "memory");
            }
        }
        __syncwarp();
        if (lane == 0)
            mbar_arrive(freed);
        // the expert's last tile in this CTA: flush now (while the consumers run the next
        // tile), not when the next staged tile shows another expert; so the last tile's
        // send is followed by one flush only
        if (send && (t + (int)gridDim.x >= total ||
                     grouped_tile(t + gridDim.x, n_tiles, n_experts, mp, offs, bm, L::BN).e != T.e))
            p3_send_flush(cfg, ctx, acct);
    }
}
