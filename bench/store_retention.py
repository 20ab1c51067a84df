"""A store that has served for weeks: metric-sample prune time, and a fresh tide cursor's read against a full read.

Usage: python bench/store_retention.py [--days 14] [--runs 2] [--stages 3] [--keep-days 7] [--sample-period-s 2]

Fills a temporary SQLite store (WAL, as ``FLEXPIPE_HOME``'s) with what ``--runs`` serving runs write over
``--days`` days: a pipeline row plus ``--stages`` stage rows every ``--sample-period-s`` seconds each, dated
evenly over the days (``created_at`` set as the server would have written it). Then, in the same run:

* a fresh ``tide_sensor`` cursor (``evaluate_tide(cursor=None)``: the samples of the last hour) against the
  read it did before (every online sample in the store, ``read_run_samples(online_only=True)``): wall time and
  rows read, the ratio printed;
* ``Store.prune_samples(keep_days)`` (``flexpipe store prune``): rows deleted, wall time, rows per second, the
  database file's size before and after (SQLite reuses the freed pages for new samples; it does not shrink the
  file without ``VACUUM``);
* the same fresh cursor after the prune.

Figures depend on the disk and the host. The defaults, 14 days of 2 runs x 4 rows every 2 s, are 4.8 M rows
(``--days`` or ``--sample-period-s`` make it smaller).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert

from flexpipe_dag.control.service import FRESH_TIDE_WINDOW_S, evaluate_tide
from flexpipe_dag.control.tide import TideConfig
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.store import Store


def fill(store: Store, days: float, runs: int, stages: int, period_s: float) -> int:
    """Write ``runs`` x ``days`` of samples with their ``created_at`` spread over the days; return rows written."""
    now = dt.datetime.now(dt.UTC)
    per_run = int(days * 86400 / period_s)
    table = m.MetricSampleRow.__table__
    written = 0
    next_id = 1
    chunk = 2000
    for start in range(0, per_run, chunk):
        heads, stage_rows = [], []
        for i in range(start, min(per_run, start + chunk)):
            when = now - dt.timedelta(seconds=(per_run - i) * period_s)
            for r in range(runs):
                head = next_id
                heads.append({"id": head, "run_key": f"serve-{r}", "gear_key": "throughput-3s", "source": "live",
                              "t_s": i * period_s, "scope": "pipeline", "rps": 5.0 + r, "completed": 10,
                              "tokens_per_s": 800.0, "queue_length": 0, "running": 8, "kv_used_fraction": 0.3,
                              "instances": 1, "created_at": when})
                stage_rows += [{"id": head + 1 + k, "run_key": f"serve-{r}", "gear_key": "throughput-3s",
                                "source": "live", "t_s": i * period_s, "scope": "stage", "parent_id": head,
                                "stage_index": k, "busy_fraction": 0.6, "queue_length": 1, "kv_blocks_used": 10,
                                "kv_blocks_total": 100, "created_at": when} for k in range(stages)]
                next_id += 1 + stages
        with store.session() as s:  # the pipeline rows first: the stage rows' parent_id refers to them
            s.execute(insert(table), heads)
            if stage_rows:
                s.execute(insert(table), stage_rows)
        written += len(heads) + len(stage_rows)
    return written


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--keep-days", type=float, default=7.0)
    ap.add_argument("--sample-period-s", type=float, default=2.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.db"
        store = Store.from_url(f"sqlite:///{path}")
        rows, fill_s = timed(lambda: fill(store, args.days, args.runs, args.stages, args.sample_period_s))
        print(f"filled: {rows:,d} rows ({args.runs} run(s) x {args.days:g} days, 1 + {args.stages} rows every "
              f"{args.sample_period_s:g} s) in {fill_s:.1f} s; database {path.stat().st_size / 2**20:.0f} MiB")
        full, full_s = timed(lambda: store.read_run_samples(online_only=True))
        window_s = FRESH_TIDE_WINDOW_S
        recent, recent_s = timed(lambda: store.read_run_samples(online_only=True,
                                                                written_after_s=time.time() - window_s))
        fresh, fresh_s = timed(lambda: evaluate_tide(store, None, TideConfig(), now_s=time.time()))
        print(f"tide, fresh cursor's read: every online sample (before) {len(full):,d} in {full_s:.2f} s; the last "
              f"{window_s:g} s (now) {len(recent):,d} in {recent_s:.3f} s: {full_s / recent_s:.0f}x faster; the whole "
              f"evaluation (tide history and forecast included) {fresh_s:.2f} s, cursor {len(fresh.cursor)} B")
        del full, recent
        size_before = path.stat().st_size
        now_s = time.time()  # one cutoff for both: samples are dated every period, a second later counts more
        dry, dry_s = timed(lambda: store.prune_samples(args.keep_days * 86400, dry_run=True, now_s=now_s))
        done, prune_s = timed(lambda: store.prune_samples(args.keep_days * 86400, now_s=now_s))
        assert done.rows == dry.rows, (done.rows, dry.rows)
        print(f"prune to {args.keep_days:g} days: {done.rows:,d} rows deleted in {prune_s:.1f} s "
              f"({done.rows / prune_s:,.0f} rows/s; dry run counted the same in {dry_s:.2f} s); database "
              f"{size_before / 2**20:.0f} MiB -> {path.stat().st_size / 2**20:.0f} MiB (pages reused, not returned)")
        _, after_s = timed(lambda: evaluate_tide(store, None, TideConfig(), now_s=time.time()))
        left, _ = timed(lambda: store.read_run_samples(online_only=True))
        print(f"after the prune: {len(left):,d} online samples left; a fresh tide cursor {after_s:.3f} s")
        store.engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
