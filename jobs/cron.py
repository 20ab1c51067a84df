"""Cron strings for FlexPipe's Dagster schedules: a ``;``-separated list, steps checked against each field's range,
and the rule that a tick is run on time or not at all.

Dagster accepts ``*/90 * * * *`` and then fires hourly (a minute step of 90 matches minute 0 only), and
``0 */36 * * *`` fires daily; an interval a cron field cannot hold is said with several crons (Dagster's
schedules take a list), e.g. every 90 minutes is ``0 0-21/3 * * *; 30 1-22/3 * * *``. :func:`parse_crons`
refuses a step beyond its field's range and names the field, the range and the list form. Before Dagster's own
check, :func:`check_cron` reads each of the 5 fields itself (numbers and the names ``JAN``-``DEC``,
``SUN``-``SAT``), so a value outside a field's range (``60 * * * *``), a step of 0 and a day that never comes
(``0 0 31 2 *``) are refused naming the field and its range; a ``*/step`` that does not divide its range
(``*/45`` minutes fires at :00 and :45) is accepted with a logged warning (:func:`cron_warnings`).

Dagster's scheduler, started after a while stopped or with a changed cron, evaluates the newest tick it
missed since the schedule last ticked, late: a nightly job whose cron moved from 02:00 to 14:00 runs
"yesterday at 14:00" at once. :func:`late_tick_reason` is the rule the schedules apply instead: a tick
evaluated more than :data:`LATE_TICK_LIMIT_S` after its time is skipped with the reason (the next tick of
the cron runs as usual).
"""

from __future__ import annotations

import datetime as dt
import logging
import re

from flexpipe_dag.core.errors import InputError

#: Separator of the crons in one setting (``FLEXPIPE_PROFILE_REFRESH_CRON``).
CRON_SEPARATOR = ";"

#: The five cron fields: (name, lowest value, highest value, unit of a step).
CRON_FIELDS: tuple[tuple[str, int, int, str], ...] = (
    ("minute", 0, 59, "minutes"), ("hour", 0, 23, "hours"), ("day of month", 1, 31, "days"),
    ("month", 1, 12, "months"), ("day of week", 0, 6, "days"))

#: A schedule tick evaluated more than this many seconds after its scheduled time is skipped, never run late
#: (the scheduler daemon evaluates schedules about every 30 s; a missed tick is older).
LATE_TICK_LIMIT_S = 600.0

#: An example of an interval no single cron holds, for the messages.
LIST_EXAMPLE = "'0 0-21/3 * * *; 30 1-22/3 * * *' (every 90 minutes)"

#: Names a field takes (lower case) -> value: months ``jan``-``dec`` (1-12), days of week ``sun``-``sat`` (0-6).
FIELD_NAMES: dict[str, dict[str, int]] = {
    "month": {n: i + 1 for i, n in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                                              "nov", "dec"))},
    "day of week": {n: i for i, n in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}}

#: Days in each month at most (February 29), for a day of month that never comes (``0 0 31 2 *``).
MONTH_DAYS_MAX = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)

_ITEM = re.compile(r"^(\*|[a-z0-9]+|[a-z0-9]+-[a-z0-9]+)(?:/([0-9]+))?$")

_log = logging.getLogger(__name__)


def _value(token: str, field: tuple[str, int, int, str]) -> int | None:
    """The number a cron token stands for in ``field`` (a digit string or a name), None when it is neither."""
    if token.isdigit():
        return int(token)
    return FIELD_NAMES.get(field[0], {}).get(token)


def _item_values(item: str, field: tuple[str, int, int, str]) -> tuple[int, int, int | None, bool] | None:
    """``(first, last, step, star)`` of one comma item of a cron field, None for a form Dagster alone reads
    (``L``, ``1#2``, ``?``).

    Raises:
        ValueError: the reason, field and range named: a value outside the field's range (7 is also Sunday in
            the day of week), a step of 0, or a step beyond the range it steps through.
    """
    match = _ITEM.match(item.lower())
    if match is None:
        return None
    name, low, high, unit = field
    base, step_text = match.group(1), match.group(2)
    parsed = [low, high] if base == "*" else [_value(v, field) for v in base.split("-")]
    ends = [v for v in parsed if v is not None]
    if len(ends) != len(parsed):
        return None
    top = 7 if name == "day of week" else high  # 7 is Sunday too
    for v in ends:
        if not low <= v <= top:
            raise ValueError(f"the {name} value {v} is outside the {name} range {low}-{high}"
                             + (" (7 is also Sunday)" if name == "day of week" else ""))
    first, last = ends[0], ends[-1]
    if len(ends) == 1 and step_text is not None:  # N/S: from N to the field's end
        last = high
    step = None if step_text is None else int(step_text)
    if step == 0:
        raise ValueError(f"the {name} step is 0; expected a step of 1 or more")
    if step is not None and step > last - first + 1:
        raise ValueError(f"the {name} step {step} is beyond the {name} range {first}-{last}: it matches {name} {first} "
                         f"only, so the cron does not fire every {step} {unit}; give several crons separated by "
                         f"'{CRON_SEPARATOR}' for such an interval, e.g. {LIST_EXAMPLE}")
    return first, last, step, base == "*"


