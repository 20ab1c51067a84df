"""The ``batch_inference`` job: a prompts file or a trace through a real pipeline, every output into the store.

Safe to re-run: results are keyed by (job, request id), finished requests are skipped, malformed rows
are counted and reported, a model that does not fit the gear is refused before launch, and a crashed
stage fails the run naming the stage while keeping what finished (and tags the gear unhealthy). The
tide sensor pauses a running job by setting its status to ``paused``: the job stops between chunks.
"""

from typing import Literal

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from flexpipe_dag.core.status import HealthFailure, InferenceJobKind, InferenceJobStatus, PipelineRunKind
from flexpipe_dag.jobs.pools import PIPELINE_RUNTIME_POOL, pipeline_runtime_held
from flexpipe_dag.resources.store_resource import StoreResource
from flexpipe_dag.runtime.chat_template import ChatTemplateMode, resolve_chat_template

#: Requests submitted per chunk; a pause takes effect between chunks.
CHUNK_REQUESTS = 16
#: What a request's KV refusal tells the user to raise in this job.
KV_KNOB = "the job's kv_pool_tokens_max"


class BatchInferenceConfig(Config):
    """What to run. Give ``prompts_path`` (JSONL / Parquet) or ``trace`` (Azure CSV).

    The store keeps this config, every field resolved, as the job's ``inference_jobs.config``: the
    tide sensor relaunches a paused job with it (``{"ops": {"run_batch": {"config": <it>}}}``).
    """

    job_key: str = Field(description="stable id of the job; re-runs with the same key resume it")
    prompts_path: str = Field(default="", description="JSONL or Parquet prompts file: id, prompt | token_ids, "
                              "max_new_tokens, priority per row (malformed rows are counted, not fatal); empty = "
                              "use `trace`")
    trace: str = Field(default="", description="with no prompts_path: an Azure LLM trace (CSV path or bundled name "
                       "such as azure-conv) whose token lengths shape prompts cut from a bundled public-domain text")
    num_requests: int = Field(default=64, description="with trace: the trace rows served (its first ones)")
    max_prompt_tokens: int = Field(default=256, description="with trace: cap on each prompt's tokens")
    max_new_tokens: int = Field(default=16, ge=1, description="tokens generated per request: a row without "
                                "max_new_tokens gets this, a row asking for more gets this (the cap)")
    gear_id: str = Field(default="", description="a stored gear; empty = `stages` CPU workers on this host, their "
                         "layers split as `split` says")
    stages: int = Field(default=2, description="with no gear_id: the model's layers split (see `split`) over this "
                        "many CPU worker processes on this host; their steps are recorded as this host's probed CPU workers "
                        "(`<host>-cpu<i>`, cluster `<host>`) for `flexpipe calibrate`")
    split: Literal["workload", "even"] = Field(
        default="workload", description="with no gear_id and stages > 1 on this host: workload = the layers split "
        "for the job's own prompts and output lengths (one stage worker measured here, the split whose slowest "
        "stage is fastest, as `flexpipe run --stages`); even = as many layers on every stage")
    micro_batch_size: int = Field(default=8, description="with no gear_id: sequences per micro-batch")
    model: str = Field(default="", description="checkpoint: HF dir or GGUF; empty = SmolLM2-135M-Instruct")
    chat_template: ChatTemplateMode = Field(
        default="auto", description="plain-text prompts and a chat model: auto = wrap each in the tokenizer's chat "
        "template when it has one (prompts already holding its special tokens, and token_ids rows, are sent as "
        "they are); on = the same, refusing a model without a template; off = send them as they are (a warning "
        "when the model has a template)")
    priority: int = Field(default=0, description="the job's priority in the store (the tide sensor admits higher first)")
    step_timeout_s: float = Field(default=120.0, description="seconds one pipeline step may take before the run "
                                  "fails naming the stage")
    kv_pool_tokens_max: int = Field(default=8192, ge=256, description="cap (tokens) on the KV pool of the job's "
                                    "gear, `gear_id` or `stages` alike")
    truncate_context: bool = Field(default=False, description="serve a request whose prompt + max_new_tokens exceed "
                                   "the model's max context with the prompt cut from the left (default: refuse it; "
                                   "either way the run's metadata counts them); only the prompt is cut: a request "
                                   "whose max_new_tokens alone fill the context is still refused")
    control_address: str = Field(default="", description="HOST:PORT: serve stage workers started on other hosts "
                                 "(`flexpipe worker --head HOST:PORT --stage S` on each) instead of spawning "
                                 "them here (PORT 0: a free port, named in the run's log); empty = every "
                                 "stage on this host")
    secret_file: str = Field(default="", description="with control_address: the run secret workers must prove "
                             "(`flexpipe worker --secret-file`); read if the file exists, else written there 0600; "
                             "empty = FLEXPIPE_RUN_SECRET_FILE / FLEXPIPE_RUN_SECRET, else a new temporary file "
                             "named in the run's log")


