"""One serving-stream sample per window from several pipeline instances of a gear.

Each instance behind a :class:`~flexpipe_dag.shift.router.ServingRouter` samples its own window every
metric period, on its own clock. Passed on one by one, the serving stream would read as one pipeline whose
load jumps between the instances' shares (two instances: half the fleet's rate, sample after sample), and
the controller and the tide rule, which compare a sample with one gear's envelope, would see half the load
that arrives. :class:`InstanceRound` collects one sample of each instance (a *round*) and hands on their
merge (:func:`~flexpipe_dag.core.metrics.merge_instance_samples`: rates and counts summed, ``instances``
set), which readers compare with ``instances`` x the gear's envelope.

A round closes when every instance has reported, or when one reports a second time before the others
did (an instance whose pump is busy or whose sample is late): then an instance missing from the round
counts with its previous sample's rates and in-flight counts (its finished requests and their latencies
were counted once), and one that has never reported counts with none. An instance that stopped taking requests
(withdrawn, failed) leaves the rounds at once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from flexpipe_dag.core.metrics import MetricSample, merge_instance_samples


class InstanceRound:
    """Rounds of instance samples (thread-safe: every lane's pump thread reports here); see module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round: dict[str, MetricSample] = {}  # lane id -> its sample in the open round
        self._previous: dict[str, MetricSample] = {}  # lane id -> its newest sample of a closed round

    def add(self, lane_id: str, sample: MetricSample, members: Sequence[str],
            routed: int | None = None) -> MetricSample | None:
        """Take ``lane_id``'s ``sample``; return the merged sample of a round it closes, else None.

        Args:
            lane_id: the reporting lane (one of ``members``).
            sample: its window.
            members: the lane ids of the live lanes of the entry point's gear that hold its traffic: the
                instances requests are routed to and those draining (withdrawn: their requests finish
                there), at least two.
            routed: how many of ``members`` take new requests (the merged sample's ``instances``; a
                draining lane adds its load, not its envelope). Default: all of them.

        Returns:
            The fleet-wide sample (``instances`` = the number of instances merged), or None while the round
            waits for other instances.
        """
        with self._lock:
            keep = set(members)
            for gone in [lid for lid in self._round if lid not in keep]:
                del self._round[gone]
            for gone in [lid for lid in self._previous if lid not in keep]:
                del self._previous[gone]
            merged = None
            if lane_id in self._round:  # a second window before the others: the round closes without them
                merged = self._close(members)
            self._round[lane_id] = sample
            if merged is None and all(lid in self._round for lid in members):
                merged = self._close(members)
        if merged is None:
            return None
        return dataclasses.replace(merged, instances=len(members) if routed is None else max(routed, 1))

    def _close(self, members: Sequence[str]) -> MetricSample:
        parts = []
        for lid in members:
            if lid in self._round:
                parts.append(self._round[lid])
            elif lid in self._previous:  # its rates and in-flight counts; its finished requests were counted
                parts.append(dataclasses.replace(self._previous[lid], completed=0, ttft_p50_ms=None, ttft_p99_ms=None,
                                                 tpot_p50_ms=None, tpot_p99_ms=None, e2e_p50_ms=None,
                                                 e2e_p99_ms=None))
        self._previous.update(self._round)
        self._round = {}
        return merge_instance_samples(parts)

    def reset(self) -> None:
        """Forget every open round (back to one instance)."""
        with self._lock:
            self._round.clear()
            self._previous.clear()
