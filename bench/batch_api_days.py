"""A Batch API store after weeks of batches: the batch runner's poll, a page of ``GET /v1/batches`` and one batch's
lookup, each against the read the code made before (every batch ever stored), in the same run.

Usage: python bench/batch_api_days.py [--batches 2000,20000] [--repeats 20] [--prune-batches 500 --lines 100]
       [--expire-lines 50000]

For each count, fills a temporary SQLite store (WAL, as ``FLEXPIPE_HOME``'s) with that many finished Batch API
batches (``inference_jobs`` rows with the API batch config, status ``done``) plus one queued batch, then times:

* the poll a server's :class:`~flexpipe_dag.serving.frontdoor.batches.BatchRunner` makes every 0.5 s
  (``_step``: the runnable batches, and the cancelled ones it owns) against the read it made before, every batch
  of the store (``store.jobs(kind="batch")``);
* a page of 20 batches (:func:`~flexpipe_dag.serving.frontdoor.batches.list_batches`, keyset-paged) against
  reading and sorting every batch, then the page;
* ``GET /v1/batches/{id}`` (:func:`~flexpipe_dag.serving.frontdoor.batches.get_batch`, by key) against a scan of
  every batch for the key;
* the runner's look for batches past their completion window (``Store.batches_past_deadline``, every
  ``EXPIRY_CHECK_S``; no baseline: it is new).

Each figure is the median of ``--repeats`` calls, milliseconds. A server polls twice a second: at 20,000 finished
batches the old poll's read took a core for the poll alone (see the printed figures).

Then the prune of expired batch results (``Store.prune_batch_results``, as ``flexpipe store prune`` and the
``store_retention`` job run it): ``--prune-batches`` ended batches of ``--lines`` result rows each (a response of
about 1.5 KB per row, as a chat completion's), their output files expired: rows deleted, wall time, rows per
second, the dry run's count against the real one, and the database file's size.

Last, a batch whose completion window has passed with half its ``--expire-lines`` lines answered: the runner's
poll that expires it (:meth:`Store.expire_batch`: the other half written as ``batch_expired`` rows in the one
transaction that ends the batch, the input file parsed first), against writing the same rows one by one through
``Store.write_result`` (each line answered as a served line is), in the same run; then the error file's build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert, update

from flexpipe_dag.core.status import API_BATCH_CONFIG_KEY
from flexpipe_dag.serving.frontdoor.batches import BatchRunner, batch_object, get_batch, is_api_batch, list_batches
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.store import Store


def fill(store: Store, n: int) -> str:
    """``n`` finished API batches and one queued one; returns the key of a batch in the middle."""
    spec = {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h", "metadata": {},
            "created_at": int(time.time())}
    rows = [{"job_key": f"batch_{i:08d}", "kind": "batch", "status": "done" if i < n else "queued", "priority": -1,
             "source_path": "file-x", "config": {API_BATCH_CONFIG_KEY: spec}, "total_requests": 2}
            for i in range(n + 1)]
    with store.session() as s:
        for start in range(0, len(rows), 5000):
            s.execute(insert(m.InferenceJob), rows[start:start + 5000])
    return f"batch_{n // 2:08d}"


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def old_page(store: Store) -> list[dict]:
    """The list before the keyset page: every batch read and sorted, then the page of 20."""
    jobs = sorted((j for j in store.jobs(kind="batch") if is_api_batch(j)), key=lambda j: j.id, reverse=True)
    return [batch_object(store, j, None) for j in jobs[:20]]


def old_lookup(store: Store, key: str):
    return next(j for j in store.jobs(kind="batch") if j.job_key == key and is_api_batch(j))


def measure(n: int, repeats: int) -> list[float]:
    """Old ms, new ms and their ratio for the poll, a page and a lookup, over a store of ``n`` finished batches."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.from_url(f"sqlite:///{Path(tmp) / 'store.db'}")
        key = fill(store, n)
        runner = BatchRunner(store, SimpleNamespace(), "m", run_key="fd-bench", log=lambda _: None)
        runner._serves = lambda job: False  # the poll's reads only: the queued batch is another server's
        figures: list[float] = []
        for old, new in ((lambda: [j for j in store.jobs(kind="batch") if is_api_batch(j)], runner._step),
                         (lambda: old_page(store), lambda: list_batches(store, None, 20)),
                         (lambda: old_lookup(store, key), lambda: get_batch(store, key, None))):
            before, after = median_ms(old, repeats), median_ms(new, repeats)
            figures += [before, after, before / after]
        assert [b["id"] for b in list_batches(store, None, 20)["data"]] == [b["id"] for b in old_page(store)]
        figures.append(median_ms(store.batches_past_deadline, repeats))  # the runner's look every EXPIRY_CHECK_S
        store.engine.dispose()
    return figures


