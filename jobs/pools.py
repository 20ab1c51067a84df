"""Dagster concurrency pools of FlexPipe's ops (limits in the instance's ``dagster.yaml``; ``deploy/dagster.yaml``
ships ``default_limit: 1``).

* :data:`PIPELINE_RUNTIME_POOL` - every op that starts the multi-process pipeline runtime on this host
  (``serve_trace``'s ``serve``, ``batch_inference``'s ``run_batch``): one runtime per host, so a second run
  queued with the first waits for the first's runtime to stop instead of loading the model next to it.
  ``gear_shift``'s op is not in it: it asks the live runtime to shift and must run while that runtime holds
  the pool.
* ``device_probe`` - the ``gpu_profile`` asset: one device probe at a time.

The pool queues runtime ops and shows the queue in the UI; what guarantees one runtime per host is the
OS file lock each of those ops takes with :func:`pipeline_runtime_held` (Dagster's slot claim is not
atomic on SQLite: see :mod:`flexpipe_dag.runtime.host_lock`).
"""

from collections.abc import Iterator
from contextlib import contextmanager

#: Pool of the ops that start the pipeline runtime (limit 1 from ``default_limit`` in ``deploy/dagster.yaml``).
PIPELINE_RUNTIME_POOL = "pipeline_runtime"
#: Pool of the device probe (the ``gpu_profile`` asset).
DEVICE_PROBE_POOL = "device_probe"
#: Every pool FlexPipe's ops and assets use.
POOLS = (PIPELINE_RUNTIME_POOL, DEVICE_PROBE_POOL)


def initialise_pools(instance) -> dict[str, int]:
    """Create each of :data:`POOLS`'s slots on ``instance`` at its ``default_limit``, before any run uses them.

    Dagster creates a pool's slots when a step first claims one; two runs starting together on an
    instance that has never used the pool can both count no slots and each add one, so both steps
    run (seen once in CI on SQLite). Initialising the pools up front, as ``flexpipe demo`` does on
    its instance and ``dagster instance concurrency set pipeline_runtime 1`` does by hand, closes
    that window.

    Args:
        instance: a ``dagster.DagsterInstance`` whose storage supports concurrency pools.

    Returns:
        ``{pool: slot count}`` after initialising (0 where the instance sets no default limit).
    """
    storage = instance.event_log_storage
    for pool in POOLS:
        storage.initialize_concurrency_limit_to_default(pool)
    return {pool: storage.get_concurrency_info(pool).slot_count for pool in POOLS}


@contextmanager
def pipeline_runtime_held(context, op_name: str) -> Iterator[float]:
    """Hold this host's pipeline-runtime lock for the body of the ``with`` (every op in
    :data:`PIPELINE_RUNTIME_POOL` runs its runtime inside it), logging on ``context.log`` whom it waits for.

    Args:
        context: the op's ``OpExecutionContext``.
        op_name: the op, as a waiting run names the holder.

    Yields:
        The seconds waited for the lock (0.0 when it was free).
    """
    from flexpipe_dag.runtime.host_lock import hold_runtime_lock

    with hold_runtime_lock(f"Dagster run {context.run_id[:8]} ({op_name})", context.log.info) as waited_s:
        if waited_s > 0.0:
            context.log.info(f"pipeline runtime lock taken after waiting {waited_s:.0f} s")
        yield waited_s
