# Older Mojo: `alias` instead of `comptime`, the wrapped type inside a parenthesis.
from utils import StaticTuple

alias MAX_PEERS: Int = (
    8
)
alias PeerBufPtr = UnsafePointer[
    UInt8, MutableAnyOrigin
]
alias MailboxPtr = UnsafePointer[Int32, MutableAnyOrigin, address_space = AddressSpace.SHARED]


@value
struct P3PeerSendConfig:
    var atomic_counter: UnsafePointer[Int32]
    var src_info_ptr: UnsafePointer[Int32]
    var row_base_ptr: UnsafePointer[UInt64]
    var recv_buf_ptrs: StaticTuple[PeerBufPtr, MAX_PEERS]
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    var send_mbx: MailboxPtr
    var send_stamp_ptr: UnsafePointer[UInt64]
    var send_stamp_on: Int
    var trace_ptr: UnsafePointer[UInt64]
    var trace_on: Int
    var send_trace_slot: Int
