"""The ``flexpipe`` command line.

Each sub-command lives in its own module under ``flexpipe_dag.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int`` as the default.
Errors FlexPipe raises on purpose (bad input, infeasible plans) print one line to stderr and exit
with status 2; nothing is written.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flexpipe_dag.core.errors import FlexPipeError, one_line

#: Sub-command modules, in the order ``flexpipe --help`` lists them.
SUBCOMMAND_MODULES = ("profile", "plan", "capacity", "simulate", "run", "worker", "shift", "calibrate", "store", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexpipe", description=__doc__.splitlines()[0])
    # DeepSpeed's launcher puts --local_rank=N before the sub-command (LOCAL_RANK carries the same)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"flexpipe_dag.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"flexpipe_dag.cli.{name}":
                continue  # that capability is not built into this checkout
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flexpipe`` script; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlexPipeError as exc:
        print(f"flexpipe {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
