/* One list of the fields drives the struct and the table of names. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifndef P3_RANKS
#define P3_RANKS 8
#endif

#define P3_FIELDS(X, ARRAY)                   \
    X(uint64_t, atomic_counter)               \
    X(uint64_t, src_info_ptr)                 \
    X(uint64_t, row_base_ptr)                 \
    ARRAY(uint64_t, recv_buf_ptrs, P3_RANKS)  \
    X(int64_t, n_ranks)                       \
    X(int64_t, p2p_world_size)                \
    X(int64_t, top_k)                         \
    X(int64_t, msg_bytes)                     \
    X(int64_t, max_tokens_per_rank)           \
    X(int64_t, my_rank)                       \
    X(uint64_t, send_mbx)                     \
    X(uint64_t, send_stamp_ptr)               \
    X(int64_t, send_stamp_on)                 \
    X(uint64_t, trace_ptr)                    \
    X(int64_t, trace_on)                      \
    X(int64_t, send_trace_slot)

#define P3_DECLARE(type, name) type name;
#define P3_DECLARE_ARRAY(type, name, n) type name[n];

struct P3PeerSendConfig {
    P3_FIELDS(P3_DECLARE, P3_DECLARE_ARRAY)
};

#define P3_NAME(type, name) #name,
#define P3_NAME_ARRAY(type, name, n) #name,
static const char *const p3_field_names[] = { P3_FIELDS(P3_NAME, P3_NAME_ARRAY) };
