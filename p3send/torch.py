"""The combine for torch runtimes: expert-grouped bf16 rows in, the reduced bf16
``[tokens, hidden]`` out, on torch's current stream, with no host synchronisation
inside, capturable by ``torch.cuda.graph``, and registered as the custom op
``torch.ops.p3send.combine`` (with a fake implementation) so ``torch.compile`` keeps it.

Optional: ``import p3send`` never imports this module or torch.

Two mappings:

- ``TorchCombine``: every rank on one GPU in this process (as ``ops.combine.Combine``).
  Inputs carry a leading rank dimension; one op call runs every rank's send, then every
  rank's receive and reduce, forked from and joined into the current stream.
- ``TorchRank``: one process per rank (``ops.rank.Rank`` over ``TorchExchange``). The
  op runs this rank's send then its receive on the current stream when the ranks are on
  different GPUs; ranks sharing a GPU need a host barrier between the two, which
  ``step`` provides (it synchronizes, as ``Rank.round`` does).

The caller owns every tensor and refreshes the per-step inputs (rows, expert offsets,
range table, ``src_info``, top-k ids and weights) in place between steps or graph
replays: the kernels read them on the device, and nothing in a launch depends on a host
copy of them. The token count is the one thing taken from the host: it is
``topk_idx.shape[-2]`` when the op is called (captured into a graph with it).

Arrival timeouts cannot raise inside a stream-ordered op: call ``check()`` after the
step's stream has been synchronized (a decode loop does so anyway to read its tokens);
it raises ``ArrivalTimeout`` naming the missing pairs and re-arms the counts. Do not
replay again before a failed step has been checked (docs/PROTOCOL.md, "Replay safety").
"""
from __future__ import annotations

import itertools
from typing import Optional

try:
    import torch
except ImportError as e:   # the optional dependency
    raise ImportError(f"p3send.torch needs torch ({e}); the rest of p3send does not") from e

from .abi.errors import ConfigError
from .cuda import driver
from .ops.combine import Combine
from .ops.rank import Rank

__all__ = ["TorchCombine", "TorchGemmFp8Send", "TorchRank", "combine", "gemm_fp8", "gemm_fp8_send", "quant_fp8",
           "device_ordinal", "register", "lookup", "unregister"]

_objects: dict[int, object] = {}      # op handle -> the open object its op calls run on
_handles = itertools.count(1)


def register(obj) -> int:
    """A new handle for ``obj``: the int a custom op (``torch.ops.p3send.*``) takes, to
    find ``obj`` again with ``lookup``. One registry serves every op of p3send.torch and
    p3send.moe; ``unregister`` the handle when ``obj`` closes.

    Args:
        obj: the object the op's calls run on (a TorchCombine, a TorchDispatch, ...).

    Returns:
        int: the handle, > 0 and never reused in this process.
    """
    handle = next(_handles)
    _objects[handle] = obj
    return handle


def lookup(handle: int, kind=object):
    """The open object registered as ``handle``, or None.

    Args:
        handle: a handle ``register`` gave.
        kind: the class (or tuple of classes) the op runs on: an object of another kind
            under that handle is None too (one op's handle passed to another op).

    Returns:
        The object, or None when no open object of that kind has the handle.
    """
    obj = _objects.get(handle)
    return obj if isinstance(obj, kind) else None


def unregister(handle) -> None:
    """Forget ``handle`` (when its object closes); an unknown one is ignored.

    Args:
        handle: a handle ``register`` gave, or None.
    """
    _objects.pop(handle, None)


