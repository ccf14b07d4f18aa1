# Traits over lines, a parameter list, comments and docstrings between the fields.
from utils import StaticTuple


@fieldwise_init
struct P3PeerSendConfig(
    Copyable,  # (trivially: all fields are plain data)
    Defaultable,
    ImplicitlyCopyable,
    Movable,
):
    '''Runtime state of the peer scatter-send.

    Fields are documented in place; see docs/ABI.md for the table.
    '''

    # -- shared tables ------------------------------------------------------
    var atomic_counter: UnsafePointer[Int32, MutAnyOrigin]
    """Range table: `[e * n_ranks + rk]` -> (t_end + 1024, count). Written by dispatch."""
    var src_info_ptr: UnsafePointer[Int32, ImmutAnyOrigin]
    """(rows, 2) of Int32: source index and slot; a '#' in a docstring is text."""
    var row_base_ptr: UnsafePointer[UInt64, MutAnyOrigin]  # """ in a comment ends nothing
    var recv_buf_ptrs: StaticTuple[UnsafePointer[UInt8, MutAnyOrigin], 8]

    # -- the world -----------------------------------------------------------
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    """This rank, 0..n_ranks-1 (an apostrophe's fine here)."""

    # -- instrumentation -------------------------------------------------------
    var send_mbx: UnsafePointer[Int32, MutAnyOrigin, address_space = AddressSpace.SHARED]
    var send_stamp_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var send_stamp_on: Int
    var trace_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var trace_on: Int
    var send_trace_slot: Int

    fn __init__(out self):
        # a method's locals are not fields
        var scratch: Int32 = 0
        self.n_ranks = 0
