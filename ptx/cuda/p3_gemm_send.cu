// p3_gemm_send.cu: the MoE down-projection as a grouped bf16 GEMM for Hopper (sm_90a) with
// p3send's peer send in its epilogue. Built to ptx/p3_gemm_send.ptx by tools/build_gemm.py
// (nvcc -rdc: p3_send_rows / p3_send_flush stay .extern, resolved at load time from
// ptx/p3_send_rows.ptx, inlined whole-program or linked with cuLink/nvJitLink).
//
// C[r, :] = X[r, :] @ W[e]^T for every absolute row r of expert e (expert_offsets[e] <= r <
// expert_offsets[e+1]): X bf16 (rows, K) row-major, W bf16 (E, N, K) (each expert's
// weights N x K, K contiguous: both operands K-major), fp32 accumulation, bf16 output.
//
// Structure: a persistent grid (one CTA per SM, 384 threads, 160 registers, no setmaxnreg).
// Warp 0 is the producer: one thread streams A (BM x 64) and B (256 x 64) k-blocks with the
// tensor memory accelerator (128-byte swizzle) into a 3-stage ring guarded by mbarriers
// (full: expect_tx; empty: one arrive per consumer warp). Warpgroups 1 and 2 are the
// consumers: wgmma with both operands in shared memory, fp32 accumulators in registers.
// BM = 128: each consumer warpgroup owns 64 rows x 256 columns (m64n256k16); BM = 64 (few
// rows per expert, as at decode): each owns the 64 rows x 128 of the columns (m64n128k16).
// Tiles (expert, m-tile, n-tile) are numbered m-tile major, so the CTAs of one wave share B
// (one expert's weights) in L2; CTA b takes tiles b, b + grid, ... Rows past an expert's end
// are computed (they belong to the next expert, or are zero-filled past the end of X) and
// masked by the epilogue.
//
// Epilogue, overlapped with the next tile's mainloop: the consumers convert fp32 -> bf16
// (round to nearest even) into one staged BM x 256 tile in shared memory (528-byte rows:
// conflict-free) and arrive on `staged`; warps 1..3 (the send warps) wait for it, handle the
// tile's valid rows and arrive on `freed`, which the consumers wait for before staging the
// next tile. Send off (ctx->p3_control < 0 or cfg.n_ranks == 0): 16-byte stores of the
// rows into C. Send on: each send warp calls p3_send_rows for its rows (warp_rank 0..2 of
// n_warps = 3) with its own P3SendAcct before the tile is staged, `staged` in acct.ready
// (the rows are checked and resolved while the consumers finish the tile; the call waits
// for it before reading the tile), flushing right after its last tile of each expert
// (while the consumers run the next tile, so the CTA's last tile is followed by one flush
// only); an expert with no rows is flushed empty by send warp 0 of CTA e % grid,
// so its count 0 is published once. The send's bytes and counts are those of
// p3_scatter_send over the same C (docs/EMBEDDING.md (c)).
#include <stdint.h>
#include <cuda_bf16.h>
#include "../p3send.h"

#define P3G_BN 256
#define P3G_BK 64
#define P3G_STAGES 3
#define P3G_THREADS 384
#define P3G_MAX_EXPERTS 128
#define P3G_SEND_WARPS 3                                          // warps 1..3 of warpgroup 0
#define P3G_STG_PITCH (2 * P3G_BN + 16)                           // bytes per staged row (padded: no bank conflicts)
#define P3G_A_STAGE (128 * P3G_BK * 2)                            // 16 KiB (BM = 64 uses half)
#define P3G_B_STAGE (P3G_BN * P3G_BK * 2)                         // 32 KiB
#define P3G_OFF_B (P3G_STAGES * P3G_A_STAGE)
#define P3G_OFF_STG (P3G_OFF_B + P3G_STAGES * P3G_B_STAGE)
#define P3G_OFF_BAR (P3G_OFF_STG + 128 * P3G_STG_PITCH)             // full[S], empty[S], staged, free
#define P3G_OFF_ACCT (P3G_OFF_BAR + (2 * P3G_STAGES + 2) * 8)
#define P3G_OFF_MPRE (P3G_OFF_ACCT + P3G_SEND_WARPS * 48)
#define P3G_SMEM (P3G_OFF_MPRE + 4 * (P3G_MAX_EXPERTS + 1))      // 215764 (sm_90 opt-in: 232448)

struct __align__(64) TmaMap { uint64_t w[16]; };                // a CUtensorMap (128 bytes)

extern __shared__ __align__(1024) uint8_t smem[];               // the layout: P3G_OFF_*

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

