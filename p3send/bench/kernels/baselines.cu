// The comparison kernels of `p3send bench` (p3send/bench/baselines.py), CUDA C++ compiled at
// bench time with NVRTC (p3send.cuda.driver.nvrtc_compile); never part of the runtime.
//
//   baseline_copy     the SM copy ceiling: one contiguous tile of VPT x blockDim vectors per CTA
//   baseline_scatter  the CUDA C++ scatter baseline: p3_scatter_send's job from the same inputs
//   baseline_rows     the scatter ceiling: rows to precomputed destinations, optionally signalled
//   baseline_publish  the flags of baseline_rows published by a kernel of their own
//   baseline_reduce   the reduce ceiling: p3_recv_reduce's arithmetic without the wait
//   dispatch_exchange the dispatch ceiling's count exchange (every rank's counts to every rank)
//   dispatch_signal   the dispatch ceiling's least signal: one flag per (source, destination), waited for
//
// Compile-time parameters (-D): VPT 16-byte vectors per thread, MAXT the most threads per CTA
// (__launch_bounds__), HINT 1 streaming (.cs) loads and stores. Requires sm_90 (bf16x2
// conversion, acq_rel/release atomics at .gpu scope). tests/cpu/test_bench.py compiles this
// file for sm_90 with the system nvcc, so a syntax error fails on a CPU machine.
typedef unsigned long long u64;
typedef unsigned int u32;
#ifndef VPT
#define VPT 1
#endif
#ifndef HINT
#define HINT 0
#endif
#ifndef MAXT
#define MAXT 1024
#endif

struct Cfg {            // P3PeerSendConfig, 184 bytes (docs/ABI.md)
    u64 atomic_counter, src_info_ptr, row_base_ptr, recv_buf_ptrs[8];
    long long n_ranks, p2p_world_size, top_k, msg_bytes, max_tokens_per_rank, my_rank;
    u64 send_mbx, send_stamp_ptr;
    long long send_stamp_on;
    u64 trace_ptr;
    long long trace_on, send_trace_slot;
};
static_assert(sizeof(Cfg) == 184, "Cfg must be P3PeerSendConfig's 184 bytes");
struct Ptrs8 { u64 p[8]; };

__device__ __forceinline__ uint4 ld16(const uint4* p) {
#if HINT
    return __ldcs(p);
#else
    return __ldg(p);
#endif
}
__device__ __forceinline__ void st16(uint4* p, uint4 v) {   // st.global: dst may come from an integer
#if HINT
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
}

// Thread t's vectors v0, v0 + ntid, ... (VPT of them, those below v1) of a row: loaded into
// x, and stored from it.
__device__ __forceinline__ void load_vecs(uint4 (&x)[VPT], const uint4* src, int v0, int v1) {
#pragma unroll
    for (int j = 0; j < VPT; ++j)
        if (v0 + j * (int)blockDim.x < v1) x[j] = ld16(src + v0 + j * blockDim.x);
}
__device__ __forceinline__ void store_vecs(uint4* dst, const uint4 (&x)[VPT], int v0, int v1) {
#pragma unroll
    for (int j = 0; j < VPT; ++j)
        if (v0 + j * (int)blockDim.x < v1) st16(dst + v0 + j * blockDim.x, x[j]);
}

// Thread t copies vectors t, t+ntid, ... (VPT of them) of the tile blockIdx.x.
extern "C" __global__ void __launch_bounds__(MAXT) baseline_copy(uint4* __restrict__ dst,
                                                             const uint4* __restrict__ src, u64 nvec)
{
    const u64 i0 = (u64)blockIdx.x * (blockDim.x * VPT) + threadIdx.x;
    uint4 x[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j)
        if (i0 + (u64)j * blockDim.x < nvec) x[j] = ld16(src + i0 + (u64)j * blockDim.x);
#pragma unroll
    for (int j = 0; j < VPT; ++j)
        if (i0 + (u64)j * blockDim.x < nvec) st16(dst + i0 + (u64)j * blockDim.x, x[j]);
}

