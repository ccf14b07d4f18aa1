"""The optional NVSHMEM transport's link seam: find the pinned NVSHMEM wheel, and link a
sending module's PTX with the shim (ptx/nvshmem/p3_nvshmem_shim.ptx) and the wheel's
``libnvshmem_device.a`` into one cubin with nvJitLink (no GPU needed for the link).

The shim was built (tools/build_nvshmem_shim.py) against the headers of exactly
NVSHMEM_WHEEL == NVSHMEM_VERSION, and its compiled code reads NVSHMEM's device state with that
version's layout: another version's library is refused here, by name, before anything links.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import NamedTuple

from ..abi.errors import ConfigError, NoDeviceError, P3SendError
from . import driver, ptxdoc, ptxinline
from .loader import ptx_dir

#: The wheel the shim was built against, and its version (``pip install 'p3send[nvshmem]'``).
NVSHMEM_WHEEL = "nvidia-nvshmem-cu13"
NVSHMEM_VERSION = "3.4.5"
INSTALL = f"pip install 'p3send[nvshmem]' (it pins {NVSHMEM_WHEEL}=={NVSHMEM_VERSION})"
#: The shim's file, in a folder of the shipped PTX directory of its own: it is no kernel module (no
#: entry, .extern internals that only libnvshmem_device.a defines), so the checks of ptx/*.ptx skip it.
SHIM = "nvshmem/p3_nvshmem_shim.ptx"
#: The architectures the link is tested for (the shim is sm_90 PTX; a newer arch JIT-compiles it).
ARCHS = ("sm_90", "sm_100")
#: The shipped modules that send; each links with the shim. Those that call p3_send_rows hold its
#: put path (its NVSHMEM regions, kept by ``shipped_module``); p3_scatter_send has none (the
#: transport sends through p3_scatter_send_fp8 on either wire).
SENDERS = ("p3_scatter_send", "p3_scatter_send_fp8", "p3_epilogue_send", "p3_gemm_send", "p3_gemm_fp8_send")
PUT_PATH = ("p3_scatter_send_fp8", "p3_epilogue_send", "p3_gemm_send", "p3_gemm_fp8_send")
#: The modules whose p3_send_rows call ``shipped_module`` inlines in the text (what the default
#: whole-program JIT does by itself; a relocatable link keeps it a real call with its register saves):
#: the transport's scatter send. p3_epilogue_send inlined needs 194 registers a thread (two sites),
#: and the GEMMs' nvcc-made call sites are of another shape: they keep the call.
INLINED = ("p3_scatter_send_fp8",)


class NvshmemUnavailable(P3SendError, RuntimeError):
    """The NVSHMEM transport cannot be used here: its wheel (or nvshmem4py, or nvJitLink) is not
    installed, or a file the wheel should hold is missing. The message says what to install."""


class NvshmemVersionError(NvshmemUnavailable):
    """The installed NVSHMEM wheel (or the host library loaded) is not the version the shim was
    built against. ``found``: the version found; ``expected``: NVSHMEM_VERSION."""

    def __init__(self, message: str, found: str, expected: str = NVSHMEM_VERSION):
        self._init_args = (message, found, expected)
        self.found, self.expected = found, expected
        super().__init__(message)


class NvshmemLinkError(P3SendError):
    """nvJitLink refused to link a sending module with the shim and libnvshmem_device.a;
    ``log``: its error log."""

    def __init__(self, message: str, log: str = ""):
        self._init_args = (message, log)
        self.log = log
        super().__init__(message + (f"\n{log}" if log else ""))


class Wheel(NamedTuple):
    """The files of the pinned NVSHMEM wheel that p3send uses."""

    version: str
    root: Path          # site-packages/nvidia/nvshmem
    include: Path       # its headers (what the shim is compiled against)
    device_lib: Path    # lib/libnvshmem_device.a (linked into every sending module)
    host_lib: Path      # lib/libnvshmem_host.so.3 (loaded by p3send.ops.nvshmem)

    @property
    def origin(self) -> str:
        return f"{NVSHMEM_WHEEL} {self.version} ({self.root})"


def wheel() -> Wheel:
    """The pinned NVSHMEM wheel's files.

    Raises:
        NvshmemUnavailable: the wheel is not installed, or lacks a file p3send needs.
        NvshmemVersionError: the installed wheel is another version than NVSHMEM_VERSION.
    """
    try:
        dist = importlib.metadata.distribution(NVSHMEM_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise NvshmemUnavailable(f"the NVSHMEM transport needs the {NVSHMEM_WHEEL} wheel, version "
                                 f"{NVSHMEM_VERSION}, which is not installed: {INSTALL}") from None
    if dist.version != NVSHMEM_VERSION:
        raise NvshmemVersionError(
            f"{NVSHMEM_WHEEL}: expected version {NVSHMEM_VERSION} (the one ptx/{SHIM} was built against; "
            f"another version's device state layout may differ), got {dist.version}: {INSTALL}, or rebuild "
            "the shim against it with tools/build_nvshmem_shim.py after changing NVSHMEM_VERSION", dist.version)
    root = Path(dist.locate_file("nvidia/nvshmem"))
    w = Wheel(dist.version, root, root / "include", root / "lib" / "libnvshmem_device.a",
              root / "lib" / "libnvshmem_host.so.3")
    for what, path in (("headers", w.include / "nvshmem.h"), ("device library", w.device_lib),
                       ("host library", w.host_lib)):
        if not path.is_file():
            raise NvshmemUnavailable(f"{NVSHMEM_WHEEL} {dist.version}: its {what} {path} is missing "
                                     f"(a broken install?): {INSTALL}")
    return w


def shim_text() -> str:
    """The shipped shim's PTX text."""
    path = ptx_dir() / SHIM
    if not path.is_file():
        raise NvshmemUnavailable(f"the shipped PTX directory {ptx_dir()} has no {SHIM}")
    return path.read_text()


