"""sample_chunks: a probe's sample drawn from across a real trace (flexpipe_dag.workload.transform)."""

from __future__ import annotations

import numpy as np
import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload import load_trace, sample_chunks
from flexpipe_dag.workload.request import Request, Workload


def test_runs_come_from_across_the_trace_and_two_phases_share_no_request():
    trace = load_trace("azure-conv")
    a = sample_chunks(trace, 1000, chunk_requests=100)
    b = sample_chunks(trace, 1000, chunk_requests=100, phase=0.5)
    ids = {r.request_id for r in trace.requests}
    index = {r.request_id: i for i, r in enumerate(trace.requests)}
    for s in (a, b):
        assert len(s) == 1000 and len({r.request_id for r in s.requests}) == 1000 and {r.request_id for r in s.requests} <= ids
        positions = [index[r.request_id] for r in s.requests]
        assert max(positions) > 0.9 * len(trace)  # the last run is near the end of the trace, not in its first minutes
        runs = np.split(np.array(positions), np.where(np.diff(positions) != 1)[0] + 1)
        assert [len(r) for r in runs] == [100] * 10
        arrivals = np.array([r.arrival_s for r in s.requests])
        assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert not {r.request_id for r in a.requests} & {r.request_id for r in b.requests}


def test_each_run_keeps_its_bursts_at_the_trace_mean_rate():
    # a trace whose rate doubles half-way: every run of the sample is replayed at the trace's mean rate
    slow = [Request(f"s{i}", float(i), 10, 5) for i in range(400)]
    fast = [Request(f"f{i}", 400.0 + i / 2.0, 10, 5) for i in range(400)]
    trace = Workload(name="drift", requests=tuple(slow + fast))
    mean_gap_s = trace.duration_s / (len(trace) - 1)
    s = sample_chunks(trace, 200, chunk_requests=50)
    gaps = np.diff([r.arrival_s for r in s.requests])
    assert gaps == pytest.approx(np.full(199, mean_gap_s))


def test_a_short_trace_is_returned_whole_and_bad_arguments_are_named():
    trace = Workload(name="t", requests=tuple(Request(f"r{i}", 5.0 + i, 10, 5) for i in range(30)))
    whole = sample_chunks(trace, 100)
    assert [r.request_id for r in whole.requests] == [r.request_id for r in trace.requests]
    assert whole.requests[0].arrival_s == 0.0
    # n not a multiple of the run length: runs of n / k requests, none overlapping
    odd = sample_chunks(trace, 29, chunk_requests=10)
    assert len({r.request_id for r in odd.requests}) == 29
    for kw, field in (({"n": 0}, "n"), ({"n": 5, "chunk_requests": 0}, "chunk_requests"), ({"n": 5, "phase": 1.0}, "phase")):
        with pytest.raises(InputError, match=field):
            sample_chunks(trace, **kw)