def _uneven_step(cron: str, item: str, values: tuple[int, int, int | None, bool],
                 field: tuple[str, int, int, str]) -> str | None:
    """A warning when ``*/step`` does not divide its field's range: the gap across the wrap is shorter."""
    first, last, step, star = values
    name, low, high, unit = field
    period = high - low + 1
    if not star or step is None or period % step == 0 or name == "day of month":  # months differ in length anyway
        return None
    fires = list(range(low, high + 1, step))
    gap = period - (fires[-1] - fires[0])
    return (f"{cron!r}: the {name} step {step} ({item}) does not divide the {name} range {low}-{high} ({period} {unit}): "
            f"it fires at {name} {', '.join(map(str, fires))}, so the gap from {name} {fires[-1]} to the next "
            f"{name} {fires[0]} is {gap} {unit}, not {step}")


def _never_fires(fields: list[list[tuple[int, int, int | None, bool] | None]]) -> str | None:
    """Why a cron whose day of month never falls in its months never fires, else None (Dagster refuses such a cron
    whatever its day of week)."""
    days, months = fields[2], fields[3]
    if None in days or None in months:
        return None
    day_min = min(v[0] for v in days if v is not None)
    month_set = sorted({m for v in months if v is not None for m in range(v[0], v[1] + 1, v[2] or 1)})
    if any(MONTH_DAYS_MAX[m - 1] >= day_min for m in month_set):
        return None
    longest = max(MONTH_DAYS_MAX[m - 1] for m in month_set)
    return (f"day of month {day_min} never falls in month {', '.join(map(str, month_set))} (at most {longest} days), "
            "so the cron never fires")


def cron_warnings(cron: str) -> tuple[str, ...]:
    """Warnings for a cron :func:`check_cron` accepts: each ``*/step`` that does not divide its field's range
    (``*/45`` minutes fires at :00 and :45; ``*/7`` hours leaves a 3-hour gap from 21:00 to 00:00)."""
    out = []
    for field, part in zip(CRON_FIELDS, cron.split(), strict=False):
        for item in part.split(","):
            values = _item_values(item, field)
            warning = values and _uneven_step(cron, item, values, field)
            if warning:
                out.append(warning)
    return tuple(out)


def check_cron(cron: str, where: str) -> str:
    """``cron`` stripped, when each of its 5 fields holds values and steps within the field's range, some date
    matches it, and Dagster reads it as a cron; a ``*/step`` that does not divide its range is logged as a
    warning (:func:`cron_warnings`).

    Args:
        cron: one cron expression.
        where: what the errors name (e.g. ``environment variable FLEXPIPE_PROFILE_REFRESH_CRON``).

    Raises:
        InputError: ``where`` named; for a 5-field cron, the field and its range named: a value outside it
            (``60 * * * *``, ``0 24 * * *``), a step of 0 (``*/0``, ``0-59/0``), a step beyond the range it steps
            through (``*/90`` in minutes 0-59, ``*/36`` in hours 0-23, ``MON-FRI/9``: with the list form), or a
            day of month that never falls in its months (``0 0 31 2 *``); else one Dagster does not read as a
            cron (the 5-field form expected).
    """
    from dagster._utils.schedules import is_valid_cron_string

    cron = cron.strip()
    parts = cron.split()
    if len(parts) == len(CRON_FIELDS):
        fields = []
        for field, part in zip(CRON_FIELDS, parts, strict=True):
            try:
                fields.append([_item_values(item, field) for item in part.split(",")])
            except ValueError as exc:
                raise InputError(where, None, f"{cron!r}: {exc}") from None
        never = _never_fires(fields)
        if never:
            raise InputError(where, None, f"{cron!r}: {never}")
    if not is_valid_cron_string(cron):
        raise InputError(where, None, f"expected a 5-field cron expression such as '0 2 * * *' (several separated "
                                      f"by '{CRON_SEPARATOR}'), got {cron!r}")
    for warning in cron_warnings(cron):
        _log.warning("%s: %s", where, warning)
    return cron


def parse_crons(text: str, where: str) -> tuple[str, ...]:
    """The crons of a setting: one cron, or several separated by ``;`` (each checked by :func:`check_cron`).

    Raises:
        InputError: ``where`` named; an empty entry, a repeated cron, or a cron :func:`check_cron` refuses.
    """
    crons = tuple(c.strip() for c in text.split(CRON_SEPARATOR))
    if not any(crons):
        raise InputError(where, None, "expected a 5-field cron expression such as '0 2 * * *', got nothing")
    if not all(crons):
        raise InputError(where, None, f"an empty cron in {text.strip()!r}; expected crons separated by "
                                      f"'{CRON_SEPARATOR}', e.g. {LIST_EXAMPLE}")
    checked = tuple(check_cron(c, where) for c in crons)
    repeated = sorted({c for c in checked if checked.count(c) > 1})
    if repeated:
        raise InputError(where, None, f"the cron {repeated[0]!r} is given twice")
    return checked


def late_tick_reason(scheduled_s: float, now_s: float, limit_s: float = LATE_TICK_LIMIT_S) -> str | None:
    """Why a tick scheduled at ``scheduled_s`` is not run when evaluated at ``now_s`` (epoch seconds), or None.

    A tick more than ``limit_s`` seconds old is one the scheduler missed (it was stopped, or the cron
    changed and names a time already past): it is skipped, never run late.
    """
    late_s = now_s - scheduled_s
    if late_s <= limit_s:
        return None
    at = dt.datetime.fromtimestamp(scheduled_s, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"tick of {at} evaluated {late_s / 3600.0:.1f} h late (limit {limit_s:.0f} s): a missed tick (scheduler "
            "stopped, or a changed cron naming a past time) is skipped, not run late; the next tick runs")
