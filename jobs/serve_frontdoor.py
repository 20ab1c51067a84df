"""The ``serve_frontdoor`` job: a day of real traffic through the OpenAI-compatible front door.

``serve_trace`` replays a trace inside its own process; this job serves the same day as users would:
it starts ``flexpipe serve`` on the planned gear (registered in the store, deciding its shifts with the
controller, ``inline_control``), submits the offline job through the Batch API, replays the tide-shaped
trace slice as streaming HTTP requests with the load tester, waits for the batch, and drains the server
with SIGTERM. The summary counts what the clients saw (lost = sent without an answer, failed = answered
with an error); the report is the serving report, with the shifts and declined shifts the server stored.
"""

import json
import threading
import time

from dagster import MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from flexpipe_dag.jobs.pools import PIPELINE_RUNTIME_POOL
from flexpipe_dag.jobs.serve import ServeTraceConfig, build_workloads, check_context, day_mean_rps, day_notes
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


class ServeFrontdoorConfig(ServeTraceConfig):
    """The day (CPU-sized defaults, as ``serve_trace``'s) and the server's batch pacing."""

    batch_pause_above: int = Field(default=2, ge=0, description="open online requests above which the server "
                                   "submits no batch line (the batch fills the troughs)")
    batch_timeout_s: float = Field(default=300.0, gt=0, description="seconds the batch may take after the replay "
                                   "before it is cancelled (what finished is kept)")
    server_start_timeout_s: float = Field(default=300.0, gt=0, description="seconds the server may take to load "
                                          "its pipeline and bind its port")
    operator_drill_at: float | None = Field(default=None, gt=0, lt=1, description="share of the replay after "
                                            "which, if the controller has shifted nothing yet, the job asks the "
                                            "server for a shift by hand (as an operator's gear_shift run does) to "
                                            "the plan's largest other gear; unset: never (flexpipe demo: 0.55)")


def failure_kinds(failed: list[dict], most: int = 3) -> str:
    """``"; errors: 12 x HTTP 429: ..., ..."``: the commonest error texts of the failed requests, for the
    run's one-line failure (CI shows its tail); empty when none failed."""
    from collections import Counter

    if not failed:
        return ""
    common = Counter(str(f.get("error"))[:160] for f in failed).most_common(most)
    return "; errors: " + "; ".join(f"{n} x {text}" for text, n in common)


def server_args(config: ServeFrontdoorConfig, gear_id: str, run_key: str, model: str | None,
                dwell_s: float | None) -> list[str]:
    """The ``flexpipe serve`` arguments for this day: the stored gear, a free port, the store run key."""
    args = ["--gear", gear_id, "--port", "0", "--run-key", run_key, "--kv-capacity-tokens",
            str(config.kv_pool_tokens_max), "--batch-inflight", str(config.max_offline_inflight),
            "--batch-pause-above", str(config.batch_pause_above), "--step-timeout-s", str(config.step_timeout_s)]
    if config.inline_control:
        args.append("--inline-control")
    if dwell_s is not None:
        args += ["--dwell-s", str(dwell_s)]
    if model is not None:
        args += ["--model", model]
    return args


def operator_drill(db, run_key: str, gears, after_s: float, stop, log, started_s: float | None = None) -> int | None:
    """After ``after_s`` seconds (unless ``stop`` is set first), if serving run ``run_key`` has made no shift, ask
    it for one by hand, as an operator's ``gear_shift`` run would: to the largest envelope among the plan's
    ``gears`` other than the live one. The server applies it like any other (warm-up, drain, switch, rollback)
    while clients stream, and its controller may move back later. Returns the shift event id, or None (a
    shift was already made, the plan has no other gear, or the run was stopped). ``started_s``: when the
    server started (``time.monotonic()``), so the event's ``t_s`` is on the run's clock as the report reads it."""
    from flexpipe_dag.core.status import ShiftEventStatus

    if stop.wait(after_s):
        return None
    if any(ev.action == "shift" for ev in db.shift_events(run_key=run_key)):
        log("operator drill: not needed, the controller has shifted")
        return None
    live = db.pipeline_liveness(run_key).gear_key
    others = [g for g in gears if g.gear_id != live]
    if not others:
        log(f"operator drill: the plan has no gear but {live}: nothing to shift to")
        return None
    to = max(others, key=lambda g: (g.rps_max, g.gear_id))
    reason = (f"operator drill: a shift by hand to {to.gear_id} under live traffic (the controller found none that "
              "pays back so far)")
    event_id = db.record_shift_event("shift", ShiftEventStatus.DECIDED, reason, from_gear_key=live,
                                     to_gear_key=to.gear_id, trigger="manual", run_key=run_key,
                                     decision_key=f"drill:{run_key}",
                                     details={"t_s": round(time.monotonic() - started_s, 1)} if started_s else None)
    db.request_shift(event_id, run_key, 120.0)
    log(f"{reason} (shift event {event_id})")
    return event_id


@op(description="Serve a tide-shaped trace slice as real HTTP traffic through flexpipe serve, with a Batch API "
                "job in the troughs and live gear shifts; write the report.",
    tags={"kind": "inference"}, pool=PIPELINE_RUNTIME_POOL)
