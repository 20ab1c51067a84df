"""Dagster concurrency pools of FlexPipe's ops (limits in the instance's ``dagster.yaml``; ``deploy/dagster.yaml``
ships ``default_limit: 1``).

* :data:`PIPELINE_RUNTIME_POOL` - every op that starts the multi-process pipeline runtime on this host
  (``serve_trace``'s ``serve``, ``batch_inference``'s ``run_batch``): one runtime per host, so a second run
  queued with the first waits for the first's runtime to stop instead of loading the model next to it.
  ``gear_shift``'s op is not in it: it asks the live runtime to shift and must run while that runtime holds
  the pool.
* ``device_probe`` - the ``gpu_profile`` asset: one device probe at a time.
"""

#: Pool of the ops that start the pipeline runtime (limit 1 from ``default_limit`` in ``deploy/dagster.yaml``).
PIPELINE_RUNTIME_POOL = "pipeline_runtime"
