/*
 * p3send.h: the ABI of Modular MAX's P3PeerSendConfig, for C and C++ runtimes.
 *
 * The normative description is docs/ABI.md; p3send/abi/config.py (FIELDS) is the table this
 * header is tested against. 184 bytes, alignment 8, little-endian, no padding.
 * Every device address is a uint64_t (never a host pointer type, whose size and
 * meaning differ between host and device). The struct is passed BY VALUE as the
 * first kernel parameter, declared in PTX as `.param .align 8 .b8 cfg[184]`.
 *
 * Compiles as C11 and C++11 (-Wall -Wextra -Werror); the static assertions below fail
 * the build on any target whose layout differs (e.g. i386, where uint64_t aligns to 4).
 */
#ifndef P3SEND_H
#define P3SEND_H

#include <stddef.h>
#include <stdint.h>

#define P3_MAX_RANKS 8
#define P5_SEND_MBX_INTS 32
#define P5_SEND_MBX_STRIDE 4
#define P3_TRACE_SLOTS 16
#define P3_CONFIG_SIZE 184
#define P3_CONFIG_ALIGN 8
#define P3_RANGE_READY_FLAG 1024

#ifdef __cplusplus
#define P3_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#define P3_ALIGNOF(type) alignof(type)
extern "C" {
#else
#define P3_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#define P3_ALIGNOF(type) _Alignof(type)
#endif

typedef struct P3PeerSendConfig {
    uint64_t atomic_counter;               /*   0  int32 range table (Region A), read only */
    uint64_t src_info_ptr;                 /*   8  int32 (rows, 2): src_idx, src_topk */
    uint64_t row_base_ptr;                 /*  16  u64 row cache, one per absolute row */
    uint64_t recv_buf_ptrs[P3_MAX_RANKS];  /*  24  receive buffer of each p2p rank */
    int64_t  n_ranks;                      /*  88  1..8; 0 disables the send */
    int64_t  p2p_world_size;               /*  96  dst_p2p = dst_rank % p2p_world_size */
    int64_t  top_k;                        /* 104  experts per token */
    int64_t  msg_bytes;                    /* 112  bytes per slot, multiple of 16 */
    int64_t  max_tokens_per_rank;          /* 120  token capacity of a receive buffer */
    int64_t  my_rank;                      /* 128  0..n_ranks-1 */
    uint64_t send_mbx;                     /* 136  device: 32-bit .shared address + 4 pad
                                                   bytes; opaque on the host, ignored */
    uint64_t send_stamp_ptr;               /* 144  u64 [2*cta]: first/last %globaltimer */
    int64_t  send_stamp_on;                /* 152  non-zero enables send stamps */
    uint64_t trace_ptr;                    /* 160  u64 [cta*P3_TRACE_SLOTS + slot] */
    int64_t  trace_on;                     /* 168  non-zero enables the trace */
    int64_t  send_trace_slot;              /* 176  -1..P3_TRACE_SLOTS-1 */
} P3PeerSendConfig;

/* A field at the wrong offset is a wild peer write on some GPU, so the build checks
 * every one (the uapi habit), not just the total size. */
#define P3_ASSERT_FIELD(field, off, size) \
    P3_STATIC_ASSERT(offsetof(P3PeerSendConfig, field) == (off), \
                     "P3PeerSendConfig." #field " must be at offset " #off); \
    P3_STATIC_ASSERT(sizeof(((P3PeerSendConfig *)0)->field) == (size), \
                     "P3PeerSendConfig." #field " must be " #size " bytes")

P3_ASSERT_FIELD(atomic_counter, 0, 8);
P3_ASSERT_FIELD(src_info_ptr, 8, 8);
P3_ASSERT_FIELD(row_base_ptr, 16, 8);
P3_ASSERT_FIELD(recv_buf_ptrs, 24, 64);
P3_ASSERT_FIELD(n_ranks, 88, 8);
P3_ASSERT_FIELD(p2p_world_size, 96, 8);
P3_ASSERT_FIELD(top_k, 104, 8);
P3_ASSERT_FIELD(msg_bytes, 112, 8);
P3_ASSERT_FIELD(max_tokens_per_rank, 120, 8);
P3_ASSERT_FIELD(my_rank, 128, 8);
P3_ASSERT_FIELD(send_mbx, 136, 8);
P3_ASSERT_FIELD(send_stamp_ptr, 144, 8);
P3_ASSERT_FIELD(send_stamp_on, 152, 8);
P3_ASSERT_FIELD(trace_ptr, 160, 8);
P3_ASSERT_FIELD(trace_on, 168, 8);
P3_ASSERT_FIELD(send_trace_slot, 176, 8);
P3_STATIC_ASSERT(sizeof(P3PeerSendConfig) == P3_CONFIG_SIZE, "P3PeerSendConfig must be 184 bytes");
P3_STATIC_ASSERT(P3_ALIGNOF(P3PeerSendConfig) == P3_CONFIG_ALIGN, "P3PeerSendConfig must align to 8");

/* Slot of (local expert e, source rank rk) in a receive-count array [MAX]. */
static inline int64_t p3_recv_count_layout(const P3PeerSendConfig *cfg, int64_t e, int64_t rk)
{
    return e * cfg->n_ranks + rk;
}

/* Byte offset of byte_off in slot (src_idx, src_topk) of a receive buffer [MAX]. */
static inline int64_t p3_recv_buf_layout(const P3PeerSendConfig *cfg, int64_t src_idx,
                                         int64_t src_topk, int64_t byte_off)
{
    return (src_idx * cfg->top_k + src_topk) * cfg->msg_bytes + byte_off;
}

/* Mojo's disabled(): pointers are unsafe_dangling() (address = pointee alignment: 4 for
 * Int32, 8 for UInt64, 1 for UInt8), never dereferenced because every use is gated by a
 * flag; p2p_world_size and top_k are 1 so they stay safe divisors; no trace slot. */
static inline P3PeerSendConfig p3_config_disabled(void)
{
    P3PeerSendConfig c;
    int i;
    c.atomic_counter = 0x4;
    c.src_info_ptr = 0x4;
    c.row_base_ptr = 0x8;
    for (i = 0; i < P3_MAX_RANKS; ++i)
        c.recv_buf_ptrs[i] = 0x1;
    c.n_ranks = 0;
    c.p2p_world_size = 1;
    c.top_k = 1;
    c.msg_bytes = 0;
    c.max_tokens_per_rank = 0;
    c.my_rank = 0;
    c.send_mbx = 0x4;
    c.send_stamp_ptr = 0x8;
    c.send_stamp_on = 0;
    c.trace_ptr = 0x8;
    c.trace_on = 0;
    c.send_trace_slot = -1;
    return c;
}

/* ======================================================================== */
/* In-epilogue send: the linkable device functions of ptx/p3_send_rows.ptx   */
/* ======================================================================== */
/* p3send's own launch state and per-warp accounting beside the ABI struct (not part of
 * MAX's ABI). Layouts as in the header of ptx/p3_send_rows.ptx and p3send/abi/config.py
 * (P3SendCtx, P3_SEND_ACCT_SIZE); docs/EMBEDDING.md shows them in use. */

/* P3SendCtx.flags (the same bits as p3_scatter_send's flags parameter, except P3_FLAG_WIRE_FP8,
 * which p3_scatter_send refuses: p3_scatter_send_fp8 takes it). */
#define P3_FLAG_ROW_CACHE 1   /* resolve rows through cfg.row_base_ptr (zeroed per launch) */
#define P3_FLAG_SIGNAL 2      /* publish the arrival counts into count_ptrs[p] */
#define P3_FLAG_SCOPE_GPU 4   /* every receiver on this GPU: .gpu-scope release, not .sys */
#define P3_FLAG_TILE 8        /* p3_scatter_send: the tile launch (flags bits 16..31: stamp/trace slots) */
#define P3_FLAG_WIRE_FP8 16   /* quantise the bf16 rows to the FP8 wire on the way out (below) */
#define P3_FLAG_NVSHMEM 32    /* ranks outside this NVLink domain by NVSHMEM puts (P3NvshmemBlock, below) */
#define P3_FLAG_NVSHMEM_ALL 64 /* with P3_FLAG_NVSHMEM: every rank by puts, this one too */
#define P3_FLAG_WIRE_FP8_STAGED 128 /* with P3_FLAG_WIRE_FP8: the tile holds the wire's rows already (below) */
#define P3_SEND_CTX_SIZE 104
#define P3_SEND_ACCT_SIZE 48

/* In device memory, read through a generic pointer; one per concurrent launch. */
typedef struct P3SendCtx {
    uint64_t count_ptrs[P3_MAX_RANKS];     /*   0  u64[n_experts*n_ranks] receive counts of
                                                   p2p rank p, as mapped here; 0 if unused */
    uint64_t expert_offsets;               /*  64  int32[n_experts+1] absolute row offsets,
                                                   non-decreasing */
    uint64_t state_ptr;                    /*  72  sender state, 40*n_experts bytes, zeroed
                                                   once at allocation, self-resetting */
    uint64_t diag_ptr;                     /*  80  u32[4] diagnostics, or 0 */
    uint32_t n_experts;                    /*  88  local experts (>= 1) */
    uint32_t flags;                        /*  92  P3_FLAG_* */
    int32_t  p3_control;                   /*  96  < 0: nothing is sent or counted */
    uint32_t reserved;                     /* 100  0 */
} P3SendCtx;

/* The NVSHMEM transport (docs/SCALING.md section 5): read by p3_send_rows / p3_send_flush only
 * under P3_FLAG_NVSHMEM, and only in a module linked with the transport's shim (p3send.ops.nvshmem;
 * the text every other module is built from has no put path and ignores both flags). The block
 * follows the sender state: at state_ptr + 40*n_experts, so neither P3SendCtx nor an entry's
 * parameters change. Rows for rank r outside this rank's NVLink domain (r / p2p_world_size !=
 * my_rank / p2p_world_size; every rank with P3_FLAG_NVSHMEM_ALL) are stored to their staging row
 * (staging + row*msg_bytes, row < staging_rows, else dropped as diag[0]; bf16 rows to a PE of
 * tile_src_mask are put from the shared tile itself) and put from there to
 * recv_sym + slot*msg_bytes at PE r; their count is an NVSHMEM signal (SET) on
 * counts_sym[e*n_ranks + my_rank] at PE r, after the puts are complete (quiet). PE == rank. Counts
 * are kept by rank, not p2p rank, under the flag: no folding. P3_FLAG_ROW_CACHE is ignored. */
#define P3_NVSHMEM_BLOCK_SIZE 40
typedef struct P3NvshmemBlock {
    uint64_t recv_sym;                     /*   0  symmetric receive buffer's slot 0 (same on every PE) */
    uint64_t counts_sym;                   /*   8  symmetric receive counts, u64[n_experts*n_ranks] */
    uint64_t staging;                      /*  16  symmetric staging, staging_rows*msg_bytes bytes */
    uint64_t staging_rows;                 /*  24  rows of the staging (> every absolute row sent) */
    uint64_t tile_src_mask;                /*  32  bit r: PE r is reachable by loads and stores, so a
                                                   bf16 put to it reads the shared tile itself, nothing
                                                   staged (0: every put row staged, as a NIC needs) */
} P3NvshmemBlock;

/* One per warp (shared or global memory), used by that warp only. Initialise to
 * expert = -1 and zeros before the warp's first call; p3_send_flush resets it.
 * ready: 0, or set before a p3_send_rows call whose tile is still being staged: the
 * 32-bit .shared address of an mbarrier (8-byte aligned) | P3_READY | the parity of the
 * phase that completes when the tile is staged. That call checks and resolves its rows
 * first, waits for the phase (acquire) before reading the tile, and on every return the
 * phase has completed; it resets ready to 0. */
#define P3_READY 2
typedef struct P3SendAcct {
    int32_t  expert;                       /*   0  local expert held, -1: none */
    uint32_t ready;                        /*   4  0, or mbarrier | P3_READY | parity */
    uint64_t units;                        /*   8  16-byte vectors handled for expert */
    uint32_t pair[P3_MAX_RANKS];           /*  16  rows stored to p2p rank p (to rank p
                                                   under P3_FLAG_NVSHMEM: no folding) */
} P3SendAcct;

#define P3_ASSERT_MEMBER(type, field, off, size) \
    P3_STATIC_ASSERT(offsetof(type, field) == (off), \
                     #type "." #field " must be at offset " #off); \
    P3_STATIC_ASSERT(sizeof(((type *)0)->field) == (size), \
                     #type "." #field " must be " #size " bytes")

P3_ASSERT_MEMBER(P3SendCtx, count_ptrs, 0, 64);
P3_ASSERT_MEMBER(P3SendCtx, expert_offsets, 64, 8);
P3_ASSERT_MEMBER(P3SendCtx, state_ptr, 72, 8);
P3_ASSERT_MEMBER(P3SendCtx, diag_ptr, 80, 8);
P3_ASSERT_MEMBER(P3SendCtx, n_experts, 88, 4);
P3_ASSERT_MEMBER(P3SendCtx, flags, 92, 4);
P3_ASSERT_MEMBER(P3SendCtx, p3_control, 96, 4);
P3_ASSERT_MEMBER(P3SendCtx, reserved, 100, 4);
P3_STATIC_ASSERT(sizeof(P3SendCtx) == P3_SEND_CTX_SIZE, "P3SendCtx must be 104 bytes");
P3_STATIC_ASSERT(P3_ALIGNOF(P3SendCtx) == 8, "P3SendCtx must align to 8");

P3_ASSERT_MEMBER(P3SendAcct, expert, 0, 4);
P3_ASSERT_MEMBER(P3SendAcct, ready, 4, 4);
P3_ASSERT_MEMBER(P3SendAcct, units, 8, 8);
P3_ASSERT_MEMBER(P3SendAcct, pair, 16, 32);
P3_STATIC_ASSERT(sizeof(P3SendAcct) == P3_SEND_ACCT_SIZE, "P3SendAcct must be 48 bytes");
P3_STATIC_ASSERT(P3_ALIGNOF(P3SendAcct) == 8, "P3SendAcct must align to 8");

P3_ASSERT_MEMBER(P3NvshmemBlock, recv_sym, 0, 8);
P3_ASSERT_MEMBER(P3NvshmemBlock, counts_sym, 8, 8);
P3_ASSERT_MEMBER(P3NvshmemBlock, staging, 16, 8);
P3_ASSERT_MEMBER(P3NvshmemBlock, staging_rows, 24, 8);
P3_ASSERT_MEMBER(P3NvshmemBlock, tile_src_mask, 32, 8);
P3_STATIC_ASSERT(sizeof(P3NvshmemBlock) == P3_NVSHMEM_BLOCK_SIZE, "P3NvshmemBlock must be 40 bytes");
P3_STATIC_ASSERT((P3_FLAG_NVSHMEM | P3_FLAG_NVSHMEM_ALL) < 0x10000 &&
                 ((P3_FLAG_NVSHMEM | P3_FLAG_NVSHMEM_ALL) & (P3_FLAG_ROW_CACHE | P3_FLAG_SIGNAL | P3_FLAG_SCOPE_GPU |
                                                          P3_FLAG_TILE | P3_FLAG_WIRE_FP8)) == 0,
                 "the NVSHMEM flags are bits of their own below the slot bits");

#ifdef __CUDACC__
/* The .visible .func of ptx/p3_send_rows.ptx, parameter for parameter (.b64 = a generic
 * pointer, .b32 = int/unsigned). Compile your kernel with -rdc=true and link that file
 * (nvJitLink or cuLink*). Call with all 32 lanes of a warp active and warp-uniform
 * arguments; contract: docs/KERNELS.md; example: docs/EMBEDDING.md. */
extern "C" __device__ void p3_send_rows(const P3PeerSendConfig *cfg, const P3SendCtx *ctx,
                                        P3SendAcct *acct, unsigned smem_tile,
                                        unsigned row_pitch, int m_abs, int rows,
                                        unsigned byte_off, unsigned seg_bytes, int expert,
                                        unsigned warp_rank, unsigned n_warps);
extern "C" __device__ void p3_send_flush(const P3PeerSendConfig *cfg, const P3SendCtx *ctx,
                                         P3SendAcct *acct);
#endif

/* ======================================================================== */
/* Kernel entry points                                                      */
/* ======================================================================== */
/* The kernels' launch contracts (parameter tables, launch shapes, buffers) are in
 * docs/KERNELS.md. */

/* The FP8 down-projection (DeepSeek-V3's recipe; DeepGEMM's SM90 layouts):
 * p3_quant_fp8 (ptx/p3_quant_fp8.ptx): block (P3_QUANT_FP8_THREADS, 1, 1), grid
 *   ceil(rows * k_dim / 8 / P3_QUANT_FP8_THREADS); bf16 x -> e4m3 q + float32 scales.
 * p3_gemm_fp8_send (ptx/p3_gemm_fp8_send.ptx, sm_90a): block (P3_GEMM_FP8_THREADS, 1, 1),
 *   P3_GEMM_FP8_SMEM bytes of dynamic shared memory, grid 1..SMs; n_cols and k_dim multiples
 *   of P3_FP8_BLOCK. The kernel for 64-row tiles and the one to link.
 * p3_gemm_fp8_send_wide (ptx/p3_gemm_fp8_send_wide.ptx, sm_90a): the same parameters, C and
 *   receive bytes; block (P3_GEMM_FP8_WIDE_THREADS, 1, 1), P3_GEMM_FP8_WIDE_SMEM bytes; the
 *   faster at 128-row tiles, loaded with p3_send_rows.ptx appended (never linked).
 * Activation scales, one per (row, P3_FP8_BLOCK columns), are MN-major: (row, kb) at float
 * kb * P3_FP8_SCALE_ROWS(rows) + row (columns 16-byte aligned for the tensor map). Weight
 * scales: float32 (E, N/P3_FP8_BLOCK, K/P3_FP8_BLOCK), contiguous. */
#define P3_FP8_BLOCK 128
#define P3_FP8_SCALE_ROWS(rows) ((((rows) + 3) / 4) * 4)
#define P3_QUANT_FP8_THREADS 256
#define P3_GEMM_FP8_THREADS 384
#define P3_GEMM_FP8_SMEM 201956
#define P3_GEMM_FP8_WIDE_THREADS 512
#define P3_GEMM_FP8_WIDE_SMEM 202004

/* ======================================================================== */
/* The combine's wire formats (p3send/abi/wire.py; docs/PROTOCOL.md)        */
/* ======================================================================== */
/* msg_bytes alone cannot name the format (7,392 B is an FP8 row of 7,168 columns and a
 * bf16 row of 3,696): a runtime decides the format and derives msg_bytes from hidden.
 * P3_WIRE_BF16: hidden bf16 values. P3_WIRE_FP8: hidden e4m3 codes, then hidden/128
 * little-endian float32 scales (scale j for columns 128j..128j+127); hidden a multiple
 * of 512 so that msg_bytes stays a multiple of 16.
 * Senders: P3_FLAG_WIRE_FP8 in P3SendCtx.flags (p3_send_rows, so p3_epilogue_send and
 * the GEMM epilogues) or in the flags of p3_scatter_send_fp8 (p3_scatter_send's parameters;
 * p3_scatter_send itself refuses the flag: diag[2], nothing written). Receiver: the
 * entry loaded, P3_RECV_ENTRY_BF16 or P3_RECV_ENTRY_FP8 (the same parameter table; the
 * FP8 entry reads hidden = 32*msg_bytes/33 columns and writes bf16 [n_tokens, hidden]).
 * P3_FLAG_WIRE_FP8_STAGED (with P3_FLAG_WIRE_FP8, in P3SendCtx.flags): the caller of
 * p3_send_rows has quantised the tile itself (row: seg_bytes/2 codes, then a float32 scale per
 * 128 columns) and p3_send_rows only copies it. p3_gemm_fp8_send(_wide) reads it too: its
 * consumers then quantise their fp32 sums (128-row tiles only; at 64 the launch sends nothing
 * and sets diag[2]). Not for a kernel whose tile is bf16 (p3_gemm_send, p3_epilogue_send). */
#define P3_WIRE_BF16 0
#define P3_WIRE_FP8 1
#define P3_WIRE_FP8_BLOCK 128
#define P3_WIRE_FP8_HIDDEN_MULTIPLE 512
#define P3_WIRE_BF16_MSG_BYTES(hidden) (2 * (hidden))
#define P3_WIRE_FP8_MSG_BYTES(hidden) ((hidden) + 4 * ((hidden) / P3_WIRE_FP8_BLOCK))
#define P3_WIRE_FP8_HIDDEN(msg_bytes) (32 * (msg_bytes) / 33)
#define P3_RECV_ENTRY_BF16 "p3_recv_reduce"
#define P3_RECV_ENTRY_FP8 "p3_recv_reduce_fp8"

P3_STATIC_ASSERT((P3_FLAG_WIRE_FP8 & (P3_FLAG_ROW_CACHE | P3_FLAG_SIGNAL | P3_FLAG_SCOPE_GPU | P3_FLAG_TILE)) == 0,
                 "P3_FLAG_WIRE_FP8 must be a flag bit of its own");
P3_STATIC_ASSERT(P3_FLAG_WIRE_FP8 < 0x10000, "flags bits 16..31 are p3_scatter_send's stamp/trace slots");
P3_STATIC_ASSERT(P3_FLAG_WIRE_FP8_STAGED < 0x10000 &&
                 (P3_FLAG_WIRE_FP8_STAGED & (P3_FLAG_ROW_CACHE | P3_FLAG_SIGNAL | P3_FLAG_SCOPE_GPU | P3_FLAG_TILE |
                                             P3_FLAG_WIRE_FP8 | P3_FLAG_NVSHMEM | P3_FLAG_NVSHMEM_ALL)) == 0,
                 "P3_FLAG_WIRE_FP8_STAGED must be a flag bit of its own below the slot bits");
P3_STATIC_ASSERT(P3_WIRE_FP8_MSG_BYTES(7168) == 7392, "the FP8 row of DeepSeek-V3's hidden size is 7,392 bytes");
P3_STATIC_ASSERT(P3_WIRE_FP8_MSG_BYTES(P3_WIRE_FP8_HIDDEN_MULTIPLE) % 16 == 0,
                 "an FP8 row of a multiple of 512 columns is whole 16-byte vectors");
P3_STATIC_ASSERT(P3_WIRE_FP8_HIDDEN(P3_WIRE_FP8_MSG_BYTES(7168)) == 7168, "P3_WIRE_FP8_HIDDEN inverts the slot size");
P3_STATIC_ASSERT(P3_WIRE_FP8_BLOCK == P3_FP8_BLOCK, "the wire's scale block is the FP8 GEMM's");

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* P3SEND_H */
