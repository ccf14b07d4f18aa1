"""Host exchanges between the processes of a world: ``allgather`` and ``barrier``, each
bounded by a timeout that names the ranks that did not arrive. ``ProcessExchange``
(stdlib multiprocessing, for processes ``run_ranks`` starts), ``TorchExchange`` (an
initialised torch.distributed group), ``MPIExchange`` (mpi4py)."""
from __future__ import annotations

import multiprocessing as mp
import queue
import re
import threading
import time

from ..abi.errors import ConfigError, P3SendError


class ExchangeTimeout(P3SendError, TimeoutError):
    """A host sync of the world did not complete in time. ``message``: what did not
    complete, and after how long; ``ranks``: the ranks that did not arrive, when the
    exchange can tell (else None)."""

    def __init__(self, message: str, ranks=None):
        self.ranks = None if ranks is None else sorted(ranks)
        super().__init__(message)


# ---------------------------------------------------------------- exchanges

class ProcessExchange:
    """allgather and barrier between processes started with the 'spawn' method.

    Create it in the parent for ``n_ranks`` processes, pass it to each child as a Process
    argument, and call ``bind(rank)`` in the child (``run_ranks`` does both). Built from
    a ``multiprocessing.Barrier``, one inbox ``Queue`` per rank, and a shared array of
    barrier arrivals per rank, which names the ranks missing from a broken barrier.
    ``timeout_s``: the default deadline of ``allgather`` and ``barrier`` in seconds;
    ``ctx``: the multiprocessing context the children are started with (default 'spawn').
    """

    def __init__(self, n_ranks: int, *, timeout_s: float = 60.0, ctx=None):
        if n_ranks < 1:
            raise ConfigError(f"n_ranks: expected >= 1, got {n_ranks}", "exchange")
        ctx = ctx or mp.get_context("spawn")
        self.n_ranks, self.rank, self.timeout_s = n_ranks, None, float(timeout_s)
        self._barrier = ctx.Barrier(n_ranks)
        self._arrived = ctx.Array("q", n_ranks, lock=False)   # each rank writes only its own slot
        self._inbox = [ctx.Queue() for _ in range(n_ranks)]
        self._gen = 0            # allgathers this rank has entered
        self._early = {}         # (gen, rank) -> obj that came before this rank reached gen

    def bind(self, rank: int) -> ProcessExchange:
        """Make this copy (in a child process) rank ``rank``'s end of the exchange; returns self.

        Args:
            rank: 0..n_ranks-1.
        """
        if not (0 <= rank < self.n_ranks):
            raise ConfigError(f"rank: expected 0..{self.n_ranks - 1}, got {rank}", "exchange")
        self.rank = rank
        return self

    def _bound(self) -> int:
        if self.rank is None:
            raise P3SendError("ProcessExchange: call bind(rank) in the child process first")
        return self.rank

    def allgather(self, obj, timeout: float | None = None) -> list:
        """Every rank's ``obj``, in rank order, once every rank has called it.

        Args:
            obj: any picklable object.
            timeout: seconds to wait for the others (default: the exchange's ``timeout_s``).

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        me = self._bound()
        timeout = self.timeout_s if timeout is None else timeout
        gen, self._gen = self._gen, self._gen + 1
        for r in range(self.n_ranks):
            if r != me:
                self._inbox[r].put((gen, me, obj))
        got = {me: obj}
        for key in [k for k in self._early if k[0] == gen]:
            got[key[1]] = self._early.pop(key)
        deadline = time.monotonic() + timeout
        while len(got) < self.n_ranks:
            try:
                g, r, o = self._inbox[me].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.n_ranks)) - set(got))
                raise ExchangeTimeout(f"rank {me}: allgather #{gen} got nothing from rank(s) {missing} "
                                      f"within {timeout:g} s (exited, hung, or slower than that)", missing) from None
            if g == gen:
                got[r] = o
            elif g > gen:
                self._early[(g, r)] = o
            # g < gen: a late part of an allgather that already failed here
        return [got[r] for r in range(self.n_ranks)]

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called it.

        Args:
            timeout: seconds to wait (default: the exchange's ``timeout_s``).

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        me = self._bound()
        timeout = self.timeout_s if timeout is None else timeout
        self._arrived[me] += 1
        try:
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            mine = self._arrived[me]
            late = [r for r in range(self.n_ranks) if self._arrived[r] < mine]
            raise ExchangeTimeout(f"rank {me}: barrier #{mine} broken after at most {timeout:g} s: rank(s) {late} "
                                  "did not arrive (exited, hung, or slower than that)", late) from None


class TorchExchange:
    """allgather and barrier through ``torch.distributed`` (``all_gather_object``,
    ``monitored_barrier``). Needs an initialised process group. Objects and barriers go
    through a gloo group (``monitored_barrier`` exists only there): ``group`` if it is
    one, else a gloo group over the whole world created here, with ``timeout_s`` as its
    timeout; creating it is collective (every rank constructs its TorchExchange)."""

    def __init__(self, group=None, *, timeout_s: float = 60.0):
        try:
            import torch.distributed as dist
        except ImportError as e:
            raise P3SendError(f"TorchExchange needs torch ({e})") from e
        if not (dist.is_available() and dist.is_initialized()):
            raise P3SendError("TorchExchange: torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group first")
        from datetime import timedelta
        self._dist, self._td, self.timeout_s = dist, timedelta, float(timeout_s)
        if dist.get_backend(group) != "gloo":
            if group is not None:
                raise ConfigError(f"group: expected a gloo group (monitored_barrier needs gloo), got backend "
                                 f"{dist.get_backend(group)!r}", "exchange")
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.group = group
        self.rank, self.n_ranks = dist.get_rank(group), dist.get_world_size(group)

    def allgather(self, obj, timeout: float | None = None) -> list:
        """Every rank's ``obj``, in rank order, once every rank has called it.

        Args:
            obj: any picklable object.
            timeout: seconds to wait for the others (default: the exchange's ``timeout_s``);
                torch's gloo group has its own, fixed when the group was made, which bounds it too.

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        out = [None] * self.n_ranks
        try:
            self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise ExchangeTimeout(f"rank {self.rank}: torch.distributed all_gather_object failed: {e}") from e
        return out

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called it.

        Args:
            timeout: seconds to wait (default: the exchange's ``timeout_s``).

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        t = self.timeout_s if timeout is None else timeout
        try:
            self._dist.monitored_barrier(group=self.group, timeout=self._td(seconds=t), wait_all_ranks=True)
        except RuntimeError as e:   # rank 0 learns who is missing; the others see a gloo timeout
            m = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))
            ranks = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
            raise ExchangeTimeout(f"rank {self.rank}: torch.distributed monitored_barrier failed within {t:g} s"
                                  + (f": rank(s) {ranks} did not arrive" if ranks else "") + f" ({e})", ranks) from e


