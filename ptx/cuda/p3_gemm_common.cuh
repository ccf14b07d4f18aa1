// p3_gemm_common.cuh: the Hopper pieces p3send's grouped GEMMs share (mbarriers, the tensor
// memory accelerator, wgmma's shared-memory descriptors and fences, bf16 packing, the tile
// numbering). Everything is __forceinline__, so each kernel's PTX holds only what it uses.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>

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

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart
// (rows of 128 bytes: 64 bf16 or 128 e4m3 elements of K).
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
