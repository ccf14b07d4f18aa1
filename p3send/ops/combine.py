"""The EP combine round for R ranks on one GPU (every rank's buffers are local
allocations and all ranks run in this process).

A round = every rank's ``p3_scatter_send`` (with the fused arrival signal) into the
peers' receive buffers, then every rank's ``p3_recv_reduce`` (bounded wait, top-k
reduce, re-arm). On one GPU each receive is ordered after all sends by events: a
spinning receiver could otherwise hold the SMs the senders need (docs/PROTOCOL.md,
"Scheduling on one GPU"). Rounds are replay-safe: nothing is reset from the host
between rounds or graph replays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..abi.config import P3PeerSendConfig, rank_config, shape_problems
from ..abi.errors import ArrivalTimeout, ConfigError
from ..abi.layout import NOT_ARRIVED, SENTINEL, recv_buf_bytes, recv_counts_len
from ..abi.wire import WIRE_BF16, WIRE_NAMES, wire_format, wire_msg_bytes
from ..cuda import driver
from .args import aligned, array_arg, warn_deprecated
from .recv import RecvReduce
from .send import ScatterSend

#: Bytes of sentinel-filled guard before and after each receive buffer when asked for.
GUARD = 4096


# ---------------------------------------------------------------- one rank's pieces
# Shared by Combine (every rank in this process) and rank.Rank (one rank per process).

def device_ptr_or_none(obj, what: str) -> int | None:
    return None if obj is None else driver.device_ptr(obj, what)


@dataclass
class RankBuffers:
    """One rank's device buffers: the receive buffer (``guard`` sentinel bytes each side)
    and counts that peers write, and the rank's own inputs and output (None when the
    caller binds its own tensors). Shapes and fills as ``Combine``'s docstring."""
    recv: object
    counts: object
    c: object
    expert_offsets: object
    range_table: object
    src_info: object
    row_base: object
    topk_idx: object
    weights: object
    out: object


def rank_buffers(alloc, *, n_ranks: int, n_local: int, max_tokens: int, top_k: int, msg: int, max_rows: int,
                 guard: int, row_cache: bool, inputs: bool = True, row: int | None = None) -> RankBuffers:
    """Allocate one rank's buffers with ``alloc(nbytes, fill=None)`` (the one place their
    sizes and initial contents are decided, for ``Combine`` and ``Rank`` alike). ``msg``: the
    slot size; ``row``: the bytes of a bf16 row of C and of the output (2*hidden; default
    ``msg``, the bf16 wire's)."""
    n_slots, rows, pairs = recv_counts_len(n_local, n_ranks), max(max_rows, 1), max(max_tokens * top_k, 1)
    row = msg if row is None else row
    mine = alloc if inputs else (lambda n, fill=None: None)
    return RankBuffers(recv=alloc(recv_buf_bytes(max_tokens, top_k, msg) + 2 * guard, SENTINEL),
                       counts=alloc(8 * n_slots, 0xFF), c=mine(rows * row),
                       expert_offsets=mine(4 * (n_local + 1), 0), range_table=mine(8 * n_slots, 0),
                       src_info=mine(8 * rows, 0xFF),
                       row_base=alloc(8 * rows, 0) if row_cache else None, topk_idx=mine(4 * pairs, 0xFF),
                       weights=mine(4 * pairs, 0), out=mine(max(max_tokens, 1) * row, 0))


def wire_setup(what: str, wire, hidden) -> tuple[int, int | None, list[str]]:
    """(format code, msg_bytes or None, problems) of a combine's ``wire`` and ``hidden``: the
    one place ``Combine``, ``Rank`` and the torch paths turn them into a slot size."""
    try:
        fmt = wire_format(wire, what=what)
    except ConfigError as e:
        return WIRE_BF16, None, list(e.problems)
    try:
        return fmt, wire_msg_bytes(hidden, fmt, what=what), []
    except ConfigError as e:
        return fmt, None, list(e.problems)


def send_wire_options(fmt: int, hidden: int) -> dict:
    """The keywords that make ``ScatterSend.prepare`` send rows on wire ``fmt`` (none on bf16)."""
    return {} if fmt == WIRE_BF16 else {"wire": WIRE_NAMES[fmt], "hidden": hidden}


