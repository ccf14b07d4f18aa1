"""p3send: the expert-parallel MoE combine as an in-epilogue peer scatter-send.

Hand-written PTX loaded through the CUDA driver (``cuda.bindings``), with the exact
ABI of Modular MAX's ``P3PeerSendConfig``. This module is the public API: everything a
runtime uses is importable from here, e.g. ``from p3send import Combine, ScatterSend``.
Importing p3send never touches CUDA: the ABI names (the struct, its layout formulas, the
errors) are plain Python, and the launchers, rounds, ranks and the driver seam are
imported on first use.

Layers (each imports only the ones before it): ``abi`` (the struct, layout formulas,
errors) -> ``cuda`` (the driver seam, PTX loading) -> ``ops`` (launchers, the combine
round, ranks) -> ``torch`` (optional adapter, ``import p3send.torch``). ``oracle``
(reference and case generators), ``conform``, ``bench``, ``tracing`` and ``cli`` sit beside
them and are never imported by the runtime.
"""
from __future__ import annotations

import importlib

from .abi.config import (CONFIG_DTYPE, FIELDS, P3_CONFIG_SIZE, P3_MAX_RANKS, P3_TRACE_SLOTS, P5_SEND_MBX_INTS,
                         P5_SEND_MBX_STRIDE, P3PeerSendConfig, P3SendCtx, rank_config, shape_problems, validate)
from .abi.errors import (ArrivalTimeout, ConfigError, ConfigIndexError, ConfigTypeError, ContextLostError, CudaError,
                         FieldError, InputFileError, NoDeviceError, P3SendError, ParamMismatchError, UnknownNameError)
from .abi.layout import (NOT_ARRIVED, RANGE_READY_FLAG, SENTINEL, decode_range_table, encode_range_table,
                         recv_buf_bytes, recv_buf_layout, recv_count_layout, recv_counts_len)

__version__ = "0.2.0"

#: Names imported on first use: name -> the module that defines it. These modules import
#: ``cuda.bindings`` only inside the functions that call the driver.
_LAZY = {
    # launchers, one per kernel
    "ScatterSend": "p3send.ops.send", "EpilogueSend": "p3send.ops.send", "RecvReduce": "p3send.ops.recv",
    "GroupedGemmSend": "p3send.ops.gemm", "GroupedGemmFp8Send": "p3send.ops.gemm_fp8",
    "QuantFp8": "p3send.ops.quant", "scale_layout": "p3send.ops.quant",
    "SendLauncher": "p3send.ops.send", "SendArgs": "p3send.ops.send",
    "send_args": "p3send.ops.send",
    "FLAG_ROW_CACHE": "p3send.ops.send", "FLAG_SIGNAL": "p3send.ops.send", "FLAG_SCOPE_GPU": "p3send.ops.send",
    "FLAG_TILE": "p3send.ops.send",
    # the dispatch (the combine's producer)
    "Dispatch": "p3send.ops.dispatch", "DispatchRank": "p3send.ops.dispatch", "DispatchShape": "p3send.ops.dispatch",
    "DispatchError": "p3send.ops.dispatch", "DispatchTimeout": "p3send.ops.dispatch",
    "dispatch_capacity": "p3send.ops.dispatch",
    # rounds and ranks
    "Combine": "p3send.ops.combine", "Rank": "p3send.ops.rank", "run_ranks": "p3send.ops.procs",
    "RankOutcome": "p3send.ops.procs",
    "ProcessExchange": "p3send.ops.exchange", "TorchExchange": "p3send.ops.exchange",
    "MPIExchange": "p3send.ops.exchange", "ExchangeTimeout": "p3send.ops.exchange",
    # the driver seam and PTX loading
    "driver": "p3send.cuda.driver", "Device": "p3send.cuda.driver", "device": "p3send.cuda.driver",
    "DeviceBuffer": "p3send.cuda.driver", "Stream": "p3send.cuda.driver", "Event": "p3send.cuda.driver",
    "Graph": "p3send.cuda.driver", "ptx_dir": "p3send.cuda.loader", "load_ptx": "p3send.cuda.loader",
    "link_ptx": "p3send.cuda.loader", "kernel": "p3send.cuda.loader", "abi_echo": "p3send.cuda.loader",
}
#: Public names whose attribute in the defining module is spelled differently.
_RENAMED = {"load_ptx": "load", "link_ptx": "link"}

__all__ = ["CONFIG_DTYPE", "FIELDS", "P3_CONFIG_SIZE", "P3_MAX_RANKS", "P3_TRACE_SLOTS", "P5_SEND_MBX_INTS",
           "P5_SEND_MBX_STRIDE", "P3PeerSendConfig", "P3SendCtx", "rank_config", "shape_problems", "validate",
           "ArrivalTimeout", "ConfigError", "ConfigIndexError", "ConfigTypeError", "ContextLostError", "CudaError",
           "FieldError", "InputFileError", "NoDeviceError", "P3SendError", "ParamMismatchError", "UnknownNameError",
           "NOT_ARRIVED", "RANGE_READY_FLAG", "SENTINEL", "decode_range_table", "encode_range_table", "recv_buf_bytes",
           "recv_buf_layout", "recv_count_layout", "recv_counts_len", "__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise UnknownNameError(f"module 'p3send' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name == "driver" else getattr(mod, _RENAMED.get(name, name))
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
