"""One launch per dispatch kernel for every rank of a ``Dispatch`` (all ranks on one GPU):
rank = ``%ctaid.y``, each rank's parameters a row of one parameter block.

The ``*_all`` entries are derived from the shipped kernels, when loaded, by one rule
(``all_ranks_ptx``; nothing derived is stored, so the two cannot drift): the entry takes
``p3_ranks`` (by value, 8 rows of ``stride`` bytes: row r = rank r's parameter block laid out
as the kernel's own parameters, then the rank's own grid.x), every
``ld.param.T %x, [name+off]`` becomes ``ld.param.T %x, [row + offset(name) + off]`` with
row = the address of ``p3_ranks`` + %ctaid.y * stride, and ``%nctaid.x`` becomes the rank's
own grid; a CTA past it exits at once. The kernels read nothing else of the grid
(%ctaid.x / %nctaid.x only), so each rank's CTAs do exactly what its own launch would do.
The largest block (p3_dispatch_send's, 504 bytes) makes 8 rows of 512 bytes: 4,096 bytes,
within the 4,352 of PTX 8.0's parameter space.

A step's 3 - 4 launches per rank on R streams (plus the fork and join events) become 3 - 4
launches on one stream, which is also what each GPU of a real deployment launches. The
fused count kernel's R CTAs wait for each other inside one launch: ``AllRanks`` checks on
the host (the occupancy of the count kernel) that they can all be resident; the split step
(``SPLIT``) never waits inside a launch. Mode "table" (a measurement) reads the rows from
device memory instead (``ld.global.nc``)."""
from __future__ import annotations

import functools
import re

import numpy as np

from ..abi.config import P3_MAX_RANKS as MAX_RANKS
from ..abi.errors import ConfigError, CudaError
from ..cuda import driver, loader, ptxdoc

_LD = re.compile(r"ld\.param\.([us]\d+|b\d+|f\d+)(\s+)(%[A-Za-z0-9_$]+),\s*\[([A-Za-z_][A-Za-z0-9_]*)(?:\+(\d+))?\]")
#: the row of the table: the register names are unused by the shipped kernels
_ROW, _Y, _G, _Q = "%p3all_row", "%p3all_y", "%p3all_g", "%p3all_q"


