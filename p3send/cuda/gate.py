"""A device-side gate for captured work: ``gated(stream, flags, index)`` wraps what its
``with`` block enqueues in a conditional IF node of the CUDA graph being captured on
``stream``, and a one-thread kernel, ``p3_gate_if``, captured just before it, sets the
node's condition from the device word ``flags[index]`` at every replay. The runtime
decides by writing that word (a device tensor, a kernel of its own, a copy in stream
order) before the replay; no host value is read at replay time.

The kernel calls ``cudaGraphSetConditional`` (CUDA >= 12.4), which lives in the CUDA
device runtime library, so the module is linked with ``libcudadevrt.a`` (found through
``cuda.pathfinder``, ``$CUDA_HOME``/``$CUDA_PATH``, or the ``nvcc`` on ``PATH``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..abi.errors import P3SendError
from . import driver
from .loader import Kernel, link

GATE_PTX = r"""//
// p3_gate_if: sets a CUDA graph's conditional handle from a device word.
//
// ENTRY p3_gate_if
// Sets the IF condition `handle` to (flags[index] != 0) with cudaGraphSetConditional,
// so the node's body (e.g. one rank's send) runs in this replay only when the word is
// non-zero. The handle is created with CU_GRAPH_COND_ASSIGN_DEFAULT and default 0: a
// replay whose gate kernel did not run skips the body.
// PARAMS
//   off  size  type  name    meaning
//     0     8  u64   handle  the CUgraphConditionalHandle (of the graph this kernel is captured in)
//     8     8  u64   flags   ptr: global u32[], 4-byte aligned: the gates, written before the replay
//    16     4  u32   index   which word of flags
// LAUNCH grid (1,1,1), block (1,1,1); no shared memory; only inside a captured graph
// ORDERING a plain load of the word: stream order makes earlier writes visible
// REQUIRES sm_90; PTX ISA 8.0; linked with libcudadevrt.a (CUDA >= 12.4 device runtime)
// TIMEOUT none: the kernel never waits
//
.version 8.0
.target sm_90
.address_size 64

.extern .func cudaGraphSetConditional
(
    .param .b64 cond_handle,
    .param .b32 cond_value
)
;

.visible .entry p3_gate_if(
    .param .u64 handle,
    .param .u64 flags,
    .param .u32 index
)
{
    .reg .pred  %p<2>;
    .reg .b32   %r<4>;
    .reg .b64   %rd<5>;

    ld.param.u64        %rd1, [handle];
    ld.param.u64        %rd2, [flags];
    ld.param.u32        %r1, [index];
    cvta.to.global.u64  %rd3, %rd2;
    mul.wide.u32        %rd4, %r1, 4;
    add.s64             %rd3, %rd3, %rd4;
    ld.global.u32       %r2, [%rd3];
    setp.ne.u32         %p1, %r2, 0;
    selp.u32            %r3, 1, 0, %p1;
    {
    .param .b64 param0;
    .param .b32 param1;
    st.param.b64        [param0+0], %rd1;
    st.param.b32        [param1+0], %r3;
    call.uni            cudaGraphSetConditional, (param0, param1);
    }
    ret;
}
"""


def cudadevrt() -> Path:
    """Path of libcudadevrt.a, or P3SendError saying where it was looked for."""
    tried = []
    try:
        from cuda.pathfinder import find_static_lib
        return Path(find_static_lib("cudadevrt"))
    except (ImportError, RuntimeError) as e:   # no wheel, no CUDA_HOME: look further
        tried.append(f"cuda.pathfinder ({str(e).splitlines()[0]})")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            p = Path(root) / sub / "libcudadevrt.a"
            if p.is_file():
                return p
            tried.append(str(p))
    raise P3SendError("the device-side gate needs libcudadevrt.a (CUDA toolkit >= 12.4, or the "
                      "nvidia-cuda-runtime wheel); looked in: " + ", ".join(tried))


_kernels: dict[int, Kernel] = {}


def gate_kernel(dev: driver.Device | None = None) -> Kernel:
    """``p3_gate_if`` on ``dev``, linked once per device."""
    dev = dev or driver.device()
    k = _kernels.get(dev.ordinal)
    if k is None:
        k = _kernels[dev.ordinal] = link([("p3_gate_if.ptx", GATE_PTX)], device=dev, name="p3_gate_if",
                                         libraries=[cudadevrt()])["p3_gate_if"]
    return k


def gated(stream, flags, index: int, dev: driver.Device | None = None):
    """Context manager for a stream being captured: what the block enqueues on the
    stream it yields runs at a replay only when the u32 ``flags[index]`` (device memory:
    a DeviceBuffer, tensor or address) is non-zero then. Work enqueued on ``stream``
    after the block is ordered after it, whether it ran or not."""
    k = gate_kernel(dev)
    addr = driver.device_ptr(flags, "gate")
    if addr % 4:
        raise P3SendError(f"gate: expected a 4-byte aligned device address, got {addr:#x}")

    def set_condition(s, handle):
        k.params_block(handle=int(handle), flags=addr, index=int(index)).launch((1,), (1,), s)

    return driver.captured_if(stream, set_condition)
