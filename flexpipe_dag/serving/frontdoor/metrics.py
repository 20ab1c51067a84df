"""The front door's Prometheus metrics (``GET /metrics``, text format from ``prometheus_client``).

Latencies are measured at the server, from the moment a request was accepted to the moment its
tokens were handed to the HTTP response: what a client sees, less the network. Names follow
Prometheus conventions (base units, ``_seconds``, ``_total``) under the ``flexpipe_`` prefix; the
priority class (``online`` / ``offline``) is a label. The pipelines' own figures (KV blocks, stage
utilisation, requests waiting) come from their 2-s metric samples, one series per live pipeline (label
``pipeline``, the lane id ``<gear_id>#<n>``, named after the gear the pipeline started with (a cold
shift reconfigures a pipeline in place, keeping its id): the entry point, further instances, a gear
shift's warming or standby pipeline), so several instances never overwrite each other's figures; a pipeline's series go
when it is retired or fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flexpipe_dag.core.metrics import MetricSample

#: Histogram buckets of TTFT and end-to-end latency, seconds (CPU runs reach tens of seconds).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
#: Histogram buckets of the time per output token, seconds.
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
CLASSES = ("online", "offline")
#: ``direction`` labels of ``flexpipe_instance_changes_total``.
DIRECTIONS = ("out", "in")
#: Labels of the per-pipeline gauges: the pipeline's lane id and the stage index.
PIPELINE_LABELS = ("pipeline", "stage")


class FrontDoorMetrics:
    """Every series of one server, in its own registry (a test may run several servers in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("flexpipe_time_to_first_token_seconds", "Time from request accepted to first token",
                              ["priority_class"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("flexpipe_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", ["priority_class"],
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("flexpipe_e2e_request_latency_seconds", "Time from request accepted to its last token",
                             ["priority_class"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("flexpipe_requests_running", "Requests accepted and unfinished", ["priority_class"],
                             registry=r)
        self.waiting = Gauge("flexpipe_requests_waiting", "Requests waiting for admission, over the live "
                                                          "pipelines (their last samples)", registry=r)
        self.requests = Counter("flexpipe_requests_total", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("flexpipe_prompt_tokens_total", "Prompt tokens of served requests",
                                     ["priority_class"], registry=r)
        self.generation_tokens = Counter("flexpipe_generation_tokens_total", "Output tokens sent to clients",
                                         ["priority_class"], registry=r)
        self.cancelled = Counter("flexpipe_requests_cancelled_total",
                                 "Requests whose response ended before the pipeline finished them (a stop "
                                 "sequence, a client that went away), cancelled in the pipeline",
                                 ["priority_class"], registry=r)
        self.kv_blocks_used = Gauge("flexpipe_kv_blocks_used", "KV blocks in use, per pipeline and stage "
                                                               "(last sample)", PIPELINE_LABELS, registry=r)
        self.kv_blocks_free = Gauge("flexpipe_kv_blocks_free", "KV blocks free, per pipeline and stage "
                                                               "(last sample)", PIPELINE_LABELS, registry=r)
        self.stage_busy = Gauge("flexpipe_stage_busy_ratio", "Share of the last sample window a stage computed, "
                                                             "per pipeline and stage", PIPELINE_LABELS, registry=r)
        self.live_gear = Gauge("flexpipe_live_gear_info", "1 for the gear serving now", ["gear_id"], registry=r)
        self.shifts = Counter("flexpipe_gear_shifts_total", "Gear shifts, by reason and outcome",
                              ["reason", "outcome"], registry=r)
        self.instances = Gauge("flexpipe_instances", "Pipeline instances requests are routed to", registry=r)
        self.instance_changes = Counter("flexpipe_instance_changes_total",
                                        "Fleet scaling decisions applied, by direction (out: instances added, "
                                        "in: instances drained and removed)", ["direction"], registry=r)
        for direction in DIRECTIONS:
            self.instance_changes.labels(direction)
        for cls in CLASSES:  # every class's series exists from the start (a scraper sees zeros, not gaps)
            self.running.labels(cls).set(0)
            for histogram in (self.ttft, self.tpot, self.e2e):
                histogram.labels(cls)
            self.prompt_tokens.labels(cls)
            self.generation_tokens.labels(cls)
            self.cancelled.labels(cls)
        self._gear: str | None = None
        self._lock = threading.Lock()
        self._latest: dict[str, MetricSample] = {}  # pipeline id -> its newest sample (its series exist)

    def observe_sample(self, sample: MetricSample) -> None:
        """A sample of the serving stream (the router's ``on_metrics``): its gear is the live one."""
        self.set_live_gear(sample.gear_id)

    def observe_pipeline_sample(self, pipeline_id: str, sample: MetricSample) -> None:
        """Take one pipeline's figures (KV blocks, stage utilisation, its queue) from its newest sample (the
        router's ``on_lane_sample``; any thread)."""
        with self._lock:
            self._latest[pipeline_id] = sample
            for st in sample.stages:
                labels = (pipeline_id, str(st.stage_index))
                self.kv_blocks_used.labels(*labels).set(st.kv_blocks_used)
                self.kv_blocks_free.labels(*labels).set(max(st.kv_blocks_total - st.kv_blocks_used, 0))
                self.stage_busy.labels(*labels).set(st.busy_fraction)
            self.waiting.set(sum(smp.queue_length for smp in self._latest.values()))

    def keep_pipelines(self, pipeline_ids: Iterable[str]) -> None:
        """Drop the series of every pipeline not in ``pipeline_ids`` (retired or failed: what it held is
        gone), and count the requests waiting over the rest."""
        keep = set(pipeline_ids)
        with self._lock:
            for gone in [pid for pid in self._latest if pid not in keep]:
                for st in self._latest.pop(gone).stages:
                    for gauge in (self.kv_blocks_used, self.kv_blocks_free, self.stage_busy):
                        with suppress(KeyError):
                            gauge.remove(gone, str(st.stage_index))
            self.waiting.set(sum(smp.queue_length for smp in self._latest.values()))

    def set_live_gear(self, gear_id: str) -> None:
        """Mark ``gear_id`` as the gear serving now (the previous one's series goes to 0)."""
        if gear_id != self._gear:
            if self._gear is not None:
                self.live_gear.labels(self._gear).set(0)
            self.live_gear.labels(gear_id).set(1)
            self._gear = gear_id

    def exposition(self, live_pipelines: Iterable[str] | None = None) -> bytes:
        """The registry in Prometheus text format; ``live_pipelines``: the ids of the pipelines still up (the
        others' series are dropped first, :meth:`keep_pipelines`), None: all kept."""
        if live_pipelines is not None:
            self.keep_pipelines(live_pipelines)
        return generate_latest(self.registry)