def _gear(config: BatchInferenceConfig, db, ckpt):
    """The job's gear: the stored ``gear_id``, else ``stages`` CPU workers; either way its KV pool capped at
    ``kv_pool_tokens_max``.

    Raises:
        InputError: naming the job field: no stored gear ``gear_id``, or ``stages`` outside 1..the model's layers.
    """
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.core.gear_builders import even_gear

    if config.gear_id:
        gear = db.load_gear(config.gear_id)
        if gear is None:
            raise InputError("batch_inference config", "gear_id", f"no stored gear {config.gear_id!r}")
        return gear.with_kv_pool_capped(config.kv_pool_tokens_max)
    if not 1 <= config.stages <= ckpt.num_layers:
        raise InputError("batch_inference config", "stages", f"expected 1..{ckpt.num_layers} ({ckpt.name}'s layers), "
                                                             f"got {config.stages}")
    gear = even_gear(ckpt.num_layers, config.stages, ckpt.name, config.micro_batch_size, None,
                     0).with_kv_pool_capped(config.kv_pool_tokens_max)
    return gear if config.control_address else _on_host_cpu_workers(gear)


def _on_host_cpu_workers(gear):
    """``gear`` (an even split over local CPU worker processes) with stage ``i`` named as this host's probed
    CPU worker ``i`` (``<host>-cpu<i>`` of cluster ``<host>``), so its recorded steps calibrate that profile."""
    from flexpipe_dag.core.gear import Gear
    from flexpipe_dag.core.host import cpu_worker_device_id, local_cluster_id

    host = local_cluster_id()
    stages = [{**st.model_dump(), "device_ids": [cpu_worker_device_id(host, i)]} for i, st in enumerate(gear.stages)]
    return Gear.model_validate({**gear.model_dump(), "stages": stages, "cluster_id": host})


def _split_for_job(context: OpExecutionContext, config: BatchInferenceConfig, ckpt, gear, rows, done: set[str],
                   prompt_format):
    """A ``stages:`` job's gear with its layers split for the rows still to run when ``split`` is ``workload``
    (:func:`~flexpipe_dag.profiling.worker_split.split_gear_for_rows`; the split logged), else ``gear``."""
    if config.gear_id or config.control_address or config.split != "workload" or config.stages < 2:
        return gear
    from flexpipe_dag.profiling.worker_split import split_gear_for_rows
    from flexpipe_dag.runtime.model_loader import resolve_dtype
    from flexpipe_dag.runtime.pipeline import RuntimeOptions

    options = RuntimeOptions()  # the job's stage workers: the runtime's default device and dtype
    split_gear, split = split_gear_for_rows(gear, ckpt, rows, done, prompt_format.apply, options.device,
                                            resolve_dtype(options.dtype, options.device), config.truncate_context)
    if split is None:
        return gear
    context.log.info(split.describe())
    return _on_host_cpu_workers(split_gear)


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
    if not config.gear_id:  # an even split: micro-batches enough to keep every stage worker busy (a stored gear's own)
        from flexpipe_dag.core.gear_builders import inflight_to_fill

        gear = gear.model_copy(update={"max_inflight_micro_batches": inflight_to_fill(
            sum(st.replicas for st in gear.stages), len(rows), gear.micro_batch_size)})
    prompt_format = resolve_chat_template(config.chat_template, ckpt.tokenizer(), ckpt.name,
                                          [r.prompt if r.token_ids is None else None for r in rows],
                                          source="batch_inference config: chat_template")
    with pipeline_runtime_held(context, "run_batch"):  # one runtime per host: wait here, before RUNNING
        # the whole config, defaults resolved: what relaunches the job (the tide sensor's run config)
        job_id = db.get_or_create_job(config.job_key, InferenceJobKind.BATCH, priority=config.priority,
                                      source_path=config.prompts_path or config.trace, gear_key=gear.gear_id,
                                      config=config.model_dump(mode="json"))
        sink = StoreResultSink(db, job_id)
        gear = _split_for_job(context, config, ckpt, gear, rows, sink.done_ids(), prompt_format)
        db.update_job(job_id, status=InferenceJobStatus.RUNNING, total_requests=len(rows), malformed_rows=len(malformed),
                      error=None, gear_key=gear.gear_id)
        for m in malformed[:50]:
            context.log.warning(f"malformed row {m.line}: {m.reason}")
        if prompt_format.message:
            (context.log.warning if prompt_format.warn else context.log.info)(prompt_format.message)
        head_secret = None
        if config.control_address:
            from flexpipe_dag.runtime.control_auth import HeadSecret

            head_secret = HeadSecret.resolve(config.secret_file or None)  # written once the port is bound
        runtime = PipelineRuntime(gear, ckpt, RuntimeOptions(step_timeout_s=config.step_timeout_s,
                                                             control_address=config.control_address or None,
                                                             truncate_context=config.truncate_context,
                                                             kv_capacity_knob=KV_KNOB + (
                                                                 " (up to the gear's kv_capacity_tokens)"
                                                                 if config.gear_id else ""),
                                                             secret=head_secret.secret if head_secret else None))
        # its samples go under its run id: registered as a batch job, they never trigger a gear shift
        db.heartbeat_pipeline_run(context.run_id, PipelineRunKind.BATCH, gear.gear_id)
        try:
            return _serve_batch(context, config, db, gear, ckpt, runtime, rows, malformed, job_id, sink, head_secret,
                                prompt_format)
        finally:
            db.end_pipeline_run(context.run_id)
            if head_secret is not None:  # a secret file this run generated goes with it
                head_secret.discard()


