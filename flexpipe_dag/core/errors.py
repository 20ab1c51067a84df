"""Errors FlexPipe raises for bad input or infeasible requests.

Every error says *where* (file, field path) and *what was expected*, so a platform engineer can
fix the input without reading code.
"""

from __future__ import annotations


class FlexPipeError(Exception):
    """Base class of every error FlexPipe raises on purpose."""


class InputError(FlexPipeError, ValueError):
    """Bad user input: a file or a field does not hold what was expected.

    Attributes:
        source: the file (or other source) the bad value came from, e.g. ``cluster.yaml``.
        field: dotted path of the bad field inside that source, e.g. ``nodes[2].memory_gb``.
        problem: what is wrong and what was expected.
    """

    def __init__(self, source: str | None, field: str | None, problem: str):
        self.source = source
        self.field = field
        self.problem = problem
        where = ": ".join(p for p in (source, field) if p)
        super().__init__(f"{where}: {problem}" if where else problem)


class InfeasibleError(FlexPipeError):
    """A request cannot be satisfied on the given cluster; the message names the binding constraint."""
