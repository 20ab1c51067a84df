"""The SQL store as a batch-job result sink (the runtime's ``ResultSink`` protocol).

Each finished request becomes one ``request_results`` row the moment it finishes, keyed by
(job, request id), so a crashed or paused job keeps everything finished and a re-run skips it.
"""

from __future__ import annotations

from typing import Any

from flexpipe_dag.sql.store import Store


class StoreResultSink:
    """``done_ids()`` / ``write(result)`` over ``request_results`` of one inference job."""

    def __init__(self, store: Store, job_id: int):
        self.store = store
        self.job_id = job_id
        self.written = 0

    def done_ids(self) -> set[str]:
        return self.store.done_request_keys(self.job_id)

    def write(self, result: dict[str, Any]) -> None:
        """Store one result dict (keys as :func:`flexpipe_dag.runtime.batch.result_record`); idempotent per id."""
        if self.store.write_result(
                self.job_id, result["id"], prompt_tokens=result["prompt_tokens"],
                output_token_ids=result["output_token_ids"], gear_key=result.get("gear_id"),
                output_text=result.get("output_text"), ttft_ms=result.get("ttft_ms"),
                tpot_ms=result.get("tpot_ms"), e2e_ms=result.get("e2e_ms")):
            self.written += 1