// The destination of absolute row ``row``, resolved by one whole warp (every lane gets the
// same answer): e = experts whose first row is <= row, minus one; the owning rank = the first
// whose range [t_end - count, t_end) holds the row (lane rk tests rank rk); the src_info
// bounds check. Returns the address (0 = not stored); p = the p2p peer (-1 = not stored),
// m = the owning ranks' mask (0 = unrouted).
__device__ __forceinline__ u64 resolve(const Cfg& cfg, const int* __restrict__ off, int n_experts, int row,
                                       int& e, int& p, u32& m)
{
    const int lane = threadIdx.x & 31, nr = (int)cfg.n_ranks;
    const int2 si = __ldg((const int2*)cfg.src_info_ptr + row);
    e = -1;
    for (int i0 = 0; i0 <= n_experts; i0 += 32) {
        const int i = i0 + lane;
        e += __popc(__ballot_sync(~0u, i <= n_experts && __ldg(off + i) <= row));
    }
    bool own = false;
    if (lane < nr) {
        const int2 t = __ldg((const int2*)cfg.atomic_counter + e * nr + lane);
        const int hi = t.x - 1024;
        own = hi - t.y <= row && row < hi;
    }
    m = __ballot_sync(~0u, own);
    const bool ok = m && si.x >= 0 && si.x < cfg.max_tokens_per_rank && si.y >= 0 && si.y < cfg.top_k;
    p = ok ? (__ffs(m) - 1) % (int)cfg.p2p_world_size : -1;
    return ok ? cfg.recv_buf_ptrs[p] + ((u64)si.x * cfg.top_k + si.y) * cfg.msg_bytes : 0;
}

// CTA b handles vectors [chunk*cta_vecs, min(nv, (chunk+1)*cta_vecs)) of row off[0] + b / chunks.
// state: u32 done[n_experts], u32 pair[n_experts][8] (0 = no signal); diag: u32 [dropped, unrouted] or 0.
// Warp 0 resolves the row for the CTA (shared memory, bar.sync); after a second bar.sync,
// thread 0 releases the CTA's stores and counts the CTA into done[e]: one atomic per CTA on
// the expert's counter, not one per warp (docs/PERF.md, "The ceilings").
extern "C" __global__ void __launch_bounds__(MAXT) baseline_scatter(
    const __grid_constant__ Cfg cfg, const __grid_constant__ Ptrs8 counts, const uint4* __restrict__ c,
    u64 c_row_stride, const int* __restrict__ off, u32* state, u32* diag, int n_experts, int chunks, int cta_vecs)
{
    const int ri = blockIdx.x / chunks, chunk = blockIdx.x - ri * chunks;
    const int row = __ldg(off) + ri;
    const int nr = (int)cfg.n_ranks;
    const int np = min(nr, (int)cfg.p2p_world_size);
    if (state && blockIdx.x == 0)                 // empty experts: 0 rows, nothing to order
        for (int i = threadIdx.x; i < n_experts * np; i += blockDim.x) {
            const int e = i / np, p = i - e * np;
            if (__ldg(off + e) == __ldg(off + e + 1))
                ((u64*)counts.p[p])[e * nr + cfg.my_rank] = 0;
        }
    if (row >= __ldg(off + n_experts)) return;
    const int nv = (int)(cfg.msg_bytes >> 4);
    const int v0 = chunk * cta_vecs + threadIdx.x, v1 = min(nv, (chunk + 1) * cta_vecs);
    const uint4* src = (const uint4*)((const char*)c + (u64)row * c_row_stride);
    uint4 x[VPT];
    load_vecs(x, src, v0, v1);                    // loads first: the resolve hides under them
    int e, p;
    u32 m;
    __shared__ u64 s_dst;
    __shared__ int s_e, s_p;
    __shared__ u32 s_m;
    if (threadIdx.x < 32) {
        const u64 d = resolve(cfg, off, n_experts, row, e, p, m);
        if (threadIdx.x == 0) s_dst = d, s_e = e, s_p = p, s_m = m;
    }
    __syncthreads();
    uint4* dst = (uint4*)s_dst;
    e = s_e, p = s_p, m = s_m;
    const bool first = chunk == 0 && threadIdx.x == 0;      // counts the row once
    if (diag && first && p < 0) atomicAdd(diag + (m ? 0 : 1), 1u);
    if (dst)
        store_vecs(dst, x, v0, v1);
    if (!state) return;
    __syncthreads();                              // every thread's stores before thread 0's release
    if (threadIdx.x != 0) return;
    u32* pair = state + n_experts + 8 * e;
    if (first && p >= 0) atomicAdd(pair + p, 1u);
    const u32 total = (u32)(__ldg(off + e + 1) - __ldg(off + e)) * (u32)chunks;
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(state + e) : "memory");
    if (old + 1 != total) return;                 // the last CTA of expert e publishes its pairs
    for (int q = 0; q < np; ++q) {
        const u64 n = atomicExch(pair + q, 0u);
        asm volatile("st.release.gpu.global.u64 [%0], %1;"
                     :: "l"((u64*)counts.p[q] + e * nr + cfg.my_rank), "l"(n) : "memory");
    }
    asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(state + e) : "memory");
}

