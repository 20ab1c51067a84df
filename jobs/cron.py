"""Cron strings for FlexPipe's Dagster schedules: a ``;``-separated list, steps checked against each field's range,
and the rule that a tick is run on time or not at all.

Dagster accepts ``*/90 * * * *`` and then fires hourly (a minute step of 90 matches minute 0 only), and
``0 */36 * * *`` fires daily; an interval a cron field cannot hold is said with several crons (Dagster's
schedules take a list), e.g. every 90 minutes is ``0 0-21/3 * * *; 30 1-22/3 * * *``. :func:`parse_crons`
refuses a step beyond its field's range and names the field, the range and the list form.

Dagster's scheduler, started after a while stopped or with a changed cron, evaluates the newest tick it
missed since the schedule last ticked, late: a nightly job whose cron moved from 02:00 to 14:00 runs
"yesterday at 14:00" at once. :func:`late_tick_reason` is the rule the schedules apply instead: a tick
evaluated more than :data:`LATE_TICK_LIMIT_S` after its time is skipped with the reason (the next tick of
the cron runs as usual).
"""

from __future__ import annotations

import datetime as dt
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

_STEP = re.compile(r"^(\*|\d+|\d+-\d+)/(\d+)$")


def _step_problem(item: str, field: tuple[str, int, int, str]) -> str | None:
    """Why a step of one comma item of a cron field is beyond the range it steps through (None when it is not)."""
    match = _STEP.match(item)
    if match is None:
        return None
    name, low, high, unit = field
    base, step = match.group(1), int(match.group(2))
    if base == "*":
        first, last = low, high
    elif "-" in base:
        first, last = (int(v) for v in base.split("-"))
    else:
        first, last = int(base), high
    if step == 0:
        return f"the {name} step is 0; expected a step of 1 or more"
    if step <= last - first + 1:
        return None
    return (f"the {name} step {step} is beyond the {name} range {first}-{last}: it matches {name} {first} only, "
            f"so the cron does not fire every {step} {unit}; give several crons separated by "
            f"'{CRON_SEPARATOR}' for such an interval, e.g. {LIST_EXAMPLE}")


def check_cron(cron: str, where: str) -> str:
    """``cron`` stripped, when Dagster reads it as a 5-field cron and no step is beyond its field's range.

    Args:
        cron: one cron expression.
        where: what the errors name (e.g. ``environment variable FLEXPIPE_PROFILE_REFRESH_CRON``).

    Raises:
        InputError: ``where`` named; not a 5-field cron, or a step beyond its field's range (``*/90`` in
            minutes 0-59, ``*/36`` in hours 0-23): the field, the range and the list form are named.
    """
    from dagster._utils.schedules import is_valid_cron_string

    cron = cron.strip()
    if not is_valid_cron_string(cron):
        raise InputError(where, None, f"expected a 5-field cron expression such as '0 2 * * *' (several separated "
                                      f"by '{CRON_SEPARATOR}'), got {cron!r}")
    for field, part in zip(CRON_FIELDS, cron.split(), strict=False):
        for item in part.split(","):
            problem = _step_problem(item, field)
            if problem:
                raise InputError(where, None, f"{cron!r}: {problem}")
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
