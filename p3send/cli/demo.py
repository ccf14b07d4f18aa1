"""``p3send demo``: the main job. One EP combine round at a DeepSeek-V3-like shape on the
GPU it finds, verified against the oracle, with the time per round and the effective
bandwidth next to the device's copy bandwidth measured in the same run. Without a GPU it
says so, runs the oracle and the PTX check instead, and exits 0. The rounds are
``p3send.oracle.rounds``; this file parses and prints."""
from __future__ import annotations

import statistics

from .common import add_world_arguments, check_world_arguments, progress, seed_of, world_and_combine

#: The world the CPU oracle runs without a GPU: tokens and hidden at most these.
CPU_TOKENS, CPU_HIDDEN = 64, 512


def add_arguments(p) -> None:
    add_world_arguments(p, tokens=512)
    p.add_argument("--rounds", type=int, default=20, help="timed graph replays, default 20")
    p.add_argument("--procs", action="store_true", help="one process per rank (CUDA IPC)")
    p.add_argument("--layer", choices=["deepseek", "softmax", "none"], default="deepseek",
                   help="after the round, a whole MoE layer (router, dispatch, expert GEMMs, the combine "
                        "from the down-projection's epilogue) with this router, captured and replayed with new "
                        "tokens, every replay checked against a torch reference (needs torch); default deepseek")


def main(args) -> int:
    from ..cuda import driver
    check_world_arguments(args)
    seed = seed_of(args)
    ok, why = driver.available()
    if not ok:
        return _cpu_only(args, seed, why)
    if args.procs:
        from .procs_demo import demo_procs
        return demo_procs(args, seed)
    from ..oracle import rounds
    world, comb = world_and_combine(args, seed, "p3send demo")
    try:
        comb.round()
        with progress("verifying against the oracle"):
            problems = rounds.check_combine(world, comb)
        if problems:
            print("  NOT VERIFIED:\n    " + "\n    ".join(problems))
            return 1
        times = rounds.replay_times_us(comb, args.rounds)
        with progress("verifying the replays against the oracle"):
            problems = rounds.check_combine(world, comb)
        copy_tbps = rounds.copy_tbps(device=comb.dev) if not problems else None
    finally:
        comb.close()
    if problems:
        print("  NOT VERIFIED after replays:\n    " + "\n    ".join(problems))
        return 1
    rows, moved = rounds.round_traffic(world)
    us = statistics.median(times)
    print(f"  verified: {args.ranks} receive buffers byte-exact (guards and unowned slots untouched), "
          f"counts arrived and re-armed, reduce within bf16 rounding; again after {len(times)} graph replays")
    print(f"  round: {us:.1f} us median of {len(times)} ({rows} rows sent, {moved / 1e6:.1f} MB moved r+w)")
    print(f"  effective bandwidth {moved / us / 1e6:.2f} TB/s vs device copy {copy_tbps:.2f} TB/s "
          f"(read+write counted) = {moved / us / 1e6 / copy_tbps:.0%} of copy")
    return _layer(args, seed) if args.layer != "none" else 0


#: The layer's shape in the demo (small experts: the point is the whole path, verified).
LAYER_HIDDEN, LAYER_INTER, LAYER_EXPERTS_PER_RANK = 1024, 512, 8


def _layer(args, seed) -> int:
    try:
        from .. import moe
    except ImportError as e:
        print(f"  SKIPPED: the MoE layer ({e})")
        return 0
    n_experts = args.ranks * LAYER_EXPERTS_PER_RANK
    print(f"  MoE layer: {args.ranks} ranks x 128 tokens, {args.layer} router, top-{args.top_k} of {n_experts} "
          f"experts, hidden {LAYER_HIDDEN}, intermediate {LAYER_INTER}, seed {seed}")
    with progress("capturing the layer and checking 20 replays with new tokens"):
        res = moe.demo(n_ranks=args.ranks, tokens=128, hidden=LAYER_HIDDEN, inter=LAYER_INTER, n_experts=n_experts,
                       top_k=args.top_k, router=args.layer, replays=20, seed=seed)
    verdict = "verified" if res["ok"] else "NOT VERIFIED"
    print(f"  layer {verdict}: {res['replays']} graph replays, largest relative error {res['max_rel_error']:.2e} "
          f"(bound {res['bound']:g}, an fp32 torch reference of the same layer); {res['step_us']:.1f} us a step")
    return 0 if res["ok"] else 1


def _cpu_only(args, seed, why) -> int:
    import argparse

    import numpy as np

    from ..cuda.loader import ptx_dir
    from ..oracle import reference
    from ..oracle.cases import world_case
    from ..oracle.rounds import oracle_round
    from .check_ptx import main as check_ptx
    print(f"p3send demo: no usable GPU here ({why}).")
    tokens, hidden = min(args.tokens, CPU_TOKENS), min(args.hidden, CPU_HIDDEN)
    capped = [f"--{name} {asked} to {used}" for name, asked, used in
              (("tokens", args.tokens, tokens), ("hidden", args.hidden, hidden)) if used != asked]
    print("  SKIPPED: the GPU round, its timing and the copy-bandwidth comparison (they need a GPU).")
    print(f"  running the numpy oracle instead on a small world ({args.ranks} ranks x {tokens} tokens, "
          f"top-{args.top_k}, {args.ranks * args.experts} experts, hidden {hidden}), seed {seed}")
    if capped:
        print(f"  CAPPED for the CPU oracle: {', '.join(capped)} (at most {CPU_TOKENS} tokens and hidden "
              f"{CPU_HIDDEN} without a GPU; the GPU round uses the shape asked for)")
    world = world_case(n_ranks=args.ranks, tokens=tokens, top_k=args.top_k, n_local=args.experts,
                       hidden=hidden, seed=seed)
    recv, out, problems = oracle_round(world)
    for r, d in enumerate(world.ranks):
        first = np.round(reference.bf16_to_f32(out[r][0, :4]).astype(float), 4).tolist() if tokens else []
        print(f"    rank {r}: {int((d.topk_idx >= 0).sum())} slots received, out[0,:4] = {first}")
    print("  the oracle's receive buffers and bf16 outputs pass the demo's own verification"
          if not problems else "  ORACLE SELF-CHECK FAILED:\n    " + "\n    ".join(problems))
    print(f"  checking the shipped PTX in {ptx_dir()}:")
    rc = check_ptx(argparse.Namespace(files=[], arch=None, no_ptxas=False))
    print("  PTX check " + ("passed (NOTE lines above name any check skipped for want of a tool)" if rc == 0
                            else "FAILED") + "; run this on a machine with an NVIDIA GPU for the real round.")
    return 1 if problems or rc else 0
