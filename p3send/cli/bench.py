"""``p3send bench``: the send and the combine round against the hardware's ceilings and
the alternatives a user would pick, measured in ONE run on the GPU it finds. The
measurements are ``p3send.bench``; this is the command: its options, their checks, the
table printed and the JSON written. Method: docs/PERF.md."""
from __future__ import annotations

import json

from ..bench import registry, report
from ..cuda import driver
from .common import check_output_path, check_world_arguments


def add_arguments(p) -> None:
    p.add_argument("--only", action="append", default=None, choices=registry.SECTIONS,
                   help="run only these sections (default: all)")
    p.add_argument("--tokens", type=int, default=4096, help="prefill tokens per rank (default 4096)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=32, help="local experts per rank")
    p.add_argument("--gemm-k", type=int, default=2048, help="K of the down-projection GEMM (gemm section)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default="p3send-bench.json", help="where to write the results")
    p.add_argument("--hold", action="store_true",
                   help="hold each timed loop's stream with a short kernel until every launch is enqueued "
                        "(no host launch gap can enter a timing; the send sections always do)")


def main(args) -> int:
    check_world_arguments(args)            # the shape rules the GPU path applies, before any work
    check_output_path(args.json, "--json")
    ok, why = driver.available()
    if not ok:
        print(f"p3send bench: no usable GPU here ({why}); nothing to measure.")
        return 0
    args.only = list(args.only or registry.SECTIONS)
    out = registry.run(args, seed=args.seed, only=args.only)
    print(report.render(out))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    return 0
