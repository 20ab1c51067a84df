"""The ``flexpipe`` command line.

Each sub-command lives in its own module under ``flexpipe_dag.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int`` as the default.
Errors FlexPipe raises on purpose (bad input, infeasible plans) print one line to stderr and exit
with status 2; nothing is written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from flexpipe_dag.core.errors import FlexPipeError, one_line

#: Sub-command modules, in the order ``flexpipe --help`` lists them.
SUBCOMMAND_MODULES = ("profile", "plan", "fleet", "capacity", "simulate", "run", "serve", "servers", "loadtest", "worker", "shift",
                      "calibrate", "store", "demo")


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, as every other FlexPipe error is: what was
    wrong and where to read more, no usage block first (sub-command parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` to stderr and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``flexpipe`` parser with every sub-command built into this checkout."""
    parser = OneLineArgumentParser(prog="flexpipe", description=__doc__.splitlines()[0])
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


def one_line_warnings(command: str) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints FlexPipe's own warnings (categories defined under
    ``flexpipe_dag``, e.g. an unsorted trace) as ``flexpipe COMMAND: warning: MESSAGE``, one line like its
    errors, without the source file and line Python's default format shows; others as Python does."""
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if category.__module__.startswith("flexpipe_dag."):
            print(f"flexpipe {command}: warning: {one_line(str(message))}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    return show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flexpipe`` script; returns the process exit status."""
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warnings(args.command)
        try:
            status = int(args.func(args) or 0)
            sys.stdout.flush()  # inside the try: a reader that left fails here, not at the interpreter's exit
            return status
        except FlexPipeError as exc:
            print(f"flexpipe {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            if not _stdout_gone():
                raise  # another pipe or socket (a remote stage): a real failure
            return 141  # `flexpipe ... | head`: 128 + SIGPIPE, as a shell reports it, and no traceback


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader left; if so it is pointed at /dev/null, so the
    interpreter's last flush does not fail again (the recipe of Python's ``signal`` docs, "Note on SIGPIPE")."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))  # a pipe without a reader
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), no poll
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return gone


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
