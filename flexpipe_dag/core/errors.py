"""Errors FlexPipe raises for bad input or infeasible requests.

Every error says *where* (file, field path) and *what was expected*, so a platform engineer can
fix the input without reading code.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

#: Most characters of one user-supplied value an error message quotes (:func:`shown`).
MAX_SHOWN_CHARS = 200
#: Longest message (problem, file or field) an :class:`InputError` carries; longer text is cut, with a note.
MAX_MESSAGE_CHARS = 1000


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` made safe to print on one terminal line: at most ``limit`` characters of it.

    Every character Python does not count as printable (line breaks, tabs, ESC and other control
    characters, NUL, the bidirectional overrides U+202A-U+202E / U+2066-U+2069, other format
    characters) is written as its escape (``\\x1b``, ``\\u202e``), as ``repr`` writes it; text over
    ``limit`` characters is cut and says how long it was.
    """
    head = text[:limit]
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in head)
    return out if len(text) <= limit else f"{out}... ({len(text)} characters, cut)"


def first_line(exc: BaseException, text: str | None = None) -> str:
    """The first non-blank line of ``text`` (default ``str(exc)``), else the exception's type name:
    the gist of an error whose text runs on (torch's C++ errors append dozens of stack frames, drivers
    and Alembic add context lines)."""
    body = (str(exc) if text is None else text).strip()
    return body.splitlines()[0] if body else type(exc).__name__


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A user's value quoted for an error message: ``repr``-style, at most ``limit`` characters of it.

    A string longer than ``limit`` shows its first ``limit`` characters and its length; control and
    bidirectional characters come out escaped (``'a\\x1b[31m'``), so nothing a user wrote can move the
    cursor, recolour the terminal or reorder the line.
    """
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()  # a pandas / numpy scalar reads as the number it holds, not np.float64(...)
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 20:  # repr of a huge container is itself huge
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class FlexPipeError(Exception):
    """Base class of every error FlexPipe raises on purpose."""


class InputError(FlexPipeError, ValueError):
    """Bad user input: a file or a field does not hold what was expected.

    The message is one line of bounded length whatever it quotes: :func:`one_line` escapes control
    and bidirectional characters and cuts ``source`` / ``field`` at 300 characters and ``problem`` at
    :data:`MAX_MESSAGE_CHARS`.

    Attributes:
        source: the file (or other source) the bad value came from, e.g. ``cluster.yaml``.
        field: dotted path of the bad field inside that source, e.g. ``nodes[2].memory_gb``.
        problem: what is wrong and what was expected.
    """

    def __init__(self, source: str | None, field: str | None, problem: str):
        self.source = None if source is None else one_line(source, MAX_SHOWN_CHARS + 100)
        self.field = None if field is None else one_line(field, MAX_SHOWN_CHARS + 100)
        self.problem = one_line(problem)
        source, field, problem = self.source, self.field, self.problem
        where = ": ".join(p for p in (source, field) if p)
        super().__init__(f"{where}: {problem}" if where else problem)


class InfeasibleError(FlexPipeError):
    """A request cannot be satisfied on the given cluster; the message names the binding constraint."""


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_input_error(source: str, err: ValidationError) -> InputError:
    """One :class:`InputError` for a pydantic ``ValidationError`` of a document read from ``source``.

    Names the first problem's field path (``fleet[2].count``) and message, with the value given where
    it helps (never a whole mapping), and counts the other problems. A model validator's message of the
    form ``path: problem`` is split into field and problem.
    """
    first = err.errors()[0]
    field = _loc(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "model_type":  # pydantic names the model class ("... or instance of _FleetNode"): ours, not the file's
        msg = "Input should be a valid dictionary (a mapping of fields)"
    if first["type"] in ("too_long", "too_short") and isinstance(first.get("input"), list):
        msg = msg.replace("List", "list")  # says how many items; the items are not echoed
    elif "input" in first and first["type"] not in ("missing", "value_error") and not isinstance(first["input"], dict):
        msg += f" (got {shown(first['input'])})"
    if first["type"] == "value_error" and not first["loc"] and ": " in msg:  # our model validators embed the path
        path, _, problem = msg.partition(": ")
        return InputError(source, path, problem)
    more = len(err.errors()) - 1
    return InputError(source, field or None, msg + (f" (and {more} more problem(s))" if more else ""))