def shipped_module(entry: str, *, inline: bool | None = None) -> tuple[str, str]:
    """(file name, PTX text) of the shipped module ``entry``, assembled as the loader assembles it
    but with the NVSHMEM transport's regions kept (the put path, calling the shim): the linkable
    functions it calls (p3_send_rows.ptx's) appended, and given internal linkage
    (``.func``). nvJitLink compiles its inputs relocatably, so a ``.visible .func`` stays a real
    call there: in the GEMMs p3_send_rows then needs more registers than the entry's budget and
    the link fails. Internal, ptxas may inline them as the driver's whole-program JIT does.

    ``inline`` (default: ``entry in INLINED``): p3_send_rows's call sites replaced by its body
    (``p3send.cuda.ptxinline``), as the whole-program JIT of the default module inlines it.

    Raises:
        NvshmemUnavailable: no such shipped file.
    """
    path = ptx_dir() / f"{entry}.ptx"
    if not path.is_file():
        raise NvshmemUnavailable(f"no shipped PTX named {entry!r} in {ptx_dir()}")
    siblings = [(p.name, p.read_text()) for p in sorted(ptx_dir().glob("*.ptx")) if p != path]
    text = ptxdoc.module_text(path.read_text(), siblings, nvshmem=True)    # the put path's regions kept
    text = re.sub(r"\.visible(\s+\.func\b)", r"\1", text)
    if inline if inline is not None else entry in INLINED:
        try:
            text, _ = ptxinline.inline_calls(text, "p3_send_rows")
        except ConfigError as e:
            raise NvshmemLinkError(f"{path.name}: cannot inline p3_send_rows: {e}") from e
    return path.name, text


def link_cubin(sources, arch: str) -> tuple[bytes, str]:
    """Link a sending module with the shim and libnvshmem_device.a for ``arch``.

    Args:
        sources: (name, PTX text) pairs of the sending module (its ``.extern .func
            p3_nvshmem_*`` declarations resolved by the shim).
        arch: ``"sm_90"``, ``"sm_100"``, ... (nvJitLink's ``-arch``).

    Returns:
        (cubin, nvJitLink's info log). Load the cubin, then call ``nvshmemx_cumodule_init`` on
        the module before its first launch (p3send.ops.nvshmem does both).

    Raises:
        NvshmemUnavailable: the wheel or nvJitLink is missing; NvshmemVersionError: another
            NVSHMEM version; NvshmemLinkError: nvJitLink refused (its log attached).
    """
    w = wheel()
    inputs = [(str(n), t) for n, t in sources] + [(SHIM, shim_text())]
    try:
        image, info, error = driver.nvjitlink_image(inputs, [f"-arch={arch}"], [w.device_lib])
    except NoDeviceError as e:
        raise NvshmemUnavailable(str(e)) from e
    if error:
        names = ", ".join(n for n, _ in inputs)
        raise NvshmemLinkError(f"nvJitLink could not link {names} with {w.device_lib.name} ({w.origin}) "
                               f"for {arch}", error)
    return image, info
