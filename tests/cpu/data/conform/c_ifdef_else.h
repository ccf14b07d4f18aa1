/* A runtime header whose stamp fields are optional: a build without stamps keeps the
 * bytes as a reserved pair. The default build (no P3_NO_STAMPS) has the ABI's layout. */
#ifndef P3RT_CONFIG_H
#define P3RT_CONFIG_H

#include <stdint.h>

#ifdef _WIN32
typedef unsigned __int64 p3rt_devptr;
#else
typedef uint64_t p3rt_devptr;
#endif

struct P3PeerSendConfig {
    p3rt_devptr atomic_counter;
    p3rt_devptr src_info_ptr;
    p3rt_devptr row_base_ptr;
    p3rt_devptr recv_buf_ptrs[8];
    int64_t n_ranks;
    int64_t p2p_world_size;
    int64_t top_k;
    int64_t msg_bytes;
    int64_t max_tokens_per_rank;
    int64_t my_rank;
    p3rt_devptr send_mbx;
#ifndef P3_NO_STAMPS
    p3rt_devptr send_stamp_ptr;
    int64_t send_stamp_on;
#else
    uint64_t send_stamp_reserved[2];
#endif
    p3rt_devptr trace_ptr;
    int64_t trace_on;
    int64_t send_trace_slot;
};

#endif /* P3RT_CONFIG_H */