def serve_http(context: OpExecutionContext, config: ServeFrontdoorConfig, store: StoreResource,
               planning: PlanningSettings, control: ControlSettings) -> dict:
    from flexpipe_dag.core.errors import InfeasibleError
    from flexpipe_dag.core.settings import flexpipe_home
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.serving.frontdoor.day import decisions_from_events, serve_day
    from flexpipe_dag.serving.frontdoor.process import ServerProcess
    from flexpipe_dag.serving.loadtest import requests_from_workload
    from flexpipe_dag.serving.report import summarize, write_html_report

    db = store.get_store()
    latest = db.latest_profile()
    if latest is None:
        raise InfeasibleError("no cluster profile stored: run profile_refresh first")
    gears = db.load_gears(latest[0].id)
    if not gears:
        raise InfeasibleError(f"no gears stored for profile version {latest[0].id}: materialise candidate_gears")
    first = next((g for g in gears if g.kind == config.initial_gear_kind), gears[0])
    mean_rps = day_mean_rps(config, gears, first)
    online_wl, offline_wl, compression = build_workloads(config, mean_rps)
    model = None if planning.model == "SmolLM2-135M" else planning.model
    ckpt = resolve_checkpoint(model)
    check_context(config, ckpt.max_context_tokens, ckpt.name)
    tok = ckpt.tokenizer()
    caps = {"max_prompt_tokens": config.max_prompt_tokens, "max_tokens": config.max_new_tokens}
    online = requests_from_workload(online_wl, tok, **caps)
    offline = requests_from_workload(offline_wl, tok, **caps)
    run_key = f"frontdoor-{context.run_id[:8]}"
    context.log.info(f"{len(online)} online requests over {config.duration_s:.0f} s (mean {mean_rps:.2f} req/s, "
                     f"tide compressed {compression:.0f}x), {len(offline)} batch lines; first gear {first.gear_id}")
    env = {"FLEXPIPE_CONTROL_FILE": control.config_file}
    if store.database_url:
        env["FLEXPIPE_DATABASE_URL"] = store.database_url
    server = ServerProcess(server_args(config, first.gear_id, run_key, model, control.dwell_s), env=env,
                           on_line=lambda line: context.log.info(f"serve: {line}"))
    t0 = time.monotonic()
    drill_stop = threading.Event()
    try:
        url = server.wait_bound(config.server_start_timeout_s)
        context.log.info(f"front door up at {url} after {time.monotonic() - t0:.0f} s")
        if config.operator_drill_at is not None:
            after_s = config.operator_drill_at * (online[-1].arrival_s if online else 0.0)
            threading.Thread(target=operator_drill, args=(db, run_key, gears, after_s, drill_stop, context.log.info, t0),
                             name="flexpipe-drill", daemon=True).start()
        day = serve_day(url, ckpt.name, online, offline, batch_timeout_s=config.batch_timeout_s,
                        log=context.log.info)
    finally:
        drill_stop.set()
        exit_status = server.stop()
    context.log.info(f"flexpipe serve exited with status {exit_status}")
    shifts, declines = decisions_from_events(db.shift_events(run_key=run_key))
    samples = [smp for _, smp in db.read_samples(run_key=run_key)]
    summary = summarize(day.results, day.submitted_online + day.submitted_offline, day.elapsed_s, shifts, declines)
    summary["lost"] -= len(day.failed)  # answered with an error: failed, not lost
    summary.update(failed=len(day.failed), failures=day.failed[:20], server_exit=exit_status, gears=len(gears),
                   batch={k: day.batch.get(k) for k in ("id", "status", "request_counts")})
    path = write_html_report(
        flexpipe_home() / "reports" / f"{run_key}.html", f"FlexPipe front-door run {run_key}", summary, samples,
        day.results, notes=[f"served over HTTP by flexpipe serve ({run_key}); online: streaming /v1/completions "
                            "replayed at the trace's arrival times; offline: one Batch API job",
                            *day_notes(config, compression, mean_rps, ckpt.name),
                            *[f"failed {f['id']}: {f['error']}" for f in day.failed[:20]]])
    (flexpipe_home() / "reports" / "latest_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    context.add_output_metadata({
        "report": MetadataValue.path(str(path)), "served": summary["served"], "lost": summary["lost"],
        "failed": summary["failed"], "shifts": len(shifts), "declined_episodes": len(summary["declines"]),
        "batch": MetadataValue.json(summary["batch"]), "output_tokens_per_s": summary["output_tokens_per_s"]})
    if summary["lost"] or summary["failed"] or summary["duplicates"] or exit_status != 0:
        raise RuntimeError(f"{summary['lost']} request(s) lost, {summary['failed']} failed, {summary['duplicates']} "
                           f"duplicated, server exit status {exit_status}{failure_kinds(day.failed)}; see {path}")
    return {"report": str(path), "summary": summary}


@job(description="A tide-shaped day of real HTTP traffic and a Batch API job through flexpipe serve, shifting gears.",
     tags={"dagster/priority": "5"})
def serve_frontdoor():
    serve_http()
