"""Figures written for people: readable at any magnitude, pure (no console, no I/O).

:func:`format_number` writes a figure with thousands separators while it is short enough to read (below
:data:`PLAIN_LIMIT`), then in scientific notation (``1.5e+07``); ``inf`` stays ``inf`` and a missing value or NaN
is ``-``. The CLI's tables and the planner's step-by-step texts (capacity arithmetic) both write through it.
"""

from __future__ import annotations

import math
from typing import Any

#: Magnitudes from here on are written in scientific notation (``1.2e+09``), not ``1,200,000,000.0``.
PLAIN_LIMIT = 1e7

#: Integers (counts: requests, tokens) keep every digit, with separators, up to here.
INT_PLAIN_LIMIT = 10**12


def format_number(value: Any, decimals: int = 1, *, unit: str = "", plain_limit: float = PLAIN_LIMIT) -> str:
    """``value`` readable at any magnitude.

    ``None`` and NaN are ``-``; infinities ``inf`` / ``-inf``; ``|value| < plain_limit`` is written
    with thousands separators and ``decimals`` decimals (``12,345.6``); larger magnitudes, and
    non-zero ones too small to show with ``decimals`` decimals, in scientific notation with two
    significant figures (``1.5e+07``, ``3.0e-04``). Integers (and bools), counts, keep every digit
    with separators below :data:`INT_PLAIN_LIMIT` (``11,999,999``). ``unit`` is appended
    (``"ms"`` -> ``12.5ms``; give ``" ms"`` for a space), not after ``-``.

    Raises:
        TypeError: ``value`` is neither a number nor ``None``.
    """
    if value is None:
        return "-"
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, (str, bytes)):
        raise TypeError(f"format_number: expected a number or None, got {type(value).__name__} {value!r}")
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars, Decimal
        except (TypeError, ValueError):
            raise TypeError(f"format_number: expected a number or None, got {type(value).__name__}") from None
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return ("inf" if value > 0 else "-inf") + unit
    magnitude = abs(value)
    if isinstance(value, int) and magnitude < max(plain_limit, INT_PLAIN_LIMIT):
        return f"{value:,d}{unit}"
    if magnitude >= plain_limit:
        return f"{value:.1e}{unit}"
    if 0 < magnitude < 0.5 * 10.0 ** -decimals:
        return f"{value:.1e}{unit}"
    return f"{value:,.{decimals}f}{unit}"