// Diagnostic only (not the send's job): the same CTA shape with every row's destination
// precomputed (row_dst[r], 0 = not stored): no resolve, no bounds check. CTA b copies chunk
// b % chunks of rows_per_cta consecutive rows (one after another), so the grid is
// ceil(n_rows / rows_per_cta) * chunks. signal 1: the least signal of the send's protocol
// (a count is published once its rows are all stored): after bar.sync thread 0 counts the CTA
// into done[b % 32] with an acq_rel atomic (the release of the CTA's stores; 32 counters, as
// many as the send's experts), and the CTA that completes its counter resets it and
// publishes with a release store into flag[b % 32]. signal 2, another protocol (receivers
// that know how many rows to expect, which the ABI's counts do not assume): thread 0 adds
// the CTA to done[b % 32] with a fire-and-forget release reduction, nothing else.
extern "C" __global__ void __launch_bounds__(MAXT) baseline_rows(const u64* __restrict__ row_dst,
    const uint4* __restrict__ c, u64 c_row_stride, int nv, int chunks, int cta_vecs, u32* done, u64* flag,
    int signal, int rows_per_cta, int n_rows)
{
    const int rb = blockIdx.x / chunks, chunk = blockIdx.x - rb * chunks;
    const int v0 = chunk * cta_vecs + threadIdx.x, v1 = min(nv, (chunk + 1) * cta_vecs);
    const int r1 = min(n_rows, (rb + 1) * rows_per_cta);
    for (int ri = rb * rows_per_cta; ri < r1; ++ri) {
        const uint4* src = (const uint4*)((const char*)c + (u64)ri * c_row_stride);
        uint4 x[VPT];
        load_vecs(x, src, v0, v1);
        uint4* dst = (uint4*)__ldg(row_dst + ri);
        if (dst)
            store_vecs(dst, x, v0, v1);
    }
    if (!signal) return;
    __syncthreads();                              // every thread's stores before thread 0's release
    if (threadIdx.x != 0) return;
    const u32 q = blockIdx.x & 31, total = (gridDim.x - q + 31) / 32;
    if (signal == 2) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(done + q) : "memory");
        return;
    }
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(done + q) : "memory");
    if (old + 1 != total) return;
    asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(done + q) : "memory");
    asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(flag + q), "l"((u64)total) : "memory");
}

// The other way to order a count after rows: the kernel boundary. A one-warp kernel launched
// after baseline_rows (stream order) publishes the flags: thread i < n, flag[i] = value
// (release store; the previous kernel's stores are visible to it by stream order).
extern "C" __global__ void baseline_publish(u64* flag, int n, u64 value)
{
    if ((int)threadIdx.x < n)
        asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(flag + threadIdx.x), "l"(value) : "memory");
}

