/*
 * p3send.h: the ABI of Modular MAX's P3PeerSendConfig, for C and C++ runtimes.
 *
 * The normative description is docs/ABI.md; p3send/abi.py (FIELDS) is the table this
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
/* Kernel entry points                                                      */
/* ======================================================================== */
/* The kernel parameter tables are in docs/ABI.md ("Kernel entry points"). */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* P3SEND_H */