def own_inputs(what: str, bufs) -> None:
    """Refuse an upload into inputs the caller owns (bound with ``bind``, or never
    allocated with ``inputs=False``): the caller writes into those in place."""
    if not all(isinstance(b, driver.DeviceBuffer) for b in bufs):
        raise ConfigError([f"{what}: the inputs are the caller's arrays (bind(), or inputs=False); write into "
                           "them in place instead of uploading"])


def rank_inputs(what: str, *, c, expert_offsets, range_table, src_info, topk_idx, weights, hidden: int,
                top_k: int, n_local: int, n_ranks: int, max_rows: int, max_tokens: int) -> dict:
    """Check one rank's inputs (numpy) and return them ready to upload: {'c': uint16 (rows,
    hidden), 'expert_offsets': int32 (n_local+1,), 'range_table': int32 (n_local*n_ranks*2,), 'src_info': int32
    (rows, 2), 'topk_idx': int32 (tokens, top_k), 'weights': f32 (tokens, top_k)}.
    Raises ConfigError titled ``what`` listing every problem."""
    c = np.ascontiguousarray(c).view(np.uint16)
    rows = c.shape[0]
    off = np.asarray(expert_offsets, dtype=np.int32)
    tk = np.asarray(topk_idx, dtype=np.int32)
    problems = []
    if c.ndim != 2 or c.shape[1] != hidden:
        problems.append(f"c: expected (rows, {hidden}) bf16, got shape {c.shape}")
    if rows > max_rows:
        problems.append(f"c: {rows} rows exceed max_rows {max_rows}")
    if off.shape != (n_local + 1,) or off[0] != 0 or (np.diff(off) < 0).any() or off[-1] != rows:
        problems.append(f"expert_offsets: expected {n_local + 1} non-decreasing values from 0 to "
                        f"rows ({rows}), got {off.tolist()[:12]}")
    if np.asarray(range_table).size != 2 * n_local * n_ranks:
        problems.append(f"range_table: expected {2 * n_local * n_ranks} int32, got {np.asarray(range_table).size}")
    if np.asarray(src_info).shape != (rows, 2):
        problems.append(f"src_info: expected ({rows}, 2) int32, got {np.asarray(src_info).shape}")
    if tk.ndim != 2 or tk.shape[1] != top_k or tk.shape[0] > max_tokens:
        problems.append(f"topk_idx: expected (tokens <= {max_tokens}, {top_k}), got {tk.shape}")
    if np.asarray(weights).shape != tk.shape:
        problems.append(f"weights: expected shape {tk.shape}, got {np.asarray(weights).shape}")
    if problems:
        raise ConfigError(problems, what)
    return {"c": c, "expert_offsets": off, "range_table": np.asarray(range_table, dtype=np.int32),
            "src_info": np.asarray(src_info, dtype=np.int32), "topk_idx": tk,
            "weights": np.asarray(weights, dtype=np.float32)}


