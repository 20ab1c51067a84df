"""A mixed online / offline day through the front door, as real clients would drive it.

A running ``flexpipe serve`` (a :class:`~flexpipe_dag.serving.frontdoor.process.ServerProcess`) gets an
offline batch through the Batch API (``POST /v1/files``, ``POST /v1/batches``) and the online trace as
streaming ``/v1/completions`` requests at their own arrival times (the load tester's open-loop replay);
the server's batch runner fills the troughs with the batch, its controller shifts gears as the load
changes. When the replay has ended and the batch is done, the server is drained with SIGTERM. What
the clients saw (per request: TTFT, TPOT, end-to-end latency, tokens or the error) makes the report; the
shifts and declined shifts are read back from the store, where the server recorded them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe_dag.serving.loadtest import LoadRequest, replay

#: Batch states after which nothing more happens to a batch.
BATCH_FINAL = ("completed", "failed", "cancelled", "expired")


@dataclass
class HttpDayReport:
    """What the clients of one day saw.

    Attributes:
        results: one dict per request answered: ``id``, ``klass`` (online / offline), ``output_tokens`` and,
            for streamed online requests, ``ttft_ms``, ``tpot_ms``, ``e2e_ms``.
        failed: one dict per request that got an error or no answer: ``id``, ``klass``, ``error``.
        submitted_online, submitted_offline: requests sent / batch lines.
        elapsed_s: from the first request sent to the batch's end (or the replay's, whichever is later).
        batch: the final batch object (``GET /v1/batches/{id}``).
        server_exit: the server's exit status after SIGTERM.
    """

    results: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    submitted_online: int = 0
    submitted_offline: int = 0
    elapsed_s: float = 0.0
    batch: dict[str, Any] = field(default_factory=dict)
    server_exit: int | None = None


def batch_input(requests: Sequence[LoadRequest], model: str) -> bytes:
    """A Batch API input file (JSONL) of ``/v1/completions`` bodies: greedy, prompt token ids, ``custom_id``
    ``offline-<index>``."""
    lines = [json.dumps({"custom_id": f"offline-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                                  "temperature": 0}}) for i, r in enumerate(requests)]
    return ("\n".join(lines) + "\n").encode()


def _checked(resp, what: str) -> dict[str, Any]:
    if resp.status_code != 200:
        raise RuntimeError(f"{what}: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def submit_batch(client, model: str, requests: Sequence[LoadRequest]) -> dict[str, Any]:
    """Upload ``requests`` as a batch input file and create the batch; returns the batch object.

    Raises:
        RuntimeError: the server refused the upload or the batch (status and body quoted).
    """
    upload = _checked(client.post("/files", files={"file": ("offline.jsonl", batch_input(requests, model))},
                                  data={"purpose": "batch"}), "upload of the batch input")
    return _checked(client.post("/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}), "batch creation")


def wait_batch(client, batch_id: str, timeout_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Poll the batch once a second until it is in a final state; past ``timeout_s`` cancel it and wait for
    the cancellation (what finished stays in its output file)."""
    deadline = time.monotonic() + timeout_s
    shown = -1
    while True:
        batch = _checked(client.get(f"/batches/{batch_id}"), "batch status")
        if batch["status"] in BATCH_FINAL:
            return batch
        done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
        if done != shown and done % 8 == 0:
            log(f"batch {batch_id}: {batch['status']}, {done} of {batch['request_counts']['total']} lines done")
            shown = done
        if time.monotonic() > deadline and batch["status"] != "cancelling":
            log(f"batch {batch_id} not done after {timeout_s:.0f} s: cancelling it")
            _checked(client.post(f"/batches/{batch_id}/cancel"), "batch cancel")
        time.sleep(1.0)


