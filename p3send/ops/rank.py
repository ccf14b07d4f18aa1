"""Real ranks: one process per EP rank, peers' receive buffers mapped with CUDA IPC.

Each process builds one ``Rank``. It allocates its shareable buffers with ``cuMemAlloc``
(the receive buffer and the receive counts), exchanges their legacy IPC handles and its
GPU's PCI bus id through an *exchange*, maps every peer's buffers, and builds its own
``P3PeerSendConfig`` whose ``recv_buf_ptrs[p]`` is peer p's receive buffer as mapped in
this process. It owns its ``ScatterSend`` and ``RecvReduce`` and their inputs.

The round (``Rank.round``), the same on every rank:

1. send: this rank's ``p3_scatter_send`` on its stream, then a stream sync;
2. mid barrier (``sync_sends``; on by default when any two ranks share a GPU): kernels of
   different processes time-slice one GPU, so a spinning receiver must not start before
   every sender has finished. Across GPUs it is optional (the receive then streams);
3. receive: ``p3_recv_reduce`` (bounded wait, reduce, re-arm), then a stream sync;
4. settle: read the receive record; an allgather of "did my wait time out" ends the
   round. It is the host barrier before the next round's sends (no sender overwrites a
   buffer a peer is still reducing), and after it every rank's sends of this round have
   completed, so a rank whose wait timed out re-arms its counts (``fill(0xFF)``) without
   racing a late signal; if any rank timed out, one more barrier keeps every next send
   after that re-arm. A timed-out rank raises ``ArrivalTimeout`` naming its missing
   (rank, expert, source) pairs.

Every host sync has a timeout: a dead peer raises ``ExchangeTimeout`` naming the ranks
that did not arrive, and marks the rank ``broken`` (the world is out of step; build a
new one). An exchange is anything with ``rank``, ``n_ranks``, ``allgather(obj) -> list``
(bounded by its own timeout) and ``barrier(timeout)``: ``ProcessExchange`` (stdlib
multiprocessing, for processes p3send starts with ``run_ranks``), ``TorchExchange`` (an
initialised torch.distributed group) and ``MPIExchange`` (mpi4py) are provided.
docs/SCALING.md says how this extends past one node.
"""
from __future__ import annotations

import os
import secrets
import socket

import numpy as np

from ..abi.config import describe_value, rank_config, shape_problems
from ..abi.errors import ArrivalTimeout, ConfigError, P3SendError
from ..abi.layout import recv_buf_bytes
from ..cuda import driver
from .args import aligned, array_arg, warn_deprecated
from .combine import (GUARD, arrival_status, bound_inputs, device_ptr_or_none, own_inputs, rank_buffers,
                      rank_inputs, send_wire_options, wire_setup)
from .recv import RecvReduce
from .send import ScatterSend

#: Tells this process from every other one (pids repeat across containers).
_PROCESS_TOKEN = secrets.token_hex(8)


# ---------------------------------------------------------------- the rank