class MPIExchange:
    """allgather and barrier through mpi4py. The barrier is ``Ibarrier`` polled against a
    deadline (MPI's blocking ``Barrier`` has no timeout; MPI cannot say who is missing);
    ``allgather`` passes such a barrier first so a dead peer cannot hang the blocking
    ``comm.allgather`` that follows. ``comm``: the communicator (default ``MPI.COMM_WORLD``);
    ``timeout_s``: the default deadline of ``allgather`` and ``barrier`` in seconds."""

    def __init__(self, comm=None, *, timeout_s: float = 60.0):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise P3SendError(f"MPIExchange needs mpi4py ({e})") from e
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.n_ranks, self.timeout_s = self.comm.Get_rank(), self.comm.Get_size(), float(timeout_s)

    def allgather(self, obj, timeout: float | None = None) -> list:
        """Every rank's ``obj``, in rank order, once every rank has called it.

        Args:
            obj: any picklable object.
            timeout: seconds to wait for the others (default: the exchange's ``timeout_s``); bounded by a barrier first.

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        self.barrier(timeout)
        return self.comm.allgather(obj)

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called it.

        Args:
            timeout: seconds to wait (default: the exchange's ``timeout_s``).

        Raises:
            ExchangeTimeout: a rank did not arrive in time (named where the exchange can tell).
        """
        t = self.timeout_s if timeout is None else timeout
        req, deadline = self.comm.Ibarrier(), time.monotonic() + t
        while not req.Test():
            if time.monotonic() > deadline:
                raise ExchangeTimeout(f"rank {self.rank}: MPI barrier not complete within {t:g} s "
                                      "(a rank exited, hung, or is slower than that; MPI does not say which)")
            time.sleep(50e-6)


