"""What several commands share: output paths checked up front, the EP-world shape options
and their check, the seed, and the progress line. Imports no other command module."""
from __future__ import annotations

import contextlib
import os
import threading
import time

from ..abi.config import shape_problems
from ..abi.errors import P3SendError


def check_output_path(path: str, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written: its folder must
    exist and be writable, and it must not be a folder. One line naming ``option``."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise P3SendError(f"{option} {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise P3SendError(f"{option} {path}: is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise P3SendError(f"{option} {path}: the folder {folder} is not writable")


def add_world_arguments(p, tokens: int) -> None:
    """The EP-world shape options shared by ``demo`` and ``trace``."""
    p.add_argument("--ranks", type=int, default=8, help="EP ranks (all on this GPU), default 8")
    p.add_argument("--tokens", type=int, default=tokens, help=f"tokens per rank, default {tokens}")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size in bf16 elements, default 7168")
    p.add_argument("--top-k", type=int, default=8, help="experts per token, default 8")
    p.add_argument("--experts", type=int, default=32, help="local experts per rank, default 32 (256 in all)")
    p.add_argument("--seed", type=int, default=None, help="the world's seed, default from the clock (printed)")


#: The CLI option of each shape argument, for messages.
_OPTION = {"n_ranks": "--ranks", "max_tokens": "--tokens", "hidden": "--hidden", "top_k": "--top-k",
           "n_local_experts": "--experts", "decode_tokens": "--decode-tokens", "gemm_k": "--gemm-k"}


def check_world_arguments(a) -> None:
    """Refuse a world shape up front, by the rules the GPU path applies (``shape_problems``:
    the same function ``Combine`` and ``Rank`` check with), so a run without a GPU refuses
    what the GPU would; raises P3SendError, one line naming each option."""
    problems = shape_problems(a.ranks, max_tokens=a.tokens, top_k=a.top_k, hidden=a.hidden,
                              n_local_experts=a.experts)
    if a.seed is not None and a.seed < 0:
        problems.append(f"seed: expected >= 0, got {a.seed}")
    for name, low in (("rounds", 1), ("decode_tokens", 1), ("iters", 1), ("warmup", 0)):
        v = getattr(a, name, None)
        if v is not None and v < low:
            problems.append(f"{name}: expected >= {low}, got {v}")
    k = getattr(a, "gemm_k", None)
    if k is not None and (k < 64 or k % 64):
        problems.append(f"gemm_k: expected a positive multiple of 64, got {k}")
    if problems:
        named = [_OPTION.get(p.split(":")[0], "--" + p.split(":")[0]) + ":" + p.split(":", 1)[1] for p in problems]
        raise P3SendError("; ".join(named))


def seed_of(args) -> int:
    """``--seed``, or one from the clock (printed by the command, so a run can be repeated)."""
    return args.seed if args.seed is not None else int(time.time()) % (1 << 31)


def shape_line(a) -> str:
    return (f"{a.ranks} ranks x {a.tokens} tokens, top-{a.top_k}, {a.ranks * a.experts} experts "
            f"({a.experts}/rank), hidden {a.hidden} bf16 ({2 * a.hidden} B rows)")


@contextlib.contextmanager
def progress(label: str, after_s: float = 1.0):
    """Say ``label ...`` once the step has taken ``after_s``, and then how long it took."""
    t0, said = time.perf_counter(), threading.Event()

    def say():
        said.set()
        print(f"  {label} ...", flush=True)

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            print(f"  {label}: {time.perf_counter() - t0:.1f} s", flush=True)


def world_and_combine(args, seed: int, label: str):
    """The seeded EP world of ``args`` (see add_world_arguments) and a guarded one-GPU
    Combine loaded with it (``oracle.rounds.world_combine``), saying what it builds.
    Returns (world, combine); the caller closes the combine."""
    from ..cuda import driver
    from ..oracle.cases import world_case
    from ..oracle.rounds import world_combine
    print(f"{label}: {shape_line(args)}, seed {seed}")
    t0 = time.perf_counter()
    with progress("building the routing and inputs"):
        world = world_case(n_ranks=args.ranks, tokens=args.tokens, top_k=args.top_k, n_local=args.experts,
                           hidden=args.hidden, seed=seed)
    dev = driver.device()
    print(f"  device: {dev}; routing and inputs built in {time.perf_counter() - t0:.1f} s")
    with progress("loading the kernels and uploading the inputs"):
        comb = world_combine(world, dev)
    return world, comb
