"""The ``batch_inference`` job: a prompts file or a trace through a real pipeline, every output into the store.

Safe to re-run: results are keyed by (job, request id), finished requests are skipped, malformed rows
are counted and reported, a model that does not fit the gear is refused before launch, and a crashed
stage fails the run naming the stage while keeping what finished (and tags the gear unhealthy). The
tide sensor pauses a running job by setting its status to ``paused``: the job stops between chunks.
"""

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from flexpipe_dag.core.status import HealthFailure, InferenceJobKind, InferenceJobStatus
from flexpipe_dag.jobs.pools import PIPELINE_RUNTIME_POOL
from flexpipe_dag.resources.store_resource import StoreResource

#: Requests submitted per chunk; a pause takes effect between chunks.
CHUNK_REQUESTS = 16


class BatchInferenceConfig(Config):
    """What to run. Give ``prompts_path`` (JSONL / Parquet) or ``trace`` (Azure CSV)."""

    job_key: str = Field(description="stable id of the job; re-runs with the same key resume it")
    prompts_path: str = ""
    trace: str = ""
    num_requests: int = 64
    max_prompt_tokens: int = 256
    max_new_tokens: int = 16
    gear_id: str = Field(default="", description="a stored gear; empty = even split over `stages` CPU workers")
    stages: int = 2
    micro_batch_size: int = 8
    model: str = Field(default="", description="checkpoint: HF dir or GGUF; empty = SmolLM2-135M-Instruct")
    priority: int = 0
    step_timeout_s: float = 120.0
    kv_pool_tokens_max: int = Field(default=8192, ge=256, description="cap on the gear's KV pool for this job")
    truncate_context: bool = Field(default=False, description="serve a request whose prompt + max_new_tokens exceed "
                                   "the model's max context with the prompt cut from the left (default: refuse it; "
                                   "either way the run's metadata counts them)")
    control_address: str = Field(default="", description="HOST:PORT: serve stage workers started on other hosts "
                                 "(`flexpipe worker --head HOST:PORT --stage S` on each) instead of spawning "
                                 "them here (PORT 0: a free port, named in the run's log); empty = every "
                                 "stage on this host")
    secret_file: str = Field(default="", description="with control_address: the run secret workers must prove "
                             "(`flexpipe worker --secret-file`); read if the file exists, else written there 0600; "
                             "empty = FLEXPIPE_RUN_SECRET_FILE / FLEXPIPE_RUN_SECRET, else a new temporary file "
                             "named in the run's log")


def _gear(config: BatchInferenceConfig, db, ckpt):
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.core.gear_builders import even_gear

    if config.gear_id:
        gear = db.load_gear(config.gear_id)
        if gear is None:
            raise InputError("batch_inference config", "gear_id", f"no stored gear {config.gear_id!r}")
        return gear.with_kv_pool_capped(config.kv_pool_tokens_max)
    return even_gear(ckpt.num_layers, config.stages, ckpt.name, config.micro_batch_size, None, 0)


def _rows(config: BatchInferenceConfig, ckpt):
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.runtime.batch import prompts_from_trace, read_prompts

    if config.prompts_path:
        return read_prompts(config.prompts_path, config.max_new_tokens)
    if config.trace:
        from flexpipe_dag.workload.bundled import bundled_path

        path = bundled_path(config.trace) if "/" not in config.trace else config.trace
        return prompts_from_trace(path, ckpt.tokenizer(), num_requests=config.num_requests,
                                  max_prompt_tokens=config.max_prompt_tokens,
                                  max_new_tokens=config.max_new_tokens), []
    raise InputError("batch_inference config", "prompts_path/trace", "give a prompts file or a trace")


@op(description="Run the job's missing requests through the pipeline, storing each result as it finishes.",
    tags={"kind": "inference"}, pool=PIPELINE_RUNTIME_POOL)
def run_batch(context: OpExecutionContext, config: BatchInferenceConfig, store: StoreResource) -> dict:
    from flexpipe_dag.core.ids import check_id
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from flexpipe_dag.sql.result_sink import StoreResultSink

    check_id(config.job_key, "batch_inference config", "job_key")  # before the store or a model is touched
    if config.gear_id:
        check_id(config.gear_id, "batch_inference config", "gear_id")
    if config.control_address:
        from flexpipe_dag.runtime.remote import parse_address

        parse_address(config.control_address, "batch_inference config: control_address")
    db = store.get_store()
    ckpt = resolve_checkpoint(config.model or None)
    gear = _gear(config, db, ckpt)
    rows, malformed = _rows(config, ckpt)
    job_id = db.get_or_create_job(config.job_key, InferenceJobKind.BATCH, priority=config.priority,
                                  source_path=config.prompts_path or config.trace, gear_key=gear.gear_id)
    db.update_job(job_id, status=InferenceJobStatus.RUNNING, total_requests=len(rows), malformed_rows=len(malformed),
                  error=None, gear_key=gear.gear_id)
    sink = StoreResultSink(db, job_id)
    for m in malformed[:50]:
        context.log.warning(f"malformed row {m.line}: {m.reason}")
    head_secret = None
    if config.control_address:
        from flexpipe_dag.runtime.control_auth import HeadSecret

        head_secret = HeadSecret.resolve(config.secret_file or None)  # written once the port is bound
    runtime = PipelineRuntime(gear, ckpt, RuntimeOptions(step_timeout_s=config.step_timeout_s,
                                                         control_address=config.control_address or None,
                                                         truncate_context=config.truncate_context,
                                                         secret=head_secret.secret if head_secret else None))
    try:
        return _serve_batch(context, config, db, gear, ckpt, runtime, rows, malformed, job_id, sink, head_secret)
    finally:
        if head_secret is not None:  # a secret file this run generated goes with it
            head_secret.discard()