def all_ranks_ptx(text: str, entry: str, mode: str = "param") -> tuple[str, int, int]:
    """``entry`` of PTX ``text`` as ``entry + "_all"``, every rank's parameters in one block.

    mode "param": the entry takes ``p3_ranks`` (.b8[8 * stride], by value: row r = rank r's
    parameter block, then its own grid.x as a u32) and reads ``ld.param.T %x, [row + o]``
    with row = the parameter's address + %ctaid.y * stride (8 rows of the largest block,
    p3_dispatch_send's, are 4,096 bytes: within PTX 8.0's 4,352); mode "table": the entry
    takes ``p3_table`` (u64: the same rows in device memory) and reads
    ``ld.global.nc.T``. Returns (the PTX text, the row stride in bytes, the offset of the
    rank's grid.x in a row)."""
    decls = ptxdoc.parse_decls(text).get(entry)
    if not decls:
        raise ConfigError([f"{entry}: no such .entry with parameters"], "all-ranks PTX")
    offs = {p.name: p.offset for p in decls}
    gofs = -(-(decls[-1].offset + decls[-1].size) // 8) * 8       # the rank's own grid.x: a u32 after its block
    stride = -(-(gofs + 4) // 8) * 8 if mode == "param" else -(-(gofs + 4) // 16) * 16
    body = text[text.index(".version"):]                  # the header block documents the per-rank entry
    if re.search(r"%ctaid\.[yz]\b", re.sub(r"//[^\n]*", "", body)):   # the rule gives %ctaid.y to the rank
        raise ConfigError([f"{entry}: reads %ctaid.y or %ctaid.z, which the all-ranks launch uses for the rank"],
                          "all-ranks PTX")
    m = re.search(rf"\.visible\s+\.entry\s+{entry}\s*\((.*?)\)", body, re.S)
    if m is None:
        raise ConfigError([f"{entry}: no such .entry"], "all-ranks PTX")
    if mode == "param":
        decl, ld = f".param .align 8 .b8 p3_ranks[{MAX_RANKS * stride}]", "ld.param"
        first = f"    mov.u64             {_ROW}, p3_ranks;\n"
    else:
        decl, ld = ".param .u64 p3_table", "ld.global.nc"
        first = f"    ld.param.u64        {_ROW}, [p3_table];\n"
    body = body[:m.start()] + f".visible .entry {entry}_all(\n    {decl}\n)" + body[m.end():]
    brace = body.index("{", m.start())
    prologue = (f"\n    .reg .b64   {_ROW};\n    .reg .b32   {_Y}, {_G};\n    .reg .pred  {_Q};\n"
                + first +
                f"    mov.u32             {_Y}, %ctaid.y;\n"
                f"    mad.wide.u32        {_ROW}, {_Y}, {stride}, {_ROW};   // this rank's row\n"
                f"    {ld}.u32    {_G}, [{_ROW}+{gofs}];           // this rank's own grid.x\n"
                f"    mov.u32             {_Y}, %ctaid.x;\n"
                f"    setp.ge.u32         {_Q}, {_Y}, {_G};\n"
                f"    @{_Q} exit;                                   // a CTA past this rank's grid\n"
                "    griddepcontrol.launch_dependents;            // the next launch may start (PDL)\n"
                "    griddepcontrol.wait;                         // the launch before has finished (PDL)")
    n_before = len(_LD.findall(body))
    body = body[:brace + 1] + prologue + body[brace + 1:]

    def sub(mm):
        t, sp, reg, name, off = mm.groups()
        if name == "p3_table":
            return mm.group(0)
        if name not in offs:
            raise ConfigError([f"{entry}: ld.param of unknown parameter {name}"], "all-ranks PTX")
        return f"{ld}.{t}{sp}{reg}, [{_ROW}+{offs[name] + int(off or 0)}]"
    out = _LD.sub(sub, body)
    left = re.findall(r"ld\.param\.\w+\s+%[\w$]+,\s*(\[(?!%p3all_row)[^\]]*\])", out)
    if left != ([] if mode == "param" else ["[p3_table]"]):
        raise ConfigError([f"{entry}: ld.param forms the rule does not cover: {left}"], "all-ranks PTX")
    if n_before == 0:
        raise ConfigError([f"{entry}: no ld.param to rewrite"], "all-ranks PTX")
    out = re.sub(r"mov\.u32(\s+)(%[A-Za-z0-9_]+),\s*%nctaid\.x;", rf"mov.u32\1\2, {_G};", out)
    if "%nctaid" in out:
        raise ConfigError([f"{entry}: a %nctaid use the rule does not cover"], "all-ranks PTX")
    return out, stride, gofs


def block_bytes(blk, stride: int) -> bytes:
    """A ParamBlock's parameters laid out at their offsets (the kernel's parameter space)."""
    buf = bytearray(stride)
    for p in blk.kernel.params:
        o = blk.get(p.name)
        buf[p.offset:p.offset + p.size] = bytes(o)
    return bytes(buf)


ENTRIES = ("p3_dispatch_count", "p3_dispatch_send", "p3_dispatch_wait", "p3_dispatch_tally")
#: The launches of a step: name -> (the entry, the RankDispatch parameter block it takes).
BLOCKS = {"tally": ("p3_dispatch_tally", "b_tally"), "count": ("p3_dispatch_count", "b_count"),
          "push": ("p3_dispatch_count", "b_push"), "layout": ("p3_dispatch_count", "b_layout"),
          "send": ("p3_dispatch_send", "b_send"), "wait": ("p3_dispatch_wait", "b_wait"),
          "send_quiet": ("p3_dispatch_send", "b_send")}
#: p3_dispatch_send's flag bit: no per-CTA signal, no arrival flag (``send_quiet``'s rows).
FLAG_NO_SIGNAL = 4
#: threads of a send or wait CTA: the per-rank step's launches (p3send.ops.dispatch takes its
#: SEND_THREADS and WAIT_THREADS from here) and the grids both steps compute from them
ROW_THREADS = 256

#: A step's launches: fused (the count kernels wait for each other inside one launch), fused
#: without the wait (its send without the signal nobody waits for: the launch boundary is the
#: arrival) and split (no launch waits for another CTA of itself: every wait is on an earlier
#: launch).
FUSED, FUSED_NO_WAIT = ("tally", "count", "send", "wait"), ("tally", "count", "send_quiet")
SPLIT = ("tally", "push", "layout", "send", "wait")


_SMEM: dict = {}


def allow_smem(func, nbytes: int) -> None:
    """Raise ``func``'s dynamic shared memory limit to ``nbytes`` unless it is higher already:
    a loaded kernel is shared by every Dispatch of the process (modules are cached), so a
    smaller shape made later must not lower the limit an earlier one launches with."""
    held, most = _SMEM.get(id(func), (None, 0))
    if held is not func:                 # (the entry holds the function: its id is not reused)
        most = 0
    if held is not func or nbytes > most:
        most = max(most, int(nbytes), 1)
        driver.set_max_dynamic_smem(func, most)
        _SMEM[id(func)] = (func, most)


@functools.cache
def param_offset(entry: str, name: str) -> int:
    """The offset of a shipped entry's parameter (its declaration, as the loader checks it)."""
    return {p.name: p.offset for p in ptxdoc.parse_decls(loader.ptx_dir().joinpath(entry + ".ptx").read_text())[
        entry]}[name]


@functools.cache
def _derived(entry: str, mode: str) -> tuple[str, int, int]:
    return all_ranks_ptx(loader.ptx_dir().joinpath(entry + ".ptx").read_text(), entry, mode)


def kernel_all(entry: str, device, mode: str = "param"):
    """The all-ranks entry of the shipped ``entry``, loaded (modules are cached by text):
    (its Kernel, the row stride, the offset of the rank's grid in a row)."""
    text, stride, gofs = _derived(entry, mode)
    return loader.load(text, device=device, name=f"{entry}_all.{mode}.ptx")[entry + "_all"], stride, gofs


class AllRanks:
    """The step of a ``Dispatch``, every rank's kernels in one launch each on one stream:
    grid (the largest of the ranks' own grids, R); a rank's CTAs past its own grid exit at
    once, and it reads its own grid where the kernel reads %nctaid.x.

    ``refresh()`` after any bind / set_tally / set_control of a rank (``Dispatch.enqueue``
    does it when a rank's parameters changed): mode "param" rebuilds the launches'
    parameter blocks on the host (no device operation, nothing synchronised); "table"
    (a measurement) uploads a device table. ``launch(stream, parts)`` enqueues a step's
    launches (``FUSED``, ``FUSED_NO_WAIT`` or ``SPLIT``) with no host wait.

    Raises:
        ConfigError: what one launch cannot do: blocks that differ between ranks; for the
            fused count, R CTAs of the count kernel that could not all be resident at once
            (they wait for each other).
    """

    def __init__(self, d, mode: str = "param", load=None, pdl: bool = True):
        self.d, dev, self.mode = d, d.dev, mode
        #: Launch every launch of a step after its first with programmatic stream serialisation
        #: (PDL): its CTAs may start while the launch before finishes and wait for it in
        #: ``griddepcontrol.wait`` (its completion and memory), so the launch latency between
        #: the kernels is hidden. ``pdl_error``: why it was turned off (the driver refused it).
        self.pdl, self.pdl_error = bool(pdl), None
        self.k, self.stride, self.gofs, self.tab = {}, {}, {}, {}
        for e in ENTRIES:          # ``load``: kernel_all's stand-in (the CPU tests' driver)
            self.k[e], self.stride[e], self.gofs[e] = (load or kernel_all)(e, dev, mode)
        rd0, R = d.ranks[0], d.n_ranks
        allow_smem(self.k["p3_dispatch_count"].func, rd0.count_smem)
        allow_smem(self.k["p3_dispatch_tally"].func, rd0._tally_smem(rd0.count_threads))
        per_sm = driver.occupancy(self.k["p3_dispatch_count"].func, rd0.count_threads, rd0.count_smem)
        self.resident = per_sm * dev.sm_count
        if mode == "table":
            self.tab = {b: driver.DeviceBuffer(R * self.stride[e], fill=0) for b, (e, _) in BLOCKS.items()}
            self.blk = {b: self.k[e].params_block(p3_table=self.tab[b].ptr) for b, (e, _) in BLOCKS.items()}
        else:
            self.blk = {b: self.k[e].params_block() for b, (e, _) in BLOCKS.items()}
        self.grid = {}
        self.refresh()

    def refresh(self) -> None:
        """Every rank's parameter blocks (as its own launches would take them) into the
        launches' rows, each with the rank's own grid."""
        rs = self.d.ranks
        for what in ("tally_threads", "count_threads", "count_smem"):
            vals = {getattr(rd, what) for rd in rs}
            if len(vals) != 1:
                raise ConfigError([f"{what}: differs between ranks ({sorted(vals)}): one launch for all ranks "
                                   f"needs one block"], "all-ranks dispatch")
        own = {"tally": [rd.tally_grid if rd.tally else 0 for rd in rs], "count": [1] * len(rs),
               "push": [1] * len(rs), "layout": [1] * len(rs), "send": [rd.send_grid for rd in rs],
               "wait": [rd.wait_grid for rd in rs], "send_quiet": [rd.send_grid for rd in rs]}
        fo = param_offset("p3_dispatch_send", "flags")
        for b, (e, attr) in BLOCKS.items():
            rows = []
            for rd, g in zip(rs, own[b]):
                row = bytearray(block_bytes(getattr(rd, attr), self.stride[e]))
                row[self.gofs[e]:self.gofs[e] + 4] = int(g).to_bytes(4, "little")
                if b == "send_quiet":        # the rank's send block with FLAG_NO_SIGNAL set
                    flags = int.from_bytes(row[fo:fo + 4], "little") | FLAG_NO_SIGNAL
                    row[fo:fo + 4] = flags.to_bytes(4, "little")
                rows.append(bytes(row))
            raw = b"".join(rows)
            if self.mode == "table":
                self.tab[b].upload(np.frombuffer(raw, np.uint8))
            else:
                self.blk[b].set(p3_ranks=raw + bytes(MAX_RANKS * self.stride[e] - len(raw)))
            self.grid[b] = max(own[b])

    def check_resident(self) -> None:
        """The fused count's R CTAs wait for each other: refuse when they cannot all be resident."""
        if self.resident < self.d.n_ranks:
            raise ConfigError([f"fused: {self.d.n_ranks} CTAs of p3_dispatch_count wait for each other in one "
                               f"launch, and only {self.resident} fit on this GPU at once: use fused=False"],
                              "all-ranks dispatch")

    def launch(self, stream, parts=FUSED) -> None:
        """The launches ``parts`` of a step on ``stream`` (``FUSED``, ``SPLIT``, or a
        diagnostic subset: the kernels keep no state across steps but the count kernel's
        epochs), no host wait."""
        rd, R, g = self.d.ranks[0], self.d.n_ranks, self.grid
        first = True
        for part in parts:
            if part == "tally":
                if not g["tally"]:
                    continue
                shape = ((g["tally"], R), (rd.tally_threads,), rd._tally_smem(rd.tally_threads))
            elif part in ("count", "push", "layout"):
                shape = ((1, R), (rd.count_threads,), rd.count_smem)
            else:
                shape = ((g[part], R), (ROW_THREADS,), 0)
            if first or not self.pdl:
                self.blk[part].launch(shape[0], shape[1], stream, shape[2])
            else:
                self._launch_pdl(self.blk[part], *shape, stream)
            first = False

    def _launch_pdl(self, blk, grid, block, smem: int, stream) -> None:
        """``blk``'s launch with programmatic stream serialisation (``driver.launch_programmatic``);
        if the driver refuses it, PDL is turned off (``pdl_error`` says why) and it launches plainly."""
        driver.ensure_current(blk.kernel.module.device)
        try:
            driver.launch_programmatic(blk.kernel.func, grid, block, smem, stream, blk.addrs, blk.kernel.name)
        except (CudaError, TypeError, ValueError) as e:
            if isinstance(e, CudaError) and "CAPTURE" in str(e).upper():
                raise                       # a capture it broke: never hidden
            self.pdl, self.pdl_error = False, f"{type(e).__name__}: {e}"
            blk.launch(grid, block, stream, smem)

    def close(self) -> None:
        for b in self.tab.values():
            b.free()
        self.tab = {}
