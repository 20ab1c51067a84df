"""The ``serve_trace`` job: real requests through a live, shifting pipeline, with an offline job in the troughs.

A time-compressed slice of a real trace (arrival times and token lengths of the Azure LLM 2023
conversation trace, reshaped so its rate follows one day of the ServeGen tide) is replayed through
the real multi-process pipeline, starting on the planned ``latency`` gear. The gear-shift
controller moves it as the load changes; an offline job (lengths from the arXiv summarisation set)
fills the trough. The run ends with a summary and an HTML report under ``FLEXPIPE_HOME/reports``.
"""

import json
import time

from dagster import Config, MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from flexpipe_dag.jobs.pools import PIPELINE_RUNTIME_POOL, pipeline_runtime_held
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


class ServeTraceConfig(Config):
    """The replay (CPU-sized defaults: a few minutes on 2 cores)."""

    trace: str = Field(default="azure-conv", description="online trace replayed (bundled name or CSV path): its "
                       "arrival times and token lengths")
    trace_start_s: float = Field(default=600.0, ge=0, description="skip the trace's sparse first minutes")
    duration_s: float = Field(default=200.0, gt=0, description="wall seconds the tide day is compressed into")
    tide_start_h: float = Field(default=2.0, ge=0, lt=24, description="tide hour the replay starts at")
    mean_rps: float = Field(default=0.0, ge=0, description="mean online arrival rate; 0 = 1.5 x the first gear's "
                                                           "rps_max (the tide's peak then overloads it, its trough "
                                                           "does not), lowered so that the peak stays within 80 % of "
                                                           "the largest gear's envelope")
    max_prompt_tokens: int = Field(default=96, ge=1, description="cap on each request's prompt tokens (CPU-sized)")
    max_new_tokens: int = Field(default=12, ge=1, description="cap on each request's generated tokens")
    offline_trace: str = Field(default="arxiv-summarization", description="trace whose lengths shape the offline "
                               "job that fills the trough")
    offline_requests: int = Field(default=24, description="requests of the offline job (its trace's first ones)")
    initial_gear_kind: str = Field(default="latency", description="kind of the planned gear the replay starts on "
                                   "(the first stored gear when none is of this kind)")
    inline_control: bool = Field(default=True,
                                 description="decide shifts in the loop (no daemon); else apply gear_shift runs")
    max_offline_inflight: int = Field(default=4, description="offline requests in the pipeline at once while the "
                                      "tide admits them")
    step_timeout_s: float = Field(default=120.0, description="seconds one pipeline step may take before the run "
                                  "fails naming the stage")
    kv_pool_tokens_max: int = Field(default=8192, ge=256,
                                    description="cap on each gear's KV pool (CPU workers share host RAM)")


def _runnable(gears, kv_pool_tokens_max: int):
    """The gears with their KV pools capped for this host (replicated stages run one worker per replica)."""
    return [g.with_kv_pool_capped(kv_pool_tokens_max) for g in gears]


def day_notes(config: ServeTraceConfig, compression: float, mean_rps: float, model_name: str) -> list[str]:
    """The report's lines on the served day: the trace, its tide shaping and compression, the length caps."""
    return [f"trace {config.trace} shaped by the ServeGen tide from {config.tide_start_h:.1f} h, "
            f"compressed {compression:.0f}x, mean {mean_rps:.2f} req/s",
            f"prompts capped at {config.max_prompt_tokens} tokens, outputs at {config.max_new_tokens}; "
            f"model {model_name}"]


def check_context(config: ServeTraceConfig, max_context_tokens: int | None, model_name: str) -> None:
    """Refuse caps under which a request could exceed the model's max context (``None``: not known).

    Every replayed request is cut to ``max_prompt_tokens`` and ``max_new_tokens``; the scheduler would
    refuse one whose prompt + ``max_new_tokens`` exceed the max context, so the caps are checked here,
    before anything launches, instead of such requests ending up refused mid-replay.

    Raises:
        InputError: naming both caps, their sum and the model's max context.
    """
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.workload.context import over_context

    if over_context(config.max_prompt_tokens, config.max_new_tokens, max_context_tokens):
        raise InputError("serve_trace config", "max_prompt_tokens + max_new_tokens",
                         f"{config.max_prompt_tokens} + {config.max_new_tokens} = "
                         f"{config.max_prompt_tokens + config.max_new_tokens} tokens exceed {model_name}'s max "
                         f"context of {max_context_tokens} tokens; expected at most {max_context_tokens}")


