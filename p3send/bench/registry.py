"""The bench's sections in the order they run and print: one ``Section`` per name, each a
``run(ctx, out)`` that measures into the results dict and a ``table(out) -> str`` that
renders its part of the table from those results alone. A new section is one module and
one line of ``REGISTRY`` (this package's docstring says how)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..abi.errors import ConfigError
from ..cuda import driver
from . import decode, dispatch, epilogue, gemm, gemm_fp8, latency, nvshmem, send, two_gpu, wire
from .data import torch_or_none


@dataclass(frozen=True)
class Section:
    name: str                               # its --only choice and its key in the results
    run: Callable[..., None]                # run(ctx, out): measure into out
    table: Callable[[dict], str]            # its part of the table ("" when out has none of it)


REGISTRY = (
    Section("prefill", send.run_prefill, send.table_prefill),
    Section("decode_send", send.run_decode_send, send.table_decode_send),
    Section("budget", send.run_budget, send.table_budget),
    Section("decode", decode.run, decode.table),
    Section("latency", latency.run_latency, latency.table_latency),
    Section("host", latency.run_host, latency.table_host),
    Section("epilogue", epilogue.run, epilogue.table),
    Section("two_gpu", two_gpu.run, two_gpu.table),
    Section("gemm", gemm.run, gemm.table),
    Section("gemm_fp8", gemm_fp8.run, gemm_fp8.table),
    Section("dispatch", dispatch.run, dispatch.table),
    Section("layer", dispatch.run_layer, dispatch.table_layer),
    Section("wire", wire.run, wire.table),
    Section("nvshmem", nvshmem.run, nvshmem.table),
)

#: Every section's name, in order: the --only choices.
SECTIONS = tuple(s.name for s in REGISTRY)


@dataclass
class Context:
    """What a section's ``run`` gets: the options (``args``: tokens, decode_tokens, ranks,
    hidden, top_k, experts, gemm_k, iters, warmup, hold), the sections asked for (``only``),
    the GPU, the seeded rng, torch (None without it) and a stream of its own."""
    args: object
    only: tuple
    dev: driver.Device
    rng: np.random.Generator
    torch: object
    stream: driver.Stream


def run(args, *, seed: int | None = None, only=None) -> dict:
    """Run the sections of ``only`` (default: all), in registry order, on this process's
    GPU; return the results: the device, the seed, the date, the options and one entry per
    section (each section's own keys). ``args``: an argparse namespace or any object with
    Context's option attributes. Needs a usable GPU (``driver.available()``)."""
    only = tuple(only or SECTIONS)
    unknown = [n for n in only if n not in SECTIONS]
    if unknown:
        raise ConfigError([f"only: expected sections of {list(SECTIONS)}, got {unknown}"], "bench run")
    dev = driver.device()
    seed = int(time.time()) if seed is None else seed
    opts = {k: v for k, v in vars(args).items() if not callable(v)}
    out = {"device": dev.name, "sm_count": dev.sm_count, "cc": dev.cc, "seed": seed,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": opts}
    ctx = Context(args=args, only=only, dev=dev, rng=np.random.default_rng(seed), torch=torch_or_none(),
                  stream=driver.Stream())
    for s in REGISTRY:
        if s.name in only:
            s.run(ctx, out)
    return out
