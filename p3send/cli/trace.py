"""``p3send trace``: a verified round's %globaltimer stamps as a Chrome trace, a summary
and a PNG (the conversion is ``p3send.tracing``; the round ``oracle.rounds.traced_round``)."""
from __future__ import annotations

import json
import os
import sys

from ..abi.errors import P3SendError
from .common import add_world_arguments, check_output_path, check_world_arguments, seed_of, world_and_combine


def add_arguments(p) -> None:
    add_world_arguments(p, tokens=128)
    p.add_argument("--warmup", type=int, default=1,
                   help="untraced rounds first (lazy module loading, cold caches), default 1")
    p.add_argument("--from", dest="from_file", metavar="FILE", default=None,
                   help="convert a timeline saved with --save instead of running a round (no GPU needed)")
    p.add_argument("--out", metavar="PREFIX", default="p3send-trace",
                   help="write PREFIX.json (Chrome trace) and PREFIX.png, default p3send-trace")
    p.add_argument("--save", metavar="FILE", default=None, help="also store the raw stamps as JSON")


def _gpu_round(args) -> tuple[dict | None, int]:
    """(timeline, exit status) of one verified round at the requested shape; (None, 0)
    without a GPU."""
    from ..cuda import driver
    from ..oracle.rounds import traced_round
    ok, why = driver.available()
    if not ok:
        print(f"p3send trace: no usable GPU here ({why}); nothing to trace. "
              "Use --from FILE to convert stamps saved with --save on a GPU machine.")
        return None, 0
    world, comb = world_and_combine(args, seed_of(args), "p3send trace")
    try:
        timeline, problems = traced_round(world, comb, args.warmup)
    finally:
        comb.close()
    if problems:
        print("  NOT VERIFIED (the trace is still written):\n    " + "\n    ".join(problems))
        return timeline, 1
    print(f"  verified against the oracle; traced round after {max(0, args.warmup)} warm-up round(s)")
    return timeline, 0


def _check_paths(args) -> None:
    """Refuse an --out/--save that would overwrite the --from file or each other
    (``--from round.json --out round`` would otherwise replace the stamps with the trace)."""
    roles = {"--from FILE": args.from_file, "--out PREFIX.json": f"{args.out}.json",
             "--out PREFIX.png": f"{args.out}.png", "--save FILE": args.save}
    seen: dict[str, str] = {}
    for role, path in roles.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise P3SendError(f"{role} and {seen[real]} are the same file ({path}); choose another name")
        seen[real] = role


def main(args) -> int:
    from .. import tracing
    for path, option in ((f"{args.out}.json", "--out"), (args.save, "--save")):
        if path is not None:
            check_output_path(path, option)
    if args.from_file is None:
        check_world_arguments(args)
    _check_paths(args)
    if args.from_file is not None:
        try:
            timeline, rc = tracing.read_timeline(args.from_file), 0
        except P3SendError as e:
            raise P3SendError(f"--from: {e}") from None
        print(f"p3send trace: stamps from {args.from_file}")
    else:
        timeline, rc = _gpu_round(args)
        if timeline is None:
            return rc
    if args.save:
        with open(args.save, "w", encoding="utf-8") as fh:
            json.dump({str(r): e for r, e in timeline.items()}, fh)
        print(f"  raw stamps saved to {args.save}")
    sys.stdout.write(tracing.summarize(timeline))
    trace = tracing.to_chrome_trace(timeline)
    json_path, png_path = f"{args.out}.json", f"{args.out}.png"
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(trace, fh)
    n = sum(1 for ev in trace["traceEvents"] if ev["ph"] == "X")
    print(f"  wrote {json_path} ({n} events; open in https://ui.perfetto.dev or chrome://tracing)")
    if tracing.plot(timeline, png_path):
        print(f"  wrote {png_path}")
    else:
        print("  no PNG: matplotlib is not installed (pip install 'p3send[plot]'); the JSON is written")
    return rc