#: Share of the largest planned envelope the default day's peak (its busiest 20 s) may reach: above it no gear
#: holds the peak, the queue grows for the rest of the day and the front door refuses requests (429).
PEAK_ENVELOPE_SHARE = 0.8
#: Window over which the day's peak rate is read (seconds of the compressed day).
PEAK_WINDOW_S = 20.0


def day_mean_rps(config: ServeTraceConfig, gears, first) -> float:
    """The day's mean online rate (req/s): ``config.mean_rps`` when set; else 1.5 x ``first``'s ``rps_max``
    (the tide's rise then overloads the gear the day starts on, so the controller must shift up), lowered
    where the day's peak (its busiest :data:`PEAK_WINDOW_S`, read from the shaped trace) would exceed
    :data:`PEAK_ENVELOPE_SHARE` of the largest envelope among ``gears``: a plan whose gears all hold about
    the same rate (or that has one gear) is still served a day it can hold.

    Raises:
        InfeasibleError: no gear has a positive envelope."""
    from flexpipe_dag.core.errors import InfeasibleError

    if config.mean_rps:
        return config.mean_rps
    largest = max(g.rps_max for g in gears)
    if not largest > 0:
        raise InfeasibleError(f"no planned gear holds any load (largest envelope {largest} req/s): re-plan the gears")
    mean_rps, cap_rps = 1.5 * first.rps_max, PEAK_ENVELOPE_SHARE * largest
    for _ in range(4):  # the arrivals are the trace's own, so the peak is only about proportional to the mean
        online, _, _ = build_workloads(config, mean_rps)
        peak_rps = online.peak_rate_rps(PEAK_WINDOW_S)
        if peak_rps <= cap_rps:
            break
        mean_rps *= 0.97 * cap_rps / peak_rps
    return mean_rps


def build_workloads(config: ServeTraceConfig, mean_rps: float):
    """(online workload shaped by the tide, offline length-only workload)."""
    from flexpipe_dag.workload.bundled import load_tide_trace, load_trace
    from flexpipe_dag.workload.tide import shape_by_tide
    from flexpipe_dag.workload.transform import as_class, head, time_window

    compression = 86400.0 / config.duration_s
    trace = load_trace(config.trace)
    trace = time_window(trace, config.trace_start_s, trace.duration_s + 1.0)
    online = shape_by_tide(trace, load_tide_trace(), compression=compression,
                           start_s=config.tide_start_h * 3600.0, duration_s=config.duration_s, mean_rps=mean_rps,
                           name=f"{config.trace} x tide")
    offline = as_class(head(load_trace(config.offline_trace), config.offline_requests), "offline", arrival_s=0.0)
    return online, offline, compression


@op(description="Serve a tide-shaped slice of a real trace through the live pipeline, shifting gears; write the report.",
    tags={"kind": "inference"}, pool=PIPELINE_RUNTIME_POOL)
