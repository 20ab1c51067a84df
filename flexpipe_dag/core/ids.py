"""Identifiers users write (device, host, cluster, gear, job ids): one printable set, one length.

An id ends up in the store (``String(200)`` columns), in table output on a terminal, in log lines
and in file names, so it is held to :data:`ID_CHARS`: ASCII letters and digits and ``. _ : / @ + -``,
1 to :data:`MAX_ID_CHARS` characters. That leaves out spaces, NUL and every other control character,
terminal escape sequences, and the bidirectional overrides (U+202E) that make text read backwards.

Pure Python, no third-party imports.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from flexpipe_dag.core.errors import InputError, shown

#: Longest id accepted, characters: the store's id columns are ``String(200)``.
MAX_ID_CHARS = 200
#: The characters an id may hold, as a regular-expression class.
ID_CHARS = "A-Za-z0-9._:/@+-"
_ID = re.compile(f"[{ID_CHARS}]+")
_BAD_CHAR = re.compile(f"[^{ID_CHARS}]")


def id_problem(value: str, max_chars: int = MAX_ID_CHARS) -> str | None:
    """Why ``value`` is not a valid id (one sentence), or None when it is."""
    if not value:
        return "empty; expected an id"
    if len(value) > max_chars:
        return f"{len(value)} characters; expected an id of at most {max_chars}"
    if not _ID.fullmatch(value):
        bad = _BAD_CHAR.search(value)
        assert bad is not None
        return (f"{shown(value)} holds {shown(bad.group())} at character {bad.start() + 1}; expected only "
                f"letters, digits and . _ : / @ + - (no spaces, control or bidirectional characters)")
    return None


def check_id(value: object, source: str | None, field: str | None, max_chars: int = MAX_ID_CHARS) -> str:
    """``value`` when it is a valid id (see module docstring).

    Raises:
        InputError: not a string, empty, longer than ``max_chars`` or holding a character outside
            :data:`ID_CHARS` (``source`` and ``field`` named; the value shown escaped and cut).
    """
    if not isinstance(value, str):
        raise InputError(source, field, f"expected an id (a string), got {shown(value)}")
    problem = id_problem(value, max_chars)
    if problem:
        raise InputError(source, field, problem)
    return value


def _validate(value: str) -> str:
    problem = id_problem(value)
    if problem:
        raise ValueError(problem)
    return value


#: A pydantic ``str`` field holding an id (validated as :func:`check_id` does).
Identifier = Annotated[str, AfterValidator(_validate)]


def printable_problem(value: str) -> str | None:
    """Why ``value`` is not printable text (one sentence: the first control, line-break or bidirectional
    character and where it is), or None when it is."""
    for i, ch in enumerate(value):
        if not ch.isprintable():
            return (f"{shown(value, 60)} holds {shown(ch)} at character {i + 1}; expected printable text (no "
                    "control, line-break or bidirectional characters)")
    return None


def _printable(value: str) -> str:
    problem = printable_problem(value)
    if problem:
        raise ValueError(problem)
    return value


#: A pydantic ``str`` field of free text shown on terminals and in tables (model names, notes): any
#: printable character, spaces included, but no control, line-break or bidirectional characters.
PrintableText = Annotated[str, AfterValidator(_printable)]
