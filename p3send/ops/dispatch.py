"""The dispatch: the combine's producer. From each rank's tokens and ``topk_idx`` it
writes, on every rank that owns experts, what the expert GEMMs and the combine read:
the rows grouped by local expert (then source rank, then token), ``expert_offsets``, the
range table at ``atomic_counter``, ``src_info``, per-expert counts, and the checked
``topk_idx`` the combine's receive takes (docs/PROTOCOL.md, "The dispatch").

Three kernels per rank and step, on its stream, with no host synchronisation:
``p3_dispatch_count`` (check and count the choices, exchange the counts with every rank,
lay every destination out), ``p3_dispatch_send`` (every token read once, each copy stored
straight to its final row, one flag per destination), ``p3_dispatch_wait`` (the bounded
wait for every source's flag; zero padding rows). When a rank's tokens fill more than one
count CTA's chunk, ``p3_dispatch_tally`` makes the check-and-count pass first, one CTA per
chunk, and the count kernel only sums the chunks (the same rows: ``set_tally``). Launch shapes come from the token count
and the capacity, never from this step's counts, so a captured graph replays with any
routing. Counters are device-side epochs: nothing is reset between steps or replays.

``Dispatch`` runs every rank on one GPU in this process (the counterpart of
``Combine``), each kernel as one launch for all ranks (``dispatch_all``); ``RankDispatch``
is one rank's buffers and launchers, which ``Dispatch`` (its ``per_rank`` step) and a
one-process-per-rank runner share.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..abi.config import (P3_MAX_MSG_BYTES, P3_MAX_RANKS, P3_MAX_TOP_K, checked_flag, checked_int, describe_value,
                          rank_config)
from ..abi.errors import ConfigError, ConfigTypeError, P3SendError
from ..abi.layout import SENTINEL
from ..cuda import driver
from ..cuda.loader import kernel
from .args import aligned, array_arg, describe
from .dispatch_all import FUSED, FUSED_NO_WAIT, ROW_THREADS, SPLIT, AllRanks, allow_smem, kernel_all

FLAG_INT64 = 1        # p3_dispatch_count: topk_idx is int64
FLAG_SCOPE_GPU = 2    # every rank on this GPU: .gpu-scope fences, count stores and flags
FLAG_PUSH_ONLY = 4    # p3_dispatch_count, split in two launches: count and push only
FLAG_LAYOUT_ONLY = 8  # ... then the wait and the layout
FLAG_TALLIED = 16     # p3_dispatch_count: p3_dispatch_tally made the token pass (one CTA per chunk)
FLAG_ZERO_PAD = 1     # p3_dispatch_wait: zero the padding rows
# FLAG_NO_SIGNAL (4, p3_dispatch_send: no per-CTA count, no flag): dispatch_all sets it in its quiet send rows

#: Threads of each kernel's CTA. The count kernel's block is its chunk of tokens: 1024 where
#: its shared memory fits (E <= 640 or so), else 512. The tally kernel's block (its chunk):
#: TALLY_THREADS (or the count kernel's block if smaller) unless ``set_tally`` says otherwise
#: (a power of two, 32 .. the count kernel's block): its chunks spread over more SMs than
#: 1024-token ones, for a few more chunks for the count kernel to sum.
COUNT_THREADS, TALLY_THREADS = 1024, 256
SEND_THREADS = WAIT_THREADS = ROW_THREADS      # one value for both steps (dispatch_all)
#: u64 words of the dispatch record (docs/KERNELS.md, p3_dispatch_count).
RECORD_WORDS = 16
#: Record words that hold a minimum (atom.min from all-ones).
MIN_WORDS = (5, 7, 9, 11)
NO_KEY = (1 << 64) - 1
#: Bytes of sentinel-filled guard before and after each receive array when asked for.
GUARD = 4096
#: Payloads: bytes of a token's row and of its scale row per hidden element count.
PAYLOADS = ("bf16", "fp8")
#: FP8 rows carry one fp32 scale per this many columns (DeepGEMM's activation layout).
FP8_SCALE_BLOCK = 128
#: The record's word 12: which kernel refused its arguments.
KERNEL_BITS = ((1, "p3_dispatch_count"), (2, "p3_dispatch_send"), (4, "p3_dispatch_wait"),
               (8, "p3_dispatch_tally"))
#: The smallest chunk of the tally kernel: its buffer holds ceil(max_tokens / this) chunks.
TALLY_MIN_TOKENS = 32
#: What the kernels take (their headers): experts in all, capacity rows (below), the
#: 32-bit products of their index arithmetic (below), the largest alignment.
MAX_EXPERTS, CAPACITY_LIMIT, INDEX_LIMIT, MAX_ALIGN = 1024, 1 << 30, 1 << 31, 4096
#: The longest wait a Dispatch or DispatchRank takes, in milliseconds (about 2.8 hours).
MAX_TIMEOUT_MS = 1e7


def release(steps, during: BaseException | None = None) -> None:
    """Call every step, even after one fails, so that everything an object owns is
    released; then raise the first failure.

    Args:
        steps: callables taking no argument (``buf.free``, ``stream.close``, ...), in order.
        during: the error a failing constructor is about to re-raise: a failure here is
            then added to it as a note instead of replacing it.

    Raises:
        Exception: the first step's failure, once every step has run (unless ``during``).
    """
    first = None
    for step in steps:
        try:
            step()
        except Exception as e:       # every step runs; the first failure is raised below
            first = e if first is None else first
    if first is None:
        return
    if during is None:
        raise first
    during.add_note(f"while releasing what was made: {type(first).__name__}: {first}")


class _Problems:
    """One message per bad argument, collected (every bad argument is reported at once);
    ``wrong_type``: one of them was of the wrong type (the error is then a TypeError too)."""

    def __init__(self):
        self.list, self.wrong_type = [], False

    def int(self, name: str, value, lo: int | None = None, hi: int | None = None, why: str = "") -> int | None:
        """``value`` as an int (``checked_int``'s rule: bools refused), or None with its problem noted."""
        try:
            return checked_int(name, value, "i64", lo=lo, hi=hi, why=why)
        except ConfigError as e:
            self.wrong_type |= isinstance(e, ConfigTypeError)
            self.list += e.problems
            return None

    def flag(self, name: str, value) -> bool | None:
        try:
            return checked_flag(name, value)
        except ConfigError as e:
            self.wrong_type = True
            self.list += e.problems
            return None

    def add(self, message: str, wrong_type: bool = False) -> None:
        self.list.append(message)
        self.wrong_type |= wrong_type

    def raise_any(self, what: str) -> None:
        if self.list:
            raise (ConfigTypeError if self.wrong_type else ConfigError)(self.list, what)


def dispatch_capacity(n_ranks: int, max_tokens: int, top_k: int, n_local: int, *, align: int = 1,
                      expert_stride: int = 0) -> int:
    """Rows a destination rank's receive arrays need in the worst case (``DispatchShape``'s
    default capacity).

    Every token of every rank sends the destination ``min(top_k, n_local)`` copies, plus
    ``align - 1`` padding rows per expert; in the masked layout, ``n_local`` blocks of
    ``expert_stride`` rows. Nothing is checked here (``layout_problems`` does).

    Args:
        n_ranks: ranks of the dispatch.
        max_tokens: tokens per rank, at most.
        top_k: experts per token.
        n_local: local experts per rank.
        align: expert starts rounded up to a multiple of this (contiguous layout).
        expert_stride: 0: the contiguous layout; > 0: the masked layout, expert e's rows
            from ``e * expert_stride``.

    Returns:
        The row count: ``n_local * expert_stride`` when expert_stride > 0, else
        ``n_ranks * max_tokens * min(top_k, n_local) + n_local * (align - 1)``.
    """
    if expert_stride:
        return n_local * expert_stride
    return n_ranks * max_tokens * min(top_k, n_local) + n_local * (align - 1)


def _layout(p: _Problems, n_ranks, n_local, top_k, capacity, align, expert_stride, max_tokens,
            local: str = "n_local") -> tuple:
    """The layout rules of the dispatch kernels, each argument's type checked before any
    value is computed from it. ``local``: the name n_local has where the caller wrote it.
    Returns the arguments as ints (None where one is bad)."""
    R = p.int("n_ranks", n_ranks, 1, P3_MAX_RANKS)
    L = p.int(local, n_local, 1)
    if R is not None and L is not None and R * L > MAX_EXPERTS:
        p.add(f"{local}: expected n_ranks*{local} <= {MAX_EXPERTS} experts, got {L} ({R} ranks: {R * L} experts)")
    K = p.int("top_k", top_k, 1, P3_MAX_TOP_K)
    T = p.int("max_tokens", max_tokens, 0)
    C = None if capacity is None else p.int("capacity", capacity, 0, CAPACITY_LIMIT - 1, " rows")
    A = p.int("align", align, 1, MAX_ALIGN, " (a power of two)")
    if A is not None and A & (A - 1):
        p.add(f"align: expected a power of two in 1..{MAX_ALIGN}, got {A}")
    S = p.int("expert_stride", expert_stride, 0, why=" (0: contiguous layout; > 0: the masked layout)")
    if S and A is not None and A != 1:
        p.add(f"expert_stride: expected 0 with align {A} (the masked layout takes align 1 only), got {S}")
    if S is not None and L is not None and S * L >= INDEX_LIMIT:
        p.add(f"expert_stride: {local}*expert_stride must stay below 2^31, got {S} ({L} experts)")
    if None not in (R, K, T) and T * K * R >= INDEX_LIMIT:
        p.add(f"max_tokens: max_tokens*top_k*n_ranks must stay below 2^31, got {T} ({K} x {R} ranks)")
    return R, L, K, T, C, A, S


def layout_problems(n_ranks: int, n_local: int, top_k: int, *, capacity: int, align: int = 1,
                    expert_stride: int = 0, max_tokens: int = 0) -> list:
    """What the dispatch kernels refuse in a shape (one message per argument; empty: fine).
    A value of the wrong type (a str, a float, a bool) is a problem too."""
    p = _Problems()
    if capacity is None:
        p.add(f"capacity: expected 0..2^30-1 rows, got {describe_value(capacity)}", wrong_type=True)
    _layout(p, n_ranks, n_local, top_k, capacity, align, expert_stride, max_tokens)
    return p.list


def _shape(p: _Problems, n_ranks, n_local, top_k, max_tokens, hidden, payload, capacity, align, expert_stride,
           zero_padding, local: str = "n_local") -> dict:
    """Every rule of a DispatchShape (``_layout``'s, the payload's and the row's), then the
    defaults (capacity, zero_padding) from arguments that passed. Returns the fields as
    plain ints and bools (meaningful only when ``p`` holds no problem)."""
    R, L, K, T, C, A, S = _layout(p, n_ranks, n_local, top_k, capacity, align, expert_stride, max_tokens, local)
    H = p.int("hidden", hidden)
    if not (isinstance(payload, str) and payload in PAYLOADS):
        p.add(f"payload: expected one of {', '.join(PAYLOADS)}, got {describe_value(payload)}",
              wrong_type=not isinstance(payload, str))
        payload = None
    elif H is not None:
        unit, x_bytes, s_bytes = (8, 2 * H, 0) if payload == "bf16" else (512, H, 4 * (H // FP8_SCALE_BLOCK))
        if H <= 0 or H % unit or x_bytes > P3_MAX_MSG_BYTES:
            p.add(f"hidden: expected a positive multiple of {unit} (rows up to 1 MiB) for {payload}, got {H}")
        elif T is not None and T * ((x_bytes + s_bytes) // 16) >= INDEX_LIMIT:
            # p3_dispatch_send numbers a step's 16-byte vectors (rows and scales) in 31 bits
            p.add(f"max_tokens: max_tokens*(row bytes)/16 must stay below 2^31 (p3_dispatch_send's vectors "
                  f"of a step), got {T} tokens of {x_bytes + s_bytes} bytes ({payload}, hidden {H})")
    ZP = None if zero_padding is None else p.flag("zero_padding", zero_padding)
    if p.list:
        return {}
    if C is None:
        C = dispatch_capacity(R, T, K, L, align=A, expert_stride=S)
        if C >= CAPACITY_LIMIT:
            formula = f"{L}*expert_stride" if S else "n_ranks*max_tokens*min(top_k, n_local) + n_local*(align-1)"
            p.add(f"capacity: expected below 2^30 rows; the default ({formula}) is {C} for max_tokens {T}: "
                  f"give a capacity, or fewer max_tokens")
    return {"n_ranks": R, "n_local": L, "top_k": K, "max_tokens": T, "hidden": H, "payload": payload,
            "capacity": C, "align": A, "expert_stride": S, "zero_padding": A > 1 if ZP is None else ZP}


@dataclass(frozen=True)
class DispatchShape:
    """The shape every rank's dispatch shares.

    payload "bf16": rows of ``2*hidden`` bytes; "fp8": ``hidden`` e4m3 bytes and ``hidden/128``
    fp32 scales (hidden a multiple of 512, so a scale row is whole 16-byte vectors).
    capacity: rows of each rank's receive arrays (default ``dispatch_capacity``);
    align / expert_stride: the contiguous (aligned) or masked layout; zero_padding:
    p3_dispatch_wait zeroes the padding rows (default: with align > 1). n_ranks: ranks of
    the dispatch; n_local: experts per rank; top_k: experts per token; max_tokens: tokens
    per rank and step, at most; hidden: the token width in elements. Every field is
    checked (type, then value) before anything is computed from it; what the kernels
    would refuse on the device is refused here.

    Raises:
        ConfigError: every bad field, named (a ConfigTypeError when one is of the wrong type).
    """
    n_ranks: int
    n_local: int
    top_k: int
    max_tokens: int
    hidden: int
    payload: str = "bf16"
    capacity: int | None = None
    align: int = 1
    expert_stride: int = 0
    zero_padding: bool | None = None

    def __post_init__(self):
        p = _Problems()
        fields = _shape(p, self.n_ranks, self.n_local, self.top_k, self.max_tokens, self.hidden, self.payload,
                        self.capacity, self.align, self.expert_stride, self.zero_padding)
        p.raise_any("dispatch shape")
        for name, value in fields.items():     # numpy integers and bools as Python ones
            object.__setattr__(self, name, value)

    def problems(self) -> list:
        """What the dispatch kernels refuse in this shape: ``layout_problems`` plus
        max_tokens, payload, hidden and zero_padding.

        Returns:
            One message per bad field, naming it (empty: fine); ``__post_init__`` raises
            them as one ConfigError.
        """
        p = _Problems()
        _shape(p, self.n_ranks, self.n_local, self.top_k, self.max_tokens, self.hidden, self.payload, self.capacity,
               self.align, self.expert_stride, self.zero_padding)
        return p.list

    @property
    def n_experts(self) -> int:
        return self.n_ranks * self.n_local

    @property
    def x_bytes(self) -> int:
        return 2 * self.hidden if self.payload == "bf16" else self.hidden

    @property
    def s_bytes(self) -> int:
        return 0 if self.payload == "bf16" else 4 * (self.hidden // FP8_SCALE_BLOCK)

    @property
    def bytes_per_rank(self) -> int:
        """Device bytes of one rank's receive arrays (rows, scales, src_info) at capacity."""
        return self.capacity * (self.x_bytes + self.s_bytes + 8)


class DispatchError(P3SendError, ValueError):
    """What the device found wrong in a step (docs/PROTOCOL.md, "The dispatch").

    Either a kernel refused its arguments (``rejected``: rank -> the record's word 12, one
    bit per kernel as in ``KERNEL_BITS``), listed first, then the waits left unfed because
    of it (``missing``, as ``DispatchTimeout``'s); or the routing broke a rule: an expert id
    out of range, a duplicated expert in one token's top-k, or copies past a destination's
    capacity (that step's outputs as documented, the offending copies treated as masked).
    ``problems``: one message per (rank, kind), naming the rank (and for routing the first
    token and k, and the expert); ``records``: the decoded record per rank (rank -> dict)."""

    def __init__(self, problems, records=None, rejected=None, missing=None):
        self.problems, self.records = list(problems), records
        self.rejected, self.missing = dict(rejected or {}), list(missing or [])
        self._init_args = (self.problems, records, self.rejected, self.missing)
        head = "dispatch launch rejected on the device" if self.rejected else "dispatch routing errors"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


class DispatchTimeout(P3SendError, TimeoutError):
    """A dispatch wait hit its deadline. ``missing``: (rank, source rank, what) triples,
    what = "counts" (the count exchange) or "rows" (the source's arrival flag);
    ``timeout_ns``: the deadline in nanoseconds (None: not known; the message then gives none)."""

    def __init__(self, missing, timeout_ns=None):
        self.missing, self.timeout_ns = list(missing), timeout_ns
        self._init_args = (self.missing, timeout_ns)
        shown = ", ".join(f"rank {r}: {w} of rank {s}" for r, s, w in self.missing[:16])
        more = "" if len(self.missing) <= 16 else f" (+{len(self.missing) - 16} more)"
        t = f" within {timeout_ns / 1e6:.3f} ms" if timeout_ns else ""
        super().__init__(f"dispatch never arrived{t} from rank(s) {sorted({s for _, s, _ in self.missing})}: "
                         f"{shown}{more}")


def step_error(rejected: dict, missing: list, routing: list, timeout_ns: int | None = None,
               records: dict | None = None) -> P3SendError | None:
    """The one error a checked step raises, the cause first: a kernel that refused its
    arguments (its peers then time out waiting for it, so a rejection must not read as a
    silent rank), then waits that timed out, then routing errors.

    Args:
        rejected: rank -> its record's word 12 (0: nothing rejected).
        missing: (rank, source rank, "counts" / "rows" / "unknown") of every timed-out wait.
        routing: the routing messages (``RankDispatch.problems``).
        timeout_ns: the waits' deadline, for the message.
        records: rank -> decoded record, kept on a DispatchError.

    Returns:
        DispatchError (rejections, with the timeouts after them), DispatchTimeout,
        DispatchError (routing), or None for a clean step.
    """
    rejected = {r: int(m) for r, m in rejected.items() if m}
    if rejected:
        lines = [f"rank {r}: {', '.join(n for b, n in KERNEL_BITS if m & b) or 'a kernel'} rejected its arguments "
                 f"(record word 12 = {m:#x}; nothing of that launch ran)" for r, m in sorted(rejected.items())]
        lines += [f"rank {r}: then timed out waiting for the {w} of " + (f"rank {s}" if s >= 0 else "a rank")
                  for r, s, w in missing]
        return DispatchError(lines + list(routing), records, rejected, missing)
    if missing:
        return DispatchTimeout(missing, timeout_ns)
    if routing:
        return DispatchError(routing, records)
    return None


def _wait_time(p: _Problems, name: str, value, unit: str, most: float | None):
    """A wait's length: a finite real number > 0 (no bool), at most ``most``; None if bad."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        p.add(f"{name}: expected a number of {unit} > 0, got {describe_value(value)}", wrong_type=True)
        return None
    v = float(value)
    if not (math.isfinite(v) and v > 0 and (most is None or v <= most)):
        p.add(f"{name}: expected a finite number of {unit} > 0" + (f" and at most {most:g}" if most else "")
              + f", got {value!r}")
        return None
    return v


def _arguments(what: str, n_ranks, *, max_tokens, top_k, hidden, n_local_experts, payload, capacity, align,
               expert_stride, zero_padding, timeout_ms, process: tuple | None = None,
               more: tuple = ()) -> tuple[DispatchShape, int]:
    """Every argument ``Dispatch`` and ``DispatchRank`` share, checked before anything is
    allocated, with every problem raised at once (named as those classes' keywords).

    Args:
        what: the class, for the error.
        timeout_ms: the device waits' deadline: a finite number of milliseconds, at least one
            nanosecond, at most ``MAX_TIMEOUT_MS``.
        process: ``(rank, exchange, sync_timeout_s)`` for DispatchRank: rank 0..n_ranks-1,
            an exchange that says it is that rank of n_ranks, the host syncs' deadline
            (a finite number of seconds > 0).
        more: further problems the caller found (messages).

    Returns:
        (the shape, the deadline in ns).

    Raises:
        ConfigError: every bad argument, named (ConfigTypeError when one is of the wrong type).
    """
    p = _Problems()
    _shape(p, n_ranks, n_local_experts, top_k, max_tokens, hidden, payload, capacity, align, expert_stride,
           zero_padding, local="n_local_experts")
    ms = _wait_time(p, "timeout_ms", timeout_ms, "milliseconds", MAX_TIMEOUT_MS)
    if ms is not None and int(ms * 1e6) < 1:
        p.add(f"timeout_ms: expected at least one nanosecond (1e-06), got {timeout_ms!r}")
    if process is not None:
        rank, exchange, sync_timeout_s = process
        R = _Problems().int("n_ranks", n_ranks, 1, P3_MAX_RANKS)      # its problem, if any, is noted above
        p.int("rank", rank, 0, None if R is None else R - 1)
        said = (getattr(exchange, "rank", None), getattr(exchange, "n_ranks", None))
        if said != (rank, n_ranks):
            p.add(f"exchange: expected rank {rank!r} of {n_ranks!r}, it says rank {said[0]!r} of {said[1]!r}")
        _wait_time(p, "sync_timeout_s", sync_timeout_s, "seconds", None)
    for m in more:
        p.add(m)
    p.raise_any(what)
    return (DispatchShape(n_ranks, n_local_experts, top_k, max_tokens, hidden, payload, capacity, align,
                          expert_stride, zero_padding), int(float(timeout_ms) * 1e6))


def record_init() -> np.ndarray:
    """A fresh dispatch record: u64[16] zeros, the minimum words all-ones."""
    rec = np.zeros(RECORD_WORDS, np.uint64)
    rec[list(MIN_WORDS)] = np.uint64(NO_KEY)
    return rec


def decode_record(rec) -> dict:
    """A dispatch record (u64[16]) as named fields (docs/KERNELS.md, p3_dispatch_count)."""
    r = [int(x) for x in np.asarray(rec, np.uint64)]
    return {"count_timeouts": r[0], "count_missing": r[1], "row_timeouts": r[2], "row_missing": r[3],
            "out_of_range": r[4], "out_of_range_key": r[5], "duplicate": r[6], "duplicate_key": r[7],
            "overflow": r[8], "overflow_expert": r[9], "dropped_here": r[10], "dropped_expert": r[11],
            "rejected": r[12], "epoch": r[13]}


def bits(mask: int) -> list:
    return [i for i in range(64) if mask >> i & 1]


class ArrayView:
    """A typed view of device memory (``__cuda_array_interface__``), e.g. the first
    ``tokens`` rows of a capacity-sized buffer, for launchers that read shapes."""

    def __init__(self, ptr: int, shape, dtype):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(int(s) for s in shape), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3}


#: The arrays ``Dispatch(stacked=True)`` allocates once for all ranks.
STACKED = ("recv_x", "recv_scales", "src_info", "expert_offsets", "range_table", "expert_counts", "topk_out")


class SubBuffer:
    """``nbytes`` of a DeviceBuffer from byte ``offset``: the DeviceBuffer calls a launcher
    makes (``ptr``, ``upload``, ``download``, ``fill``), on the slice; ``free`` leaves the
    parent alone."""

    def __init__(self, parent: driver.DeviceBuffer, offset: int, nbytes: int):
        self.parent, self.offset, self.nbytes = parent, int(offset), int(nbytes)
        self.ptr = parent.ptr + self.offset

    def upload(self, arr, stream=None, offset: int = 0) -> None:
        if np.asarray(arr).nbytes + offset > self.nbytes:
            raise ConfigError([f"upload of {np.asarray(arr).nbytes} bytes at {offset} exceeds {self.nbytes}"],
                              "argument")
        self.parent.upload(arr, stream, offset=self.offset + offset)

    def download(self, dtype=np.uint8, shape=None, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        if nbytes is None:
            nbytes = self.nbytes - offset if shape is None else int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.parent.download(dtype, shape, offset=self.offset + offset, nbytes=nbytes)

    def fill(self, byte: int, stream=None, offset: int = 0, nbytes: int | None = None) -> None:
        self.parent.fill(byte, stream, offset=self.offset + offset, nbytes=self.nbytes - offset if nbytes is None
                         else nbytes)

    def free(self) -> None:
        pass

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


class RankDispatch:
    """One rank's dispatch: its buffers, its three kernels' parameter blocks, its record.

    Shared with peers (peers store into them): ``recv_x`` (capacity, x_bytes) and
    ``recv_scales`` (capacity, s_bytes) with ``guard`` sentinel bytes each side, ``src_info``
    int32 (capacity, 2) (likewise), the count exchange ``xcount`` u64 [2][n_ranks][E] and
    the arrival ``flags`` u64 [n_ranks]. Own: ``expert_offsets`` int32 [n_local+1],
    ``range_table`` int32 [n_local*n_ranks*2], ``expert_counts`` int32 [n_local],
    ``topk_out`` int32 [max_tokens, top_k], ``route`` (scratch), ``state`` u64[4] and the
    record ``diag`` u64[16]; with ``inputs``, upload buffers for x, scales and topk_idx.
    ``alloc(nbytes, fill, name)`` makes each buffer (a DeviceBuffer or a ``SubBuffer``)."""

    def __init__(self, shape: DispatchShape, rank: int, *, device: driver.Device, alloc, timeout_ns: int,
                 guard: int = 0, inputs: bool = True, same_gpu: bool = True):
        sh, self.shape, self.rank, self.dev = shape, shape, rank, device
        self.timeout_ns, self.guard, self.same_gpu = int(timeout_ns), guard, same_gpu
        cap, K, E, R = max(sh.capacity, 1), sh.top_k, sh.n_experts, sh.n_ranks
        slots = max(sh.max_tokens, 1) * K
        # the kernels and the count kernel's shared memory first: a shape this GPU cannot
        # run is refused before anything is allocated
        self.count_threads = COUNT_THREADS
        while True:
            W = self.count_threads // 32
            self.count_smem = 8 * E * W + 4 * R * E + 16 * E
            if self.count_smem <= device.smem_optin or self.count_threads <= 512:
                break
            self.count_threads //= 2
        if self.count_smem > device.smem_optin:
            raise ConfigError([f"n_local: {E} experts need {self.count_smem} B of shared memory in "
                               f"p3_dispatch_count; {device.name} allows {device.smem_optin}"], "dispatch")
        self.k_count = kernel("p3_dispatch_count", device)
        self.k_send = kernel("p3_dispatch_send", device)
        self.k_wait = kernel("p3_dispatch_wait", device)
        self.k_tally = kernel("p3_dispatch_tally", device)
        allow_smem(self.k_count.func, self.count_smem)      # (never lowered: the kernel is shared)
        allow_smem(self.k_tally.func, self._tally_smem(self.count_threads))
        self.recv_x_alloc = alloc(cap * sh.x_bytes + 2 * guard, SENTINEL, "recv_x")
        self.recv_scales_alloc = alloc(cap * sh.s_bytes + 2 * guard, SENTINEL, "recv_scales") if sh.s_bytes else None
        self.src_info_alloc = alloc(8 * cap + 2 * guard, 0xFF, "src_info")
        self.xcount = alloc(8 * 2 * R * E, 0, "xcount")
        self.flags = alloc(8 * R, 0, "flags")
        self.expert_offsets = alloc(4 * (sh.n_local + 1), 0, "expert_offsets")
        self.range_table = alloc(8 * sh.n_local * R, 0, "range_table")
        self.expert_counts = alloc(4 * sh.n_local, 0, "expert_counts")
        self.topk_out = alloc(4 * slots, 0xFF, "topk_out")
        self.route = alloc(8 * slots, 0xFF, "route")
        self.state = alloc(32, 0, "state")
        self.tally_buf = alloc(4 * E * -(-max(sh.max_tokens, 1) // TALLY_MIN_TOKENS), 0, "tally")
        self.diag = alloc(8 * RECORD_WORDS, None, "diag")
        self.diag.upload(record_init())
        self.x = alloc(max(sh.max_tokens, 1) * sh.x_bytes, None, "x") if inputs else None
        self.scales = alloc(max(sh.max_tokens, 1) * sh.s_bytes, None, "scales") if inputs and sh.s_bytes else None
        self.topk_idx = alloc(8 * slots, None, "topk_idx") if inputs else None
        self.tokens, self.int64, self.topk_addr = 0, False, 0
        self.b_count = self.k_count.params_block()
        self.b_push = self.k_count.params_block()
        self.b_layout = self.k_count.params_block()
        self.b_send = self.k_send.params_block()
        self.b_wait = self.k_wait.params_block()
        self.b_tally = self.k_tally.params_block()
        #: None: the tally kernel makes the token pass when the tokens fill more than one count
        #: CTA's chunk (the single CTA then walks them in turn); True / False: always / never.
        self.tally_mode, self.tally, self.tally_grid = None, False, 1
        self.tally_threads = min(TALLY_THREADS, self.count_threads)
        self.inputs = None
        self.send_grid = 1
        self.wait_grid = self._wait_grid()
        self.p3_control = 0
        self.cfg = None
        #: Bumped whenever a parameter block changes (an all-ranks launch then rebuilds its rows).
        self.version = 0

    # ------------------------------------------------------------ addresses
    def ptr(self, name: str) -> int:
        """The address peers store to: recv_x, recv_scales, src_info (after the guard), xcount, flags."""
        if name in ("recv_x", "recv_scales", "src_info"):
            buf = getattr(self, name + "_alloc")
            return 0 if buf is None else buf.ptr + self.guard
        return getattr(self, name).ptr

    def peer_info(self) -> dict:
        return {n: self.ptr(n) for n in ("recv_x", "recv_scales", "src_info", "xcount", "flags")}

    def _tally_smem(self, threads: int) -> int:
        return 8 * self.shape.n_experts * (threads // 32) + 4 * self.shape.n_experts

    def set_tally(self, on: bool | None = None, threads: int | None = None) -> None:
        """Which token pass a step makes (refilled at once when inputs are bound). The rows,
        routing and record are the same either way.

        Args:
            on: None (the default): the tally kernel's multi-CTA pass when this step's tokens
                are more than one count CTA's chunk, else the count kernel's own; True /
                False: always / never.
            threads: the tally kernel's block and chunk of tokens (a power of two, 32 .. the
                count kernel's block); None: unchanged (default ``TALLY_THREADS``).

        Raises:
            ConfigError: a bad ``on`` or ``threads``.
        """
        p = _Problems()
        if on is not None:
            p.flag("on", on)
        t = self.tally_threads if threads is None else p.int("threads", threads, TALLY_MIN_TOKENS,
                                                             self.count_threads, " (a power of two)")
        if t is not None and t & (t - 1):
            p.add(f"threads: expected a power of two in {TALLY_MIN_TOKENS}..{self.count_threads}, got {t}")
        p.raise_any(f"rank {self.rank} tally")
        self.tally_mode, self.tally_threads = (None if on is None else bool(on)), int(t)
        if self.inputs is not None:
            self._fill()

    def _wait_grid(self) -> int:
        sh = self.shape
        if not sh.zero_padding:
            return 1
        pad_rows = sh.expert_stride if sh.expert_stride else sh.align - 1
        vectors = pad_rows * (sh.x_bytes + sh.s_bytes) // 16
        parts = max(1, min(64, -(-vectors // (WAIT_THREADS * 8))))
        return max(1, sh.n_local * parts)

    # ------------------------------------------------------------ inputs
    def bind(self, *, x, topk_idx, scales=None) -> int:
        """Attach this step's inputs as device arrays (read in place by every launch and
        replay): x bf16 (tokens, hidden) (uint16/int16 too) or e4m3 (tokens, hidden)
        (uint8/float8_e4m3fn), scales f32 (tokens, hidden/128) for fp8, topk_idx int32 or
        int64 (tokens, top_k). Returns the token count (topk_idx's leading dimension)."""
        sh, problems = self.shape, []
        shp = tuple(getattr(topk_idx, "shape", ())) or tuple(
            getattr(topk_idx, "__cuda_array_interface__", {}).get("shape", ()))
        tokens = int(shp[0]) if len(shp) == 2 else -1
        if len(shp) != 2 or shp[1] != sh.top_k or not 0 <= tokens <= sh.max_tokens:
            problems.append(f"topk_idx: expected (tokens <= {sh.max_tokens}, {sh.top_k}), got shape {shp}")
        tokens = max(tokens, 0)
        dt = describe(topk_idx)["dtype"] if not isinstance(topk_idx, (int, driver.DeviceBuffer)) else None
        if dt not in (None, "int32", "int64"):
            problems.append(f"topk_idx: expected dtype int32 or int64, got {dt}")
        self.int64 = dt == "int64"
        ka, _ = array_arg(topk_idx, "topk_idx", problems, nbytes_min=(8 if self.int64 else 4) * tokens * sh.top_k,
                          ordinal=self.dev.ordinal)
        aligned("topk_idx", ka, 8 if self.int64 else 4, problems)
        xd = ("bfloat16", "uint16", "int16") if sh.payload == "bf16" else ("float8_e4m3fn", "uint8", "int8")
        xa, _ = array_arg(x, "x", problems, dtypes=xd, nbytes_min=tokens * sh.x_bytes, ordinal=self.dev.ordinal)
        aligned("x", xa, 16, problems)
        sa = 0
        if sh.s_bytes:
            sa, _ = array_arg(scales, "scales", problems, dtypes=("float32",), nbytes_min=tokens * sh.s_bytes,
                              ordinal=self.dev.ordinal)
            aligned("scales", sa, 16, problems)
        elif scales is not None:
            problems.append("scales: expected None for a bf16 payload")
        if problems:
            raise ConfigError(problems, f"rank {self.rank} dispatch inputs")
        self.tokens, self.inputs, self.topk_addr = tokens, (xa, sa, ka), ka
        self._fill()
        return tokens

    def set_inputs(self, *, x, topk_idx, scales=None) -> int:
        """Upload this step's inputs from numpy (shapes and dtypes as ``bind``) into the
        buffers this rank owns."""
        if self.x is None:
            raise ConfigError([f"rank {self.rank}: the dispatch inputs are the caller's (inputs=False); bind them"],
                              "dispatch inputs")
        sh = self.shape
        tk = np.ascontiguousarray(topk_idx)
        if tk.dtype not in (np.int32, np.int64) or tk.ndim != 2 or tk.shape[1] != sh.top_k or \
                tk.shape[0] > sh.max_tokens:
            raise ConfigError([f"topk_idx: expected int32 or int64 (tokens <= {sh.max_tokens}, {sh.top_k}), "
                               f"got {tk.dtype} {tk.shape}"], f"rank {self.rank} dispatch inputs")
        T = tk.shape[0]
        xb = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
        if xb.size != T * sh.x_bytes:
            raise ConfigError([f"x: expected {T} rows of {sh.x_bytes} bytes, got {xb.size} bytes"],
                              f"rank {self.rank} dispatch inputs")
        if (scales is None) != (not sh.s_bytes):
            want = "float32 (tokens, hidden/128)" if sh.s_bytes else "None"
            raise ConfigError([f"scales: expected {want} for a {sh.payload} payload, got {type(scales).__name__}"],
                              f"rank {self.rank} dispatch inputs")
        self.x.upload(xb)
        if sh.s_bytes:
            sb = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint8).reshape(-1)
            if sb.size != T * sh.s_bytes:
                raise ConfigError([f"scales: expected {T} rows of {sh.s_bytes} bytes, got {sb.size} bytes"],
                                  f"rank {self.rank} dispatch inputs")
            self.scales.upload(sb)
        self.topk_idx.upload(tk)
        return self.bind(x=ArrayView(self.x.ptr, (T, sh.x_bytes), np.uint8) if sh.payload == "fp8" else
                         ArrayView(self.x.ptr, (T, sh.hidden), np.uint16),
                         topk_idx=ArrayView(self.topk_idx.ptr, (T, sh.top_k), tk.dtype),
                         scales=ArrayView(self.scales.ptr, (T, sh.s_bytes // 4), np.float32) if sh.s_bytes else None)

    # ------------------------------------------------------------ parameter blocks
    def connect(self, peers: list) -> None:
        """Point the kernels at every rank's shared buffers: ``peers[p]`` = rank p's
        ``peer_info()`` as mapped in this process (p == rank: this rank's own)."""
        sh = self.shape
        if len(peers) != sh.n_ranks:
            raise ConfigError([f"peers: expected {sh.n_ranks}, got {len(peers)}"], "dispatch")
        self.peers = peers
        self.cfg = rank_config(n_ranks=sh.n_ranks, my_rank=self.rank, recv_bufs=[p["recv_x"] for p in peers],
                               top_k=sh.top_k, msg_bytes=sh.x_bytes, max_tokens=sh.max_tokens,
                               range_table=self.range_table, src_info=self.ptr("src_info"))

    def _fill(self) -> None:
        if self.cfg is None:
            raise ConfigError([f"rank {self.rank}: connect() the peers before binding inputs"], "dispatch")
        sh, (xa, sa, ka) = self.shape, self.inputs
        scope = FLAG_SCOPE_GPU if self.same_gpu else 0
        pick = [[p[n] for p in self.peers] for n in ("xcount", "recv_x", "recv_scales", "src_info", "flags")]
        self.tally = self.tokens > self.count_threads if self.tally_mode is None else self.tally_mode
        self.tally_grid = max(1, -(-self.tokens // self.tally_threads))
        tallied = FLAG_TALLIED if self.tally else 0
        for blk, split in ((self.b_count, 0), (self.b_push, FLAG_PUSH_ONLY), (self.b_layout, FLAG_LAYOUT_ONLY)):
            blk.set(cfg=self.cfg, xcount_ptrs=pick[0], topk_idx=ka, topk_out=self.topk_out, route=self.route,
                    expert_offsets=self.expert_offsets, range_table=self.range_table,
                    expert_counts=self.expert_counts, state_ptr=self.state, diag_ptr=self.diag,
                    timeout_ns=self.timeout_ns, n_tokens=self.tokens, n_local=sh.n_local,
                    capacity=sh.capacity, align=sh.align, expert_stride=sh.expert_stride,
                    flags=(FLAG_INT64 if self.int64 else 0) | scope | split | tallied, tally=self.tally_buf,
                    tally_tokens=self.tally_threads, p3_control=self.p3_control)
        self.b_tally.set(cfg=self.cfg, topk_idx=ka, topk_out=self.topk_out, route=self.route, tally=self.tally_buf,
                         diag_ptr=self.diag, n_tokens=self.tokens, n_local=sh.n_local,
                         flags=FLAG_INT64 if self.int64 else 0, p3_control=self.p3_control)
        self.b_send.set(cfg=self.cfg, x_ptrs=pick[1], scale_ptrs=pick[2], info_ptrs=pick[3], flag_ptrs=pick[4],
                        x=xa, scales=sa, route=self.route, state_ptr=self.state, diag_ptr=self.diag,
                        n_tokens=self.tokens, x_bytes=sh.x_bytes, s_bytes=sh.s_bytes, capacity=sh.capacity,
                        flags=scope, p3_control=self.p3_control)
        self.b_wait.set(cfg=self.cfg, flags_ptr=self.flags, recv_x=self.ptr("recv_x"),
                        recv_scales=self.ptr("recv_scales"), src_info=self.ptr("src_info"),
                        expert_offsets=self.expert_offsets, expert_counts=self.expert_counts, state_ptr=self.state,
                        diag_ptr=self.diag, timeout_ns=self.timeout_ns, x_bytes=sh.x_bytes, s_bytes=sh.s_bytes,
                        n_local=sh.n_local, capacity=sh.capacity,
                        flags=(FLAG_ZERO_PAD if sh.zero_padding else 0) | scope, p3_control=self.p3_control)
        nvt = (sh.x_bytes + sh.s_bytes) // 16
        self.send_grid = max(1, -(-self.tokens * nvt // SEND_THREADS))
        self.version += 1

    def set_control(self, p3_control: int) -> None:
        """< 0: every kernel of this rank's dispatch returns at once (on every rank alike)."""
        self.p3_control = int(p3_control)
        for b in (self.b_count, self.b_push, self.b_layout, self.b_send, self.b_wait, self.b_tally):
            b.set(p3_control=self.p3_control)
        self.version += 1

    # ------------------------------------------------------------ launches
    def launch_count(self, stream, split: int = 0, tally: bool = True) -> None:
        """The count kernel: fused (split 0), or its FLAG_PUSH_ONLY / FLAG_LAYOUT_ONLY launch;
        before the fused or push-only one, the tally kernel when this step uses it (and
        ``tally``: False leaves it to the caller, as ``launch_tally``)."""
        if tally and self.tally and split != FLAG_LAYOUT_ONLY:
            self.launch_tally(stream)
        blk = {0: self.b_count, FLAG_PUSH_ONLY: self.b_push, FLAG_LAYOUT_ONLY: self.b_layout}[split]
        blk.launch((1,), (self.count_threads,), stream, self.count_smem)

    def launch_tally(self, stream) -> None:
        """The tally kernel (the multi-CTA token pass), when this step uses it (``tally``)."""
        self.b_tally.launch((self.tally_grid,), (self.tally_threads,), stream, self._tally_smem(self.tally_threads))

    def launch_send(self, stream) -> None:
        self.b_send.launch((self.send_grid,), (SEND_THREADS,), stream)

    def launch_wait(self, stream) -> None:
        self.b_wait.launch((self.wait_grid,), (WAIT_THREADS,), stream)

    def launch(self, stream) -> None:
        """The whole step of this rank on ``stream``: count, send, wait."""
        self.launch_count(stream)
        self.launch_send(stream)
        self.launch_wait(stream)

    # ------------------------------------------------------------ results
    def record(self, reset: bool = True) -> dict:
        rec = self.diag.download(np.uint64)
        if reset:
            self.diag.upload(record_init())
        return decode_record(rec)

    def rearm(self) -> None:
        """After a timeout, with every rank's kernels finished: epochs, exchange and flags to zero."""
        for b in (self.state, self.xcount, self.flags):
            b.fill(0)

    def slot_value(self, key: int) -> int | None:
        """topk_idx at flat slot ``key`` of the bound input, when it can be read back."""
        obj, item = self.topk_idx, 8 if self.int64 else 4
        if obj is None or self.topk_addr != obj.ptr or key * item >= obj.nbytes:
            return None      # the caller's own array: not read back here
        v = obj.download(np.int64 if self.int64 else np.int32, offset=key * item, nbytes=item)
        return int(v[0])

    def view(self, name: str, rows: int | None = None) -> np.ndarray:
        """A receive array as numpy: recv_x uint8 (capacity, x_bytes), recv_scales uint8
        (capacity, s_bytes), src_info int32 (capacity, 2); with the guards when ``rows`` is
        None and a guard was asked for (flat uint8)."""
        buf = getattr(self, name + "_alloc")
        raw = buf.download()
        if rows is None and self.guard:
            return raw
        sh = self.shape
        inner = raw[self.guard:len(raw) - self.guard]
        width = {"recv_x": sh.x_bytes, "recv_scales": sh.s_bytes, "src_info": 8}[name]
        out = inner.reshape(-1, width)[: rows if rows is not None else sh.capacity]
        return out.view(np.int32) if name == "src_info" else out

    def handle(self) -> dict:
        """What this rank's combine reads, as typed device views: expert_offsets int32
        (n_local+1,), range_table int32 (2*n_local*n_ranks,), src_info int32 (capacity, 2),
        topk_idx int32 (tokens, top_k) (the checked one: -1 for every copy not stored) and
        expert_counts int32 (n_local,)."""
        sh = self.shape
        return {"expert_offsets": ArrayView(self.expert_offsets.ptr, (sh.n_local + 1,), np.int32),
                "range_table": ArrayView(self.range_table.ptr, (2 * sh.n_local * sh.n_ranks,), np.int32),
                "src_info": ArrayView(self.ptr("src_info"), (max(sh.capacity, 1), 2), np.int32),
                "topk_idx": ArrayView(self.topk_out.ptr, (self.tokens, sh.top_k), np.int32),
                "expert_counts": ArrayView(self.expert_counts.ptr, (sh.n_local,), np.int32)}

    def recv_x_view(self) -> ArrayView:
        """The received rows as a device view: (capacity, hidden) bf16 bits (uint16), or
        (capacity, hidden) e4m3 bytes (uint8)."""
        sh = self.shape
        return ArrayView(self.ptr("recv_x"), (max(sh.capacity, 1), sh.hidden), np.uint16 if sh.payload == "bf16"
                         else np.uint8)

    def problems(self, rec: dict) -> tuple[list, list]:
        """(timeouts as (rank, source, what), routing messages) of one record."""
        sh, r = self.shape, self.rank
        missing = [(r, s, "counts") for s in bits(rec["count_missing"])]
        missing += [(r, s, "rows") for s in bits(rec["row_missing"])]
        if (rec["count_timeouts"] or rec["row_timeouts"]) and not missing:
            missing.append((r, -1, "unknown"))
        msgs = []
        for kind, key in (("out_of_range", "out_of_range_key"), ("duplicate", "duplicate_key")):
            if rec[kind]:
                t, k = divmod(rec[key], sh.top_k)
                v = self.slot_value(rec[key])
                what = "an expert id out of range" if kind == "out_of_range" else "a duplicated expert"
                msgs.append(f"rank {r}: {rec[kind]} slot(s) with {what}, the first token {t} k {k}"
                            + (f" (expert {v}, {sh.n_experts} experts)" if v is not None else "")
                            + ": treated as masked")
        if rec["overflow"]:
            g = rec["overflow_expert"]
            msgs.append(f"rank {r}: {rec['overflow']} copies did not fit their destination (capacity "
                        f"{sh.capacity} rows), the first for expert {g} (rank {g // sh.n_local}): not sent, masked")
        if rec["dropped_here"]:
            msgs.append(f"rank {r}: {rec['dropped_here']} copies for its experts did not fit, the first for local "
                        f"expert {rec['dropped_expert']}")
        return missing, msgs


class Dispatch:
    """The dispatch of ``n_ranks`` ranks on one GPU in this process (``Combine``'s producer).

    Per rank (``ranks[r]``, a ``RankDispatch``): inputs x / scales / topk_idx, outputs
    recv_x, recv_scales, src_info, expert_offsets, range_table, expert_counts and topk_out
    (shapes in ``RankDispatch``). A step (``enqueue``) = one launch per kernel for every
    rank on the step's stream (``dispatch_all.AllRanks``: rank = the grid's y, the ranks'
    parameter blocks in the launch's own parameters): the tally when used, the count, the
    send, and the wait only where it zeroes padding rows (``all_parts``); the second and
    later launches with PDL. ``check`` afterwards raises what the device found. ``per_rank``:
    instead every rank's kernels on its own stream, forked from and joined into the step's
    stream (the step of a one-process-per-rank runner, as each rank launches it; an
    attribute: it may be switched between steps).
    ``stacked``: every rank's receive arrays and routing outputs are slices of one
    allocation per array (``slabs``), so they read as (R, ...) tensors (``stacked_views``);
    no guards then. ``fused``: the ranks' count kernels wait for each other inside one
    launch (their CTAs are all resident: checked); False: no launch waits for a CTA of
    itself (the count split in two launches, push then layout, every wait on an earlier
    launch), for schedulers that serialise kernels (compute-sanitizer).

    Args:
        n_ranks: ranks of the dispatch, all on this GPU.
        max_tokens: tokens per rank and step, at most.
        top_k: experts per token.
        hidden: the token width in elements.
        n_local_experts: experts per rank (n_ranks * n_local_experts in all).
        payload, capacity, align, expert_stride, zero_padding: as ``DispatchShape`` (the
            payload "bf16" or "fp8", the receive arrays' rows, the layout).
        device: the Device (default: ``driver.device()``).
        timeout_ms: the device waits' deadline in milliseconds (> 0, at most 1e7); a wait
            past it makes ``check`` raise DispatchTimeout.
        guard: pad every receive array with GUARD sentinel bytes each side (tests check
            them untouched); not with ``stacked``.
        inputs: allocate upload buffers for ``set_inputs``; False: the inputs are the
            caller's device arrays (``bind``).
        fused, stacked, per_rank: as above.

    Raises:
        ConfigError: every bad argument, named, before anything is allocated; with ``fused``
            (and not ``per_rank``), ranks whose count CTAs cannot all be resident at once
            (``AllRanks.check_resident``: it needs the loaded kernel), after the allocations,
            which are released before it is raised.
    """

    def __init__(self, n_ranks: int, *, max_tokens: int, top_k: int, hidden: int, n_local_experts: int,
                 payload: str = "bf16", capacity: int | None = None, align: int = 1, expert_stride: int = 0,
                 zero_padding: bool | None = None, device: driver.Device | None = None, timeout_ms: float = 2000.0,
                 guard: bool = False, inputs: bool = True, fused: bool = True, stacked: bool = False,
                 per_rank: bool = False):
        self.shape, self.timeout_ns = _arguments(
            "Dispatch", n_ranks, max_tokens=max_tokens, top_k=top_k, hidden=hidden, n_local_experts=n_local_experts,
            payload=payload, capacity=capacity, align=align, expert_stride=expert_stride, zero_padding=zero_padding,
            timeout_ms=timeout_ms, more=["guard: stacked outputs have no guards"] if stacked and guard else ())
        self.fused, self.per_rank = bool(fused), bool(per_rank)
        self.all, self._versions = None, None
        self._bufs, self.slabs, self.ranks = [], {}, []
        self.streams, self.origin, self.fork, self.done, self.pushed, self.sent = [], None, None, [], [], []
        try:
            self._build(device, guard, inputs, stacked)
        except BaseException as e:           # nothing made so far outlives the failure
            self._release(during=e)
            raise

    def _build(self, device, guard: bool, inputs: bool, stacked: bool) -> None:
        n_ranks = self.shape.n_ranks
        self.dev = device or driver.device()
        for r in range(n_ranks):
            def alloc(n, fill=None, name="", r=r):
                if stacked and name in STACKED:
                    slab = self.slabs.get(name)
                    if slab is None:             # one allocation of every rank's share: (R, ...) views
                        slab = driver.DeviceBuffer(n_ranks * n, fill=fill)
                        self._bufs.append(slab)
                        self.slabs[name] = slab
                    return SubBuffer(slab, r * n, n)
                b = driver.DeviceBuffer(n, fill=fill)
                self._bufs.append(b)
                return b
            self.ranks.append(RankDispatch(self.shape, r, device=self.dev, alloc=alloc, timeout_ns=self.timeout_ns,
                                           guard=GUARD if guard else 0, inputs=inputs))
        peers = [rd.peer_info() for rd in self.ranks]
        for rd in self.ranks:
            rd.connect(peers)
        for _ in range(n_ranks):             # appended one by one: a failure leaves the made ones listed
            self.streams.append(driver.Stream())
        self.origin = driver.Stream()
        self.fork = driver.Event(timing=False)
        for events in (self.done, self.pushed, self.sent):
            for _ in range(n_ranks):
                events.append(driver.Event(timing=False))
        self.all = AllRanks(self, load=kernel_all)         # (looked up here: the CPU tests replace it)
        if self.fused and not self.per_rank:
            self.all.check_resident()

    @property
    def n_ranks(self) -> int:
        return self.shape.n_ranks

    def set_inputs(self, r: int, *, x, topk_idx, scales=None) -> None:
        """Upload rank r's inputs from numpy into the buffers it owns (``inputs=True``).

        Args:
            r: the rank, 0..n_ranks-1.
            x: the tokens: bf16 bits uint16 (T, hidden), or e4m3 bytes uint8 (T, hidden).
            topk_idx: int32 or int64 (T, top_k) global expert ids, -1 masked, T <= max_tokens.
            scales: fp8 only: f32 (T, hidden/128); None for bf16.
        """
        self.ranks[r].set_inputs(x=x, topk_idx=topk_idx, scales=scales)

    def set_tally(self, on: bool | None = None, threads: int | None = None) -> None:
        """Every rank's ``RankDispatch.set_tally``: which token pass the steps make. The
        outputs are the same either way.

        Args:
            on: None (the default): the multi-CTA tally when a rank's tokens fill more than
                one count CTA's chunk; True / False: always / never.
            threads: the tally kernel's block and chunk of tokens (a power of two, 32 .. the
                count kernel's block); None: unchanged (default ``TALLY_THREADS``).

        Raises:
            ConfigError: a bad ``on`` or ``threads``.
        """
        for rd in self.ranks:
            rd.set_tally(on, threads)

    def bind(self, r: int, *, x, topk_idx, scales=None) -> None:
        """Attach rank r's inputs as device arrays the caller owns and refreshes in place
        (every later ``enqueue`` and graph replay reads them there).

        Args:
            r: the rank, 0..n_ranks-1.
            x: the tokens on this GPU, 16-byte aligned: bf16 (tokens, hidden) (bfloat16,
                uint16 or int16) for the bf16 payload, e4m3 (tokens, hidden)
                (float8_e4m3fn, uint8 or int8) for fp8.
            topk_idx: int32 or int64 (tokens, top_k) global expert ids, -1 masked,
                tokens <= max_tokens (the step's token count is its leading dimension).
            scales: fp8 only: float32 (tokens, hidden/128), 16-byte aligned; None for bf16.

        Raises:
            ConfigError: every wrong shape, dtype, device, size or alignment, listed.
        """
        self.ranks[r].bind(x=x, topk_idx=topk_idx, scales=scales)

    def enqueue(self, *, stream=None, rank_streams=None) -> None:
        """Enqueue one step on the rank streams, forked from and joined into ``stream``; no
        host wait (``check`` after the step has completed).

        Args:
            stream: the stream the step forks from and joins into (anything
                ``driver.as_stream`` takes; default ``origin``).
            rank_streams: one stream per rank, in rank order (e.g. a Combine's ``streams``;
                default the Dispatch's own ``streams``): where ``per_rank`` launches each
                rank's kernels; the all-ranks step (the default) launches on ``stream`` only.

        Raises:
            ConfigTypeError: a stream ``driver.as_stream`` does not take.
            ConfigError: ``rank_streams`` does not hold one stream per rank.
        """
        origin = self.origin if stream is None else driver.as_stream(stream)
        streams = self.streams if rank_streams is None else [driver.as_stream(s) for s in rank_streams]
        if len(streams) != len(self.ranks):
            raise ConfigError([f"rank_streams: expected {len(self.ranks)} streams (one per rank), got {len(streams)}"],
                              "dispatch step")
        if not self.per_rank:                # every rank in one launch per kernel, on the step's stream
            if self.fused:
                self.all.check_resident()
            versions = tuple(rd.version for rd in self.ranks)
            if versions != self._versions:   # a rank's parameters changed: rebuild the rows (host only)
                self.all.refresh()
                self._versions = versions
            self.all.launch(origin, self.all_parts())
            return
        self.fork.record(origin)
        for s in streams:
            s.wait(self.fork)
        if self.fused:
            # every count kernel first: each waits for all of them (one CTA each: all resident)
            for rd, s in zip(self.ranks, streams):
                rd.launch_count(s)
            for rd, s in zip(self.ranks, streams):
                rd.launch_send(s)
                rd.launch_wait(s)
        else:
            for rd, s, ev in zip(self.ranks, streams, self.pushed):
                rd.launch_count(s, FLAG_PUSH_ONLY)
                ev.record(s)
            for rd, s, ev in zip(self.ranks, streams, self.sent):
                for e in self.pushed:
                    s.wait(e)
                rd.launch_count(s, FLAG_LAYOUT_ONLY)
                rd.launch_send(s)
                ev.record(s)
            for rd, s in zip(self.ranks, streams):
                for e in self.sent:
                    s.wait(e)
                rd.launch_wait(s)
        for ev, s in zip(self.done, streams):
            origin.wait(ev.record(s))

    def all_parts(self) -> tuple:
        """The launches of the all-ranks step: the split one, or the fused one, whose wait
        launch is left out unless it zeroes padding rows, its send then without the signal
        (FLAG_NO_SIGNAL): every rank's send has finished, with its rows stored, before a
        launch after it on the same stream starts (stream order is the acquire), and a source
        that sent nothing is the one whose counts timed out or whose launch was rejected,
        which the records name already."""
        if not self.fused:
            return SPLIT
        return FUSED if self.shape.zero_padding else FUSED_NO_WAIT

    def capture(self) -> driver.Graph:
        """A CUDA graph of one step; replay with ``graph.launch(dispatch.origin)``."""
        with driver.Graph.capture(self.origin, self.streams if self.per_rank else ()) as cap:
            self.enqueue()
        return cap.graph

    def step(self) -> None:
        """Enqueue one step, wait for it, and ``check``."""
        self.enqueue()
        self.origin.synchronize()
        self.check()

    def check(self) -> None:
        """After a step has completed: read (and reset) every rank's record once, re-arm
        every rank's epoch if a wait timed out, and raise what the records hold, the cause
        first (``step_error``): DispatchError for a kernel that rejected its arguments
        (naming the rank and the record bits, then the waits that timed out for it),
        DispatchTimeout naming every (rank, source) that never arrived, DispatchError for
        routing errors."""
        records = {rd.rank: rd.record() for rd in self.ranks}
        missing, routing = [], []
        for rd in self.ranks:
            m, msgs = rd.problems(records[rd.rank])
            missing += m
            routing += msgs
        if missing:
            for rd in self.ranks:
                rd.rearm()
        err = step_error({r: rec["rejected"] for r, rec in records.items()}, missing, routing, self.timeout_ns,
                         records)
        if err is not None:
            raise err

    def handle(self, r: int) -> dict:
        """Rank r's ``RankDispatch.handle()``."""
        return self.ranks[r].handle()

    def recv_x(self, r: int) -> ArrayView:
        """Rank r's ``RankDispatch.recv_x_view()``."""
        return self.ranks[r].recv_x_view()

    def stacked_views(self) -> dict:
        """With ``stacked``: every rank's outputs as (R, ...) device views: recv_x (R, capacity,
        hidden) (uint16 bf16 bits or uint8 e4m3), recv_scales (R, capacity, hidden/128) f32 or
        None, src_info (R, capacity, 2), expert_offsets (R, n_local+1), range_table
        (R, 2*n_local*n_ranks), expert_counts (R, n_local) int32, topk_idx (R, max_tokens,
        top_k) int32 (rank r's first tokens[r] rows: its checked topk_idx)."""
        if not self.slabs:
            raise ConfigError(["stacked_views: this Dispatch was built without stacked=True"], "Dispatch")
        sh, R, cap = self.shape, self.n_ranks, max(self.shape.capacity, 1)
        x_dt = np.uint16 if sh.payload == "bf16" else np.uint8
        out = {"recv_x": ArrayView(self.slabs["recv_x"].ptr, (R, cap, sh.hidden), x_dt),
               "recv_scales": ArrayView(self.slabs["recv_scales"].ptr, (R, cap, sh.s_bytes // 4), np.float32)
               if sh.s_bytes else None,
               "src_info": ArrayView(self.slabs["src_info"].ptr, (R, cap, 2), np.int32),
               "expert_offsets": ArrayView(self.slabs["expert_offsets"].ptr, (R, sh.n_local + 1), np.int32),
               "range_table": ArrayView(self.slabs["range_table"].ptr, (R, 2 * sh.n_local * R), np.int32),
               "expert_counts": ArrayView(self.slabs["expert_counts"].ptr, (R, sh.n_local), np.int32),
               "topk_idx": ArrayView(self.slabs["topk_out"].ptr, (R, max(sh.max_tokens, 1), sh.top_k), np.int32)}
        return out

    def close(self) -> None:
        """Close the streams and events and free every device buffer this Dispatch allocated:
        every step is tried, the first failure raised after the last."""
        self._release()

    def _release(self, during: BaseException | None = None) -> None:
        owned = [s for s in self.streams + [self.origin] if s is not None]
        events = [ev for ev in self.done + self.pushed + self.sent + [self.fork] if ev is not None]
        steps = [s.close for s in owned] + [ev.close for ev in events] + [b.free for b in self._bufs]
        if self.all is not None:
            steps.insert(0, self.all.close)
            self.all = None
        self._bufs = []
        release(steps, during)


class DispatchRank:
    """This process's rank of the dispatch, one process per rank: its ``RankDispatch``,
    with every peer's shared arrays (rows, scales, src_info, count exchange, flags) mapped
    by legacy CUDA IPC (``cuMemAlloc`` memory). Construction is collective over
    ``exchange`` (anything with ``rank``, ``n_ranks``, ``allgather`` and ``barrier``, as
    ``ops.rank.Rank`` takes). Shapes as ``Dispatch``.

    ``sync``: None: on when any two ranks share a GPU (the same on every rank). Kernels of
    different processes time-slice one GPU, so with ``sync`` a ``step`` splits the count
    kernel and puts a host barrier before each launch that waits for another rank (as
    ``Rank.round`` does); across GPUs ``enqueue`` runs the fused step with no host wait.

    Args:
        rank: this process's rank, 0..n_ranks-1.
        n_ranks: ranks of the dispatch, one process each.
        exchange: the host exchange; it must say it is ``rank`` of ``n_ranks``.
        max_tokens, top_k, hidden, n_local_experts, payload, capacity, align, expert_stride,
            zero_padding, timeout_ms, guard, inputs: as ``Dispatch`` (the same on every rank:
            construction compares the shapes).
        device: the GPU ordinal (default: $P3SEND_DEVICE or 0).
        sync_timeout_s: the host barriers' deadline in seconds (> 0; ``barrier``).
        sync: as above.
    """

    def __init__(self, rank: int, n_ranks: int, exchange, *, max_tokens: int, top_k: int, hidden: int,
                 n_local_experts: int, payload: str = "bf16", capacity: int | None = None, align: int = 1,
                 expert_stride: int = 0, zero_padding: bool | None = None, device: int | None = None,
                 timeout_ms: float = 2000.0, sync_timeout_s: float = 60.0, guard: bool = False,
                 inputs: bool = True, sync: bool | None = None):
        self.shape, self.timeout_ns = _arguments(
            f"DispatchRank {rank}", n_ranks, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
            n_local_experts=n_local_experts, payload=payload, capacity=capacity, align=align,
            expert_stride=expert_stride, zero_padding=zero_padding, timeout_ms=timeout_ms,
            process=(rank, exchange, sync_timeout_s))
        self.rank, self.exchange, self.sync_timeout_s = int(rank), exchange, float(sync_timeout_s)
        self.dev, self.rd, self.stream = None, None, None
        self._bufs, self._mapped, self._closed = [], [], False
        try:
            self._connect(device, guard, inputs, sync)
        except BaseException as e:           # what was made is released; the peers find out at their next sync
            self._release(sync=False, during=e)
            raise

    def _connect(self, device, guard: bool, inputs: bool, sync) -> None:
        rank, n_ranks = self.rank, self.shape.n_ranks
        self.dev = driver.device(device)

        def alloc(n, fill=None, name=""):
            b = driver.DeviceBuffer(n, fill=fill)
            self._bufs.append(b)
            return b
        self.rd = RankDispatch(self.shape, rank, device=self.dev, alloc=alloc, timeout_ns=self.timeout_ns,
                               guard=GUARD if guard else 0, inputs=inputs, same_gpu=False)
        rd = self.rd
        shared = {"recv_x": (rd.recv_x_alloc, rd.guard), "recv_scales": (rd.recv_scales_alloc, rd.guard),
                  "src_info": (rd.src_info_alloc, rd.guard), "xcount": (rd.xcount, 0), "flags": (rd.flags, 0)}
        handles = {n: (None if b is None else driver.ipc_get_handle(b), off) for n, (b, off) in shared.items()}
        mine = {"rank": rank, "bus_id": driver.pci_bus_id(self.dev.ordinal), "shape": self.shape, "handles": handles}
        infos = self.exchange.allgather(mine)
        bad = [f"rank {i}: shape {info['shape']} differs from this rank's {self.shape}"
               for i, info in enumerate(infos) if info["shape"] != self.shape]
        if bad:
            raise ConfigError(bad, f"DispatchRank {rank} world")
        peers = []
        for p, info in enumerate(infos):
            if p == rank:
                peers.append(rd.peer_info())
                continue
            m = {}
            for n, (h, off) in info["handles"].items():
                if h is None:
                    m[n] = 0
                    continue
                self.dev.activate()
                ptr = driver.ipc_open_handle(h)
                self._mapped.append(ptr)
                m[n] = ptr + off
            peers.append(m)
        rd.connect(peers)
        self.sync = len({i["bus_id"] for i in infos}) < n_ranks if sync is None else bool(sync)
        self.stream = driver.Stream()
        self.barrier()

    def barrier(self) -> None:
        """Return once every rank has called it (the exchange's barrier, ``sync_timeout_s``).

        Raises:
            ExchangeTimeout: a rank did not arrive in time.
        """
        self.exchange.barrier(self.sync_timeout_s)

    def set_inputs(self, *, x, topk_idx, scales=None) -> int:
        """Upload this rank's inputs from numpy into the buffers it owns (``inputs=True``).

        Args:
            x: the tokens: bf16 bits (uint16) (tokens, hidden) for the bf16 payload, e4m3
                bytes (uint8) (tokens, hidden) for fp8; read as raw bytes, so they must
                come to tokens * row bytes.
            topk_idx: int32 or int64 (tokens, top_k) global expert ids, -1 masked,
                tokens <= max_tokens.
            scales: fp8 only: float32 (tokens, hidden/128); not read for bf16.

        Returns:
            The token count (topk_idx's leading dimension).

        Raises:
            ConfigError: the inputs are the caller's (``inputs=False``), or a shape, dtype
                or size is wrong.
        """
        return self.rd.set_inputs(x=x, topk_idx=topk_idx, scales=scales)

    def bind(self, *, x, topk_idx, scales=None) -> int:
        """Attach this rank's inputs as device arrays the caller owns and refreshes in place
        (every later launch reads them there).

        Args:
            x: the tokens on this rank's GPU, 16-byte aligned: bf16 (tokens, hidden)
                (bfloat16, uint16 or int16) for the bf16 payload, e4m3 (tokens, hidden)
                (float8_e4m3fn, uint8 or int8) for fp8.
            topk_idx: int32 or int64 (tokens, top_k) global expert ids, -1 masked,
                tokens <= max_tokens.
            scales: fp8 only: float32 (tokens, hidden/128), 16-byte aligned; None for bf16.

        Returns:
            The token count (topk_idx's leading dimension).

        Raises:
            ConfigError: every wrong shape, dtype, device, size or alignment, listed.
        """
        return self.rd.bind(x=x, topk_idx=topk_idx, scales=scales)

    def enqueue(self, stream=None) -> None:
        """The fused step on ``stream`` (default this rank's own), no host synchronisation:
        for ranks on different GPUs (every rank's step must be enqueued; ``check`` after)."""
        self.rd.launch(self.stream if stream is None else driver.as_stream(stream))

    def step(self, stream=None) -> None:
        """One step with the host barriers ranks sharing a GPU need (with ``sync``), waited
        for, then ``check``. Every rank must call it for the same step.

        Args:
            stream: the stream to launch on (anything ``driver.as_stream`` takes; default
                this rank's own).

        Raises:
            DispatchError, DispatchTimeout: as ``check``.
            ExchangeTimeout: a rank did not reach a barrier (with ``sync``) or ``check``'s
                allgather in time.
        """
        s = self.stream if stream is None else driver.as_stream(stream)
        if not self.sync:
            self.rd.launch(s)
        else:
            self.rd.launch_count(s, FLAG_PUSH_ONLY)
            s.synchronize()
            self.barrier()                 # every rank's counts are in
            self.rd.launch_count(s, FLAG_LAYOUT_ONLY)
            self.rd.launch_send(s)
            s.synchronize()
            self.barrier()                 # every rank's rows and flags are in
            self.rd.launch_wait(s)
        s.synchronize()
        self.check()

    def check(self) -> None:
        """After this rank's step has completed: read (and reset) this rank's record once,
        then an allgather of (did a wait time out, what did the device reject); if any
        rank's wait timed out, every rank re-arms its epoch, exchange and flags between two
        barriers. This rank then raises what it found, the cause first (``step_error``):
        DispatchError for a launch rejected here, or on a peer when this rank has a problem
        of its own (a peer that rejected its launch is why this rank timed out), then
        DispatchTimeout naming what it missed, then DispatchError for its routing errors."""
        rec = self.rd.record()
        missing, routing = self.rd.problems(rec)
        views = self.exchange.allgather((bool(missing), int(rec["rejected"])))
        if any(timed_out for timed_out, _ in views):
            self.barrier()                 # every rank's kernels of the step have finished
            self.rd.rearm()
            self.barrier()
        if not (missing or routing or rec["rejected"]):
            return
        err = step_error({p: mask for p, (_, mask) in enumerate(views)}, missing, routing, self.timeout_ns,
                         {self.rank: rec})
        if err is not None:
            raise err

    def close(self, sync: bool = True) -> None:
        """Unmap the peers' arrays, then (after a barrier with ``sync``) free this rank's own.
        Every step is tried even when one fails (a barrier that times out still frees this
        rank's buffers); the first failure is raised after the last step."""
        if not self._closed:
            self._release(sync)

    def _release(self, sync: bool, during: BaseException | None = None) -> None:
        self._closed = True
        steps = [] if self.dev is None else [self.dev.activate]
        if self.stream is not None:
            steps.append(self.stream.synchronize)      # nothing of this rank still reads a peer's memory
        steps += [lambda ptr=ptr: driver.ipc_close(ptr) for ptr in self._mapped]
        if sync:
            steps.append(self.barrier)     # every peer has unmapped this rank's arrays
        if self.stream is not None:
            steps.append(self.stream.close)
        steps += [b.free for b in self._bufs]
        self._mapped, self._bufs = [], []
        release(steps, during)

    def __enter__(self) -> DispatchRank:
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._closed:
            self._release(sync=exc_type is None, during=exc)
        return False
