"""The compilers ``conform`` runs on a C/C++ declaration, and how it runs them.

The C compiler is the one Python's build tools would use (``$CC``, else Python's
configured ``CC``, else ``cc``; ``$CXX`` / ``CXX`` / ``c++`` for C++). Every path reaches a
compiler as an argv element of its own (no shell, nothing quoted into generated source),
every run has a deadline, and what a run prints is read up to a cap, so a header that
expands without end cannot fill the memory.

The CUDA headers are found, in this order, under ``$CUDA_HOME``, ``$CUDA_PATH``,
``$CUDA_ROOT``, beside ``nvcc`` on the ``PATH``, under ``CUDA_ROOTS``, and in the
``nvidia-cuda-*`` wheels (``nvidia/*/include`` of the Python path).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import select
import shlex
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass

from ..abi.errors import ConfigError

#: Folders that hold a CUDA toolkit by convention, looked at after the environment and nvcc.
CUDA_ROOTS = ("/usr/local/cuda", "/opt/cuda")
#: The namespace package of NVIDIA's wheels (``nvidia/<component>/include``), looked at last.
CUDA_WHEEL_PACKAGE = "nvidia"
#: Seconds one preprocessor or compiler run may take.
PREPROCESS_TIMEOUT_S = 60
COMPILE_TIMEOUT_S = 180
#: The most a preprocessor may print (a header that expands without end is stopped here).
MAX_PREPROCESSED_BYTES = 256 << 20
#: The most of a compiler's diagnostics kept (the first error is what is reported).
MAX_LOG_BYTES = 1 << 20

CUDACC_CHOICES = ("both", "with", "without")
_MACRO = re.compile(r"[A-Za-z_]\w*(?:=.*)?", flags=re.DOTALL)


@dataclass(frozen=True)
class CompilerOptions:
    """How the compiler is to see a C/C++ declaration.

    Attributes:
        macros: ``"-DNAME"``, ``"-DNAME=VALUE"`` or ``"-UNAME"`` strings, applied in order
            (as on a compiler's command line).
        include_dirs: folders searched for ``#include`` (``-I``), before the CUDA headers.
        cudacc: ``"both"`` (default: once without and once with ``__CUDACC__`` defined,
            as a host compiler and nvcc see the header), ``"without"`` or ``"with"``.
        cuda_include: ``"auto"`` (look for the CUDA headers), ``"none"`` (use none), or the
            folder holding ``cuda.h`` / ``cuda_runtime_api.h``.
    """
    macros: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    cudacc: str = "both"
    cuda_include: str = "auto"

    def checked(self) -> CompilerOptions:
        """These options with absolute folders, after checking each.

        Returns:
            CompilerOptions: the same options, ``include_dirs`` and ``cuda_include`` absolute.

        Raises:
            ConfigError: a macro that is not ``-DNAME[=VALUE]`` / ``-UNAME`` with NAME an
                identifier, ``__CUDACC__`` given as a macro (``cudacc`` says that), a
                folder that does not exist, or an unknown ``cudacc``.
        """
        what = "conform option"
        for m in self.macros:
            flag, body = m[:2], m[2:]
            if flag not in ("-D", "-U") or not _MACRO.fullmatch(body) or (flag == "-U" and "=" in body):
                raise ConfigError(f"{m!r}: expected -DNAME, -DNAME=VALUE or -UNAME (NAME an identifier)", what)
            if body.split("=", 1)[0] == "__CUDACC__":
                raise ConfigError(f"{m}: __CUDACC__ is set by --cudacc (with, without or both), "
                                  "not by a macro option", what)
        if self.cudacc not in CUDACC_CHOICES:
            raise ConfigError(f"cudacc: expected one of {', '.join(CUDACC_CHOICES)}; got {self.cudacc!r}", what)
        dirs = []
        for d in self.include_dirs:
            if not os.path.isdir(d):
                raise ConfigError(f"-I {d}: no such folder", what)
            dirs.append(os.path.abspath(d))
        cuda = self.cuda_include
        if cuda not in ("auto", "none"):
            if not os.path.isdir(cuda):
                raise ConfigError(f"--cuda-include {cuda}: no such folder", what)
            cuda = os.path.abspath(cuda)
        return CompilerOptions(tuple(self.macros), tuple(dirs), self.cudacc, cuda)


@dataclass(frozen=True)
class CudaHeaders:
    """Where the CUDA headers are, if anywhere.

    Attributes:
        include: the folder holding ``cuda.h`` or ``cuda_runtime_api.h``; None if none was found.
        how: where it was found ("$CUDA_HOME", "nvcc at /usr/bin/nvcc", ...) or, when
            ``include`` is None, what was looked at.
        nvcc: the nvcc of that toolkit, if there is one.
        version: (major, minor) from ``CUDA_VERSION`` in ``cuda.h``, if readable.
    """
    include: str | None
    how: str
    nvcc: str | None = None
    version: tuple[int, int] | None = None

    @property
    def runtime_api(self) -> bool:
        """Whether ``cuda_runtime_api.h`` is there (what a host compiler needs to see
        ``__device__``, ``__align__`` and the vector types as nvcc declares them)."""
        return bool(self.include) and os.path.isfile(os.path.join(self.include, "cuda_runtime_api.h"))


def _has_headers(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, h)) for h in ("cuda.h", "cuda_runtime_api.h"))


def _version(include: str) -> tuple[int, int] | None:
    try:
        with open(os.path.join(include, "cuda.h"), encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 20)
    except OSError:
        return None
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", head, flags=re.MULTILINE)
    return (int(m.group(1)) // 1000, int(m.group(1)) % 1000 // 10) if m else None


def _root_includes(root: str) -> list[str]:
    targets = glob.glob(os.path.join(glob.escape(root), "targets", "*", "include"))
    return [os.path.join(root, "include"), *sorted(targets)]


def _wheel_includes() -> list[str]:
    try:
        spec = importlib.util.find_spec(CUDA_WHEEL_PACKAGE)
    except (ImportError, ValueError):
        return []
    places = list(spec.submodule_search_locations or []) if spec else []
    return sorted(d for p in places for d in glob.glob(os.path.join(glob.escape(p), "*", "include")))


def find_cuda_headers(environ=None) -> CudaHeaders:
    """Look for the CUDA headers (see the module's docstring for the order).

    Args:
        environ: the environment to read ``CUDA_HOME`` / ``CUDA_PATH`` / ``CUDA_ROOT`` /
            ``PATH`` from (default ``os.environ``).

    Returns:
        CudaHeaders: the first folder found, or ``include=None`` with what was looked at.
    """
    env = os.environ if environ is None else environ
    candidates: list[tuple[str, str, str | None]] = []   # (include, how, toolkit root)
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if env.get(var):
            candidates += [(inc, f"${var}", env[var]) for inc in _root_includes(env[var])]
    nvcc_on_path = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if nvcc_on_path:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc_on_path)))
        candidates += [(inc, f"nvcc at {nvcc_on_path}", root) for inc in _root_includes(root)]
    for root in CUDA_ROOTS:
        candidates += [(inc, root, root) for inc in _root_includes(root)]
    candidates += [(inc, "the nvidia-cuda-* wheels", None) for inc in _wheel_includes()]
    for inc, how, root in candidates:
        if os.path.isdir(inc) and _has_headers(inc):
            nvcc = nvcc_on_path
            if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
                nvcc = os.path.join(root, "bin", "nvcc")
            return CudaHeaders(os.path.realpath(inc), how, nvcc, _version(inc))
    looked = "$CUDA_HOME, $CUDA_PATH, $CUDA_ROOT, nvcc on the PATH, " + ", ".join(CUDA_ROOTS) \
        + " and the nvidia-cuda-* wheels"
    return CudaHeaders(None, looked, nvcc_on_path)


def cuda_headers(options: CompilerOptions) -> CudaHeaders:
    """The CUDA headers ``options`` asks for: found, given, or none.

    Args:
        options: checked options (``cuda_include`` "auto", "none" or an absolute folder).

    Returns:
        CudaHeaders: ``include`` None for "none" or when nothing was found.
    """
    if options.cuda_include == "auto":
        return find_cuda_headers()
    if options.cuda_include == "none":
        return CudaHeaders(None, "not used (--cuda-include none)")
    inc = options.cuda_include
    nvcc = os.path.join(os.path.dirname(inc), "bin", "nvcc")
    return CudaHeaders(inc, "--cuda-include", nvcc if os.path.isfile(nvcc) else shutil.which("nvcc"), _version(inc))


def compiler(language: str) -> list[str]:
    """The system compiler for ``language``.

    Args:
        language: "C" or "C++".

    Returns:
        list[str]: its command as argv (``$CC`` / ``$CXX`` may hold flags).

    Raises:
        ConfigError: the compiler is not installed.
    """
    var = "CC" if language == "C" else "CXX"
    cmd = os.environ.get(var) or sysconfig.get_config_var(var) or ("cc" if language == "C" else "c++")
    argv = shlex.split(cmd)
    if not argv or shutil.which(argv[0]) is None:
        raise ConfigError(f"checking {language} needs a {language} compiler: {cmd!r} is not installed "
                          f"(set ${var})", "conform setup")
    return argv


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: bytes
    log: str


class ToolFailure(Exception):
    """A compiler run that did not finish: too slow, or printing without end."""


def run_tool(argv: list[str], *, timeout: float, cap: int = MAX_LOG_BYTES, cwd: str | None = None) -> RunResult:
    """Run ``argv`` (no shell): its exit status, stdout (at most ``cap`` bytes) and the
    start of its stderr.

    Args:
        argv: the command.
        timeout: seconds before it is killed.
        cap: the most of stdout accepted.
        cwd: the folder to run in.

    Returns:
        RunResult: exit status, stdout, and up to ``MAX_LOG_BYTES`` of stderr as text.

    Raises:
        ToolFailure: it ran past ``timeout``, or printed more than ``cap``.
        OSError: it could not be started.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd)
    out, err, total = [], [], {1: 0, 2: 0}
    streams = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
    deadline = time.monotonic() + timeout
    try:
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolFailure(f"{os.path.basename(argv[0])} ran for more than {timeout:.0f} s")
            ready, _, _ = select.select(list(streams), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    del streams[fd]
                    continue
                which = streams[fd]
                total[which] += len(chunk)
                if which == 1:
                    if total[1] > cap:
                        raise ToolFailure(f"{os.path.basename(argv[0])} printed more than {cap >> 20} MiB")
                    out.append(chunk)
                elif total[2] <= MAX_LOG_BYTES:
                    err.append(chunk)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (ToolFailure, subprocess.TimeoutExpired) as e:
        proc.kill()
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise ToolFailure(f"{os.path.basename(argv[0])} ran for more than {timeout:.0f} s") from None
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return RunResult(proc.returncode, b"".join(out), b"".join(err).decode(errors="replace"))
