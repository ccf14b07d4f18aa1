"""Load p3send's PTX through the driver, check each entry's parameters against its
documented table before any launch, and launch with prebuilt parameter blocks.

The typed launchers built on this live in ``p3send.ops``.
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import numpy as np

from ..abi.config import P3_MAX_RANKS, P3PeerSendConfig, describe_value
from ..abi.files import read_text
from ..abi.errors import ConfigError, ConfigTypeError, CudaError, P3SendError, ParamMismatchError
from ..cuda import driver, ptxdoc


class PeerPtrs(ctypes.LittleEndianStructure):
    """``u64[8]`` passed by value (e.g. ``count_ptrs``)."""
    _fields_ = [("p", ctypes.c_uint64 * P3_MAX_RANKS)]


_CTYPES = {"u64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32,
           "s32": ctypes.c_int32, "f32": ctypes.c_float, "P3PeerSendConfig": P3PeerSendConfig,
           "u64[8]": PeerPtrs}
#: The integer parameter types: their PTX name and range (a value outside is refused, never wrapped).
_INT_RANGES = {ctypes.c_uint64: ("u64", 0, (1 << 64) - 1), ctypes.c_int64: ("s64", -(1 << 63), (1 << 63) - 1),
               ctypes.c_uint32: ("u32", 0, (1 << 32) - 1), ctypes.c_int32: ("s32", -(1 << 31), (1 << 31) - 1)}


def ptx_dir() -> Path:
    """The shipped PTX directory: inside the installed package, else ``<repo>/ptx``."""
    pkg = Path(__file__).resolve().parent.parent
    for d in (pkg / "ptx", pkg.parent / "ptx"):
        if d.is_dir() and any(d.glob("*.ptx")):
            return d
    raise P3SendError(f"no shipped PTX found: looked in {pkg / 'ptx'} and {pkg.parent / 'ptx'}")


class Kernel:
    """One ``.entry`` of a loaded module, with its parameter table (from the PTX header)."""

    def __init__(self, module: Module, name: str, params: list[ptxdoc.Param]):
        self.module, self.name, self.params = module, name, params
        self.func = driver.get_function(module.handle, name)
        want = [(p.offset, p.size) for p in params]
        try:
            got = driver.param_info(self.func, len(params))
        except CudaError as e:
            raise ParamMismatchError(f"{module.name}: entry {name} has fewer parameters than the "
                                     f"{len(params)} documented ({e})") from e
        if got != want:
            rows = "\n".join(f"  param {i} ({p.name}): documented {w}, driver {g}"
                             for i, (p, w, g) in enumerate(zip(params, want, got)) if w != g)
            raise ParamMismatchError(
                f"{module.name}: entry {name}: the driver's parameter layout (offset, size) differs from "
                f"the documented table:\n{rows}")
        self.num_regs = driver.func_attribute(self.func, "NUM_REGS")
        self.max_threads = driver.func_attribute(self.func, "MAX_THREADS_PER_BLOCK")

    def params_block(self, **values) -> ParamBlock:
        return ParamBlock(self, **values)

    def __repr__(self):
        return f"Kernel({self.name}, {len(self.params)} params, {self.num_regs} regs)"


class ParamBlock:
    """Live ctypes objects for every parameter plus the array of their addresses, so a
    repeated launch costs one ``cuLaunchKernel`` (the fast host path)."""

    def __init__(self, kernel: Kernel, **values):
        self.kernel = kernel
        self._objs = {}
        for p in kernel.params:
            ct = _CTYPES.get(p.type)
            if ct is None:
                ct = ctypes.c_uint8 * p.size
            self._objs[p.name] = ct()
        self.addrs = np.array([ctypes.addressof(o) for o in self._objs.values()], dtype=np.uint64)
        self.set(**values)

    def set(self, **values) -> ParamBlock:
        """Store parameter values, each checked against its type: an integer parameter takes an
        int or numpy integer in its type's range, or (any of them) a buffer, stored as its device
        address (``driver.device_ptr``); ``u64[8]`` up to 8 such addresses; ``f32`` a number;
        the config struct a P3PeerSendConfig; an opaque one bytes of its size.

        Args:
            **values: parameter name -> value.

        Returns:
            self.

        Raises:
            ConfigTypeError: an unknown parameter, or a value of the wrong kind (a float, bool,
                str or None for an integer) naming the kernel and parameter.
            ConfigError: an integer outside its type's range (e.g. -1 for a u64), named so.
        """
        for name, v in values.items():
            obj = self._objs.get(name)
            if obj is None:
                raise ConfigTypeError(f"{self.kernel.name}: no parameter {name!r}; parameters are "
                                f"{', '.join(self._objs)}", "kernel parameters")
            if isinstance(obj, P3PeerSendConfig):
                if not isinstance(v, P3PeerSendConfig):
                    raise ConfigTypeError(f"{self.kernel.name}.{name}: expected a P3PeerSendConfig, "
                                          f"got {type(v).__name__}", "kernel parameters")
                ctypes.memmove(ctypes.addressof(obj), ctypes.addressof(v), ctypes.sizeof(obj))
            elif isinstance(obj, PeerPtrs):
                vals = [self._integer(f"{name}[{i}]", x, ctypes.c_uint64) for i, x in enumerate(v)]
                if len(vals) > P3_MAX_RANKS:
                    raise ConfigError(f"{name}: at most {P3_MAX_RANKS} addresses, got {len(vals)}", "kernel parameters")
                obj.p[:] = vals + [0] * (P3_MAX_RANKS - len(vals))
            elif isinstance(obj, ctypes.Array):
                b = bytes(v)
                if len(b) != ctypes.sizeof(obj):
                    raise ConfigError(f"{name}: expected {ctypes.sizeof(obj)} bytes, got {len(b)}", "kernel parameters")
                ctypes.memmove(ctypes.addressof(obj), b, len(b))
            elif isinstance(obj, ctypes.c_float):
                obj.value = float(v)
            else:
                obj.value = self._integer(name, v, type(obj))
        return self

    def _integer(self, name: str, v, ct) -> int:
        kind, lo, hi = _INT_RANGES[ct]
        where = f"{self.kernel.name}.{name}"
        if v is None or isinstance(v, (bool, np.bool_, float, np.floating, complex, str, bytes)):
            raise ConfigTypeError([f"{where}: expected an integer ({kind}) or a device buffer, got "
                                   f"{describe_value(v)}"], "kernel parameters")
        x = int(v) if isinstance(v, (int, np.integer)) else driver.device_ptr(v, where)
        if not lo <= x <= hi:
            raise ConfigError([f"{where}: expected a {kind} value ({lo}..{hi}), got {x}"], "kernel parameters")
        return x

    def get(self, name):
        return self._objs[name]

    def launch(self, grid, block, stream: driver.Stream, smem: int = 0) -> None:
        driver.ensure_current(self.kernel.module.device)
        driver.launch(self.kernel.func, grid, block, smem, stream, self.addrs, self.kernel.name)


class Module:
    """A PTX file (or string) JIT-loaded on a device, with every documented entry checked.

    ``image``: a cubin already linked from ``text``'s sources (see ``link``)."""

    def __init__(self, text: str, name: str, dev: driver.Device, image: bytes | None = None):
        self.name, self.text, self.device = name, text, dev
        target = ptxdoc.ptx_target(text)
        if target and target.startswith("sm_"):
            need = int(target[3:].rstrip("af"))
            have = dev.cc[0] * 10 + dev.cc[1]
            if have < need:
                raise P3SendError(f"{name}: PTX targets {target}, but {dev.name} is sm_{have}")
        dev.activate()
        if image is None:
            self.handle, self.info_log = driver.load_module(text, name)
        else:
            self.handle, self.info_log = driver.load_image(image), ""
        entries = ptxdoc.parse_header(text)
        decls = ptxdoc.parse_decls(text)
        self.kernels: dict[str, Kernel] = {}
        for ename, params in decls.items():
            documented = entries.get(ename)
            if documented is not None and documented.kind == "entry":
                self.kernels[ename] = Kernel(self, ename, documented.params)
            elif ename not in entries and _is_entry(text, ename):
                self.kernels[ename] = Kernel(self, ename, params)  # a user's PTX without a header

    def __getitem__(self, name) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise ConfigError(f"{self.name} has no entry {name!r}; entries: {', '.join(self.kernels)}",
                              "kernel name") from None