__device__ __forceinline__ void tma_load(uint32_t dst, const TmaMap *map, uint32_t bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr)
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
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R])
{
#pragma unroll
    for (int i = 0; i < R; ++i)
        asm volatile("" : "+f"(d[i]) :: "memory");
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, both from shared memory, K-major, 128-byte swizzle.
__device__ __forceinline__ void wgmma_256(float (&d)[128], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, both from shared memory, K-major, 128-byte swizzle.
__device__ __forceinline__ void wgmma_128(float (&d)[64], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

template <int WN> __device__ __forceinline__ void wgmma_k16(float (&d)[WN / 2], uint64_t da, uint64_t db, int sd);
template <> __device__ __forceinline__ void wgmma_k16<256>(float (&d)[128], uint64_t da, uint64_t db, int sd)
{
    wgmma_256(d, da, db, sd);
}
template <> __device__ __forceinline__ void wgmma_k16<128>(float (&d)[64], uint64_t da, uint64_t db, int sd)
{
    wgmma_128(d, da, db, sd);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

struct Tile {
    int e, m0, rows, n0;
};

// Tile t: m-tile mg = t / n_tiles (mpre[e] m-tiles precede expert e), n-tile t % n_tiles.
__device__ __forceinline__ Tile tile_at(int t, int n_tiles, int n_experts, const int *mpre, const int *offs, int bm)
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
    T.n0 = (t - mg * n_tiles) * P3G_BN;
    return T;
}

// A consumer warpgroup: the mainloop of every tile of this CTA, then its accumulators as
// bf16 into the staged tile (after the send warps have released the previous one).
template <int WN>
__device__ __forceinline__ void consumer(uint32_t base, int wg, int wq, int lane, int total, int kblocks)
{
    float acc[WN / 2];
    const uint32_t a_off = WN == 256 ? wg * 64 * 128 : 0;     // this warpgroup's rows of an A stage
    const uint32_t b_off = WN == 256 ? 0 : wg * 128 * 128;    // this warpgroup's rows of a B stage
    const int row_off = WN == 256 ? wg * 64 : 0, col_off = WN == 256 ? 0 : wg * 128;
    const uint32_t full = base + P3G_OFF_BAR, empty = full + 8 * P3G_STAGES;
    const uint32_t staged = empty + 8 * P3G_STAGES, freed = staged + 8;
    const uint32_t stg = base + P3G_OFF_STG + (row_off + wq * 16 + (lane >> 2)) * P3G_STG_PITCH + 2 * col_off +
                         (lane & 3) * 4;
    uint32_t s = 0, ph = 0, prev = 0, i = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        for (int kb = 0; kb < kblocks; ++kb) {
            mbar_wait(full + 8 * s, ph);
            const uint64_t da = sw128_desc(base + s * P3G_A_STAGE + a_off);
            const uint64_t db = sw128_desc(base + P3G_OFF_B + s * P3G_B_STAGE + b_off);
            fence_acc(acc);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < P3G_BK / 16; ++k)
                wgmma_k16<WN>(acc, da + 2 * k, db + 2 * k, (kb | k) != 0);
            wgmma_commit();
            if (kb > 0) {
                wgmma_wait<1>();                    // k-block kb-1 is read: its stage is free
                if (lane == 0)
                    mbar_arrive(empty + 8 * prev);
            }
            prev = s;
            if (++s == P3G_STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
        wgmma_wait<0>();
        fence_acc(acc);
        if (lane == 0)
            mbar_arrive(empty + 8 * prev);
        mbar_wait(freed, (i & 1) ^ 1);              // the send warps are done with the previous tile
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
            asm volatile("st.shared.u32 [%0], %1;" :: "r"(stg + j * 16), "r"(pack_bf16(acc[4 * j], acc[4 * j + 1]))
                         : "memory");
            asm volatile("st.shared.u32 [%0], %1;" :: "r"(stg + 8 * P3G_STG_PITCH + j * 16),
                         "r"(pack_bf16(acc[4 * j + 2], acc[4 * j + 3])) : "memory");
        }
        mbar_arrive(staged);                        // release: the send warps read the tile next
    }
}

// A send warp (warp_rank 0..2): every staged tile of this CTA, its share of the rows, to C
// (send off) or to the rows' owners through p3_send_rows, then releases the staging buffer.
__device__ __forceinline__ void send_warp(const P3PeerSendConfig *cfg, const P3SendCtx *ctx, uint8_t *c_ptr,
                                          uint64_t c_row_stride, uint32_t base, int warp_rank, int lane,
                                          int total, int n_tiles, int n_experts, int bm, bool send,
                                          const int *offs)
{
    const int *mp = reinterpret_cast<const int *>(smem + P3G_OFF_MPRE);
    P3SendAcct *acct = reinterpret_cast<P3SendAcct *>(smem + P3G_OFF_ACCT) + warp_rank;
    const uint32_t staged = base + P3G_OFF_BAR + 16 * P3G_STAGES, freed = staged + 8;
    const uint32_t stg = base + P3G_OFF_STG;
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
        const Tile T = tile_at(t, n_tiles, n_experts, mp, offs, bm);
        if (send) {
            // called before the tile is staged: p3_send_rows checks and resolves the rows
            // while the consumers finish the tile, then waits on `staged` (acct.ready)
            if (lane == 0)
                acct->ready = staged | P3_READY | (i & 1);
            p3_send_rows(cfg, ctx, acct, stg, P3G_STG_PITCH, T.m0, T.rows, 2u * T.n0, 2 * P3G_BN, T.e, warp_rank,
                         P3G_SEND_WARPS);
        } else {
            mbar_wait(staged, i & 1);
            for (int r = warp_rank; r < T.rows; r += P3G_SEND_WARPS) {
                uint32_t v0, v1, v2, v3;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                             : "r"(stg + r * P3G_STG_PITCH + lane * 16) : "memory");
                uint8_t *dst = c_ptr + (uint64_t)(T.m0 + r) * c_row_stride + 2u * T.n0 + lane * 16;
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
                     tile_at(t + gridDim.x, n_tiles, n_experts, mp, offs, bm).e != T.e))
            p3_send_flush(cfg, ctx, acct);
    }
}

