"""p3send: the expert-parallel MoE combine as an in-epilogue peer scatter-send.

Hand-written PTX loaded through the CUDA driver (``cuda.bindings``), with the exact
ABI of Modular MAX's ``P3PeerSendConfig``. Importing p3send never touches CUDA.
"""
from .abi import (CONFIG_DTYPE, FIELDS, P3_CONFIG_SIZE, P3_MAX_RANKS, P3_TRACE_SLOTS,
                  P5_SEND_MBX_INTS, P5_SEND_MBX_STRIDE, P3PeerSendConfig, validate)
from .errors import (ArrivalTimeout, ConfigError, ContextLostError, CudaError, NoDeviceError,
                     P3SendError, ParamMismatchError)
from .layout import (NOT_ARRIVED, RANGE_READY_FLAG, decode_range_table, encode_range_table,
                     recv_buf_bytes, recv_buf_layout, recv_count_layout, recv_counts_len)

__version__ = "0.1.0"
__all__ = [n for n in dir() if not n.startswith("_")]
