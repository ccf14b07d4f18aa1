# The struct the way MAX's source writes it: a wrapped alias, decorators, docstrings.
from sys.info import size_of
from utils import StaticTuple

comptime P5SendMailboxPtr = UnsafePointer[
    Int32,
    MutAnyOrigin,
    address_space = AddressSpace.SHARED,
]
"""A CTA's SMEM mailbox (32 Int32 words)."""

comptime P3_MAX_RANKS = 8


@fieldwise_init
@register_passable("trivial")
struct P3PeerSendConfig(ImplicitlyCopyable, Movable):
    """Runtime state for the in-epilogue EP-combine peer scatter-send."""

    var atomic_counter: UnsafePointer[Int32, MutAnyOrigin]
    """The range table (Region A)."""
    var src_info_ptr: UnsafePointer[Int32, ImmutAnyOrigin]
    var row_base_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    # One receive buffer per peer rank, as this rank sees it.
    var recv_buf_ptrs: StaticTuple[
        UnsafePointer[UInt8, MutAnyOrigin],  # [rank] -> buffer
        P3_MAX_RANKS,
    ]
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    var send_mbx: P5SendMailboxPtr
    var send_stamp_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var send_stamp_on: Int
    var trace_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var trace_on: Int
    var send_trace_slot: Int

    @staticmethod
    @always_inline
    fn disabled() -> Self:
        var recv = StaticTuple[UnsafePointer[UInt8, MutAnyOrigin], P3_MAX_RANKS]()
        return Self(
            atomic_counter=UnsafePointer[Int32, MutAnyOrigin](),
            n_ranks=0,
        )

    @always_inline
    fn recv_count_layout(self, e: Int, rk: Int) -> Int:
        return e * self.n_ranks + rk
