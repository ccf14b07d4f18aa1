# The config, then the rest of the module: a trait and other structs with their own names.
from utils import StaticTuple

comptime N = 8


struct P3PeerSendConfig(ImplicitlyCopyable, Movable):
    var atomic_counter: UnsafePointer[Int32, MutAnyOrigin]
    var src_info_ptr: UnsafePointer[Int32, ImmutAnyOrigin]
    var row_base_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var recv_buf_ptrs: StaticTuple[UnsafePointer[UInt8, MutAnyOrigin], N]
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


trait PeerSender:
    fn send(self, cfg: P3PeerSendConfig):
        ...


struct SendStats(Copyable, Movable):
    comptime N = 2
    var rows: StaticTuple[Int32, Self.N]
    var bytes: Int


struct P3PeerSendConfigV0:
    var n_ranks: Int32
