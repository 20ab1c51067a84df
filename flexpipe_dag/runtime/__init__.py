"""FlexPipe's pipeline runtime: real multi-process pipeline-parallel LLM inference.

Modules (one job each):

* :mod:`~flexpipe_dag.runtime.model_loader` - checkpoints (HF directory / GGUF) -> cached
  safetensors; builds one stage's layers only.
* :mod:`~flexpipe_dag.runtime.kv_blocks` - pure paged-KV block accounting (block tables, free list).
* :mod:`~flexpipe_dag.runtime.kv_cache` - the per-stage pre-allocated K/V block pool (torch).
* :mod:`~flexpipe_dag.runtime.stage` - forward of a packed batch through one stage.
* :mod:`~flexpipe_dag.runtime.scheduler` - pure iteration-level continuous batching.
* :mod:`~flexpipe_dag.runtime.messages` - pure: the typed messages, events, counter slots and
  scheduler config between processes, and their checked JSON wire form.
* :mod:`~flexpipe_dag.runtime.transport` - framed tensor messages over ``torch.distributed``.
* :mod:`~flexpipe_dag.runtime.rendezvous` / :mod:`~flexpipe_dag.runtime.remote` - the head's
  control store (address, client) and stage workers on other hosts.
* :mod:`~flexpipe_dag.runtime.worker` / :mod:`~flexpipe_dag.runtime.pipeline` - one process per
  stage, the driver, watchdog and live metrics.
* :mod:`~flexpipe_dag.runtime.batch` - batch jobs: prompt files, sinks, idempotent re-runs.
* :mod:`~flexpipe_dag.runtime.scoring` (pure) / :mod:`~flexpipe_dag.runtime.pipe_layers` /
  :mod:`~flexpipe_dag.runtime.score_runtime` / :mod:`~flexpipe_dag.runtime.score_launch` -
  prefill-only scoring jobs on DeepSpeed's ``PipelineModule``, split at the gear's stage boundaries
  (spawned on this host, or started by DeepSpeed's launcher / torchrun on several hosts).

Nothing here is imported by the pure planning / simulation / control code.
"""