@torch.library.custom_op("p3send::combine", mutates_args=())
def combine(handle: int, rows: torch.Tensor, expert_offsets: torch.Tensor, range_table: torch.Tensor,
            src_info: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
            gate: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045 (torch's schema inference)
    """The combine of the ``TorchCombine``/``TorchRank`` registered as ``handle``: returns
    the reduced bf16 output, shape ``topk_idx.shape[:-1] + (hidden,)``."""
    obj = lookup(handle, _Base)
    if obj is None:
        raise ConfigError([f"handle: no open p3send combine has handle {handle}"], "p3send::combine")
    return obj._run(rows, expert_offsets, range_table, src_info, topk_idx, weights, gate)


@combine.register_fake
def _combine_fake(handle, rows, expert_offsets, range_table, src_info, topk_idx, weights, gate=None):
    return rows.new_empty((*topk_idx.shape[:-1], rows.shape[-1]))


def device_ordinal(device=None) -> int:
    """The CUDA ordinal of ``device`` as torch names it.

    Args:
        device: None or ``"cuda"`` (torch's current CUDA device), ``"cuda:N"``, an int N,
            or a ``torch.device`` of type cuda.

    Returns:
        int: the ordinal.

    Raises:
        ConfigError: ``device`` is not a CUDA device (``"cpu"``, ``"meta"``), or not a
            device torch can parse.
    """
    if device is None:
        return torch.cuda.current_device()
    try:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError, ValueError) as e:     # torch's words for a device it cannot parse
        raise ConfigError([f"device: expected a CUDA device, got {device!r} ({e})"], "p3send.torch") from None
    if d.type != "cuda":
        raise ConfigError([f"device: expected a CUDA device, got {d}"], "p3send.torch")
    return torch.cuda.current_device() if d.index is None else d.index


def _check_shapes(what: str, want: dict, got: dict) -> None:
    """want/got: name -> shape tuple (None in want: any size there)."""
    problems = []
    if got.get("weights") is not None and got.get("topk_idx") is not None and \
            tuple(got["weights"].shape) != tuple(got["topk_idx"].shape):
        problems.append(f"weights: expected the shape of topk_idx {tuple(got['topk_idx'].shape)}, "
                        f"got {tuple(got['weights'].shape)}")
    for name, w in want.items():
        g = tuple(got[name].shape) if got[name] is not None else None
        if g is None or len(g) != len(w) or any(a is not None and a != b for a, b in zip(w, g)):
            shown = "(" + ", ".join("*" if a is None else str(a) for a in w) + ")"
            problems.append(f"{name}: expected shape {shown}, got {g}")
    if problems:
        raise ConfigError(problems, what)


class _Base:
    def _register(self) -> None:
        self.handle = register(self)
        self._key = None

    def __call__(self, rows, expert_offsets, range_table, src_info, topk_idx, weights, gate=None):
        """``torch.ops.p3send.combine`` for this object (see the module docstring)."""
        return combine(self.handle, rows, expert_offsets, range_table, src_info, topk_idx, weights, gate)

    def close(self) -> None:
        unregister(getattr(self, "handle", None))
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class TorchCombine(_Base):
    """Every rank on one GPU, in this process. Call it (or ``torch.ops.p3send.combine``)
    with, for R ranks, T tokens, K = top_k, L = n_local_experts, H = hidden:

    rows bf16 (R, max_rows, H): rank r's expert-grouped output rows;
    expert_offsets int32 (R, L+1); range_table int32 (R, L*R*2); src_info int32
    (R, max_rows, 2); topk_idx int32 (R, T, K) global expert ids (-1 masked); weights f32
    (R, T, K); gate (only with ``gated=True``) int32 (R,): rank r sends in a replay only
    if gate[r] != 0 then. Returns out bf16 (R, T, H).

    ``gated``: the sends sit in conditional graph nodes whose condition a one-thread
    kernel reads from ``gate`` at every replay (``p3send.cuda.gate``; needs
    libcudadevrt.a, and the op then runs only under graph capture).
    ``wire``: the row format between the ranks, ``"bf16"`` or ``"fp8"`` (``p3send.abi.wire``;
    rows and out stay bf16), refused before anything is allocated when it cannot carry H.
    """

    def __init__(self, n_ranks: int, *, max_tokens: int, top_k: int, hidden: int, n_local_experts: int,
                 max_rows: int | None = None, device=None, timeout_ms: float = 2000.0, guard: bool = False,
                 num_sms: int | None = None, gated: bool = False, wire="bf16"):
        self.ordinal = device_ordinal(device)
        torch.cuda.init()
        self.dev = driver.device(self.ordinal)
        self._inner = Combine(n_ranks, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                              n_local_experts=n_local_experts, max_rows=max_rows, device=self.dev,
                              timeout_ms=timeout_ms, guard=guard, stamps=False, num_sms=num_sms, inputs=False,
                              wire=wire)
        self.n_ranks, self.top_k, self.hidden, self.n_local = n_ranks, top_k, hidden, n_local_experts
        self.gated = gated
        if gated:
            from .cuda.gate import gate_kernel
            gate_kernel(self.dev)          # linked now: never inside a capture
        self._register()

    @property
    def combine(self) -> Combine:
        """The underlying ``ops.combine.Combine`` (receive buffers, counts, launchers)."""
        return self._inner

    def _run(self, rows, offs, rtab, src, topk, w, gate):
        R, L, H = self.n_ranks, self.n_local, self.hidden
        want = {"rows": (R, None, H), "expert_offsets": (R, L + 1), "range_table": (R, 2 * L * R),
                "src_info": (R, None, 2), "topk_idx": (R, None, self.top_k), "weights": (R, None, self.top_k)}
        got = {"rows": rows, "expert_offsets": offs, "range_table": rtab, "src_info": src, "topk_idx": topk,
               "weights": w}
        if self.gated:
            want["gate"], got["gate"] = (R,), gate
        elif gate is not None:
            raise ConfigError(["gate: this TorchCombine was built without gated=True"], "p3send::combine")
        _check_shapes("p3send::combine", want, got)
        stream = torch.cuda.current_stream(self.ordinal)
        capturing = torch.cuda.is_current_stream_capturing()
        if self.gated:
            problems = []
            if not capturing:
                problems.append("gate: a device-side gate needs CUDA graph capture (torch.cuda.graph); "
                                "outside a capture call a TorchCombine built without gated=True")
            if gate.dtype != torch.int32 or gate.device != rows.device:
                problems.append(f"gate: expected int32 on {rows.device}, got {gate.dtype} on {gate.device}")
            if problems:
                raise ConfigError(problems, "p3send::combine")
        out = torch.empty((R, topk.shape[1], H), dtype=torch.bfloat16, device=rows.device)
        key = tuple(t.data_ptr() for t in (rows, offs, rtab, src, topk, w)) + \
            tuple(tuple(t.shape) for t in (rows, src, topk))
        if key != self._key:               # new arrays: check and attach them (host only)
            self._key = None
            for r in range(R):
                self._inner.bind(r, c=rows[r], expert_offsets=offs[r], range_table=rtab[r], src_info=src[r],
                                 topk_idx=topk[r], weights=w[r], out=out[r])
            self._key = key
        else:                              # only the output moved: one parameter per receive
            for r in range(R):
                self._inner.set_output(r, out[r])
        self._inner.enqueue(stream=stream, gate=gate if self.gated else None)
        return out

    def check(self, stream=None) -> None:
        """Raise ArrivalTimeout naming the missing pairs of the last step (re-arming the
        counts first), after ``stream`` (if given) is synchronized; the step must have
        completed."""
        if stream is not None:
            driver.as_stream(stream).synchronize()
        self._inner.check()

    def recv_view(self, r: int, with_guard: bool = False):
        return self._inner.recv_view(r, with_guard)

    def counts_view(self, r: int):
        return self._inner.counts_view(r)


class TorchRank(_Base):
    """This process's rank of a world of processes (``torch.distributed`` initialised):
    call it (the op, no host sync; ranks on different GPUs) or ``step`` (host barrier
    between send and receive, for ranks sharing a GPU), with rows bf16 (max_rows, H),
    expert_offsets int32 (L+1,), range_table int32 (L*n_ranks*2,), src_info int32
    (max_rows, 2), topk_idx int32 (T, K), weights f32 (T, K); returns out bf16 (T, H).
    After the op, call ``settle()`` before the next step's sends (the host barrier
    between rounds). Construction is collective. ``exchange``: default a TorchExchange
    over the default group. ``wire``: the row format, ``"bf16"`` or ``"fp8"``, as ``Rank``'s."""

    def __init__(self, exchange=None, *, max_tokens: int, top_k: int, hidden: int, n_local_experts: int,
                 max_rows: int | None = None, device=None, timeout_ms: float = 2000.0, sync_timeout_s: float = 60.0,
                 sync_sends: bool | None = None, guard: bool = False, wire="bf16"):
        from .ops.exchange import TorchExchange
        self.ordinal = device_ordinal(device)
        torch.cuda.init()
        exchange = exchange or TorchExchange(timeout_s=sync_timeout_s)
        self._inner = Rank(exchange.rank, exchange.n_ranks, exchange, max_tokens=max_tokens, top_k=top_k,
                           hidden=hidden, n_local_experts=n_local_experts, device=self.ordinal, max_rows=max_rows,
                           timeout_ms=timeout_ms, sync_timeout_s=sync_timeout_s, sync_sends=sync_sends, guard=guard,
                           inputs=False, wire=wire)
        self.rank, self.n_ranks = exchange.rank, exchange.n_ranks
        self.top_k, self.hidden, self.n_local = top_k, hidden, n_local_experts
        self._register()

    @property
    def inner(self) -> Rank:
        """The underlying ``ops.rank.Rank``."""
        return self._inner

    def _bind(self, rows, offs, rtab, src, topk, w):
        L, H = self.n_local, self.hidden
        _check_shapes(f"rank {self.rank}: p3send::combine",
                      {"rows": (None, H), "expert_offsets": (L + 1,), "range_table": (2 * L * self.n_ranks,),
                       "src_info": (None, 2), "topk_idx": (None, self.top_k), "weights": (None, self.top_k)},
                      {"rows": rows, "expert_offsets": offs, "range_table": rtab, "src_info": src, "topk_idx": topk,
                       "weights": w})
        out = torch.empty((topk.shape[0], H), dtype=torch.bfloat16, device=rows.device)
        key = tuple(t.data_ptr() for t in (rows, offs, rtab, src, topk, w)) + \
            tuple(tuple(t.shape) for t in (rows, src, topk, w))
        if key != self._key:
            self._key = None
            self._inner.bind(c=rows, expert_offsets=offs, range_table=rtab, src_info=src, topk_idx=topk, weights=w,
                             out=out)
            self._key = key
        else:
            self._inner.set_output(out)
        return out

    def _run(self, rows, offs, rtab, src, topk, w, gate):
        if gate is not None:
            raise ConfigError(["gate: TorchRank has no device-side gate"], "p3send::combine")
        if self._inner.sync_sends:
            raise ConfigError([f"rank {self.rank}: ranks share a GPU, so the send and the receive need a host "
                               "barrier between them; call step() (it synchronizes) instead of the op"],
                              "p3send::combine")
        out = self._bind(rows, offs, rtab, src, topk, w)
        self._inner.enqueue(torch.cuda.current_stream(self.ordinal))
        return out

    def step(self, rows, expert_offsets, range_table, src_info, topk_idx, weights):
        """One whole round on the current stream with the host syncs of ``Rank.round``
        (send, mid barrier when ranks share a GPU, receive, settle): raises
        ArrivalTimeout naming this rank's missing pairs. Returns out bf16 (T, H)."""
        out = self._bind(rows, expert_offsets, range_table, src_info, topk_idx, weights)
        self._inner.round(stream=torch.cuda.current_stream(self.ordinal))
        return out

    def settle(self, stream=None) -> None:
        """After the op: wait for ``stream`` (default the current one), then the end of
        the round (allgather of timeouts = the host barrier before the next sends; re-arm
        and ArrivalTimeout if this rank's wait timed out)."""
        driver.as_stream(stream if stream is not None else torch.cuda.current_stream(self.ordinal)).synchronize()
        self._inner.settle()

    def barrier(self) -> None:
        self._inner.barrier()

    def recv_view(self, with_guard: bool = False):
        return self._inner.recv_view(with_guard)

    def counts_view(self):
        return self._inner.counts_view()


# ---------------------------------------------------------------- the FP8 down-projection
# torch.ops.p3send.quant_fp8 / gemm_fp8 / gemm_fp8_send: the quantiser and the FP8 grouped
# GEMM (ops.quant, ops.gemm_fp8) on torch's current stream, with fake implementations.

_fp8_launchers: dict = {}     # (kind, device index, n_experts) -> QuantFp8 / GroupedGemmFp8Send


def _fp8_launcher(kind: str, index: int, n_experts: int = 0):
    from .ops.gemm_fp8 import GroupedGemmFp8Send
    from .ops.quant import QuantFp8
    key = (kind, index, n_experts)
    obj = _fp8_launchers.get(key)
    if obj is None:
        dev = driver.device(index)
        obj = _fp8_launchers[key] = QuantFp8(dev) if kind == "quant" else GroupedGemmFp8Send(n_experts, device=dev)
    return obj


def _fp8_scales_view(sa: torch.Tensor, rows: int) -> torch.Tensor:
    """The (rows, K/128) MN-major view of scales given as quant_fp8 returns them (K/128, m_pad)."""
    return sa.t()[:rows] if sa.dim() == 2 and sa.is_contiguous() and sa.shape[1] == -(-rows // 4) * 4 else sa


@torch.library.custom_op("p3send::quant_fp8", mutates_args=())
def quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per-token quantiser (``p3_quant_fp8``): x bf16 (rows, K), K a multiple of
    128 -> (q float8_e4m3fn (rows, K), scales float32 (K/128, m_pad), m_pad = rows rounded
    up to 4). ``scales.t()[:rows]`` is the (rows, K/128) TMA-aligned MN-major view that
    DeepGEMM and ``gemm_fp8`` take (``gemm_fp8`` takes either form)."""
    from .ops.quant import scale_layout
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ConfigError([f"x: expected a bf16 (rows, K) CUDA tensor, got {tuple(x.shape)} {x.dtype} on "
                           f"{x.device}"], "p3send::quant_fp8")
    lay = scale_layout(x.shape[0], x.shape[1])
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((lay.kb, lay.m_pad), dtype=torch.float32, device=x.device)
    qz = _fp8_launcher("quant", x.device.index if x.device.index is not None else torch.cuda.current_device())
    qz(x, q, s.t()[: x.shape[0]], stream=driver.as_stream(torch.cuda.current_stream(x.device)))
    return q, s


@quant_fp8.register_fake
def _quant_fp8_fake(x):
    rows, k = x.shape
    return (x.new_empty((rows, k), dtype=torch.float8_e4m3fn),
            x.new_empty((-(-k // 128), -(-rows // 4) * 4), dtype=torch.float32))


def _gemm_fp8_run(cfg, a, sa, b, sb, expert_offsets, c, bm, **send):
    g = _fp8_launcher("gemm", a.device.index if a.device.index is not None else torch.cuda.current_device(),
                      b.shape[0])
    g(cfg, a, _fp8_scales_view(sa, a.shape[0]), b, sb, expert_offsets, c, bm=bm if bm > 0 else None,
      stream=driver.as_stream(torch.cuda.current_stream(a.device)), **send)


@torch.library.custom_op("p3send::gemm_fp8", mutates_args=())
def gemm_fp8(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, expert_offsets: torch.Tensor,
             bm: int = 0) -> torch.Tensor:
    """The FP8 block-scaled grouped GEMM with the send off (``p3_gemm_fp8_send`` writing C):
    a float8_e4m3fn (rows, K), sa float32 scales (quant_fp8's (K/128, m_pad), or the (rows,
    K/128) MN-major view), b float8_e4m3fn (E, N, K), sb float32 (E, N/128, K/128),
    expert_offsets int32 (E+1,) on the GPU (any expert starts: the device offsets are not
    read on the host); bm 128 or 64 rows per tile (0: 128). Returns C bf16 (rows, N).

    Enqueued on torch's current stream with no host wait, and calls may be queued back to
    back (on one stream or several): the launcher (one per GPU and E) keeps on the GPU the
    device-side arguments (tensor maps of a, sa and b, the offsets' address, bm) of its last
    ``GroupedGemmFp8Send.DEVICE_ARGS_SLOTS`` distinct calls. A call whose a, sa, b (data
    pointers, shapes, strides), expert_offsets and bm equal one of them launches with no
    upload; a new one first uploads them on the current stream (a host wait for that stream).
    Not capturable by ``torch.cuda.graph`` (ConfigError)."""
    from .abi.config import P3PeerSendConfig
    c = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    _gemm_fp8_run(P3PeerSendConfig.disabled(), a, sa, b, sb, expert_offsets, c, bm, expert_align=1)
    return c


@gemm_fp8.register_fake
def _gemm_fp8_fake(a, sa, b, sb, expert_offsets, bm=0):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


class TorchGemmFp8Send:
    """The FP8 GEMM with the send in its epilogue, for one sender: ``cfg`` (a
    P3PeerSendConfig with the receive buffers, range table and src_info; msg_bytes = 2N),
    ``count_ptrs`` (the receivers' counts), as ``GroupedGemmFp8Send.prepare``. Call it (or
    ``torch.ops.p3send.gemm_fp8_send(handle, ...)``) with the tensors of ``gemm_fp8``: every
    row goes to its owner exactly as p3_scatter_send sends that C; nothing is returned and C
    is never written. The op mutates no tensor torch knows of (the receive buffers are
    p3send's): under torch.compile keep it outside the compiled region. Stream order, the
    cache of device-side arguments (count_ptrs, row_cache, same_gpu and p3_control among
    them; cfg is passed by value) and the refusal under graph capture: as ``gemm_fp8``."""

    def __init__(self, n_experts: int, cfg, *, count_ptrs=None, row_cache: bool = False, same_gpu: bool = False,
                 p3_control: int = 0, device=None):
        from .ops.gemm_fp8 import GroupedGemmFp8Send
        self.ordinal = device_ordinal(device)
        self.gemm = GroupedGemmFp8Send(n_experts, device=driver.device(self.ordinal))
        self.cfg, self.send = cfg, dict(count_ptrs=count_ptrs, row_cache=row_cache, same_gpu=same_gpu,
                                        p3_control=p3_control)
        self.handle = register(self)

    def __call__(self, a, sa, b, sb, expert_offsets, bm: int = 0) -> None:
        gemm_fp8_send(self.handle, a, sa, b, sb, expert_offsets, bm)

    def _run(self, a, sa, b, sb, expert_offsets, bm):
        self.gemm(self.cfg, a, _fp8_scales_view(sa, a.shape[0]), b, sb, expert_offsets, bm=bm if bm > 0 else None,
                  expert_align=1, stream=driver.as_stream(torch.cuda.current_stream(a.device)), **self.send)

    def close(self) -> None:
        unregister(self.handle)
        self.gemm.close()


@torch.library.custom_op("p3send::gemm_fp8_send", mutates_args=())
def gemm_fp8_send(handle: int, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                  expert_offsets: torch.Tensor, bm: int = 0) -> None:
    """The fused GEMM + send of the ``TorchGemmFp8Send`` registered as ``handle``."""
    obj = lookup(handle, TorchGemmFp8Send)
    if obj is None:
        raise ConfigError([f"handle: no open TorchGemmFp8Send has handle {handle}"], "p3send::gemm_fp8_send")
    obj._run(a, sa, b, sb, expert_offsets, bm)


@gemm_fp8_send.register_fake
def _gemm_fp8_send_fake(handle, a, sa, b, sb, expert_offsets, bm=0):
    return None
