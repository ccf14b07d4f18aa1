"""p3send: the expert-parallel MoE combine as an in-epilogue peer scatter-send.

Hand-written PTX loaded through the CUDA driver (``cuda.bindings``), with the exact
ABI of Modular MAX's ``P3PeerSendConfig``. Importing p3send never touches CUDA.

Layers (each imports only the ones before it): ``abi`` (the struct, layout formulas,
errors) -> ``cuda`` (the driver seam, PTX loading) -> ``ops`` (launchers, the combine
round, ranks) -> ``torch`` (optional adapter). ``oracle`` (reference and case
generators) and ``cli`` (the commands) sit beside them and are never imported by the
runtime.
"""
from .abi.config import (CONFIG_DTYPE, FIELDS, P3_CONFIG_SIZE, P3_MAX_RANKS, P3_TRACE_SLOTS, P5_SEND_MBX_INTS,
                         P5_SEND_MBX_STRIDE, P3PeerSendConfig, validate)
from .abi.errors import (ArrivalTimeout, ConfigError, ContextLostError, CudaError, NoDeviceError, P3SendError,
                         ParamMismatchError)
from .abi.layout import (NOT_ARRIVED, RANGE_READY_FLAG, decode_range_table, encode_range_table, recv_buf_bytes,
                         recv_buf_layout, recv_count_layout, recv_counts_len)

__version__ = "0.1.0"
__all__ = ["CONFIG_DTYPE", "FIELDS", "P3_CONFIG_SIZE", "P3_MAX_RANKS", "P3_TRACE_SLOTS", "P5_SEND_MBX_INTS",
           "P5_SEND_MBX_STRIDE", "P3PeerSendConfig", "validate", "ArrivalTimeout", "ConfigError",
           "ContextLostError", "CudaError", "NoDeviceError", "P3SendError", "ParamMismatchError", "NOT_ARRIVED",
           "RANGE_READY_FLAG", "decode_range_table", "encode_range_table", "recv_buf_bytes", "recv_buf_layout",
           "recv_count_layout", "recv_counts_len", "__version__"]
