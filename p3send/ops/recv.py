"""Launcher of ``p3_recv_reduce`` / ``p3_recv_reduce_fp8`` (the bf16 and FP8 wires,
``p3send.abi.wire``): the bounded wait for every (expert, source) count, the top-k
weighted reduce (the FP8 rows dequantised), and the re-arm of the counts."""
from __future__ import annotations

import numpy as np

from ..abi.config import P3PeerSendConfig, msg_bytes_problem, n_ranks_problem, top_k_problem
from ..abi.errors import ConfigError
from ..abi.wire import RECV_ENTRY, WIRE_BF16, WIRE_NAMES, as_columns, wire_format, wire_problems
from ..cuda import driver
from ..cuda.loader import ParamBlock, kernel
from .args import aligned, array_arg


class RecvReduce:
    """Launcher for ``p3_recv_reduce`` for one receiving rank: owns its state and record.

    ``device``: the Device to launch on (default: ``driver.device()``); ``max_ctas`` caps the
    grid (default 4 CTAs per SM: a rank with the GPU to itself); ``wire``: the row format,
    ``"bf16"`` (``p3_recv_reduce``) or ``"fp8"`` (``p3_recv_reduce_fp8``).

    Raises:
        ConfigError: ``wire`` is not a format.
    """

    THREADS = 256

    def __init__(self, *, device: driver.Device | None = None, max_ctas: int | None = None, wire="bf16"):
        self.wire = wire_format(wire, what="RecvReduce")
        self.dev = device or driver.device()
        self.k = kernel(RECV_ENTRY[self.wire], self.dev)
        self.state = driver.DeviceBuffer(32, fill=0)
        self.diag = driver.DeviceBuffer(32, fill=0)
        self.max_ctas = max_ctas or 4 * self.dev.sm_count   # 4 CTAs of 256 threads fit an SM
        self.block = self.k.params_block()
        self.grid = 1

    def prepare(self, cfg: P3PeerSendConfig, recv, counts, topk_idx, weights, out, *, n_tokens: int,
                n_experts: int, timeout_ns: int, stamps=None, hidden: int | None = None,
                wire=None) -> ParamBlock:
        """Validate every argument and fill the parameter block (no launch).

        Args:
            cfg: this rank's config (n_ranks, top_k, msg_bytes, max_tokens_per_rank are read).
            recv: this rank's receive buffer, u8 (max_tokens_per_rank, top_k, msg_bytes), 16-aligned.
            counts: its receive counts, u64 [n_experts*n_ranks], all-ones before the first round.
            topk_idx: int32 (n_tokens, top_k) global expert ids (-1 or out of range: masked).
            weights: float32 (n_tokens, top_k) router weights (read when ``out`` is given).
            out: bf16 (n_tokens, hidden), 16-aligned, or None: unreduced mode.
            n_tokens: tokens of this rank, <= max_tokens_per_rank.
            n_experts: local experts per rank.
            timeout_ns: how long a wait may take, from its CTA's start (0: poll once).
            stamps: u64 [4*CTAs] zeroed before each launch, or None.
            hidden: the row's columns; ``cfg.msg_bytes`` must be the launcher's format's slot
                size for it (``abi.wire.wire_problems``). Required on the FP8 wire; None on
                bf16: msg_bytes/2.
            wire: the format the caller means, checked against the launcher's (None: the
                launcher's).

        Returns:
            The filled ParamBlock.

        Raises:
            ConfigError: every bad argument, listed, before anything is launched.
        """
        problems = [p for p in (n_ranks_problem(cfg.n_ranks), top_k_problem(cfg.top_k),
                                msg_bytes_problem(cfg.msg_bytes)) if p]
        if wire is not None and wire_format(wire, what="receive launch") != self.wire:
            problems.append(f"wire: this launcher reduces the {WIRE_NAMES[self.wire]} wire (RecvReduce(wire=...)), "
                            f"got {wire!r}")
        if hidden is None and self.wire == WIRE_BF16:
            hidden = max(cfg.msg_bytes, 0) // 2
        if hidden is None:
            problems.append("hidden: expected the row's columns on the fp8 wire (msg_bytes alone cannot name the "
                            "format), got None")
            hidden = 0
        else:
            problems += wire_problems(cfg.msg_bytes, hidden, self.wire)
            hidden = as_columns(hidden)
            if hidden is None or hidden < 0:
                hidden = 0          # reported above; the size checks below go on without it
        if not (0 <= n_tokens <= cfg.max_tokens_per_rank):
            problems.append(f"n_tokens: expected 0..max_tokens_per_rank ({cfg.max_tokens_per_rank}), got {n_tokens}")
        if n_experts < 1:
            problems.append(f"n_experts: expected >= 1, got {n_experts}")
        if timeout_ns < 0:
            problems.append(f"timeout_ns: expected >= 0, got {timeout_ns}")
        addrs = {}
        pairs, row, out_row = n_tokens * cfg.top_k, max(cfg.msg_bytes, 0), 2 * hidden
        ordinal = self.dev.ordinal
        for name, obj, align, need, dtypes, size in (
                ("recv", recv, 16, True, None, pairs * row),
                ("counts", counts, 8, True, ("uint64", "int64"), 8 * n_experts * cfg.n_ranks),
                ("topk_idx", topk_idx, 4, True, ("int32",), 4 * pairs),
                ("weights", weights, 4, out is not None, ("float32",), 4 * pairs),
                ("out", out, 16, False, ("bfloat16", "uint16", "int16"), n_tokens * out_row)):
            a = 0 if obj is None else array_arg(obj, name, problems, dtypes=dtypes, nbytes_min=size, ordinal=ordinal)[0]
            if need or a:
                aligned(name, a, align, problems)
            addrs[name] = a
        units = n_tokens * -(-out_row // 512)      # one warp per (token, 512 bytes of its output row)
        if units >= 1 << 32:
            problems.append(f"n_tokens: {n_tokens} tokens x {out_row}-byte output rows exceed 2^32 work units")
        if problems:
            raise ConfigError(problems, "receive launch")
        warps = max(1, units)
        self.grid = max(1, min(self.max_ctas, -(-warps // (self.THREADS // 32))))
        return self.block.set(cfg=cfg, recv_ptr=addrs["recv"], counts_ptr=addrs["counts"],
                              topk_idx=addrs["topk_idx"], weights=addrs["weights"], out_ptr=addrs["out"],
                              state_ptr=self.state, diag_ptr=self.diag, timeout_ns=int(timeout_ns),
                              stamp_ptr=0 if stamps is None else stamps, n_tokens=n_tokens, n_experts=n_experts)

    def launch(self, stream: driver.Stream, block: ParamBlock | None = None) -> None:
        """Enqueue the prepared receive on ``stream`` (no host wait).

        Args:
            stream: a ``driver.Stream``.
            block: a prepared block, or None: the launcher's own.
        """
        (block or self.block).launch((self.grid,), (self.THREADS,), stream)

    def record(self) -> dict:
        """The last launch's record: timed-out waits, first missing slot and its value."""
        d = self.diag.download(np.uint64)
        return {"timeouts": int(d[0]) if d[0] != 1 << 63 else None, "rejected": int(d[0]) == 1 << 63,
                "first_missing_slot": int(np.int64(d[1])), "value": int(d[2]), "end_ns": int(d[3])}

    def close(self) -> None:
        """Free the receiver state and record."""
        self.state.free()
        self.diag.free()
