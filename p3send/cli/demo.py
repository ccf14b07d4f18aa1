"""``p3send demo``: the main job. One EP combine round at a DeepSeek-V3-like shape on the
GPU it finds, verified against the oracle, with the time per round and the effective
bandwidth next to the device's copy bandwidth measured in the same run. Without a GPU it
says so, runs the oracle and the PTX check instead, and exits 0."""
from __future__ import annotations

import contextlib
import statistics
import threading
import time

import numpy as np

from ..abi.config import shape_problems
from ..abi.errors import P3SendError


def add_world_arguments(p, tokens: int) -> None:
    """The EP-world shape options shared by ``demo`` and ``trace``."""
    p.add_argument("--ranks", type=int, default=8, help="EP ranks (all on this GPU), default 8")
    p.add_argument("--tokens", type=int, default=tokens, help=f"tokens per rank, default {tokens}")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size in bf16 elements, default 7168")
    p.add_argument("--top-k", type=int, default=8, help="experts per token, default 8")
    p.add_argument("--experts", type=int, default=32, help="local experts per rank, default 32 (256 in all)")
    p.add_argument("--seed", type=int, default=None)


def add_arguments(p) -> None:
    add_world_arguments(p, tokens=512)
    p.add_argument("--rounds", type=int, default=20, help="timed graph replays, default 20")
    p.add_argument("--procs", action="store_true", help="one process per rank (CUDA IPC)")


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


def shape_line(a) -> str:
    return (f"{a.ranks} ranks x {a.tokens} tokens, top-{a.top_k}, {a.ranks * a.experts} experts "
            f"({a.experts}/rank), hidden {a.hidden} bf16 ({2 * a.hidden} B rows)")


def world_and_combine(args, seed: int, label: str):
    """The seeded EP world of ``args`` (see add_world_arguments) and a guarded one-GPU
    Combine loaded with it; prints the shape and the device. Returns (world, device, combine)."""
    from ..cuda import driver
    from ..ops.combine import Combine
    from ..oracle.cases import world_case
    print(f"{label}: {shape_line(args)}, seed {seed}")
    t0 = time.perf_counter()
    with progress("building the routing and inputs"):
        world = world_case(n_ranks=args.ranks, tokens=args.tokens, top_k=args.top_k, n_local=args.experts,
                           hidden=args.hidden, seed=seed)
    dev = driver.device()
    print(f"  device: {dev}; routing and inputs built in {time.perf_counter() - t0:.1f} s")
    comb = Combine(args.ranks, max_tokens=args.tokens, top_k=args.top_k, hidden=args.hidden,
                   n_local_experts=args.experts, device=dev, guard=True)
    try:
        with progress("uploading the inputs"):
            comb.load_world(world)
    except Exception:
        comb.close()
        raise
    return world, dev, comb


def main(args) -> int:
    from ..cuda import driver
    check_world_arguments(args)
    seed = args.seed if args.seed is not None else int(time.time()) % (1 << 31)
    ok, why = driver.available()
    if not ok:
        return _cpu_only(args, seed, why)
    if args.procs:
        from .procs_demo import demo_procs
        return demo_procs(args, seed)
    from ..oracle.cases import check_world
    world, dev, comb = world_and_combine(args, seed, "p3send demo")
    try:
        comb.round()
        with progress("verifying against the oracle"):
            problems = check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output,
                                   guard=comb.guard)
        if problems:
            print("  NOT VERIFIED:\n    " + "\n    ".join(problems))
            return 1
        graph = comb.capture()
        start, end = driver.Event(), driver.Event()
        times = []
        for _ in range(args.rounds):
            start.record(comb.origin)
            graph.launch(comb.origin)
            end.record(comb.origin)
            end.synchronize()
            times.append(1000.0 * start.elapsed_ms(end))
        comb.check()
        with progress("verifying the replays against the oracle"):
            problems = check_world(world, lambda r: comb.recv_view(r, with_guard=True), comb.output,
                                   guard=comb.guard)
        graph.close()
        copy_tbps = _copy_bandwidth(dev)
    finally:
        comb.close()
    if problems:
        print("  NOT VERIFIED after replays:\n    " + "\n    ".join(problems))
        return 1
    rows = sum(len(d.c) for d in world.ranks)
    msg = 2 * args.hidden
    moved = 2 * rows * msg + args.ranks * args.tokens * (args.top_k + 1) * msg
    us = statistics.median(times)
    print(f"  verified: {args.ranks} receive buffers byte-exact (guards and unowned slots untouched), "
          f"counts arrived and re-armed, reduce within bf16 rounding; again after {len(times)} graph replays")
    print(f"  round: {us:.1f} us median of {len(times)} ({rows} rows sent, {moved / 1e6:.1f} MB moved r+w)")
    print(f"  effective bandwidth {moved / us / 1e6:.2f} TB/s vs device copy {copy_tbps:.2f} TB/s "
          f"(read+write counted) = {moved / us / 1e6 / copy_tbps:.0%} of copy")
    return 0


