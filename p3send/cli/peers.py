"""Fair peers for ``p3send bench`` (issue 15): what a good engineer would write instead of
hand-written PTX, doing the same job from the same inputs as ``p3_scatter_send``.

- ``TritonScatter``: a Triton kernel, compiled ahead of time with ``triton.compile``
  (needs Triton, not torch) and launched through the driver seam like every p3send kernel.
- ``CudaScatter``: a CUDA C++ kernel compiled at bench time with NVRTC
  (``cuda.bindings.nvrtc``; nvcc where NVRTC is missing).
- ``SMCopy``: the plainest SM copy (the SM ceiling): each CTA copies one contiguous tile
  of ``threads * vpt`` 16-byte vectors and exits.

The two scatter peers share one design: one CTA (program) per (row, column chunk), the
chunks of a row equal in size; each CTA issues its 16-byte loads of C first, then one warp
resolves the row (expert by counting ``expert_offsets <= row``, owning rank = the first
whose range-table range holds the row, ``dst_p2p = rank % p2p_world_size``, the
``src_info`` bounds check) while the loads are in flight, then every thread stores. The
signal: one thread of the row's chunk-0 CTA adds the row to ``pair[e][p]`` (relaxed), and
after ``bar.sync`` one thread counts the CTA into ``done[e]`` with an acq_rel atomic at
.gpu scope (the release of all the CTA's stores); the CTA that
completes ``done[e]`` (rows of e x chunks) swaps every ``pair[e][p]`` to 0 and publishes
it with a .gpu release store into ``count_ptrs[p][e*n_ranks + my_rank]``, then resets
``done[e]``; CTA 0 publishes 0 for empty experts. The state (``u32 done[E]``, ``u32
pair[E][8]``) is zeroed once at construction and self-resetting inside the kernel, so its
cost is in the timed launch. The .gpu scope is enough only for receivers on this GPU (the
bench's one-GPU sections); p3_scatter_send's default signal is .sys.

``time_peers`` runs each peer's launch-shape variants and reports the fastest, so the bar
is each peer's best shape on the GPU at hand. Bench-only: nothing in the runtime imports
this module. Triton, torch and NVRTC are
optional; a peer that cannot be built raises ``PeerUnavailable`` saying why.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

import numpy as np

from ..abi.config import P3PeerSendConfig
from ..abi.errors import ConfigError, P3SendError
from ..cuda import driver
from ..ops.send import send_args

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 -- Triton is an optional comparison only
    triton = tl = None


class PeerUnavailable(P3SendError):
    """A peer cannot be built here (Triton, NVRTC/nvcc missing, or a compile error)."""


# ---------------------------------------------------------------- CUDA C++ (NVRTC)

CUDA_SOURCE = r"""
// VPT: 16-byte vectors per thread; MAXT: the most threads per CTA; HINT 1: streaming (.cs)
// loads and stores.
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
extern "C" __global__ void __launch_bounds__(MAXT) p3peer_copy(uint4* __restrict__ dst,
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
// thread 0 releases the CTA's stores and counts the CTA into done[e]. (Every warp resolving
// and signalling on its own, with no CTA barrier, measured 1.5x to 5x slower at the prefill
// shape: 7 to 28 times the atomics on one counter per expert.)
extern "C" __global__ void __launch_bounds__(MAXT) p3peer_scatter(
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
extern "C" __global__ void __launch_bounds__(MAXT) p3peer_rows(const u64* __restrict__ row_dst,
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
// after p3peer_rows (stream order) publishes the flags: thread i < n, flag[i] = value
// (release store; the previous kernel's stores are visible to it by stream order).
extern "C" __global__ void p3peer_publish(u64* flag, int n, u64 value)
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
extern "C" __global__ void __launch_bounds__(MAXT) p3peer_reduce(const __grid_constant__ Ptrs32 p,
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
"""


def _nvrtc():
    """cuda.bindings.nvrtc with its library loaded, or None."""
    try:
        from cuda.bindings import nvrtc
        err, _, _ = nvrtc.nvrtcVersion()
        return nvrtc if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None
    except Exception:  # noqa: BLE001 -- no cuda-bindings, or no libnvrtc on this machine
        return None


def compile_cuda(source: str, arch: str, defines: dict | None = None) -> tuple[bytes, str]:
    """CUDA C++ -> cubin for ``arch`` (e.g. "sm_90") with NVRTC, else nvcc; returns (cubin,
    which compiler). Raises PeerUnavailable with the compiler's log."""
    opts = [f"--gpu-architecture={arch}", "--std=c++17"] + [f"-D{k}={v}" for k, v in (defines or {}).items()]
    nv = _nvrtc()
    if nv is not None:
        ok = nv.nvrtcResult.NVRTC_SUCCESS
        err, prog = nv.nvrtcCreateProgram(source.encode(), b"p3send_peers.cu", 0, [], [])
        if err != ok:
            raise PeerUnavailable(f"nvrtcCreateProgram: {err}")
        try:
            err, = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            _, n = nv.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nv.nvrtcGetProgramLog(prog, log)
            if err != ok:
                raise PeerUnavailable(f"NVRTC could not compile the CUDA C++ peers ({err}):\n"
                                      + log.decode(errors="replace"))
            _, n = nv.nvrtcGetCUBINSize(prog)
            cubin = b" " * n
            nv.nvrtcGetCUBIN(prog, cubin)
        finally:
            nv.nvrtcDestroyProgram(prog)
        _, major, minor = nv.nvrtcVersion()
        return cubin, f"NVRTC {major}.{minor}"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise PeerUnavailable("the CUDA C++ peers need NVRTC (cuda.bindings.nvrtc and libnvrtc) or nvcc; "
                              "found neither")
    with tempfile.TemporaryDirectory() as d:
        cu, out = os.path.join(d, "peers.cu"), os.path.join(d, "peers.cubin")
        with open(cu, "w") as f:
            f.write(source)
        r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", *opts[2:], "-o", out, cu],
                           capture_output=True, text=True)
        if r.returncode:
            raise PeerUnavailable(f"nvcc could not compile the CUDA C++ peers:\n{r.stderr}")
        with open(out, "rb") as f:
            return f.read(), "nvcc"


@functools.cache
def _cuda_module(ordinal: int, arch: str, threads: int, vpt: int, hint: int = 0):
    cubin, how = compile_cuda(CUDA_SOURCE, arch, {"VPT": vpt, "HINT": hint, "MAXT": threads})
    return driver.load_image(cubin), how


# ---------------------------------------------------------------- launches

class Launch:
    """One prepared launch: a function, its shape and live ctypes objects for every
    parameter (their addresses prebuilt, so a launch is one cuLaunchKernel)."""

    def __init__(self, func, name: str, grid: int, block: int, smem: int, objs: list):
        self.func, self.name, self.grid, self.block, self.smem = func, name, grid, block, smem
        self.objs = objs
        self.addrs = np.array([ctypes.addressof(o) for o in objs], dtype=np.uint64)
        _check_params(func, name, tuple((ctypes.sizeof(o), ctypes.alignment(o)) for o in objs))

    def __call__(self, stream: driver.Stream) -> None:
        if self.grid:
            driver.launch(self.func, (self.grid,), (self.block,), self.smem, stream, self.addrs, self.name)


_checked: set = set()


def _check_params(func, name: str, shapes: tuple) -> None:
    """The driver's parameter layout of ``func`` must be exactly ``shapes`` ((size, align) per
    parameter, packed in order): a wrong count or size would launch garbage."""
    key = (int(func), shapes)
    if func is None or key in _checked:
        return
    want, at = [], 0
    for size, align in shapes:
        at = -(-at // align) * align
        want.append((at, size))
        at += size
    got = driver.param_info(func, len(shapes))
    extra = True
    try:
        driver.param_info(func, len(shapes) + 1)
    except P3SendError:
        extra = False
    if got != want or extra:
        raise P3SendError(f"{name}: the driver's parameter layout {got}{' and more' if extra else ''} "
                          f"differs from the arguments built here {want}")
    _checked.add(key)


def _tile(nv: int, threads: int, vpt: int) -> tuple[int, int, int]:
    """A row of ``nv`` vectors cut into equal chunks of at most threads*vpt: (chunks,
    cta_vecs, block: the whole warps that cover a chunk with vpt vectors per thread)."""
    chunks = -(-nv // (threads * vpt))
    cta_vecs = -(-nv // chunks)
    return chunks, cta_vecs, 32 * -(-cta_vecs // (32 * vpt))


class _ScatterPeer:
    """What the two scatter peers share: the same argument checks as ScatterSend, the
    state (self-resetting) and diagnostics, prepare/launch/__call__/close."""

    label = "scatter peer"

    def __init__(self, n_experts: int, device: driver.Device | None, threads: int, vpt: int):
        if n_experts < 1:
            raise ConfigError([f"n_experts: expected >= 1, got {n_experts}"], f"{self.label}")
        if threads % 32 or not (32 <= threads <= 1024) or vpt < 1 or threads * vpt > 8192:
            raise ConfigError([f"threads, vpt: expected a multiple of 32 in 32..1024 and vpt >= 1, "
                               f"threads*vpt <= 8192; got {threads}, {vpt}"], f"{self.label}")
        self.dev = device or driver.device()
        self.n_experts, self.threads, self.vpt = int(n_experts), threads, vpt
        self.state = driver.DeviceBuffer(36 * self.n_experts, fill=0)   # u32 done[E], u32 pair[E][8]
        self.diag = driver.DeviceBuffer(8, fill=0)
        self.offsets_buf = driver.DeviceBuffer(4 * (self.n_experts + 1))
        self.last: Launch | None = None
        self.grid = 0

    def prepare(self, cfg: P3PeerSendConfig, c, expert_offsets, c_row_stride: int | None = None, *,
                count_ptrs=None, row_cache: bool = False, p3_control: int = 0, expert_offsets_host=None,
                rows_in_c: int | None = None) -> Launch:
        """The arguments of ``ScatterSend.prepare`` (the signal is always .gpu scope: receivers
        on this GPU). The grid needs the row count: pass the offsets as numpy (as
        ``expert_offsets`` or ``expert_offsets_host``), else ``rows_in_c`` bounds it."""
        stride = cfg.msg_bytes if c_row_stride is None else int(c_row_stride)
        host = expert_offsets if isinstance(expert_offsets, np.ndarray) else expert_offsets_host
        c_addr = driver.device_ptr(c, "c")
        nb = getattr(c, "nbytes", None) if isinstance(c, driver.DeviceBuffer) else None
        cap = rows_in_c
        if cap is None and nb is not None and stride:
            cap = (nb - cfg.msg_bytes) // stride + 1 if nb >= cfg.msg_bytes else 0
        sa = send_args(cfg, expert_offsets, n_experts=self.n_experts, ordinal=self.dev.ordinal, host_offsets=host,
                       rows_cap=cap, count_ptrs=count_ptrs, row_cache=row_cache, p3_control=p3_control,
                       same_gpu=True, staging=self.offsets_buf)
        problems, offs_addr, peers = sa.problems, sa.expert_offsets, sa.count_ptrs
        if row_cache:
            problems.append("row_cache: the peers do not implement the row cache")
        if cfg.send_stamp_on or cfg.trace_on:
            problems.append("send_stamp_on, trace_on: the peers do not write stamps or trace")
        if c_addr % 16:
            problems.append(f"c: expected a 16-byte aligned address, got {c_addr:#x}")
        if stride % 16 or stride < cfg.msg_bytes:
            problems.append(f"c_row_stride: expected a multiple of 16 >= msg_bytes ({cfg.msg_bytes}), got {stride}")
        if host is None and cap is None:
            problems.append("expert_offsets_host: the peers size their grid from the row count; pass the "
                            "offsets as numpy or rows_in_c")
        if problems:
            raise ConfigError(problems, f"{self.label} launch")
        if p3_control < 0 or cfg.n_ranks == 0:        # the send is off: nothing to launch
            self.last = Launch(None, self.label, 0, 0, 0, [])
            return self.last
        rows = int(host[-1]) - int(host[0]) if host is not None else int(cap)
        nv = cfg.msg_bytes // 16
        chunks, cta_vecs, block = _tile(nv, self.threads, self.vpt)
        self.grid = max(1, rows * chunks)
        if self.grid >= 1 << 31:
            raise ConfigError([f"rows: {rows} rows x {chunks} chunks exceed the grid"], f"{self.label} launch")
        state = self.state.ptr if count_ptrs is not None else 0
        self.last = self._build(cfg, peers, c_addr, stride, offs_addr, state, chunks, cta_vecs, block)
        return self.last

    def launch(self, stream: driver.Stream, prepared: Launch | None = None) -> None:
        driver.ensure_current(self.dev)
        (prepared or self.last)(stream)

    def __call__(self, *args, stream=None, **kw) -> None:
        """prepare(*args, **kw) and launch; synchronous when no stream is given."""
        launch = self.prepare(*args, **kw)
        s = stream or driver.Stream()
        self.launch(s, launch)
        if stream is None:
            s.synchronize()
            s.close()

    def diagnostics(self, reset: bool = True) -> dict:
        """{'dropped', 'unrouted'} rows since the last reset ('rejected' is always False: the
        host checks reject a bad config before any launch)."""
        d = self.diag.download(np.uint32)
        if reset:
            self.diag.fill(0)
        return {"dropped": int(d[0]), "unrouted": int(d[1]), "rejected": False}

    def close(self) -> None:
        for b in (self.state, self.diag, self.offsets_buf):
            if b is not None:
                b.free()


class CudaScatter(_ScatterPeer):
    """The CUDA C++ scatter peer (NVRTC): one CTA of ``threads`` threads per (row, chunk),
    ``vpt`` 16-byte vectors per thread."""

    label = "CUDA C++ scatter peer"

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, threads: int = 256,
                 vpt: int = 1):
        super().__init__(n_experts, device, threads, vpt)
        mod, self.compiler = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "p3peer_scatter")
        self.config = f"{threads} thr x {vpt} vec ({self.compiler})"

    def _build(self, cfg, peers, c_addr, stride, offs_addr, state, chunks, cta_vecs, block) -> Launch:
        u64, i32 = ctypes.c_uint64, ctypes.c_int32
        objs = [P3PeerSendConfig.from_buffer_copy(bytes(cfg)), (u64 * 8)(*peers), u64(c_addr), u64(stride),
                u64(offs_addr), u64(state), u64(self.diag.ptr), i32(self.n_experts), i32(chunks), i32(cta_vecs)]
        return Launch(self.func, "p3peer_scatter", self.grid, block, 0, objs)


class SMCopy:
    """The SM ceiling: ``p3peer_copy`` over ``nbytes`` (a multiple of 16), one tile of
    ``threads * vpt`` vectors per CTA."""

    def __init__(self, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1, hint: int = 0):
        self.dev = device or driver.device()
        mod, self.compiler = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt,
                                          hint=hint)
        self.func = driver.get_function(mod, "p3peer_copy")
        self.threads, self.vpt = threads, vpt
        self.config = f"{threads} thr x {vpt} vec{', .cs' if hint else ''} ({self.compiler})"

    def prepare(self, dst, src, nbytes: int) -> Launch:
        problems = []
        d, s = driver.device_ptr(dst, "dst"), driver.device_ptr(src, "src")
        for name, a in (("dst", d), ("src", s)):
            if a % 16:
                problems.append(f"{name}: expected a 16-byte aligned address, got {a:#x}")
        if nbytes < 0 or nbytes % 16:
            problems.append(f"nbytes: expected a non-negative multiple of 16, got {nbytes}")
        if problems:
            raise ConfigError(problems, "SM copy")
        nvec = nbytes // 16
        grid = -(-nvec // (self.threads * self.vpt))
        return Launch(self.func, "p3peer_copy", grid, self.threads, 0,
                      [ctypes.c_uint64(d), ctypes.c_uint64(s), ctypes.c_uint64(nvec)])

    def launch(self, stream: driver.Stream, prepared: Launch) -> None:
        driver.ensure_current(self.dev)
        prepared(stream)


class RowsCopy(SMCopy):
    """The scatter ceiling: ``p3peer_rows``, the CUDA C++ peer's CTA shape copying every row
    of C to its precomputed destination (``row_dst[r]``, u64 on the device): no routing, no
    bounds check. What no kernel of its family writing the same slots from the same rows
    beats. ``signal``: False; True, the least signal of the send's protocol (one release per
    CTA into one of 32 counters, the last CTA of each publishing a flag); "kernel", that
    order by the kernel boundary (the copy, then ``p3peer_publish`` setting the 32 flags);
    "red", another protocol's (one fire-and-forget release reduction per CTA, for receivers
    that know how many rows to expect)."""

    SIGNALS = {False: 0, True: 1, "kernel": 0, "red": 2}

    def __init__(self, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1,
                 rows_per_cta: int = 1, signal: bool | str = False):
        if signal not in self.SIGNALS:
            raise ConfigError([f"signal: expected one of {list(self.SIGNALS)}, got {signal!r}"], "scatter ceiling")
        super().__init__(device=device, threads=threads, vpt=vpt)
        mod, _ = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "p3peer_rows")
        self.publish = driver.get_function(mod, "p3peer_publish") if signal == "kernel" else None
        self.signal = signal
        self.rows_per_cta = max(1, int(rows_per_cta))
        self.state = driver.DeviceBuffer(32 * 4 + 32 * 8, fill=0) if signal else None   # u32 done[32], u64 flag[32]
        if self.rows_per_cta > 1:
            self.config = self.config.replace(" (", f", {self.rows_per_cta} rows/CTA (", 1)
        self.config += {False: "", True: ", signalled", "kernel": ", then a publish kernel",
                        "red": ", release reductions"}[signal]

    def prepare(self, row_dst, c, rows: int, msg_bytes: int):
        """The launch (a callable taking a stream): with ``signal="kernel"``, p3peer_rows
        without its signal, then p3peer_publish setting the 32 flags."""
        problems = []
        if rows < 0:
            problems.append(f"rows: expected >= 0, got {rows}")
        if msg_bytes <= 0 or msg_bytes % 16:
            problems.append(f"msg_bytes: expected a positive multiple of 16, got {msg_bytes}")
        if driver.device_ptr(c, "c") % 16:
            problems.append("c: expected a 16-byte aligned address")
        if problems:
            raise ConfigError(problems, "scatter ceiling")
        chunks, cta_vecs, block = _tile(msg_bytes // 16, self.threads, self.vpt)
        done = self.state.ptr if self.state is not None else 0
        u64, i32 = ctypes.c_uint64, ctypes.c_int32
        grid = -(-rows // self.rows_per_cta) * chunks
        copy = Launch(self.func, "p3peer_rows", grid, block, 0,
                      [u64(driver.device_ptr(row_dst, "row_dst")), u64(driver.device_ptr(c, "c")),
                       u64(msg_bytes), i32(msg_bytes // 16), i32(chunks), i32(cta_vecs), u64(done),
                       u64(done + 128 if done else 0), i32(self.SIGNALS[self.signal]), i32(self.rows_per_cta),
                       i32(rows)])
        if self.publish is None:
            return copy
        publish = Launch(self.publish, "p3peer_publish", 1 if grid else 0, 32, 0,
                         [u64(self.state.ptr + 128), i32(32), u64(grid)])

        def both(stream):
            copy(stream)
            publish(stream)
        both.grid = grid
        return both

    def close(self) -> None:
        if self.state is not None:
            self.state.free()
            self.state = None


class ReduceCeiling(SMCopy):
    """The reduce ceiling: ``p3peer_reduce``, the receive's top-k reduce (same arithmetic, so
    the same bytes out) for every rank of a one-GPU round in one launch, with no wait, no
    re-arm and no diagnostics: what no receive of the same slots beats."""

    def __init__(self, *, device: driver.Device | None = None, threads: int = 128, vpt: int = 1):
        super().__init__(device=device, threads=threads, vpt=vpt)
        mod, _ = _cuda_module(self.dev.ordinal, f"sm_{self.dev.cc[0]}{self.dev.cc[1]}", threads, vpt)
        self.func = driver.get_function(mod, "p3peer_reduce")

    def prepare(self, recv: list, topk_idx: list, weights: list, out: list, *, tokens: int, top_k: int,
                msg_bytes: int, n_global: int) -> Launch:
        ranks = len(recv)
        problems = []
        if not 1 <= ranks <= 8 or not (len(topk_idx) == len(weights) == len(out) == ranks):
            problems.append(f"recv, topk_idx, weights, out: expected 1..8 ranks each, got "
                            f"{len(recv)}, {len(topk_idx)}, {len(weights)}, {len(out)}")
        if not 1 <= top_k <= 8:
            problems.append(f"top_k: expected 1..8, got {top_k}")
        if msg_bytes <= 0 or msg_bytes % 16:
            problems.append(f"msg_bytes: expected a positive multiple of 16, got {msg_bytes}")
        if problems:
            raise ConfigError(problems, "reduce ceiling")
        ptrs = (ctypes.c_uint64 * 32)()
        for i, group in enumerate((recv, topk_idx, weights, out)):
            for r, x in enumerate(group):
                ptrs[8 * i + r] = driver.device_ptr(x, "reduce ceiling buffer")
        nv = msg_bytes // 16
        chunks, cta_vecs, block = _tile(nv, self.threads, self.vpt)
        i32 = ctypes.c_int32
        return Launch(self.func, "p3peer_reduce", ranks * tokens * chunks, block, 0,
                      [ptrs, i32(tokens), i32(top_k), i32(nv), i32(n_global), i32(chunks), i32(cta_vecs)])


# ---------------------------------------------------------------- Triton

if triton is not None:
    @triton.jit
    def _pick8(i, a0, a1, a2, a3, a4, a5, a6, a7):
        return tl.where(i == 0, a0, tl.where(i == 1, a1, tl.where(i == 2, a2, tl.where(i == 3, a3, tl.where(
            i == 4, a4, tl.where(i == 5, a5, tl.where(i == 6, a6, a7)))))))

    @triton.jit
    def _scatter_tl(c, off, table, src_info, state, diag,
                    r0, r1, r2, r3, r4, r5, r6, r7, k0, k1, k2, k3, k4, k5, k6, k7,
                    c_stride_w, n_ranks, p2p, top_k, msg_w, max_tokens, my_rank,
                    n_experts, chunks, cta_vecs,
                    BV: tl.constexpr, EP: tl.constexpr, SIGNAL: tl.constexpr):
        # program = (row, chunk); C and the receive buffers as int32 words, [BV, 4] = BV vectors
        pid = tl.program_id(0)
        ri = pid // chunks
        chunk = pid - ri * chunks
        row = tl.load(off) + ri
        q = tl.arange(0, 8)
        npeer = tl.minimum(n_ranks, p2p)
        if SIGNAL:
            if pid == 0:   # empty experts: 0 rows, nothing to order
                ee = tl.arange(0, EP)
                em = ee < n_experts
                empty = em & (tl.load(off + ee, mask=em, other=0) == tl.load(off + ee + 1, mask=em, other=0))
                kq = _pick8(q, k0, k1, k2, k3, k4, k5, k6, k7)
                cp = (kq[None, :] + 8 * (ee[:, None] * n_ranks + my_rank)).to(tl.pointer_type(tl.int64))
                tl.store(cp, tl.zeros((EP, 8), tl.int64), mask=empty[:, None] & (q[None, :] < npeer))
        if row < tl.load(off + n_experts):
            nv = msg_w // 4
            vi = tl.arange(0, BV)
            v = chunk * cta_vecs + vi
            w = tl.arange(0, 4)
            vm = ((vi < cta_vecs) & (v < nv))[:, None] & (w[None, :] < 4)
            words = v[:, None] * 4 + w[None, :]
            x = tl.load(c + tl.multiple_of(row.to(tl.int64) * c_stride_w, 4) + words, mask=vm)
            # the row's expert: offsets <= row, minus one
            ee = tl.arange(0, EP)
            e = tl.sum((tl.load(off + ee, mask=ee <= n_experts, other=2147483647) <= row).to(tl.int32)) - 1
            # its rank: the first whose range [t_end - count, t_end) holds the row
            rm = q < n_ranks
            ent = table + 2 * (e * n_ranks + q)
            t_end = tl.load(ent, mask=rm, other=0) - 1024
            owns = rm & (t_end - tl.load(ent + 1, mask=rm, other=0) <= row) & (row < t_end)
            rank = tl.min(tl.where(owns, q, 8))
            si = tl.load(src_info + 2 * row.to(tl.int64))
            sk = tl.load(src_info + 2 * row.to(tl.int64) + 1)
            ok = (rank < 8) & (si >= 0) & (si < max_tokens) & (sk >= 0) & (sk < top_k)
            p = rank % p2p
            base = tl.multiple_of(_pick8(p, r0, r1, r2, r3, r4, r5, r6, r7).to(tl.pointer_type(tl.int32)), 16)
            slot = tl.multiple_of((si.to(tl.int64) * top_k + sk) * msg_w, 4)
            tl.store(base + slot + words, x, mask=vm & ok)
            if chunk == 0:
                if not ok:
                    tl.atomic_add(diag + tl.where(rank < 8, 0, 1), 1, sem="relaxed", scope="gpu")
            if SIGNAL:
                if (chunk == 0) & ok:
                    tl.atomic_add(state + n_experts + 8 * e + p, 1, sem="relaxed", scope="gpu")
                tl.debug_barrier()   # every thread's stores before the release below
                total = (tl.load(off + e + 1) - tl.load(off + e)) * chunks
                old = tl.atomic_add(state + e, 1, sem="acq_rel", scope="gpu")
                if old == total - 1:   # the last program of expert e publishes its pairs
                    pm = q < npeer
                    n = tl.atomic_xchg(state + n_experts + 8 * e + q, tl.zeros((8,), tl.int32), mask=pm,
                                       sem="acquire", scope="gpu")
                    kq = _pick8(q, k0, k1, k2, k3, k4, k5, k6, k7)
                    cp = (kq + 8 * (e * n_ranks + my_rank)).to(tl.pointer_type(tl.int64))
                    tl.atomic_xchg(cp, n.to(tl.int64), mask=pm, sem="release", scope="gpu")
                    tl.atomic_xchg(state + e, 0, sem="relaxed", scope="gpu")

    _TL_PTRS = ("c", "off", "table", "src_info", "state", "diag")
    _TL_I32 = ("n_experts", "chunks", "cta_vecs")


@functools.cache
def _triton_kernel(arch: int, bv: int, ep: int, signal: bool, num_warps: int):
    """Compile ``_scatter_tl`` ahead of time (no torch, no Triton launcher): (cubin, name,
    shared bytes, num_warps, the non-constexpr parameter names in order)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = [n for n in _scatter_tl.arg_names if n not in ("BV", "EP", "SIGNAL")]
    sig = {n: "*i32" if n in _TL_PTRS else "i32" if n in _TL_I32 else "i64" for n in names}
    sig.update(BV="constexpr", EP="constexpr", SIGNAL="constexpr")
    attrs = {(_scatter_tl.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("c", "off")}
    src = ASTSource(_scatter_tl, sig, constexprs={"BV": bv, "EP": ep, "SIGNAL": signal}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1})
    md = k.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise PeerUnavailable("the Triton peer needs scratch memory; this launcher passes none")
    return k.asm["cubin"], md.name, md.shared, md.num_warps, names


class TritonScatter(_ScatterPeer):
    """The Triton scatter peer: one program of ``threads`` threads per (row, chunk), ``vpt``
    16-byte vectors per thread, compiled ahead of time and launched through the driver."""

    label = "Triton scatter peer"

    def __init__(self, n_experts: int, *, device: driver.Device | None = None, threads: int = 256, vpt: int = 1):
        if triton is None:
            raise PeerUnavailable("Triton is not installed")
        super().__init__(n_experts, device, threads, vpt)
        self.config = f"{threads} thr x {vpt} vec (Triton {triton.__version__})"
        self._funcs: dict = {}

    def _build(self, cfg, peers, c_addr, stride, offs_addr, state, chunks, cta_vecs, block) -> Launch:
        bv = 1 << max(0, cta_vecs - 1).bit_length()              # BV: the power of two >= cta_vecs
        nw = max(1, min(32, bv // (32 * self.vpt)))
        ep = 1 << self.n_experts.bit_length()                     # EP >= n_experts + 1
        key = (bv, ep, state != 0, nw)
        if key not in self._funcs:
            cubin, name, smem, nw, names = _triton_kernel(self.dev.cc[0] * 10 + self.dev.cc[1], *key)
            mod = driver.load_image(cubin)
            func = driver.get_function(mod, name)
            if smem > 48 * 1024:
                driver.set_max_dynamic_smem(func, smem)
            self._funcs[key] = (mod, func, name, smem, nw, names)
        _, func, name, smem, nw, names = self._funcs[key]
        v = dict(c=c_addr, off=offs_addr, table=cfg.atomic_counter, src_info=cfg.src_info_ptr, state=state,
                 diag=self.diag.ptr, c_stride_w=stride // 4, n_ranks=cfg.n_ranks, p2p=cfg.p2p_world_size,
                 top_k=cfg.top_k, msg_w=cfg.msg_bytes // 4, max_tokens=cfg.max_tokens_per_rank,
                 my_rank=cfg.my_rank, n_experts=self.n_experts, chunks=chunks, cta_vecs=cta_vecs)
        for i in range(8):
            v[f"r{i}"], v[f"k{i}"] = cfg.recv_buf_ptrs[i], peers[i]
        objs = [(ctypes.c_uint64 if n in _TL_PTRS else ctypes.c_int32 if n in _TL_I32 else ctypes.c_int64)(v[n])
                for n in names]
        objs += [ctypes.c_uint64(0), ctypes.c_uint64(0)]         # Triton's global and profile scratch
        return Launch(func, name, self.grid, 32 * nw, smem, objs)


# ---------------------------------------------------------------- in the bench

#: The variants tried at bench time (each peer reports its fastest; the first is the default):
#: (threads, vpt), for the copy (threads, vpt[, hint]).
TRITON_VARIANTS = ((256, 4), (256, 1), (256, 2), (128, 4), (512, 2), (128, 8))
CUDA_VARIANTS = ((256, 2), (256, 1), (256, 4), (128, 4), (512, 2))
COPY_VARIANTS = ((256, 1), (256, 2), (256, 4), (128, 2), (512, 1), (256, 1, 1))
ROWS_VARIANTS = ((256, 1), (256, 2), (256, 4), (128, 8), (128, 8, 2), (256, 4, 4), (1024, 1, 8))  # (.., rows/CTA)
REDUCE_VARIANTS = ((128, 1), (256, 1), (64, 1), (128, 2), (256, 2))


def time_peers(timer, sends: list, copy: tuple, *, n_experts: int, dev, iters: int, warmup: int,
               variants: bool = True, ceiling: tuple | None = None, best: dict | None = None) -> tuple[dict, dict]:
    """Time the peers next to a bench section's own rows, on the section's buffers.

    sends: per rotated input set, a dict of ScatterSend.prepare's arguments (cfg, c,
    expert_offsets, expert_offsets_host, count_ptrs, rows_in_c); copy: (dsts, srcs, nbytes),
    one dst/src per set, as the section's cuMemcpyDtoD row uses. Each peer runs its
    variants (TRITON_VARIANTS, CUDA_VARIANTS, COPY_VARIANTS; only the first with ``variants=False``) and
    reports its fastest. Returns (rows, skipped): rows {"Triton scatter peer" | "CUDA C++
    scatter peer" | "SM copy ceiling": the Timer's result + "config" (the fastest variant, in
    words), "variant" (its tuple) and "variants" (every variant's median)}, skipped {row
    name: reason}. ceiling: (row_dsts, cs, n_rows, msg_bytes, identity_dsts), one row_dst
    table per set (and one writing row r to row r of the copy's destination), adds the
    RowsCopy rows: the scatter ceiling, its identity-destination control, and its three
    signals. best: a dict to
    receive, per row, (fn(i) launching the fastest variant on the timer's stream, its peer)
    for a timing in turns; the caller then closes those peers (``close_peers``)."""
    rows, skipped = {}, {}
    dsts, srcs, nbytes = copy

    def scatter(peer, i):
        a = sends[i]
        return peer.prepare(a["cfg"], a["c"], a["expert_offsets"], expert_offsets_host=a["expert_offsets_host"],
                            count_ptrs=a["count_ptrs"], rows_in_c=a.get("rows_in_c"))

    contestants = (
        ("Triton scatter peer", TRITON_VARIANTS, lambda t, v: TritonScatter(n_experts, device=dev, threads=t, vpt=v),
         scatter, len(sends)),
        ("CUDA C++ scatter peer", CUDA_VARIANTS, lambda t, v: CudaScatter(n_experts, device=dev, threads=t, vpt=v),
         scatter, len(sends)),
        ("SM copy ceiling", COPY_VARIANTS, lambda t, v, h=0: SMCopy(device=dev, threads=t, vpt=v, hint=h),
         lambda peer, i: peer.prepare(dsts[i], srcs[i], nbytes), len(dsts)))
    if ceiling is not None:
        row_dsts, cs, n_rows, msg, ident = ceiling
        for label, sig, tables in (("scatter ceiling (destinations precomputed)", False, row_dsts),
                                   ("scatter ceiling, identity destinations (control)", False, ident),
                                   ("signalled scatter ceiling", True, row_dsts),
                                   ("scatter ceiling, then a publish kernel", "kernel", row_dsts),
                                   ("scatter ceiling, release reductions (another protocol)", "red", row_dsts)):
            contestants += ((label, ROWS_VARIANTS,
                             lambda t, v, n=1, sig=sig: RowsCopy(device=dev, threads=t, vpt=v, rows_per_cta=n, signal=sig),
                             lambda peer, i, tables=tables: peer.prepare(tables[i], cs[i], n_rows, msg), len(tables)),)
    for label, vs, make, prepare, n_sets in contestants:
        per = {}
        for v in vs[: None if variants else 1]:
            try:
                peer = make(*v)
            except PeerUnavailable as e:
                skipped[label] = str(e)
                break
            launches = [prepare(peer, i) for i in range(n_sets)]

            def fn(i, peer=peer, launches=launches, n_sets=n_sets):
                peer.launch(timer.s, launches[i % n_sets])
            per[peer.config] = (timer.run(fn, iters, warmup), v, fn, peer)
        if per:
            fastest = min(per, key=lambda k: per[k][0]["median_us"])
            rows[label] = dict(per[fastest][0], config=fastest, variant=per[fastest][1],
                               variants={k: round(x[0]["median_us"], 2) for k, x in per.items()})
            if best is not None:
                best[label] = per[fastest][2:]
            close_peers(x[3] for k, x in per.items() if best is None or k != fastest)
    return rows, skipped


def close_peers(peers) -> None:
    for peer in peers:
        if hasattr(peer, "close"):
            peer.close()