def _serve_batch(context, config, db, gear, ckpt, runtime, rows, malformed, job_id, sink, head_secret) -> dict:
    """The serving part of :func:`run_batch`: waits for remote workers (publishing the run secret once
    the port is bound), then serves the rows in chunks, pausing when the tide sensor says so."""
    from flexpipe_dag.runtime.batch import run_batch_job
    from flexpipe_dag.runtime.observations import ObservationCollector

    if head_secret is not None:  # the bound port (PORT 0 picks one)
        address = runtime.listen()
        secret_path = head_secret.publish()
        context.log.info(f"waiting for {sum(st.replicas for st in gear.stages)} stage workers at {address} "
                         f"(run secret in {secret_path or '$FLEXPIPE_RUN_SECRET'}: `flexpipe worker --secret-file`)")
    finished = skipped = tokens = steps = refused_context = 0
    refused: dict[str, str] = {}
    truncated: dict[str, str] = {}
    paused = False
    failure = None
    with runtime:
        # stage-step measurements for calibration (only for gears planned on a stored profile:
        # their device ids are the profile's)
        collector = ObservationCollector(runtime, context.run_id) if gear.cluster_id else None
        context.log.info(f"gear {gear.gear_id}: stages {gear.layer_ranges()}; per-stage memory "
                         + ", ".join(f"{i['param_bytes'] / 2**20:.0f} MiB" for i in runtime.stage_info))
        todo = [r for r in rows if r.request_id not in sink.done_ids()]
        skipped = len(rows) - len(todo)
        for start in range(0, len(todo), CHUNK_REQUESTS):
            if db.job_status(job_id) == InferenceJobStatus.PAUSED:
                paused = True
                context.log.info(f"job {config.job_key} paused by the tide sensor after {finished} requests")
                break
            samples: list = []
            report = run_batch_job(runtime, todo[start:start + CHUNK_REQUESTS], sink, on_metrics=samples.append)
            db.write_samples(context.run_id, samples)  # the same 2 s schema the simulator emits
            if collector is not None:
                steps += db.write_observations(context.run_id, collector.collect(), cluster_key=gear.cluster_id)
            finished += report.finished
            tokens += report.output_tokens
            refused.update(report.refused)
            truncated.update(report.truncated)
            refused_context += report.refused_context
            for request_id, why in report.refused.items():
                context.log.warning(f"refused {request_id}: {why}")
            context.log.info(f"{skipped + finished}/{len(rows)} requests done")
            if report.failure:
                failure = report.failure
                break
    if failure:
        db.update_job(job_id, status=InferenceJobStatus.FAILED, error=failure)
        db.mark_unhealthy(gear.gear_id, gear.cluster_id or "local", gear.model_name, HealthFailure.CRASHED_STAGE,
                          failure, run_key=context.run_id)
        raise Failure(f"batch job {config.job_key}: {failure}; {skipped + finished} finished results kept",
                      metadata={"finished": skipped + finished})
    if refused_context or truncated:
        context.log.warning(f"{refused_context + len(truncated)} requests over {ckpt.name}'s {runtime.max_context_tokens}-token "
                            f"max context (prompt + max_new_tokens): {refused_context} refused, {len(truncated)} "
                            "served truncated")
    status = "paused" if paused else "done"
    db.update_job(job_id, status=status)
    context.add_output_metadata({"job_key": config.job_key, "status": status, "finished_now": finished,
                                 "skipped_already_done": skipped, "malformed_rows": len(malformed),
                                 "output_tokens": tokens, "gear": gear.gear_id, "observed_steps": steps,
                                 "refused": len(refused), "refused_context": refused_context,
                                 "truncated_context": len(truncated), "max_context_tokens": runtime.max_context_tokens,
                                 "malformed": MetadataValue.md("\n".join(f"- row {m.line}: {m.reason}"
                                                                         for m in malformed[:50]) or "none")})
    return {"job_id": job_id, "status": status}


@job(description="Offline batch inference into the SQL store (admitted in troughs by tide_sensor, or by hand).",
     tags={"dagster/priority": "-1"})
def batch_inference():
    run_batch()
