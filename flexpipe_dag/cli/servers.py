"""``flexpipe servers``: the live serving runs in the store (``flexpipe serve`` front doors and ``serve_trace``
runs): where clients reach them, the gear each serves, since when, and how fresh its heartbeat is."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import check_number

#: A serving run whose heartbeat is older than this is not listed (it died without ending its run).
DEFAULT_MAX_AGE_S = 30.0
#: The oldest heartbeat ``--max-age-s`` may reach back to: a year (a timestamp that far back is still a date).
MAX_AGE_LIMIT_S = 365 * 86400.0


def register(subparsers) -> None:
    p = subparsers.add_parser("servers", help="list the live serving runs in the store, with their API endpoints",
                              description=__doc__.replace("``", ""))
    p.add_argument("--max-age-s", type=float, default=DEFAULT_MAX_AGE_S,
                   help="leave out runs whose last heartbeat is older (a server that died without saying so)")
    p.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    p.set_defaults(func=servers)


def live_endpoint(store, max_age_s: float = DEFAULT_MAX_AGE_S) -> str:
    """The API endpoint of the live serving run with the freshest heartbeat.

    Raises:
        InputError: no live serving run in the store has an endpoint (start ``flexpipe serve`` or give --url).
    """
    for run in store.live_serving_runs(max_age_s):
        if run.endpoint:
            return run.endpoint
    raise InputError(None, "--url", "no live front door in the store (none heartbeat in the last "
                                    f"{max_age_s:.0f} s): start `flexpipe serve`, or give --url")


def servers(args: argparse.Namespace) -> int:
    from flexpipe_dag.sql.store import Store

    check_number(args.max_age_s, None, "--max-age-s", gt=0, le=MAX_AGE_LIMIT_S, unit="s")
    runs = Store.from_url().live_serving_runs(args.max_age_s)
    now = time.time()
    rows: list[dict[str, Any]] = [{"run_key": r.run_key, "endpoint": r.endpoint, "gear": r.gear_key,
             "started_s_ago": round(now - r.started_at_s, 1), "heartbeat_s_ago": round(now - r.heartbeat_at_s, 1),
             "shifts": "inline" if r.inline_control else "gear_shift runs"} for r in runs]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no live serving run (none heartbeat in the last {args.max_age_s:.0f} s)")
        return 0
    from rich.table import Table

    from flexpipe_dag.cli.tables import plain_console

    table = Table("run key", "endpoint", "gear", "up (s)", "heartbeat (s ago)", "shifts decided by")
    for r in rows:
        table.add_row(str(r["run_key"]), str(r["endpoint"] or "-"), str(r["gear"] or "-"),
                      f"{r['started_s_ago']:.0f}", f"{r['heartbeat_s_ago']:.0f}", str(r["shifts"]))
    plain_console(width=200).print(table)
    return 0