// The reduce ceiling (diagnostic, not the receive's job): p3_recv_reduce's arithmetic with no
// wait, no re-arm and no diagnostics, for every rank of a one-GPU round in one launch. CTA b
// reduces vectors [chunk*cta_vecs, ...) of token t of rank r (b = (r*tokens + t)*chunks +
// chunk): every slot's loads first (top_k <= 8), then the fp32 FMAs in k order and one
// bf16 store per vector, as docs/KERNELS.md specifies the reduce.
struct Ptrs32 { u64 recv[8], topk[8], w[8], out[8]; };
__device__ __forceinline__ float lo_f(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_f(u32 u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
extern "C" __global__ void __launch_bounds__(MAXT) baseline_reduce(const __grid_constant__ Ptrs32 p,
    int tokens, int top_k, int nv, int n_global, int chunks, int cta_vecs)
{
    const int b = blockIdx.x / chunks, chunk = blockIdx.x - b * chunks;
    const int r = b / tokens, t = b - r * tokens;
    const int v0 = chunk * cta_vecs + threadIdx.x, v1 = min(nv, (chunk + 1) * cta_vecs);
    const int* idx = (const int*)p.topk[r] + (u64)t * top_k;
    const float* wt = (const float*)p.w[r] + (u64)t * top_k;
    const uint4* slots = (const uint4*)p.recv[r] + (u64)t * top_k * nv;
    uint4 x[8][VPT];
    float w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int g = k < top_k ? __ldg(idx + k) : -1;
        const bool ok = g >= 0 && g < n_global;
        w[k] = ok ? __ldg(wt + k) : 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int v = v0 + j * (int)blockDim.x;
            x[k][j] = make_uint4(0, 0, 0, 0);
            if (ok && v < v1) x[k][j] = ld16(slots + (u64)k * nv + v);
        }
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = v0 + j * (int)blockDim.x;
        if (v >= v1) continue;
        float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k >= top_k) break;
            const u32 q[4] = {x[k][j].x, x[k][j].y, x[k][j].z, x[k][j].w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                a[2 * h] = fmaf(w[k], lo_f(q[h]), a[2 * h]);
                a[2 * h + 1] = fmaf(w[k], hi_f(q[h]), a[2 * h + 1]);
            }
        }
        uint4 o;
        o.x = pack_bf16(a[0], a[1]); o.y = pack_bf16(a[2], a[3]);
        o.z = pack_bf16(a[4], a[5]); o.w = pack_bf16(a[6], a[7]);
        st16((uint4*)p.out[r] + (u64)t * nv + v, o);
    }
}

// The dispatch's ceiling (p3send/bench/dispatch.py): the least synchronisation the dispatch's
// protocol needs around the copy floor, for every rank of a one-GPU step, CTA r acting for
// rank r (grid n_ranks, every CTA resident: each waits for the others).
// dispatch_exchange: CTA r takes the step's epoch (epoch[r] + 1), stores its n_experts counts
// (counts[r][g], given) tagged with the epoch into every rank p's exchange buffer
// xbuf[parity][p][r][g] (one fence before: the release), then polls its own n_ranks x
// n_experts words until each carries the tag (a fence after: the acquire). dispatch_signal
// (after the copy, by stream order): CTA r stores the epoch into flag[p][r] of every rank p,
// then polls its own n_ranks flags with acquire loads. Both give up timeout_ns after they
// started and count it in err[0]. The counts are not computed: the dispatch's counting and
// layout are what the ceiling leaves out.
__device__ __forceinline__ u64 gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void dispatch_exchange(u64* xbuf, const u32* __restrict__ counts, u64* epoch, u32* err,
                                             int n_ranks, int n_experts, u64 timeout_ns)
{
    const u64 t0 = gtimer();
    const int r = blockIdx.x, n = n_ranks * n_experts;
    const u64 e = epoch[r] + 1;                   // read by every thread before thread 0 stores it below
    const u64 tag = (e % 0xFFFFFFFFull) + 1;      // never the zero of a fresh buffer
    u64* half = xbuf + (e & 1) * (u64)n_ranks * n;
    __threadfence();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int p = i / n_experts, g = i - p * n_experts;
        const u64 v = tag << 32 | counts[r * n_experts + g];
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(half + (u64)p * n + r * n_experts + g), "l"(v)
                     : "memory");
    }
    bool late = false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const u64* w = half + (u64)r * n + i;
        u64 v;
        do {
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
        } while ((v >> 32) != tag && !(late = gtimer() - t0 > timeout_ns));
        if (late) break;
    }
    __threadfence();
    if (late) atomicAdd(err, 1u);
    __syncthreads();
    if (threadIdx.x == 0) epoch[r] = e;
}
extern "C" __global__ void dispatch_signal(u64* flag, const u64* __restrict__ epoch, u32* err, int n_ranks,
                                           u64 timeout_ns)
{
    const u64 t0 = gtimer();
    const int r = blockIdx.x, s = threadIdx.x;
    if (s >= n_ranks) return;
    const u64 e = epoch[r];
    __threadfence();                              // the copy before it (stream order), released
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(flag + s * n_ranks + r), "l"(e) : "memory");
    u64 v;
    bool late = false;
    do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(flag + r * n_ranks + s) : "memory");
    } while (v != e && !(late = gtimer() - t0 > timeout_ns));
    if (late) atomicAdd(err, 1u);
}
