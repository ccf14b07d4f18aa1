/* A host runtime built on the driver API: device addresses are CUdeviceptr. */
#pragma once
#include <cuda.h>
#include <stdint.h>

typedef struct P3PeerSendConfig {
    CUdeviceptr atomic_counter;
    CUdeviceptr src_info_ptr;
    CUdeviceptr row_base_ptr;
    CUdeviceptr recv_buf_ptrs[8];
    int64_t n_ranks;
    int64_t p2p_world_size;
    int64_t top_k;
    int64_t msg_bytes;
    int64_t max_tokens_per_rank;
    int64_t my_rank;
    CUdeviceptr send_mbx;
    CUdeviceptr send_stamp_ptr;
    int64_t send_stamp_on;
    CUdeviceptr trace_ptr;
    int64_t trace_on;
    int64_t send_trace_slot;
} P3PeerSendConfig;
