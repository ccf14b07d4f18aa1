// Included by .cu and .cpp files alike; the CUDA side pulls in the runtime header.
#pragma once
#ifdef __CUDACC__
#include <cuda_runtime.h>
#define P3_HOST_DEVICE __host__ __device__
#else
#define P3_HOST_DEVICE
#endif
#include <cstdint>

namespace p3 {
struct P3PeerSendConfig {
    std::uint64_t atomic_counter;
    std::uint64_t src_info_ptr;
    std::uint64_t row_base_ptr;
    std::uint64_t recv_buf_ptrs[8];
    std::int64_t n_ranks;
    std::int64_t p2p_world_size;
    std::int64_t top_k;
    std::int64_t msg_bytes;
    std::int64_t max_tokens_per_rank;
    std::int64_t my_rank;
    std::uint64_t send_mbx;
    std::uint64_t send_stamp_ptr;
    std::int64_t send_stamp_on;
    std::uint64_t trace_ptr;
    std::int64_t trace_on;
    std::int64_t send_trace_slot;

    P3_HOST_DEVICE std::int64_t slots() const { return top_k * n_ranks; }
};
}  // namespace p3
