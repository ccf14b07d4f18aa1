"""``p3send`` command line: the parser, and one line on stderr with exit status 2 for any
``P3SendError``. Each subcommand imports only what it needs, so ``layout``/``conform``/
``check-ptx`` never touch CUDA."""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..abi.errors import P3SendError

DESCRIPTION = ("p3send: the expert-parallel MoE combine as an in-epilogue peer scatter-send, "
               "hand-written PTX driven from Python.")

EPILOG = """examples:
  p3send layout --format c            the P3PeerSendConfig ABI as a C declaration
  p3send conform my_config.h          check a foreign declaration against the ABI
  p3send check-ptx                    lint and assemble the shipped PTX (CPU only)
  p3send demo                         one verified combine round (the oracle without a GPU)
  p3send bench                        benchmarks against the copy ceiling and the alternatives
  p3send trace --out round            a round's stamps as a Chrome trace and a PNG

'p3send COMMAND --help' lists a command's options."""


def _cmd_layout(args) -> int:
    from ..conform import render
    sys.stdout.write(render(args.format))
    return 0


def _cmd_conform(args) -> int:
    from ..conform import CompilerOptions, check
    options = CompilerOptions(tuple(args.macros or ()), tuple(args.include_dirs or ()), args.cudacc,
                              args.cuda_include)
    report = check(args.path, struct=args.struct, kind=args.kind, options=options)
    sys.stdout.write(report.text())
    return report.status


def _cmd_check_ptx(args) -> int:
    from .check_ptx import main as check_main
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
    ap = argparse.ArgumentParser(prog="p3send", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"p3send {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("layout", help="print the P3PeerSendConfig layout")
    p.add_argument("--format", choices=["table", "json", "c", "mojo", "numpy"], default="table")
    p.set_defaults(func=_cmd_layout)

    p = sub.add_parser("conform", help="check a foreign declaration (C/C++ header, Mojo, JSON) against the ABI")
    p.add_argument("path")
    p.add_argument("--struct", default="P3PeerSendConfig", help="struct name in the file")
    p.add_argument("--kind", choices=["auto", "c", "mojo", "json"], default="auto",
                   help="how to read PATH (auto: by extension)")
    p.add_argument("-D", dest="macros", action="append", type=lambda v: f"-D{v}", metavar="NAME[=VALUE]",
                   help="C/C++: define a macro, as for the compiler (with -U, applied in order)")
    p.add_argument("-U", dest="macros", action="append", type=lambda v: f"-U{v}", metavar="NAME",
                   help="C/C++: undefine a macro")
    p.add_argument("-I", dest="include_dirs", action="append", metavar="DIR",
                   help="C/C++: search DIR for #include files (before the CUDA headers)")
    p.add_argument("--cudacc", choices=["both", "with", "without"], default="both",
                   help="C/C++: check with and/or without __CUDACC__ defined, as nvcc and a host "
                        "compiler see the header (default: both)")
    p.add_argument("--cuda-include", default="auto", metavar="auto|none|DIR",
                   help="C/C++: the CUDA headers (default auto: $CUDA_HOME, nvcc's toolkit, "
                        "/usr/local/cuda, the nvidia-cuda-* wheels)")
    p.set_defaults(func=_cmd_conform)

    p = sub.add_parser("check-ptx", help="lint PTX and assemble it for sm_90 and sm_100, report resources")
    from .check_ptx import add_arguments as check_ptx_args
    check_ptx_args(p)
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