def _is_entry(text: str, name: str) -> bool:
    import re
    return re.search(rf"\.entry\s+{re.escape(name)}\s*\(", text) is not None


_modules: dict[tuple[int, str], Module] = {}


def load(source, *, device: driver.Device | None = None, name: str | None = None) -> Module:
    """Load PTX from a shipped entry name (``"p3_scatter_send"``), a path, or PTX text.

    Args:
        source: an entry name of a shipped file, a path (``Path``, or a str ending in
            ``.ptx`` or holding a ``/``), or PTX text (str or bytes).
        device: the GPU (default ``driver.device()``).
        name: the name JIT messages give the text (default: the file's name).

    Returns:
        The Module (cached per device and content); index it by entry name for a Kernel.

    Raises:
        CudaError: the JIT refused the text (its log attached); ParamMismatchError: an
        entry's parameters differ from its header; InputFileError: an unreadable path.
    """
    dev = device or driver.device()
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and
                                     (source.endswith(".ptx") or "/" in source)):
        path = Path(source)
        text, name = read_text(path, what="PTX file"), name or path.name
    elif isinstance(source, str) and "\n" not in source:
        path = ptx_dir() / f"{source}.ptx"
        if not path.exists():
            raise P3SendError(f"no shipped PTX named {source!r} in {ptx_dir()}")
        text, name = path.read_text(), name or path.name
        # a kernel that calls the linkable functions is one module with them appended
        siblings = [(p.name, p.read_text()) for p in sorted(ptx_dir().glob("*.ptx")) if p != path]
        try:
            text = ptxdoc.module_text(text, siblings)
        except ValueError as e:
            raise P3SendError(f"{name}: {e}") from e
    else:
        text = source.decode() if isinstance(source, bytes) else source
        name = name or "<ptx string>"
    key = (dev.ordinal, hashlib.sha1(text.encode()).hexdigest())
    mod = _modules.get(key)
    if mod is None:
        mod = _modules[key] = Module(text, name, dev)
    return mod


