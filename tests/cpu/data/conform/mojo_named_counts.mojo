# The array length is a named constant of the struct itself, and the pointee a wrapped alias.
from utils import StaticTuple

comptime RecvPtr = UnsafePointer[
    UInt8,
    MutAnyOrigin,
]


struct P3PeerSendConfig(ImplicitlyCopyable, Movable):
    comptime MAX_RANKS = 8
    comptime MBX_INTS: Int = 32

    var atomic_counter: UnsafePointer[Int32, MutAnyOrigin]
    var src_info_ptr: UnsafePointer[Int32, ImmutAnyOrigin]
    var row_base_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var recv_buf_ptrs: StaticTuple[RecvPtr, Self.MAX_RANKS]
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    var send_mbx: UnsafePointer[Int32, MutAnyOrigin, address_space = AddressSpace.SHARED]
    var send_stamp_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var send_stamp_on: Int
    var trace_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var trace_on: Int
    var send_trace_slot: Int