def _copy_bandwidth(dev, nbytes: int = 1 << 30) -> float:
    from ..cuda import driver
    a, b = driver.DeviceBuffer(nbytes, fill=0x5A), driver.DeviceBuffer(nbytes)
    s = driver.Stream()
    e0, e1 = driver.Event(), driver.Event()
    t = []
    for i in range(12):
        e0.record(s)
        driver.memcpy_dtod(b.ptr, a.ptr, nbytes, s)
        e1.record(s)
        e1.synchronize()
        if i >= 2:
            t.append(e0.elapsed_ms(e1))
    a.free()
    b.free()
    s.close()
    return 2 * nbytes / (statistics.median(t) * 1e-3) / 1e12


def _cpu_only(args, seed, why) -> int:
    import argparse

    from ..abi.layout import SENTINEL
    from ..cuda.loader import ptx_dir
    from ..oracle import reference as ref
    from ..oracle.cases import check_world, world_case, world_recv_expected
    from .ptxcheck import main as check_ptx
    print(f"p3send demo: no usable GPU here ({why}).")
    tokens, hidden = min(args.tokens, 64), min(args.hidden, 512)
    print("  SKIPPED: the GPU round, its timing and the copy-bandwidth comparison (they need a GPU).")
    print(f"  running the numpy oracle instead on a small world ({args.ranks} ranks x {tokens} tokens, "
          f"top-{args.top_k}, {args.ranks * args.experts} experts, hidden {hidden}), seed {seed}")
    world = world_case(n_ranks=args.ranks, tokens=tokens, top_k=args.top_k, n_local=args.experts,
                       hidden=hidden, seed=seed)
    m = world.msg_bytes
    recv, out = {}, {}
    for r in range(args.ranks):
        d = world.ranks[r]
        recv[r] = world_recv_expected(world, r, np.full(tokens * args.top_k * m, SENTINEL, np.uint8))
        out[r] = ref.f32_to_bf16(ref.reduce(recv[r], d.topk_idx, d.weights, world.n_local, world.n_ranks, m))
        print(f"    rank {r}: {int((d.topk_idx >= 0).sum())} slots received, "
              f"out[0,:4] = {np.round(ref.bf16_to_f32(out[r][0, :4]).astype(float), 4).tolist() if tokens else []}")
    problems = check_world(world, recv.__getitem__, out.__getitem__)
    print("  the oracle's receive buffers and bf16 outputs pass the demo's own verification"
          if not problems else "  ORACLE SELF-CHECK FAILED:\n    " + "\n    ".join(problems))
    print(f"  checking the shipped PTX in {ptx_dir()}:")
    rc = check_ptx(argparse.Namespace(files=[], arch=None, no_ptxas=False))
    print("  PTX check " + ("passed (NOTE lines above name any check skipped for want of a tool)" if rc == 0
                            else "FAILED") + "; run this on a machine with an NVIDIA GPU for the real round.")
    return 1 if problems or rc else 0
