"""``p3send`` command line. Each subcommand imports only what it needs, so
``layout``/``conform``/``check-ptx`` never touch CUDA."""
from __future__ import annotations

import argparse
import sys

from ..abi.errors import P3SendError


def check_output_path(path: str, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written: its folder must
    exist and be writable, and it must not be a folder. One line naming ``option``."""
    import os
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise P3SendError(f"{option} {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise P3SendError(f"{option} {path}: is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise P3SendError(f"{option} {path}: the folder {folder} is not writable")


def _cmd_layout(args) -> int:
    from .conform import render
    sys.stdout.write(render(args.format))
    return 0


def _cmd_conform(args) -> int:
    from .conform import check_path
    problems = check_path(args.path, struct=args.struct, kind=args.kind)
    if problems:
        print(f"{args.path}: {args.struct} does NOT conform to the P3PeerSendConfig ABI "
              f"({len(problems)} problem(s)):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"{args.path}: {args.struct} conforms to the P3PeerSendConfig ABI (184 bytes, align 8, 16 fields)")
    return 0


def _cmd_check_ptx(args) -> int:
    from .ptxcheck import main as check_main
    return check_main(args)


def _cmd_demo(args) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def _cmd_bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args)


def _cmd_trace(args) -> int:
    from .trace import main as trace_main
    return trace_main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="p3send", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("layout", help="print the P3PeerSendConfig layout")
    p.add_argument("--format", choices=["table", "json", "c", "mojo", "numpy"], default="table")
    p.set_defaults(func=_cmd_layout)

    p = sub.add_parser("conform", help="check a foreign declaration (C/C++ header, Mojo, JSON) against the ABI")
    p.add_argument("path")
    p.add_argument("--struct", default="P3PeerSendConfig", help="struct name in the file")
    p.add_argument("--kind", choices=["auto", "c", "mojo", "json"], default="auto",
                   help="how to read PATH (auto: by extension)")
    p.set_defaults(func=_cmd_conform)

    p = sub.add_parser("check-ptx", help="assemble PTX for sm_90 and sm_100 and report resources")
    p.add_argument("files", nargs="*", help="PTX files (default: the shipped ptx/*.ptx)")
    p.add_argument("--arch", action="append", help="target(s), default sm_90 and sm_100")
    p.add_argument("--no-ptxas", action="store_true", help="skip the system ptxas even if present")
    p.set_defaults(func=_cmd_check_ptx)

    p = sub.add_parser("demo", help="run a verified EP combine round (the main job)")
    from .demo import add_arguments as demo_args
    demo_args(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="benchmarks against the copy ceiling and the alternatives")
    from .bench import add_arguments as bench_args
    bench_args(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("trace", help="turn a round's stamps into a Chrome trace (and a PNG)")
    from .trace import add_arguments as trace_args
    trace_args(p)
    p.set_defaults(func=_cmd_trace)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except P3SendError as e:
        print(f"p3send {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
