"""The ``linalg-prefill`` command."""

from __future__ import annotations

import argparse
import sys

from .cache import default_cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="linalg-prefill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the kernels, run them on the CPU against the reference")
    demo.add_argument("--backends", default="llvm-cpu,cuda", help="comma-separated backends to build")
    sub.add_parser("clear-cache", help="remove every cached artifact")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(tuple(b for b in args.backends.split(",") if b))
    if args.command == "clear-cache":
        cache = default_cache()
        print(f"removed {cache.clear()} artifacts from {cache.root}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
