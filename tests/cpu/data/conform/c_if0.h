// The previous layout is kept under #if 0 for reference, and so is a retired field.
#pragma once
#include <stdint.h>

#if 0
typedef struct P3PeerSendConfig {
    uint64_t atomic_counter;
    int32_t n_ranks;
    int32_t my_rank;
} P3PeerSendConfig;
#endif

typedef struct P3PeerSendConfig {
    uint64_t atomic_counter;
    uint64_t src_info_ptr;
    uint64_t row_base_ptr;
    uint64_t recv_buf_ptrs[8];
#if 0
    int32_t legacy_rank;   /* retired: my_rank replaces it */
#endif
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
} P3PeerSendConfig;
