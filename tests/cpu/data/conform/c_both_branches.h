/* Every scalar is spelled per compiler: the same names in both branches. */
#ifndef EP_PEER_SEND_H_
#define EP_PEER_SEND_H_

#if defined(_MSC_VER) && _MSC_VER < 1600
typedef unsigned __int64 ep_u64;
#define EP_I64 __int64
#else
#include <stdint.h>
typedef uint64_t ep_u64;
#define EP_I64 int64_t
#endif

typedef struct {
    ep_u64 atomic_counter;
    ep_u64 src_info_ptr;
    ep_u64 row_base_ptr;
    ep_u64 recv_buf_ptrs[8];
#if defined(EP_LEGACY_ABI)
    long n_ranks;
    long p2p_world_size;
    long top_k;
    long msg_bytes;
    long max_tokens_per_rank;
    long my_rank;
#else
    EP_I64 n_ranks;
    EP_I64 p2p_world_size;
    EP_I64 top_k;
    EP_I64 msg_bytes;
    EP_I64 max_tokens_per_rank;
    EP_I64 my_rank;
#endif
    ep_u64 send_mbx;
    ep_u64 send_stamp_ptr;
    EP_I64 send_stamp_on;
    ep_u64 trace_ptr;
    EP_I64 trace_on;
    EP_I64 send_trace_slot;
} P3PeerSendConfig;

#endif  /* EP_PEER_SEND_H_ */