class Rank:
    """This process's EP rank of an ``n_ranks`` world (one Rank per process).

    Buffers (``cuMemAlloc``, so legacy CUDA IPC shares them), shapes as in
    ``combine.Combine``: recv u8 (max_tokens, top_k, msg_bytes) with ``GUARD`` sentinel
    bytes on each side when ``guard``, and counts u64 [n_local*n_ranks] (all-ones = not
    arrived) are shared; C bf16 (max_rows, hidden), expert offsets, range table, src_info,
    row cache, topk_idx int32 / weights f32 (tokens, top_k) and out bf16 (tokens, hidden)
    are this rank's own. ``device``: ordinal (default $P3SEND_DEVICE or 0);
    ``timeout_ms``: the receive wait; ``sync_timeout_s``: every barrier (allgathers use
    the exchange's own timeout); ``sync_sends``: the mid-round barrier, the same on every
    rank (None: on when any two ranks share a GPU). Construction is collective.

    Read the receive buffer or the counts of a finished round before the next
    ``barrier()``: after ``round`` returns, peers may already be sending the next round.
    """

    def __init__(self, rank: int, n_ranks: int, exchange, *, max_tokens: int, top_k: int, hidden: int,
                 n_local_experts: int, device: int | None = None, max_rows: int | None = None,
                 timeout_ms: float = 2000.0, sync_timeout_s: float = 60.0, sync_sends: bool | None = None,
                 guard: bool = False, row_cache: bool = False, num_sms: int | None = None, inputs: bool = True,
                 wire="bf16"):
        """n_local_experts: experts per rank; row_cache: give the send a row cache (one u64
        per row of C, ``cfg.row_base_ptr``) and send with it; num_sms: the send's SM budget
        (``ScatterSend.set_num_sms``; default every SM); inputs: allocate C, the routing
        inputs, topk_idx/weights and out here (``set_inputs`` uploads them); False: the
        caller owns them as device arrays and attaches them with ``bind`` (e.g. torch
        tensors refreshed in place); wire: the row format, ``"bf16"`` or ``"fp8"``
        (``p3send.abi.wire``), the same on every rank (msg_bytes =
        ``wire_msg_bytes(hidden, wire)``; C and the output stay bf16 (rows, hidden))."""
        problems = shape_problems(n_ranks, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                                  n_local_experts=n_local_experts, timeout_ms=timeout_ms)
        fmt, msg, wire_bad = wire_setup(f"Rank {rank}", wire, hidden)
        problems += [p for p in wire_bad if p.split(":")[0] not in {q.split(":")[0] for q in problems}]
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or \
                not isinstance(n_ranks, (int, np.integer)) or not 0 <= rank < n_ranks:
            problems.append(f"rank: expected an integer 0..n_ranks-1 (n_ranks={n_ranks!r}), got {describe_value(rank)}")
        ex = (getattr(exchange, "rank", None), getattr(exchange, "n_ranks", None))
        if ex != (rank, n_ranks):
            problems.append(f"exchange: expected rank {rank!r} of {n_ranks!r}, it says rank {ex[0]} of {ex[1]}")
        if isinstance(sync_timeout_s, bool) or not isinstance(sync_timeout_s, (int, float)) or \
                not 0 < sync_timeout_s < float("inf"):
            problems.append(f"sync_timeout_s: expected a finite number of seconds > 0, got "
                            f"{describe_value(sync_timeout_s)}")
        if problems:
            raise ConfigError(problems, f"Rank {rank}")
        self.rank, self.n_ranks, self.exchange = rank, n_ranks, exchange
        self.max_tokens, self.top_k, self.hidden, self.n_local = max_tokens, top_k, hidden, n_local_experts
        self.msg, self.wire = msg, fmt
        self.max_rows = max_rows if max_rows is not None else max_tokens * top_k * n_ranks
        self.timeout_ns = int(timeout_ms * 1e6)
        self.sync_timeout_s = float(sync_timeout_s)
        self.guard = GUARD if guard else 0
        self.recv_bytes = recv_buf_bytes(max_tokens, top_k, self.msg)
        self.tokens = 0
        self.broken = False          # a host sync failed: the peers are out of step
        self._closed = False
        self._bufs, self._mapped, self._graphs, self._events = [], [], [], []
        self.sender = self.receiver = self.stream = None
        self.dev = driver.device(device)   # this process's GPU, before any other CUDA call
        try:
            self._allocate(row_cache, num_sms, inputs)
            self._connect(sync_sends)
            self.barrier()                 # every rank has mapped its peers and armed its counts
        except BaseException:
            self._teardown(sync=False, quiet=True)
            raise

    # ------------------------------------------------------------ setup
    def _alloc(self, nbytes: int, fill: int | None = None) -> driver.DeviceBuffer:
        buf = driver.DeviceBuffer(nbytes, fill=fill)
        self._bufs.append(buf)
        return buf

    def _allocate(self, row_cache: bool, num_sms: int | None, inputs: bool = True) -> None:
        b = rank_buffers(self._alloc, n_ranks=self.n_ranks, n_local=self.n_local, max_tokens=self.max_tokens,
                         top_k=self.top_k, msg=self.msg, max_rows=self.max_rows, guard=self.guard,
                         row_cache=row_cache, inputs=inputs, row=2 * self.hidden)
        self.recv, self.counts, self.c = b.recv, b.counts, b.c
        self.expert_offsets, self.range_table, self.src_info = b.expert_offsets, b.range_table, b.src_info
        self.row_base, self.topk_idx, self.weights, self.out = b.row_base, b.topk_idx, b.weights, b.out
        self.sender = ScatterSend(self.n_local, device=self.dev, num_sms=num_sms)
        self.send_wire = send_wire_options(self.wire, self.hidden)
        self.receiver = RecvReduce(device=self.dev, wire=self.wire)
        self.stream = driver.Stream()
        self._events = [driver.Event() for _ in range(4)]   # send start/end, receive start/end

    def _connect(self, sync_sends: bool | None) -> None:
        mine = {"rank": self.rank, "pid": os.getpid(), "process": _PROCESS_TOKEN, "host": socket.gethostname(),
                "device": self.dev.ordinal,
                "bus_id": driver.pci_bus_id(self.dev.ordinal), "shape": self._shape(), "sync_sends": sync_sends,
                "recv": driver.ipc_get_handle(self.recv), "recv_offset": self.guard,
                "counts": driver.ipc_get_handle(self.counts)}
        self.peers = self.exchange.allgather(mine)
        problems = _world_problems(mine, self.peers, self.n_ranks)
        if problems:
            raise ConfigError(problems, f"world as seen by rank {self.rank}")
        recv_ptrs, self.count_ptrs = [], []
        for p, info in enumerate(self.peers):
            if p == self.rank:
                recv_ptrs.append(self.recv.ptr + self.guard)
                self.count_ptrs.append(self.counts.ptr)
                continue
            if info["bus_id"] != mine["bus_id"]:
                self._check_reach(p, info)
            recv_ptrs.append(self._open(info["recv"]) + info["recv_offset"])
            self.count_ptrs.append(self._open(info["counts"]))
        self.recv_ptrs = recv_ptrs
        self.cfg = self._config() if self.range_table is not None else None
        # one decision for the whole world (every rank must run the same syncs): on when any
        # two ranks share a GPU
        shared = len({i["bus_id"] for i in self.peers}) < self.n_ranks
        self.sync_sends = shared if sync_sends is None else bool(sync_sends)

    def _config(self):
        return rank_config(my_rank=self.rank, n_ranks=self.n_ranks, recv_bufs=self.recv_ptrs, top_k=self.top_k,
                           msg_bytes=self.msg, max_tokens=self.max_tokens,
                           range_table=driver.device_ptr(self.range_table, "range_table"),
                           src_info=driver.device_ptr(self.src_info, "src_info"),
                           row_base=device_ptr_or_none(self.row_base, "row_base"))

    def _shape(self) -> tuple:
        return (self.n_ranks, self.max_tokens, self.top_k, self.hidden, self.n_local, self.max_rows, self.wire)

    def _check_reach(self, p: int, info: dict) -> None:
        """Peer p's GPU must be visible here and reachable by P2P. The mapping itself enables
        the access (driver.ipc_open_handle passes CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), so no
        context is created on the peer's GPU in this process."""
        here = driver.ordinal_of_pci_bus_id(info["bus_id"])
        me = f"rank {self.rank} on GPU {self.dev.ordinal} (PCI {driver.pci_bus_id(self.dev.ordinal)})"
        them = f"rank {p}'s GPU (PCI {info['bus_id']}, GPU {info['device']} in its process)"
        if here is None:
            raise P3SendError(f"{me} cannot see {them}: every GPU of the world must be visible to every rank "
                              "(check CUDA_VISIBLE_DEVICES)")
        if not driver.can_access_peer(self.dev.ordinal, here):
            raise P3SendError(f"{me} cannot reach {them}, GPU {here} here, by peer-to-peer access: "
                              "cuDeviceCanAccessPeer reports no NVLink or PCIe P2P path between them "
                              "(`nvidia-smi topo -m` shows the links); p3send's peer stores need one")

    def _open(self, handle: bytes) -> int:
        self.dev.activate()
        ptr = driver.ipc_open_handle(handle)
        self._mapped.append(ptr)
        return ptr

    # ------------------------------------------------------------ inputs
    def load(self, world) -> None:
        """Upload this rank's share of a ``p3send.oracle.cases.World``: its C and routing as
        an expert owner, its tokens' topk_idx and weights (``set_inputs``).

        Raises:
            ConfigError: the world has another number of ranks, or as ``set_inputs``.
        """
        if getattr(world, "n_ranks", None) != self.n_ranks:
            raise ConfigError([f"world: expected {self.n_ranks} ranks, got {getattr(world, 'n_ranks', world)!r}"],
                              f"Rank {self.rank}.load")
        d = world.ranks[self.rank]
        self.set_inputs(c=d.c, expert_offsets=d.expert_offsets, range_table=d.range_table,
                        src_info=d.src_info, topk_idx=d.topk_idx, weights=d.weights)

    def set_inputs(self, *, c, expert_offsets, range_table, src_info, topk_idx, weights) -> None:
        """Upload this rank's inputs from host arrays into the buffers it owns; capture graphs
        after this.

        Args:
            c, expert_offsets, range_table, src_info, topk_idx, weights: numpy arrays, shapes
                and dtypes as ``Combine.set_inputs``.

        Raises:
            ConfigError: a shape, size or value is wrong, or the inputs are the caller's.
        """
        self._usable()
        a = rank_inputs(f"rank {self.rank} inputs", c=c, expert_offsets=expert_offsets, range_table=range_table,
                        src_info=src_info, topk_idx=topk_idx, weights=weights, hidden=self.hidden,
                        top_k=self.top_k, n_local=self.n_local, n_ranks=self.n_ranks, max_rows=self.max_rows,
                        max_tokens=self.max_tokens)
        own_inputs(f"Rank {self.rank}.set_inputs", (self.c, self.expert_offsets, self.range_table, self.src_info,
                                                    self.topk_idx, self.weights))
        self.c.upload(a["c"])
        self.expert_offsets.upload(a["expert_offsets"])
        self.range_table.upload(a["range_table"])
        self.src_info.upload(a["src_info"])
        self.topk_idx.upload(a["topk_idx"])
        self.weights.upload(a["weights"])
        self.tokens = a["topk_idx"].shape[0]
        self._prepare(a["expert_offsets"])

    def bind(self, *, c, expert_offsets, range_table, src_info, topk_idx, weights, out) -> None:
        """Attach this rank's inputs and output as device arrays it does not own (as
        ``Combine.bind``, without the rank argument), checked for dtype, device and size
        before any launch. Rounds and captured graphs read them in place; the token count
        is ``topk_idx``'s leading dimension now.

        Args:
            c, expert_offsets, range_table, src_info, topk_idx, weights, out: device arrays,
                shapes and dtypes as ``Combine.bind``.

        Raises:
            ConfigError: every wrong dtype, device or size, listed.
        """
        self._usable()
        self.tokens = bound_inputs(f"rank {self.rank} inputs", self.dev.ordinal, c=c, expert_offsets=expert_offsets,
                                   range_table=range_table, src_info=src_info, topk_idx=topk_idx, weights=weights,
                                   out=out, hidden=self.hidden, top_k=self.top_k, n_local=self.n_local,
                                   n_ranks=self.n_ranks, max_tokens=self.max_tokens)
        self.c, self.expert_offsets, self.range_table, self.src_info = c, expert_offsets, range_table, src_info
        self.topk_idx, self.weights, self.out = topk_idx, weights, out
        self.cfg = self._config()
        self._prepare(None)

    def set_output(self, out) -> None:
        """Point this rank's reduce at a new output array, nothing else changed.

        Args:
            out: bf16 (tokens, hidden) on this rank's GPU, tokens as last bound.

        Raises:
            ConfigError: ``out`` is too small, of another dtype or on another device.
        """
        self._usable()
        problems = []
        addr, _ = array_arg(out, "out", problems, dtypes=("bfloat16", "uint16", "int16"),
                            nbytes_min=2 * self.tokens * self.hidden, ordinal=self.dev.ordinal)
        aligned("out", addr, 16, problems)
        if problems:
            raise ConfigError(problems, f"rank {self.rank} output")
        self.out = out
        self.receiver.block.set(out_ptr=addr)

    def _prepare(self, host_offsets) -> None:
        self.sender.prepare(self.cfg, self.c, self.expert_offsets, 2 * self.hidden, count_ptrs=self.count_ptrs,
                            expert_offsets_host=host_offsets, row_cache=self.row_base is not None,
                            rows_in_c=self.max_rows, **self.send_wire)
        self.receiver.prepare(self.cfg, self.recv.ptr + self.guard, self.counts, self.topk_idx, self.weights,
                              self.out, n_tokens=self.tokens, n_experts=self.n_local, timeout_ns=self.timeout_ns,
                              hidden=self.hidden)

    def refill_c(self, c) -> None:
        """New C values, same routing (between rounds or graph replays). c: bf16 bits,
        uint16 (rows, hidden)."""
        own_inputs(f"Rank {self.rank}.refill_c", (self.c,))
        self.c.upload(np.ascontiguousarray(c).view(np.uint16))

    @property
    def offs(self):
        """Deprecated alias of ``expert_offsets`` (removed in 0.3)."""
        warn_deprecated("Rank.offs", "Rank.expert_offsets")
        return self.expert_offsets

    @property
    def rtab(self):
        """Deprecated alias of ``range_table`` (removed in 0.3)."""
        warn_deprecated("Rank.rtab", "Rank.range_table")
        return self.range_table

    # ------------------------------------------------------------ the round
    def _usable(self, in_round: bool = False) -> None:
        """Refuse work on a closed Rank, and new rounds of a world out of step (the rest of
        the round whose mid barrier failed still runs: it names the missing pairs)."""
        if self._closed:
            raise P3SendError(f"rank {self.rank}: this Rank is closed")
        if self.broken and not in_round:
            raise P3SendError(f"rank {self.rank}: a host sync of this world failed earlier, so the ranks are out "
                              "of step; close this Rank and build a new world")

    def enqueue(self, stream=None, *, send: bool = True, receive: bool = True) -> None:
        """Enqueue this rank's send and/or receive on ``stream`` (a torch or cupy stream, a
        handle, a ``driver.Stream``; default the Rank's own) with no host synchronisation
        and no barrier: for ranks on different GPUs, whose receive may run concurrently with
        the peers' sends (on a shared GPU use ``round``). The caller owns the host barrier
        between rounds (``settle``)."""
        self._usable()
        s = self.stream if stream is None else driver.as_stream(stream)
        if send:
            if self.row_base is not None:
                self.row_base.fill(0, s)
            self.sender.launch(s)
        if receive:
            self.receiver.launch(s)

    def send(self, graph: driver.Graph | None = None, *, skip: bool = False, stream=None) -> None:
        """Run this rank's send (or its captured graph) and wait for it. ``skip`` sends
        nothing (a rank that never sends). ``stream``: run it in that stream's order (a
        torch or cupy stream, a handle: ``driver.as_stream``; default the Rank's own)."""
        self._usable()
        s = self.stream if stream is None else driver.as_stream(stream)
        self._events[0].record(s)
        if graph is not None:
            graph.launch(s)
        elif not skip:
            self.enqueue(s, receive=False)
        self._events[1].record(s)
        s.synchronize()

    def receive(self, graph: driver.Graph | None = None, *, stream=None) -> None:
        """Run this rank's bounded wait + reduce + re-arm (or its graph) and wait for it
        (``stream`` as in ``send``)."""
        self._usable(in_round=True)
        s = self.stream if stream is None else driver.as_stream(stream)
        self._events[2].record(s)
        (graph.launch if graph is not None else self.receiver.launch)(s)
        self._events[3].record(s)
        s.synchronize()

    def barrier(self) -> None:
        """A host barrier of the world (``sync_timeout_s``); a failure marks this rank broken."""
        try:
            self.exchange.barrier(self.sync_timeout_s)
        except P3SendError:
            self.broken = True
            raise

    def settle(self, late: P3SendError | None = None) -> None:
        """End a round after ``receive`` (every rank calls it; see the module docstring).
        Raises ArrivalTimeout naming this rank's missing pairs, chained from ``late`` (a
        failed mid-round barrier) if any; else re-raises ``late``."""
        missing, record = arrival_status(self.rank, self.receiver, self.counts, self.n_ranks)
        timed_out, anyone = record is not None, False
        if late is None and not self.broken:
            try:
                anyone = any(self.exchange.allgather(timed_out))
            except P3SendError as e:
                self.broken, late = True, e
        if timed_out:
            self.counts.fill(0xFF)
        if anyone and late is None:
            try:
                self.barrier()             # no next-round send before every re-arm
            except P3SendError as e:
                late = e
        if timed_out:
            raise ArrivalTimeout(missing, record, self.timeout_ns) from late
        if late is not None:
            raise late

    def round(self, graphs: tuple | None = None, *, skip_send: bool = False, stream=None) -> None:
        """One whole round: send, (mid barrier), receive, settle.

        Args:
            graphs: the pair from ``capture()`` to replay instead of launching, or None.
            skip_send: send nothing (a rank that never sends).
            stream: as in ``send``.

        Raises:
            ArrivalTimeout: this rank's missing pairs; ExchangeTimeout: a host sync failed.
        """
        send_graph, recv_graph = graphs if graphs is not None else (None, None)
        self.send(send_graph, skip=skip_send, stream=stream)
        late = None
        if self.sync_sends:
            try:
                self.barrier()
            except P3SendError as e:
                late = e
        self.receive(recv_graph, stream=stream)
        self.settle(late)

    def capture(self) -> tuple:
        """(send graph, receive graph) of this rank, replayed by ``round(graphs)`` with the
        host barrier between them; closed with the Rank. Capture again after set_inputs."""
        self._usable()
        with driver.Graph.capture(self.stream) as cs:
            self.enqueue(receive=False)
        self._graphs.append(cs.graph)
        with driver.Graph.capture(self.stream) as cr:
            self.receiver.launch(self.stream)
        self._graphs.append(cr.graph)
        return cs.graph, cr.graph

    # ------------------------------------------------------------ results
    def output(self) -> np.ndarray:
        """This rank's reduced output, bf16 bits uint16 (tokens, hidden)."""
        return self.out.download(np.uint16, shape=(self.tokens, self.hidden))

    def recv_view(self, with_guard: bool = False) -> np.ndarray:
        """This rank's receive buffer, flat uint8.

        Args:
            with_guard: include the sentinel guard bytes on each side.
        """
        raw = self.recv.download()
        return raw if with_guard else raw[self.guard:self.guard + self.recv_bytes]

    def counts_view(self) -> np.ndarray:
        """This rank's receive counts, uint64 [n_local*n_ranks] (all-ones = not arrived)."""
        return self.counts.download(np.uint64)

    def times_us(self) -> tuple[float, float]:
        """(send, receive) GPU time of the last round in microseconds."""
        e = self._events
        return 1000.0 * e[0].elapsed_ms(e[1]), 1000.0 * e[2].elapsed_ms(e[3])

    # ------------------------------------------------------------ teardown
    def close(self, sync: bool = True) -> None:
        """Unmap every peer buffer and free every allocation; idempotent, and complete even
        when some step fails (the first error is raised after all steps). With ``sync``
        and the world in step, a bounded barrier between unmapping the peers' buffers and
        freeing this rank's own: a peer that passed it no longer writes here and has closed
        its mapping (freeing exported memory before every importer closed it is undefined
        in the CUDA IPC contract)."""
        if not self._closed:
            self._teardown(sync=sync, quiet=False)

    def _teardown(self, sync: bool, quiet: bool) -> None:
        self._closed = True
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except P3SendError as e:
                errors.append(e)

        attempt(self.dev.activate)
        if self.stream is not None:
            attempt(self.stream.synchronize)
        for g in self._graphs:
            attempt(g.close)
        for ptr in self._mapped:
            attempt(driver.ipc_close, ptr)
        if sync and not self.broken:
            try:
                self.barrier()
            except P3SendError:
                pass                       # a peer is gone: free anyway
        for part in (self.sender, self.receiver):
            if part is not None:
                attempt(part.close)
        for b in self._bufs:
            attempt(b.free)
        for ev in self._events:
            attempt(ev.close)
        if self.stream is not None:
            attempt(self.stream.close)
        self._graphs, self._mapped, self._bufs, self._events = [], [], [], []
        if errors and not quiet:
            raise errors[0]

    def __enter__(self) -> Rank:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        try:
            self.close(sync=False)
        except P3SendError:
            pass                           # the error in flight says more
        return False