extern "C" __global__ void __launch_bounds__(P3G_THREADS, 1)
p3_gemm_send(const __grid_constant__ P3PeerSendConfig cfg, const P3SendCtx *ctx, const TmaMap *tmaps,
             uint8_t *c_ptr, uint64_t c_row_stride, uint32_t n_cols, uint32_t k_dim, uint32_t bm)
{
    // The tensor maps live in device memory (written before the launch): by value, their
    // 64-byte alignment would put them where the driver's parameter layout and PTX's differ.
    const TmaMap *tmap_a = tmaps, *tmap_b = tmaps + 1;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int *mpre = reinterpret_cast<int *>(smem + P3G_OFF_MPRE);
    const int *offs = reinterpret_cast<const int *>(ctx->expert_offsets);
    const int n_experts = (int)ctx->n_experts;
    if (n_experts < 1 || n_experts > P3G_MAX_EXPERTS || (bm != 64 && bm != 128) || k_dim == 0 ||
        k_dim % P3G_BK || n_cols == 0 || n_cols % P3G_BN)
        return;                                     // the launcher refuses these before launch
    if (base & 1023)
        __trap();                                   // the swizzled stages need 1024-byte alignment
    const uint32_t full = base + P3G_OFF_BAR, empty = full + 8 * P3G_STAGES;
    const uint32_t staged = empty + 8 * P3G_STAGES, freed = staged + 8;
    if (tid == 0) {
        int m = 0;
        mpre[0] = 0;
        for (int e = 0; e < n_experts; ++e) {
            const int r = offs[e + 1] - offs[e];
            m += r > 0 ? (r + (int)bm - 1) / (int)bm : 0;
            mpre[e + 1] = m;
        }
        for (int s = 0; s < P3G_STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 8);            // one arrive per consumer warp
        }
        mbar_init(staged, 256);                     // every consumer thread, after its stores
        mbar_init(freed, P3G_SEND_WARPS);           // one arrive per send warp
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (warp >= 1 && warp <= P3G_SEND_WARPS) {
        P3SendAcct *a = reinterpret_cast<P3SendAcct *>(smem + P3G_OFF_ACCT) + (warp - 1);
        if (lane == 0) {
            a->expert = -1;
            a->ready = 0;
            a->units = 0;
        }
        if (lane < P3_MAX_RANKS)
            a->pair[lane] = 0;
    }
    __syncthreads();
    const int n_tiles = (int)(n_cols / P3G_BN), kblocks = (int)(k_dim / P3G_BK);
    const int total = mpre[n_experts] * n_tiles;

    if (warp == 0) {                                // the producer: one thread issues every copy
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_a) : "memory");
            asm volatile("prefetch.tensormap [%0];" :: "l"((uint64_t)tmap_b) : "memory");
            const uint32_t tx = bm * P3G_BK * 2 + P3G_B_STAGE;
            uint32_t s = 0, ph = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const Tile T = tile_at(t, n_tiles, n_experts, mpre, offs, (int)bm);
                const int brow = T.e * (int)n_cols + T.n0;
                for (int kb = 0; kb < kblocks; ++kb) {
                    mbar_wait(empty + 8 * s, ph ^ 1);
                    mbar_expect_tx(full + 8 * s, tx);
                    tma_load(base + s * P3G_A_STAGE, tmap_a, full + 8 * s, kb * P3G_BK, T.m0);
                    tma_load(base + P3G_OFF_B + s * P3G_B_STAGE, tmap_b, full + 8 * s, kb * P3G_BK, brow);
                    if (++s == P3G_STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
    } else if (warp <= P3G_SEND_WARPS) {
        int64_t n_ranks;                            // cfg.n_ranks, loaded as [cfg+88] (tools/build_gemm.py names it)
        asm("ld.param.s64 %0, [p3_gemm_send_param_0+88];" : "=l"(n_ranks));
        const bool send = ctx->p3_control >= 0 && n_ranks != 0;        // else the plain GEMM writes C
        send_warp(&cfg, ctx, c_ptr, c_row_stride, base, warp - 1, lane, total, n_tiles, n_experts, (int)bm, send,
                  offs);
    } else {
        const int wg = warp / 4 - 1, wq = warp % 4;
        if (bm == 128)
            consumer<256>(base, wg, wq, lane, total, kblocks);
        else
            consumer<128>(base, wg, wq, lane, total, kblocks);
    }
}