def bound_inputs(what: str, ordinal: int, *, c, expert_offsets, range_table, src_info, topk_idx, weights,
                 out, hidden: int, top_k: int, n_local: int, n_ranks: int, max_tokens: int) -> int:
    """Check one rank's inputs given as device arrays (torch tensors, CAI objects,
    DeviceBuffers) that the caller owns and refreshes in place; return the token count
    (``topk_idx``'s leading dimension: the launch uses it, not device values).
    c: bf16 (rows, hidden); expert_offsets int32 (n_local+1,); range_table int32
    (n_local*n_ranks*2,); src_info int32 (>= rows, 2); topk_idx int32 (tokens, top_k);
    weights f32 (tokens, top_k); out bf16 (tokens, hidden). Raises ConfigError titled
    ``what`` listing every problem (dtype, device, size), before anything is launched."""
    problems = []
    shape = tuple(getattr(topk_idx, "shape", ())) or tuple(topk_idx.__cuda_array_interface__["shape"])
    tokens = int(shape[0]) if len(shape) == 2 else -1
    if len(shape) != 2 or shape[1] != top_k or not (0 <= tokens <= max_tokens):
        problems.append(f"topk_idx: expected (tokens <= {max_tokens}, {top_k}) int32, got shape {shape}")
    tokens = max(tokens, 0)
    _, c_bytes = array_arg(c, "c", problems, dtypes=("bfloat16", "uint16", "int16"), ordinal=ordinal)
    cshape = tuple(getattr(c, "shape", ()))
    rows = int(cshape[0]) if cshape else ((c_bytes or 0) // (2 * hidden) if hidden > 0 else 0)
    if cshape and (len(cshape) != 2 or cshape[1] != hidden):
        problems.append(f"c: expected (rows, {hidden}) bf16, got shape {cshape}")
    for name, obj, dtypes, nbytes in (
            ("expert_offsets", expert_offsets, ("int32",), 4 * (n_local + 1)),
            ("range_table", range_table, ("int32",), 8 * n_local * n_ranks),
            ("src_info", src_info, ("int32",), 8 * rows),
            ("topk_idx", topk_idx, ("int32",), 4 * tokens * top_k),
            ("weights", weights, ("float32",), 4 * tokens * top_k),
            ("out", out, ("bfloat16", "uint16", "int16"), 2 * tokens * hidden)):
        array_arg(obj, name, problems, dtypes=dtypes, nbytes_min=nbytes, ordinal=ordinal)
    if problems:
        raise ConfigError(problems, what)
    return tokens


def arrival_status(rank: int, receiver: RecvReduce, counts: driver.DeviceBuffer, n_ranks: int):
    """After rank's receive: ([], None) when every wait was satisfied, else (the missing
    (rank, local_expert, source_rank) triples read from the counts still all-ones, the
    kernel's record). Raises ConfigError if the kernel rejected its configuration.
    counts: the rank's receive counts, u64 [n_local*n_ranks]."""
    rec = receiver.record()
    if rec["rejected"]:
        raise ConfigError([f"rank {rank}: the receive kernel rejected its configuration"], "receive")
    if not rec["timeouts"]:
        return [], None
    cnt = counts.download(np.uint64)
    return [(rank, int(s) // n_ranks, int(s) % n_ranks) for s in np.nonzero(cnt == NOT_ARRIVED)[0]], rec


class Combine:
    """Owns, for each of ``n_ranks`` ranks: its receive buffer and counts, C and the
    routing inputs (range table, src_info, expert offsets), topk_idx/weights/out,
    stamps, and the send/receive launchers; builds each rank's P3PeerSendConfig.

    Shapes: C of rank r is bf16 (rows_r, hidden) with rows_r <= max_rows; topk_idx int32
    and weights f32 (tokens, top_k); out bf16 (tokens, hidden).
    """

    def __init__(self, n_ranks: int, *, max_tokens: int, top_k: int, hidden: int, n_local_experts: int,
                 max_rows: int | None = None, device: driver.Device | None = None, timeout_ms: float = 2000.0,
                 guard: bool = False, stamps: bool = True, num_sms: int | None = None, row_cache: bool = False,
                 inputs: bool = True, wire="bf16"):
        """Allocate every rank's buffers and launchers on ``device``.

        Args:
            n_ranks: ranks of the combine, all on this GPU.
            max_tokens: tokens per rank and round, at most.
            top_k: experts per token.
            hidden: the row width in bf16 elements (C and the output; msg_bytes =
                ``abi.wire.wire_msg_bytes(hidden, wire)``).
            n_local_experts: experts per rank.
            max_rows: rows of each rank's C, at most (default max_tokens * top_k * n_ranks).
            device: the Device (default: ``driver.device()``).
            timeout_ms: the receive waits' deadline in milliseconds; a wait past it raises
                ArrivalTimeout.
            guard: pad every receive buffer with GUARD sentinel bytes each side (tests
                check them untouched).
            stamps: allocate the send and receive stamp buffers (per-CTA timestamps).
            num_sms: SMs per rank's send (default: 2 x the GPU's SMs / n_ranks, at most all).
            row_cache: give each rank's send a row cache (``cfg.row_base_ptr``, one u64 per
                row of C) and send with it.
            inputs: allocate C, the routing inputs, topk_idx/weights and out here (uploaded by
                ``set_inputs``); False: the caller owns them and attaches them with ``bind``.
            wire: the row format on the wire, ``"bf16"`` or ``"fp8"`` (``p3send.abi.wire``: the
                senders quantise C's rows, the receives dequantise).

        Raises:
            ConfigError: every bad size, timeout or format, named.
            P3SendError: ``wire="fp8"`` with a send launcher that cannot quantise.
        """
        problems = shape_problems(n_ranks, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                                  n_local_experts=n_local_experts, timeout_ms=timeout_ms)
        fmt, msg, wire_bad = wire_setup("Combine", wire, hidden)
        problems += [p for p in wire_bad if p.split(":")[0] not in {q.split(":")[0] for q in problems}]
        if problems:
            raise ConfigError(problems, "Combine")
        self.dev = device or driver.device()
        self.n_ranks, self.max_tokens, self.top_k, self.hidden = n_ranks, max_tokens, top_k, hidden
        self.n_local, self.msg, self.wire = n_local_experts, msg, fmt
        self.max_rows = max_rows if max_rows is not None else max_tokens * top_k * n_ranks
        self.timeout_ns = int(timeout_ms * 1e6)
        self.guard = GUARD if guard else 0
        self.row_cache = row_cache
        self.recv_bytes = recv_buf_bytes(max_tokens, top_k, self.msg)
        R = range(n_ranks)
        self._bufs = []

        def alloc(n, fill=None):
            return self._keep(driver.DeviceBuffer(n, fill=fill))
        bufs = [rank_buffers(alloc, n_ranks=n_ranks, n_local=n_local_experts, max_tokens=max_tokens, top_k=top_k,
                             msg=self.msg, max_rows=self.max_rows, guard=self.guard, row_cache=row_cache,
                             inputs=inputs, row=2 * hidden) for _ in R]
        self.recv_alloc = [b.recv for b in bufs]
        self.counts = [b.counts for b in bufs]
        self.c = [b.c for b in bufs]
        self.expert_offsets = [b.expert_offsets for b in bufs]
        self.range_table = [b.range_table for b in bufs]
        self.src_info = [b.src_info for b in bufs]
        self.row_base = [b.row_base for b in bufs]
        self.topk_idx = [b.topk_idx for b in bufs]
        self.weights = [b.weights for b in bufs]
        self.out = [b.out for b in bufs]
        # On one GPU the ranks share it: by default each rank's send gets 2/n_ranks of the
        # SMs, so the sends of a round run at once instead of one after another, and the
        # CTAs of ranks with fewer rows leave their SMs to the others' (2x oversubscribed;
        # docs/PERF.md compares the shares).
        share = num_sms or max(1, min(self.dev.sm_count, 2 * self.dev.sm_count // n_ranks))
        self.senders = [ScatterSend(n_local_experts, device=self.dev, num_sms=share) for _ in R]
        self.send_wire = send_wire_options(fmt, hidden)
        self.receivers = [RecvReduce(device=self.dev, max_ctas=max(1, 4 * self.dev.sm_count // n_ranks), wire=fmt)
                          for _ in R]
        self.send_stamps = [alloc(16 * self.senders[r].grid, 0) if stamps else None for r in R]
        self.recv_stamps = [alloc(32 * self.receivers[r].max_ctas, 0) if stamps else None for r in R]
        self.streams = [driver.Stream() for _ in R]
        self.origin = driver.Stream()
        self.sent = [driver.Event(timing=False) for _ in R]
        self.done = [driver.Event(timing=False) for _ in R]
        self.fork = driver.Event(timing=False)
        self.stamps_on = stamps
        self.tokens = [0] * n_ranks
        self.cfgs = [self._config(r) if inputs else None for r in R]

    def _keep(self, buf):
        self._bufs.append(buf)
        return buf

    def recv_ptr(self, r: int) -> int:
        """The device address of rank ``r``'s receive buffer (past its guard bytes).

        Args:
            r: the rank.
        """
        return self.recv_alloc[r].ptr + self.guard

    def _config(self, r: int) -> P3PeerSendConfig:
        return rank_config(my_rank=r, n_ranks=self.n_ranks, recv_bufs=[self.recv_ptr(p) for p in range(self.n_ranks)],
                           top_k=self.top_k, msg_bytes=self.msg, max_tokens=self.max_tokens,
                           range_table=driver.device_ptr(self.range_table[r], "range_table"),
                           src_info=driver.device_ptr(self.src_info[r], "src_info"),
                           row_base=device_ptr_or_none(self.row_base[r], "row_base"),
                           send_stamps=device_ptr_or_none(self.send_stamps[r], "send_stamps"))

    # ------------------------------------------------------------ inputs
    def set_inputs(self, r: int, *, c, expert_offsets, range_table, src_info, topk_idx, weights) -> None:
        """Upload rank ``r``'s inputs from host arrays into the buffers this Combine owns.

        Args:
            r: the rank, 0..n_ranks-1.
            c: bf16 bits, uint16 (rows, hidden) (or any 2-byte dtype viewed as such): the
                expert-grouped rows this rank sends.
            expert_offsets: int32 (n_local+1,), non-decreasing from 0 to rows.
            range_table: int32 (n_local*n_ranks*2,) (``encode_range_table``).
            src_info: int32 (rows, 2): (token, top-k slot) of each row at its owner.
            topk_idx: int32 (tokens, top_k): global expert ids of this rank's tokens (-1 masked).
            weights: float32 (tokens, top_k): their router weights.

        Raises:
            ConfigError: a shape, size or value is wrong (every problem listed), or the
                inputs are the caller's (``bind``, ``inputs=False``).
        """
        self._check_rank(r)
        a = rank_inputs(f"rank {r} inputs", c=c, expert_offsets=expert_offsets, range_table=range_table,
                        src_info=src_info, topk_idx=topk_idx, weights=weights, hidden=self.hidden,
                        top_k=self.top_k, n_local=self.n_local, n_ranks=self.n_ranks, max_rows=self.max_rows,
                        max_tokens=self.max_tokens)
        own_inputs(f"Combine.set_inputs({r})", (self.c[r], self.expert_offsets[r], self.range_table[r],
                                                self.src_info[r], self.topk_idx[r], self.weights[r]))
        self.c[r].upload(a["c"])
        self.expert_offsets[r].upload(a["expert_offsets"])
        self.range_table[r].upload(a["range_table"])
        self.src_info[r].upload(a["src_info"])
        self.topk_idx[r].upload(a["topk_idx"])
        self.weights[r].upload(a["weights"])
        self.tokens[r] = a["topk_idx"].shape[0]
        self._prepare(r)

    def load(self, world) -> None:
        """Upload every rank's inputs from a ``p3send.oracle.cases.World`` (``set_inputs`` per rank).

        Raises:
            ConfigError: the world's shape differs from this Combine's, or as ``set_inputs``.
        """
        if getattr(world, "n_ranks", None) != self.n_ranks:
            raise ConfigError([f"world: expected {self.n_ranks} ranks, got {getattr(world, 'n_ranks', world)!r}"],
                              "Combine.load")
        for r, d in enumerate(world.ranks):
            self.set_inputs(r, c=d.c, expert_offsets=d.expert_offsets, range_table=d.range_table,
                            src_info=d.src_info, topk_idx=d.topk_idx, weights=d.weights)

    def set_rank(self, r: int, **inputs) -> None:
        """Deprecated alias of ``set_inputs`` (removed in 0.3)."""
        warn_deprecated("Combine.set_rank", "Combine.set_inputs")
        self.set_inputs(r, **inputs)

    def load_world(self, world) -> None:
        """Deprecated alias of ``load`` (removed in 0.3)."""
        warn_deprecated("Combine.load_world", "Combine.load")
        self.load(world)

    @property
    def offs(self) -> list:
        """Deprecated alias of ``expert_offsets`` (removed in 0.3)."""
        warn_deprecated("Combine.offs", "Combine.expert_offsets")
        return self.expert_offsets

    @property
    def rtab(self) -> list:
        """Deprecated alias of ``range_table`` (removed in 0.3)."""
        warn_deprecated("Combine.rtab", "Combine.range_table")
        return self.range_table

    def _check_rank(self, r) -> None:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < self.n_ranks:
            raise ConfigError([f"r: expected a rank 0..{self.n_ranks - 1}, got {r!r}"], "Combine")

    def refill_c(self, r: int, c) -> None:
        """Replace rank r's C values in place (same routing), e.g. between graph replays.
        c: bf16 bits, uint16 (rows, hidden)."""
        self._check_rank(r)
        own_inputs(f"Combine.refill_c({r})", (self.c[r],))
        self.c[r].upload(np.ascontiguousarray(c).view(np.uint16))

    def bind(self, r: int, *, c, expert_offsets, range_table, src_info, topk_idx, weights, out) -> None:
        """Attach rank ``r``'s inputs and output as device arrays the caller owns (torch
        tensors, ``__cuda_array_interface__`` objects, DeviceBuffers), checked for dtype,
        device and size before any launch. Rounds and captured graphs then read them in
        place: refresh their contents between rounds or replays; bind again only when an
        array moves (``set_output`` when only the output does).

        Args:
            r: the rank.
            c: bf16 (rows, hidden); expert_offsets: int32 (n_local+1,); range_table: int32
                (n_local*n_ranks*2,); src_info: int32 (>= rows, 2); topk_idx: int32 (tokens,
                top_k), whose leading dimension is the token count from now on; weights:
                float32 (tokens, top_k); out: bf16 (tokens, hidden).

        Raises:
            ConfigError: every wrong dtype, device or size, listed.
        """
        self._check_rank(r)
        self.tokens[r] = bound_inputs(f"rank {r} inputs", self.dev.ordinal, c=c, expert_offsets=expert_offsets,
                                      range_table=range_table, src_info=src_info, topk_idx=topk_idx,
                                      weights=weights, out=out, hidden=self.hidden, top_k=self.top_k,
                                      n_local=self.n_local, n_ranks=self.n_ranks, max_tokens=self.max_tokens)
        self.c[r], self.expert_offsets[r], self.range_table[r] = c, expert_offsets, range_table
        self.src_info[r], self.topk_idx[r], self.weights[r], self.out[r] = src_info, topk_idx, weights, out
        self.cfgs[r] = self._config(r)
        self._prepare(r)

    def set_output(self, r: int, out) -> None:
        """Point rank ``r``'s reduce at a new output array, nothing else changed (one
        parameter of the prepared receive; e.g. a fresh torch tensor every step).

        Args:
            r: the rank.
            out: bf16 (tokens, hidden) on this GPU, tokens as last bound.

        Raises:
            ConfigError: ``out`` is too small, of another dtype or on another device.
        """
        self._check_rank(r)
        problems = []
        addr, _ = array_arg(out, "out", problems, dtypes=("bfloat16", "uint16", "int16"),
                            nbytes_min=2 * self.tokens[r] * self.hidden, ordinal=self.dev.ordinal)
        aligned("out", addr, 16, problems)
        if problems:
            raise ConfigError(problems, f"rank {r} output")
        self.out[r] = out
        self.receivers[r].block.set(out_ptr=addr)

    def _prepare(self, r: int) -> None:
        self.senders[r].prepare(self.cfgs[r], self.c[r], self.expert_offsets[r], 2 * self.hidden,
                                count_ptrs=[self.counts[p] for p in range(self.n_ranks)],
                                row_cache=self.row_cache, rows_in_c=self.max_rows, same_gpu=True, **self.send_wire)
        self.receivers[r].prepare(self.cfgs[r], self.recv_ptr(r), self.counts[r], self.topk_idx[r], self.weights[r],
                                  self.out[r], n_tokens=self.tokens[r], n_experts=self.n_local,
                                  timeout_ns=self.timeout_ns, stamps=self.recv_stamps[r], hidden=self.hidden)

    # ------------------------------------------------------------ the round
    def enqueue(self, skip_send=(), send=True, receive=True, *, stream=None, gate=None) -> None:
        """Enqueue one round (or only its sends / only its receives) on the rank
        streams, forked from and joined into ``stream``; no host wait.

        Args:
            skip_send: ranks whose send is left out (tests a dead rank).
            send, receive: enqueue that half.
            stream: anything ``driver.as_stream`` takes (a torch or cupy stream, a
                handle); default ``origin``.
            gate: while ``stream`` is being captured, a device u32 array [n_ranks]: rank r's
                send runs at a replay only if gate[r] != 0 then (``p3send.cuda.gate``).
        """
        origin = self.origin if stream is None else driver.as_stream(stream)
        if gate is not None:
            from ..cuda.gate import gated
        self.fork.record(origin)
        for r in range(self.n_ranks):
            s = self.streams[r]
            s.wait(self.fork)
            if not send:
                continue
            if self.row_base[r] is not None:
                self.row_base[r].fill(0, s)
            if self.stamps_on:  # stamps describe the latest round only
                self.send_stamps[r].fill(0, s)
                self.recv_stamps[r].fill(0, s)
            if r in skip_send:
                pass
            elif gate is not None:
                with gated(s, gate, r, self.dev) as body:
                    self.senders[r].launch(body)
            else:
                self.senders[r].launch(s)
            self.sent[r].record(s)
        for r in range(self.n_ranks if receive else 0):
            s = self.streams[r]
            if send:
                for p in range(self.n_ranks):
                    if p != r:
                        s.wait(self.sent[p])
            self.receivers[r].launch(s)
        for r in range(self.n_ranks):
            origin.wait(self.done[r].record(self.streams[r]))

    def round(self, skip_send=(), send=True, receive=True, *, stream=None) -> None:
        """Run one round, wait for it and check it.

        Args:
            skip_send: ranks whose send is left out (tests a dead rank).
            send, receive: run one half (to inspect the counts in between).
            stream: run it in that stream's order (as ``enqueue``); it is then synchronized.

        Raises:
            ArrivalTimeout: naming every missing (rank, expert, source rank) pair; the
                counts are re-armed first, so the next round starts clean.
        """
        self.enqueue(skip_send, send, receive, stream=stream)
        (self.origin if stream is None else driver.as_stream(stream)).synchronize()
        if receive:
            self.check()

    def counts_view(self, r: int) -> np.ndarray:
        """Rank r's receive counts, uint64 [n_local*n_ranks] (all-ones = not arrived)."""
        return self.counts[r].download(np.uint64)

    def check(self) -> None:
        """After a round has completed (its stream synchronized): raise ArrivalTimeout
        naming every missing pair if any wait timed out, re-arming the counts first."""
        missing, record = [], None
        for r in range(self.n_ranks):
            m, rec = arrival_status(r, self.receivers[r], self.counts[r], self.n_ranks)
            missing += m
            record = record or rec
        if missing or record:
            for r in range(self.n_ranks):
                self.counts[r].fill(0xFF)
            raise ArrivalTimeout(missing, record, self.timeout_ns)

    def capture(self, send=True, receive=True, *, gate=None) -> driver.Graph:
        """A CUDA graph of one round; replay with ``graph.launch(combine.origin)`` or on any stream.

        Args:
            send, receive: capture that half (as ``enqueue``).
            gate: as ``enqueue``.
        """
        with driver.Graph.capture(self.origin, self.streams) as cap:
            self.enqueue(send=send, receive=receive, gate=gate)
        return cap.graph

    # ------------------------------------------------------------ results
    def output(self, r: int) -> np.ndarray:
        """Rank r's reduced output, bf16 bits uint16 (tokens, hidden)."""
        return self.out[r].download(np.uint16, shape=(self.tokens[r], self.hidden))

    def recv_view(self, r: int, with_guard: bool = False) -> np.ndarray:
        """Rank r's receive buffer: flat uint8 of the unreduced (max_tokens, top_k, msg_bytes) slots.

        Args:
            r: the rank.
            with_guard: include the sentinel guard bytes on each side.
        """
        raw = self.recv_alloc[r].download()
        return raw if with_guard else raw[self.guard:self.guard + self.recv_bytes]

    def timeline(self) -> dict:
        """Stamps of the last round: per rank, send (first, last) per CTA and receive
        (start, last wait done, end, tokens) per CTA, in %globaltimer ns."""
        out = {}
        for r in range(self.n_ranks):
            if self.send_stamps[r] is None:
                continue
            s = self.send_stamps[r].download(np.uint64).reshape(-1, 2)
            v = self.recv_stamps[r].download(np.uint64).reshape(-1, 4)[: self.receivers[r].grid]
            out[r] = {"send": s.tolist(), "recv": v.tolist()}
        return out

    def close(self) -> None:
        """Free every buffer, stream, event and launcher this Combine owns."""
        for s in self.senders:
            s.close()
        for rv in self.receivers:
            rv.close()
        for b in self._bufs:
            b.free()
        for s in self.streams + [self.origin]:
            s.close()
        for ev in self.sent + self.done + [self.fork]:
            ev.close()
        self._bufs = []
