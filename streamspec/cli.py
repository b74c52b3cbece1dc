"""The `streamspec` command line. Subcommands stay thin: the work lives in the library."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamspec", description="Speculative Streaming for HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="add streams to the default model and show what they predict")
    demo.add_argument("--example", type=int, default=0, help="index of the Spider dev question to show")
    sub.add_parser("prepare", help="convert the default model into the cache (done on first use otherwise)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.example)
    elif args.command == "prepare":
        from .assets import default_model_path

        print(default_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
