/* Shared by the host runtime and the kernels. The device side narrows the counts to
 * 32 bits (a bug: nvcc's view of the struct is not the ABI). */
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
typedef int32_t p3_count_t;
#define P3_HD __host__ __device__
#else
typedef int64_t p3_count_t;
#define P3_HD
#endif

struct P3PeerSendConfig {
    uint64_t atomic_counter;
    uint64_t src_info_ptr;
    uint64_t row_base_ptr;
    uint64_t recv_buf_ptrs[8];
    p3_count_t n_ranks;
    int64_t p2p_world_size;
    p3_count_t top_k;
    int64_t msg_bytes;
    int64_t max_tokens_per_rank;
    int64_t my_rank;
    uint64_t send_mbx;
    uint64_t send_stamp_ptr;
    int64_t send_stamp_on;
    uint64_t trace_ptr;
    int64_t trace_on;
    int64_t send_trace_slot;
};

P3_HD inline int64_t p3_slots(const P3PeerSendConfig *c) { return c->top_k * c->n_ranks; }