def _world_problems(mine: dict, peers: list, n_ranks: int) -> list[str]:
    if len(peers) != n_ranks:
        return [f"exchange: expected {n_ranks} entries, got {len(peers)}"]
    problems = []
    me = mine["rank"]
    for p, info in enumerate(peers):
        if info["rank"] != p:
            problems.append(f"exchange: entry {p} comes from rank {info['rank']}")
        if info["shape"] != mine["shape"]:
            problems.append(f"rank {p}: shape (n_ranks, max_tokens, top_k, hidden, n_local, max_rows, wire) "
                            f"{info['shape']} differs from rank {me}'s {mine['shape']}")
        if info["sync_sends"] != mine["sync_sends"]:
            problems.append(f"rank {p}: sync_sends={info['sync_sends']}, rank {me}: {mine['sync_sends']} "
                            "(every rank must run the same host syncs)")
        if info["host"] != mine["host"]:
            problems.append(f"rank {p} runs on {info['host']}, rank {me} on {mine['host']}: CUDA IPC maps memory "
                            "within one node only (docs/SCALING.md says what a cross-node path needs)")
        elif p != me and info["process"] == mine["process"]:
            problems.append(f"rank {p} is in this process too: one Rank per process (CUDA IPC cannot open a "
                            "handle in the process that exported it; combine.Combine runs ranks in one process)")
    return problems