def serve(context: OpExecutionContext, config: ServeTraceConfig, store: StoreResource, planning: PlanningSettings,
          control: ControlSettings) -> dict:
    from flexpipe_dag.control.tide import TideForecaster, load_history
    from flexpipe_dag.core.errors import InfeasibleError
    from flexpipe_dag.core.settings import flexpipe_home
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from flexpipe_dag.serving.prompts import timed_requests
    from flexpipe_dag.serving.report import summarize, write_html_report
    from flexpipe_dag.serving.serve import ServeSettings, TraceServer
    from flexpipe_dag.shift.executor import GearExecutor
    from flexpipe_dag.shift.router import ServingRouter

    db = store.get_store()
    figures = control.resolved()  # the controller's and the tide's figures, read once per process
    latest = db.latest_profile()
    if latest is None:
        raise InfeasibleError("no cluster profile stored: run profile_refresh first")
    info, _ = latest
    gears = _runnable(db.load_gears(info.id), config.kv_pool_tokens_max)
    if not gears:
        raise InfeasibleError(f"no runnable gears stored for profile version {info.id}: materialise candidate_gears")
    first = next((g for g in gears if g.kind == config.initial_gear_kind), gears[0])
    mean_rps = day_mean_rps(config, gears, first)
    online_wl, offline_wl, compression = build_workloads(config, mean_rps)
    ckpt = resolve_checkpoint(None if planning.model == "SmolLM2-135M" else planning.model)
    check_context(config, ckpt.max_context_tokens, ckpt.name)
    tok = ckpt.tokenizer()
    online = timed_requests(online_wl, tok, ckpt.eos_token_ids(), max_prompt_tokens=config.max_prompt_tokens,
                            max_new_tokens=config.max_new_tokens)
    offline = timed_requests(offline_wl, tok, ckpt.eos_token_ids(), max_prompt_tokens=config.max_prompt_tokens,
                             max_new_tokens=config.max_new_tokens)
    run_key = f"serve-{context.run_id[:8]}"
    context.log.info(f"{len(online)} online requests over {config.duration_s:.0f} s (mean {mean_rps:.2f} req/s, "
                     f"tide compressed {compression:.0f}x), {len(offline)} offline; first gear {first.gear_id}")
    settings = ServeSettings(run_key=run_key, online_job_key=f"{run_key}-online", offline_job_key=f"{run_key}-offline",
                             inline_control=config.inline_control, tide_start_s=config.tide_start_h * 3600.0,
                             tide_compression=compression, max_offline_inflight=config.max_offline_inflight)
    options = RuntimeOptions(step_timeout_s=config.step_timeout_s)
    holder: dict = {}
    router = ServingRouter(on_result=lambda out: holder["server"].on_result(out),
                           on_metrics=lambda smp: holder["server"].on_metrics(smp))
    with pipeline_runtime_held(context, "serve"), router:  # one runtime per host
        t0 = time.monotonic()
        router.open(PipelineRuntime(first, ckpt, options))
        context.log.info(f"gear {first.gear_id} live after {time.monotonic() - t0:.1f} s")
        server = TraceServer(db, figures, router, GearExecutor(router, options=options), gears, settings,
                             forecaster=TideForecaster(load_history(figures.tide)), tokenizer=tok,
                             log=context.log.info)
        holder["server"] = server
        report = server.serve(online, offline)
    summary = summarize(report.results, report.submitted_online + report.submitted_offline, report.elapsed_s,
                        report.shifts, report.declines)
    summary["offline_admissions"] = report.tide_decisions
    summary["offline_not_admitted"] = len(offline) - report.submitted_offline
    path = write_html_report(flexpipe_home() / "reports" / f"{run_key}.html", f"FlexPipe serve run {run_key}", summary,
                             report.samples, report.results,
                             notes=[*day_notes(config, compression, mean_rps, ckpt.name),
                                    *[f"{d['t_s']:.0f} s: {d['reason']}" for d in report.tide_decisions]])
    (flexpipe_home() / "reports" / "latest_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    context.add_output_metadata({
        "report": MetadataValue.path(str(path)), "served": summary["served"], "lost": summary["lost"],
        "shifts": len(report.shifts), "declined_episodes": len(summary["declines"]),
        "last_decline": summary["declines"][-1]["reason"] if summary["declines"] else "none",
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "summary": MetadataValue.json(json.loads(json.dumps(summary, default=str)))})
    if summary["lost"] or summary["duplicates"]:
        raise RuntimeError(f"{summary['lost']} request(s) lost, {summary['duplicates']} duplicated; see {path}")
    return {"report": str(path), "summary": summary}


@job(description="Serve a tide-shaped slice of a real trace through the live pipeline while it shifts gears.",
     tags={"dagster/priority": "5"})
def serve_trace():
    serve()
