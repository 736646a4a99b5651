"""``seqpar`` entry point. Each subcommand lives in its own module ``seqpar.cli.<name>`` that
defines ``add_parser(subparsers)`` (which sets ``func``) -- listed in ``SUBCOMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ["train", "export", "verify", "bench", "plan", "env"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seqpar", description="Exact sequence parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"seqpar.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"seqpar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"seqpar {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
