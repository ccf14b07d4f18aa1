/* Array lengths and spellings come from macros a build may override (-DEP_MAX_PEERS=4). */
#ifndef EP_CONFIG_H
#define EP_CONFIG_H
#include <stdint.h>

#ifndef EP_MAX_PEERS
#define EP_MAX_PEERS 8
#endif
#define EP_ADDR uint64_t
#define EP_INT int64_t
#define EP_ALIGNED(n) __attribute__((aligned(n)))

struct EP_ALIGNED(8) P3PeerSendConfig {
    EP_ADDR atomic_counter;
    EP_ADDR src_info_ptr;
    EP_ADDR row_base_ptr;
    EP_ADDR recv_buf_ptrs[EP_MAX_PEERS];
    EP_INT n_ranks;
    EP_INT p2p_world_size;
    EP_INT top_k;
    EP_INT msg_bytes;
    EP_INT max_tokens_per_rank;
    EP_INT my_rank;
    EP_ADDR send_mbx;
    EP_ADDR send_stamp_ptr;
    EP_INT send_stamp_on;
    EP_ADDR trace_ptr;
    EP_INT trace_on;
    EP_INT send_trace_slot;
};
#endif