def link(sources, *, device: driver.Device | None = None, name: str = "<linked>",
         max_registers: int | None = None, libraries=()) -> Module:
    """Link PTX sources with the driver's JIT linker, resolving ``.extern .func``
    references across them: how a runtime links p3send's device functions into its own
    kernel. Every documented entry of the sources is checked as in ``load``.

    Args:
        sources: (name, text) pairs; names of shipped files may be given alone, e.g.
            ``"p3_send_rows"``.
        device: the GPU (default ``driver.device()``).
        name: the linked module's name in messages.
        max_registers: ``CU_JIT_MAX_REGISTERS`` for the link, or None.
        libraries: device-code archives to link as well (paths, e.g. libcudadevrt.a).

    Returns:
        The linked Module.

    Raises:
        CudaError: the linker refused (its log attached).
    """
    dev = device or driver.device()
    pairs = []
    for src in sources:
        if isinstance(src, str):
            path = ptx_dir() / f"{src}.ptx"      # shipped: without the NVSHMEM transport's regions
            pairs.append((path.name, ptxdoc.without_nvshmem(path.read_text())))
        else:
            pairs.append((src[0], src[1]))
    dev.activate()
    image, _ = driver.link_ptx(pairs, {"CU_JIT_MAX_REGISTERS": max_registers} if max_registers else None,
                               libraries)
    return Module("\n".join(t for _, t in pairs), name, dev, image=image)


def kernel(entry: str, device: driver.Device | None = None) -> Kernel:
    """A shipped kernel by entry name (file name == entry name).

    Args:
        entry: e.g. ``"p3_scatter_send"``.
        device: the GPU (default ``driver.device()``).
    """
    return load(entry, device=device)[entry]


def abi_echo(cfg: P3PeerSendConfig, tag: int = 0x5EED_0F_C0FFEE, device=None) -> tuple[bytes, int]:
    """Launch ``p3_abi_echo``: proves a by-value launch of the struct.

    Args:
        cfg: the config to pass by value.
        tag: a u64 the kernel echoes after the struct.
        device: the GPU (default ``driver.device()``).

    Returns:
        (the 184 bytes the device saw, the tag it saw).
    """
    k = kernel("p3_abi_echo", device)
    out = driver.DeviceBuffer(192, fill=0)
    try:
        s = driver.Stream()
        k.params_block(cfg=cfg, out=out, tag=tag).launch((1,), (32,), s)
        s.synchronize()
        raw = out.download()
        s.close()
    finally:
        out.free()
    return raw[:184].tobytes(), int(raw[184:192].view(np.uint64)[0])
