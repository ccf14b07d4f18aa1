"""The p3send error hierarchy: every error p3send raises derives from P3SendError.

Nothing here imports CUDA, so the hierarchy is usable (and catchable) on machines
without a driver.
"""
from __future__ import annotations


class P3SendError(Exception):
    """Root of every error p3send raises on purpose.

    Every subclass survives pickling with its attributes (errors cross process
    boundaries in ``run_ranks``): a subclass whose ``__init__`` takes other arguments than
    the message stores them in ``self._init_args``.
    """

    def __reduce__(self):
        return type(self), getattr(self, "_init_args", self.args), self.__dict__


class ConfigError(P3SendError, ValueError):
    """A P3PeerSendConfig or a launch argument is invalid.

    ``problems`` lists one message per offending field, each naming the field,
    what was expected and what was given.
    """

    def __init__(self, problems, what="P3PeerSendConfig"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.what = what
        self._init_args = (self.problems, what)
        if len(self.problems) == 1:
            msg = f"invalid {what}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"invalid {what} ({len(self.problems)} problems):\n{lines}"
        super().__init__(msg)


class ConfigTypeError(ConfigError, TypeError):
    """A launch argument of the wrong type (e.g. not a P3PeerSendConfig, not an address)."""


class ConfigIndexError(ConfigError, IndexError):
    """An index outside an array of the config (e.g. ``cfg.recv_buf_ptrs[8] = addr``): also
    an IndexError, as a plain ctypes array would raise."""


class FieldError(ConfigError, AttributeError):
    """An attribute of a ``P3PeerSendConfig`` that is not one of its fields."""


class CudaError(P3SendError):
    """A CUDA driver (or nvJitLink) call failed.

    Attributes: ``call`` (the API name), ``name`` (e.g. CUDA_ERROR_INVALID_PTX),
    ``code`` (int), ``explanation`` (the driver's description) and ``log`` (the JIT
    error/info log when there is one, else "").
    """

    def __init__(self, call, name, code, explanation="", log=""):
        self.call, self.name, self.code = call, name, int(code)
        self.explanation, self.log = explanation, log
        self._init_args = (call, name, self.code, explanation, log)
        msg = f"Call to {call} results in {name} ({self.code})"
        if explanation:
            msg += f": {explanation}"
        if log:
            msg += "\n--- JIT log ---\n" + log.rstrip()
        super().__init__(msg)


class ContextLostError(CudaError):
    """A sticky error: the CUDA context is unusable and the process must recreate it."""


class NoDeviceError(P3SendError, RuntimeError):
    """No CUDA driver or no usable GPU on this machine (tests skip on this)."""


class InputFileError(P3SendError, ValueError):
    """A file given by the user cannot be read as asked: not a regular file (a folder, a
    FIFO, a device), larger than the reader's cap, not UTF-8 text, or nested deeper
    than the parser allows. The message names the path and what was wrong."""


class ParamMismatchError(P3SendError):
    """A kernel's parameter layout reported by the driver differs from its documented table."""


class ArrivalTimeout(P3SendError, TimeoutError):
    """A receive wait hit its deadline.

    ``missing`` is a list of (rank, local_expert, source_rank) triples whose arrival
    signal never came; ``record`` is the kernel's raw diagnostic record; ``timeout_ns``
    the deadline that passed, in nanoseconds (None: not known; the message then gives none).
    """

    def __init__(self, missing, record=None, timeout_ns=None):
        self.missing = list(missing)
        self.record = record
        self.timeout_ns = timeout_ns
        self._init_args = (self.missing, record, timeout_ns)
        shown = ", ".join(f"rank {r}: expert {e} from rank {s}" for r, e, s in self.missing[:16])
        more = "" if len(self.missing) <= 16 else f" (+{len(self.missing) - 16} more)"
        senders = sorted({s for _, _, s in self.missing})
        t = f" within {timeout_ns / 1e6:.3f} ms" if timeout_ns else ""
        super().__init__(
            f"arrival signal never came{t} from rank(s) {senders}: "
            f"{len(self.missing)} (expert, rank) pair(s) missing: {shown}{more}")


class UnknownNameError(P3SendError, AttributeError):
    """``p3send.<name>`` for a name the public API does not have."""