def _batch_results(client, batch: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(answered lines, failed lines) of a finished batch, from its output and error files."""
    answered: list[dict] = []
    failed: list[dict] = []
    for key, into in (("output_file_id", answered), ("error_file_id", failed)):
        if not batch.get(key):
            continue
        resp = client.get(f"/files/{batch[key]}/content")
        if resp.status_code != 200:
            raise RuntimeError(f"batch {key} {batch[key]}: HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.text.splitlines():
            if line.strip():
                into.append(json.loads(line))
    results = [{"id": o["custom_id"], "klass": "offline",
                "output_tokens": o["response"]["body"]["usage"]["completion_tokens"]}
               for o in answered if (o.get("response") or {}).get("status_code") == 200]
    errors = [{"id": o["custom_id"], "klass": "offline",
               "error": json.dumps(o.get("error") or (o.get("response") or {}).get("body"))[:300]}
              for o in failed + [o for o in answered if (o.get("response") or {}).get("status_code") != 200]]
    return results, errors


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def serve_day(url: str, model: str, online: Sequence[LoadRequest], offline: Sequence[LoadRequest], *,
              batch_timeout_s: float = 600.0, log: Callable[[str], None] = print) -> HttpDayReport:
    """Drive the server at ``url`` (its ``/v1`` base) through one day; see the module docstring.

    Args:
        url: the server's ``/v1`` base URL.
        model: the model id it serves.
        online: the online requests, with their arrival times (seconds from the start).
        offline: the batch's requests (their arrival times are not used).
        batch_timeout_s: how long after the replay the batch may take before it is cancelled.
        log: one line per step worth telling.

    Returns:
        The :class:`HttpDayReport` (``server_exit`` is left for the caller, who stops the server).

    Raises:
        RuntimeError: the server refused the batch upload or creation, or a batch file could not be read.
    """
    import httpx

    report = HttpDayReport(submitted_online=len(online), submitted_offline=len(offline))
    with httpx.Client(base_url=url, timeout=120) as client:
        t0 = time.monotonic()
        batch = submit_batch(client, model, offline) if offline else None
        if batch is not None:
            log(f"batch {batch['id']}: {len(offline)} offline lines submitted through the Batch API")
        log(f"replaying {len(online)} online requests over {online[-1].arrival_s if online else 0:.0f} s as "
            "streaming /v1/completions")
        measured, _ = asyncio.run(replay(url, model, online))
        log(f"replay done after {time.monotonic() - t0:.0f} s: "
            f"{sum(m.error is None for m in measured)} of {len(measured)} answered")
        for i, m in enumerate(measured):
            if m.error is not None:
                report.failed.append({"id": f"online-{i}", "klass": "online", "error": m.error})
                continue
            report.results.append({"id": f"online-{i}", "klass": "online", "output_tokens": m.output_tokens,
                                   "ttft_ms": _ms(m.ttft_s), "tpot_ms": _ms(m.tpot_s), "e2e_ms": _ms(m.e2e_s)})
        if batch is not None:
            report.batch = wait_batch(client, batch["id"], batch_timeout_s, log)
            done, errors = _batch_results(client, report.batch)
            report.results.extend(done)
            report.failed.extend(errors)
        report.elapsed_s = time.monotonic() - t0
    return report


def decisions_from_events(events: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(shifts, declines) of one serving run from its stored shift events, in the shapes the serving report
    takes (:func:`flexpipe_dag.serving.report.summarize`): ``t_s`` is the run's own clock (seconds since it
    started), ``status`` a shift's outcome (done, rolled_back, failed, or still applying)."""
    shifts: list[dict[str, Any]] = []
    declines: list[dict[str, Any]] = []
    for ev in events:
        d = ev.details or {}
        base = {"t_s": float(d.get("t_s") or 0.0), "from_gear": ev.from_gear_key, "to_gear": ev.to_gear_key,
                "trigger": ev.trigger, "reason": ev.reason}
        if ev.action == "shift":
            shifts.append({**base, "status": ev.status, "outcome": d.get("outcome"),
                           "timings_s": d.get("timings_s") or {}})
        else:
            declines.append({**base, "kind": d.get("reason_kind")})
    return shifts, declines