def _serve_batch(context, config, db, gear, ckpt, runtime, rows, malformed, job_id, sink, head_secret,
                 prompt_format) -> dict:
    """The serving part of :func:`run_batch`: waits for remote workers (publishing the run secret once
    the port is bound), then serves the rows in chunks, pausing when the tide sensor says so, and records
    every stage step (under the gear's cluster; a ``stages:`` run's gear is this host's CPU workers)."""
    from flexpipe_dag.runtime.batch import no_text_line, run_batch_job
    from flexpipe_dag.runtime.observations import ObservationCollector

    if head_secret is not None:  # the bound port (PORT 0 picks one)
        address = runtime.listen()
        secret_path = head_secret.publish()
        context.log.info(f"waiting for {sum(st.replicas for st in gear.stages)} stage workers at {address} "
                         f"(run secret in {secret_path or '$FLEXPIPE_RUN_SECRET'}: `flexpipe worker --secret-file`)")
    finished = skipped = tokens = steps = refused_context = 0
    refused: dict[str, str] = {}
    truncated: dict[str, str] = {}
    no_text: list[str] = []
    paused = False
    failure = None
    with runtime:
        # stage-step measurements for calibration, every run: a planned gear's device ids are its
        # profile's, a local `stages:` run's this host's probed CPU workers (remote ones: no cluster)
        collector = ObservationCollector(runtime, context.run_id)
        _say_where_steps_go(context, db, gear)
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
            report = run_batch_job(runtime, todo[start:start + CHUNK_REQUESTS], sink, on_metrics=samples.append,
                                   chat_template=prompt_format.apply)
            db.write_samples(context.run_id, samples)  # the same 2 s schema the simulator emits
            steps += db.write_observations(context.run_id, collector.collect(), cluster_key=gear.cluster_id)
            no_text.extend(report.no_text)
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
    empty = no_text_line(no_text, finished, ckpt.eos_token_ids(), hint=_no_text_hint(prompt_format))
    if empty:
        context.log.warning(empty)
    status = "paused" if paused else "done"
    db.update_job(job_id, status=status)
    context.add_output_metadata({"job_key": config.job_key, "status": status, "finished_now": finished,
                                 "skipped_already_done": skipped, "malformed_rows": len(malformed),
                                 "output_tokens": tokens, "gear": gear.gear_id, "observed_steps": steps,
                                 "refused": len(refused), "refused_context": refused_context,
                                 "truncated_context": len(truncated), "max_context_tokens": runtime.max_context_tokens,
                                 "no_text": len(no_text), "no_text_rows": MetadataValue.md(empty or "none"),
                                 "chat_template": config.chat_template,
                                 "chat_template_applied": prompt_format.apply,
                                 "malformed": MetadataValue.md("\n".join(f"- row {m.line}: {m.reason}"
                                                                         for m in malformed[:50]) or "none")})
    return {"job_id": job_id, "status": status}


def _say_where_steps_go(context, db, gear) -> None:
    """Log the cluster a run's stage steps are recorded for, and what ``flexpipe calibrate`` still needs."""
    if not gear.cluster_id:
        context.log.info(f"stage steps recorded without a cluster (gear {gear.gear_id} names none; a `stages:` run "
                         "on remote workers): calibration cannot use them; a planned gear (gear_id) calibrates its "
                         "profile")
    elif db.latest_profile(gear.cluster_id) is None:
        context.log.warning(f"stage steps recorded for cluster {gear.cluster_id}, which has no stored profile yet: "
                            "profile it (the profile_refresh job on this host), then `flexpipe calibrate`")
    else:
        context.log.info(f"stage steps recorded for cluster {gear.cluster_id} (`flexpipe calibrate` fits them)")


def _no_text_hint(prompt_format) -> str:
    """What may give rows without text some (the line after :func:`~flexpipe_dag.runtime.batch.no_text_line`)."""
    if prompt_format.warn:
        return "the model has a chat template and chat_template: off sent plain prompts without it; auto wraps them"
    if prompt_format.apply:
        return "the plain-text prompts went in the model's chat template: check the prompts themselves"
    return "check that the prompts suit this model (a chat model answers prompts in its chat template)"


@job(description="Offline batch inference into the SQL store (admitted in troughs by tide_sensor, or by hand).",
     tags={"dagster/priority": "-1"})
def batch_inference():
    run_batch()
