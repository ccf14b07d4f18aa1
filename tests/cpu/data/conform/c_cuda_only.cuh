// Kernel-side header: written for nvcc only (CUDA keywords with no include of their own).
#pragma once
#include <stdint.h>

struct __align__(8) P3PeerSendConfig {
    uint64_t atomic_counter;
    uint64_t src_info_ptr;
    uint64_t row_base_ptr;
    uint64_t recv_buf_ptrs[8];
    int64_t n_ranks;
    int64_t p2p_world_size;
    int64_t top_k;
    int64_t msg_bytes;
    int64_t max_tokens_per_rank;
    int64_t my_rank;
    uint64_t send_mbx;
    uint64_t send_stamp_ptr;
    int64_t send_stamp_on;
    uint64_t trace_ptr;
    int64_t trace_on;
    int64_t send_trace_slot;

    __device__ __forceinline__ int64_t slots() const { return top_k * n_ranks; }
};