def measure_prune(batches: int, lines: int) -> None:
    """Fill ``batches`` ended batches of ``lines`` result rows, all expired; time the dry run and the prune."""
    import datetime as dt

    body = json.dumps({"status_code": 200, "body": {"choices": [{"message": {"content": "x" * 1400}}]}})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.db"
        store = Store.from_url(f"sqlite:///{path}")
        fill(store, batches)
        expired = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        with store.session() as s:
            s.execute(update(m.InferenceJob).where(m.InferenceJob.status == "done").values(results_expire_at=expired))
            for job_id in range(1, batches + 1):
                s.execute(insert(m.RequestResult), [
                    {"job_id": job_id, "request_key": f"l-{i}", "status": "done", "prompt_tokens": 40,
                     "output_tokens": 300, "output_token_ids": [], "output_text": body} for i in range(lines)])
        size_mib = path.stat().st_size / 2**20
        t0 = time.perf_counter()
        dry = store.prune_batch_results(dry_run=True)
        t1 = time.perf_counter()
        done = store.prune_batch_results()
        t2 = time.perf_counter()
        assert (dry.rows, dry.batches) == (done.rows, done.batches) == (batches * lines, batches)
        store.engine.dispose()
        print(f"prune of expired batch results: {done.rows:,d} rows of {done.batches:,d} batches ({size_mib:.0f} MiB "
              f"store) in {t2 - t1:.2f} s ({done.rows / (t2 - t1):,.0f} rows/s); the dry run counted the same in "
              f"{t1 - t0:.2f} s; file after: {path.stat().st_size / 2**20:.0f} MiB (SQLite reuses freed pages)")


def measure_expiry(lines: int) -> None:
    """A ``lines``-line batch past its deadline, half answered: the poll that expires it vs ``write_result`` per line."""
    import datetime as dt

    from flexpipe_dag.serving.frontdoor.batches import BATCH_EXPIRED_ERROR, batch_file, create_batch
    from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics

    content = "\n".join(json.dumps({"custom_id": f"l-{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "m", "prompt": "Summarise the report.", "max_tokens": 64}})
                        for i in range(lines)).encode()
    answered = json.dumps({"status_code": 200, "body": {"choices": [{"text": "x" * 400}]}})
    expired_text = json.dumps({"error": BATCH_EXPIRED_ERROR})
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.from_url(f"sqlite:///{Path(tmp) / 'store.db'}")
        store.save_api_file("file-big", "batch", "big.jsonl", content)
        ids = []
        for _ in range(2):
            job = store.job_by_key(create_batch(store, "file-big", "/v1/completions", "24h", None)["id"])
            with store.session() as s:
                s.execute(insert(m.RequestResult), [
                    {"job_id": job.id, "request_key": f"l-{i}", "status": "done", "prompt_tokens": 8,
                     "output_tokens": 64, "output_token_ids": [], "output_text": answered} for i in range(0, lines, 2)])
                s.execute(update(m.InferenceJob).where(m.InferenceJob.id == job.id).values(expires_at=past))
            ids.append(job.id)
        t0 = time.perf_counter()
        for i in range(1, lines, 2):  # the baseline: each unanswered line through the one-row write
            store.write_result(ids[0], f"l-{i}", prompt_tokens=0, output_token_ids=[], status="failed",
                               output_text=expired_text)
        t1 = time.perf_counter()
        store.update_job(ids[0], status="done")  # out of the runner's way
        engine = SimpleNamespace(metrics=FrontDoorMetrics())
        runner = BatchRunner(store, engine, "m", run_key="fd-bench", log=lambda _: None)
        runner._serves = lambda job: False
        runner._step()
        t2 = time.perf_counter()
        job = store.job_by_key(store.jobs(kind="batch")[-1].job_key)
        errors = batch_file(store, f"{job.job_key}-errors")
        t3 = time.perf_counter()
        assert job.status == "expired" and store.batch_result_counts(job.id).answered == lines
        assert errors is not None and errors.content.count(b"batch_expired") == len(range(1, lines, 2))
        store.engine.dispose()
    n = len(range(1, lines, 2))
    print(f"expiry of a {lines:,d}-line batch, {n:,d} lines unanswered: the poll that expires it {t2 - t1:.2f} s "
          f"({n / (t2 - t1):,.0f} rows/s, input parsed included) against {t1 - t0:.2f} s through write_result one row "
          f"at a time ({(t1 - t0) / (t2 - t1):.0f}x); its error file built in {t3 - t2:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2000,20000", help="finished batches in the store, comma-separated")
    ap.add_argument("--repeats", type=int, default=20, help="calls per figure (the median is printed)")
    ap.add_argument("--prune-batches", type=int, default=500, help="ended batches whose results are pruned")
    ap.add_argument("--lines", type=int, default=100, help="result rows per pruned batch")
    ap.add_argument("--expire-lines", type=int, default=50000, help="lines of the batch whose window passes")
    args = ap.parse_args()
    print(f"{'batches':>8} | {'poll old ms':>11} {'new ms':>8} {'x':>6} | {'page old ms':>11} {'new ms':>8} "
          f"{'x':>6} | {'get old ms':>10} {'new ms':>8} {'x':>6} | {'deadline look ms':>16}")
    for n in (int(x) for x in args.batches.split(",")):
        figures = measure(n, args.repeats)
        print(f"{n:>8,d} | " + " | ".join(f"{figures[i]:>11.2f} {figures[i + 1]:>8.2f} {figures[i + 2]:>5.0f}x"
                                          for i in range(0, 9, 3)) + f" | {figures[9]:>16.2f}")
    measure_prune(args.prune_batches, args.lines)
    measure_expiry(args.expire_lines)


if __name__ == "__main__":
    main()
