# Parametric aliases: one per-peer array type, one device-pointer type.
from utils import StaticTuple

comptime PEERS = 8
comptime PerPeer[T: AnyTrivialRegType] = StaticTuple[T, PEERS]
comptime DevicePtr[dtype: DType, //, origin: Origin = MutAnyOrigin] = UnsafePointer[Scalar[dtype], origin]
comptime Count = Int


struct P3PeerSendConfig[origin: MutOrigin = MutAnyOrigin](ImplicitlyCopyable, Movable):
    var atomic_counter: DevicePtr[DType.int32]
    var src_info_ptr: DevicePtr[DType.int32]
    var row_base_ptr: DevicePtr[DType.uint64]
    var recv_buf_ptrs: PerPeer[DevicePtr[DType.uint8]]
    var n_ranks: Count
    var p2p_world_size: Count
    var top_k: Count
    var msg_bytes: Count
    var max_tokens_per_rank: Count
    var my_rank: Count
    var send_mbx: DevicePtr[DType.int32]
    var send_stamp_ptr: DevicePtr[DType.uint64]
    var send_stamp_on: Count
    var trace_ptr: DevicePtr[DType.uint64]
    var trace_on: Count
    var send_trace_slot: Count
