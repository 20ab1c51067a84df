"""The layer split of an offline ``--stages`` run for its own prompts (planner/workload_split.py,
profiling/worker_split.py, ``flexpipe run --split``): the workload priced step by step as the runtime schedules
it, the exact min-bottleneck split, the head weighing per sampled token, replicas, and the run using it."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from flexpipe_dag.core.cluster import REFERENCE_TFLOPS, ClusterProfile, Device
from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.partition import compositions
from flexpipe_dag.planner.workload_split import WorkloadCost, workload_cost, workload_layer_counts

#: A CPU core of this kind of host (75 GFLOP/s fp32, 10 GB/s): prefill compute-bound, decode weight-read-bound.
CORE = Device(device_id="worker", node_id="h", kind="cpu-worker", memory_gib=8.0, peak_tflops=0.075,
              hbm_bandwidth_gbps=10.0, compute_score=0.075 / REFERENCE_TFLOPS)


@pytest.fixture(scope="module")
def cost():
    cluster = ClusterProfile(cluster_id="c", devices=[CORE], measured_at=dt.datetime(2026, 12, 7, tzinfo=dt.UTC))
    return CostModel(load_model_spec("SmolLM2-135M"), cluster, dtype="fp32")


def _step_by_step(cost, prompts, outputs, mb):
    """Reference: every step of every micro-batch priced on its own (no segments)."""
    layer = first = last = 0.0
    for g in range(0, len(prompts), mb):
        p, o = prompts[g:g + mb], outputs[g:g + mb]
        n = sum(p)
        layer += cost.layer_step_ms("worker", n, sum(x * (x + 1) / 2 for x in p), n)
        first += cost.first_extra_ms("worker", n)
        last += cost.last_extra_ms("worker", len(p))
        for t in range(1, max(o)):
            run = [i for i in range(len(p)) if o[i] > t]
            ctx = sum(p[i] + t for i in run)
            layer += cost.layer_decode_ms("worker", len(run), ctx)
            first += cost.first_extra_ms("worker", len(run))
            last += cost.last_extra_ms("worker", len(run))
    return layer, first, last


def test_workload_priced_as_the_runtime_schedules_it(cost):
    prompts, outputs = [40, 3, 64, 17, 9], [1, 16, 5, 5, 30]
    work = workload_cost(cost, "worker", prompts, outputs, 2)
    # 3 micro-batches: (40, 3) prefill + 15 decode steps, (64, 17) + 4, (9) + 29
    assert work.steps == 3 + 15 + 4 + 29
    layer, first, last = _step_by_step(cost, prompts, outputs, 2)
    assert work.layer_ms == pytest.approx(layer, rel=0.01)  # the segments' middle-step context
    assert work.first_ms == pytest.approx(first, rel=1e-9) and work.last_ms == pytest.approx(last, rel=1e-9)
    assert work.stage_ms(3, True, False) == pytest.approx(3 * work.layer_ms + work.first_ms)
    assert work.stage_ms(2, False, True) == pytest.approx(2 * work.layer_ms + work.last_ms)


def test_split_is_the_exact_min_bottleneck_and_the_head_weighs_per_sampled_token(cost):
    decode_heavy = workload_cost(cost, "worker", [8] * 16, [128] * 16, 8)
    prefill_heavy = workload_cost(cost, "worker", [512] * 16, [1] * 16, 8)
    for work in (decode_heavy, prefill_heavy):
        for stages in (2, 3):
            sizes = workload_layer_counts(work, 30, stages)
            best = min(max(work.stage_ms(n, i == 0, i == stages - 1) for i, n in enumerate(c))
                       for c in compositions(30, stages))
            got = max(work.stage_ms(n, i == 0, i == stages - 1) for i, n in enumerate(sizes))
            assert sum(sizes) == 30 and got == pytest.approx(best)
    # decoding, SmolLM2's head (49,152 x 576) reads as much as ~8 of its 30 layers: the last stage takes fewer
    assert workload_layer_counts(decode_heavy, 30, 2)[1] <= 12
    # prefill of long prompts: one logit row per prompt, the head weighs next to nothing
    assert workload_layer_counts(prefill_heavy, 30, 2) in ([15, 15], [16, 14])


def test_replicas_share_a_stage_and_bad_input_is_refused(cost):
    work = WorkloadCost(layer_ms=10.0, first_ms=0.0, last_ms=0.0, steps=1)
    assert workload_layer_counts(work, 30, 2, [1, 2]) == [10, 20]  # two lanes: twice the layers at equal time
    with pytest.raises(ValueError, match="replicas: expected 2 whole counts >= 1"):
        workload_layer_counts(work, 30, 2, [1, 0])
    with pytest.raises(InfeasibleError):
        workload_layer_counts(work, 3, 4)
    with pytest.raises(ValueError, match="as many output lengths as prompts"):
        workload_cost(cost, "worker", [4, 4], [2], 8)
    with pytest.raises(ValueError, match=">= 1 token"):
        workload_cost(cost, "worker", [4, 0], [2, 2], 8)
    with pytest.raises(ValueError, match="micro_batch_size"):
        workload_cost(cost, "worker", [4], [2], 0)


def test_even_gear_takes_a_split_and_names_it():
    assert even_gear(30, 2, "m", 8, None, 1024).gear_id == "uniform-2"
    assert even_gear(30, 2, "m", 8, None, 1024, layers_per_stage=[15, 15]).gear_id == "uniform-2"
    g = even_gear(30, 2, "m", 8, None, 1024, [1, 2], layers_per_stage=[19, 11])
    assert (g.gear_id, g.kind, g.layer_ranges()) == ("split-2-19x11-r1x2", "manual", [(0, 19), (19, 30)])
    with pytest.raises(ValueError, match="summing to 30"):
        even_gear(30, 2, "m", 8, None, 1024, layers_per_stage=[19, 12])


def test_flexpipe_run_splits_its_stages_for_its_prompts(tmp_path, capsys, monkeypatch):
    """A real 2-stage run: the gear it serves is the split the planner gives for these prompts on the worker
    (the worker's figures fixed here, so the expected split is known; the measurement itself runs in the bench
    and in every other ``--stages`` run)."""
    from flexpipe_dag.cli import main
    from flexpipe_dag.profiling import worker_split
    from flexpipe_dag.profiling.worker_split import split_for_workload
    from tests.test_runtime_helpers import checkpoint

    monkeypatch.setattr(worker_split, "measure_worker", lambda device, dtype, micro_batch_size, threads=1: CORE)
    ids = [[1, 2, 3]] * 4
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "token_ids": t, "max_new_tokens": 24}) + "\n"
                               for i, t in enumerate(ids)))
    out = tmp_path / "out.jsonl"
    assert main(["run", "--stages", "2", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "24"]) == 0
    err = capsys.readouterr().err
    ck = checkpoint()
    expected = split_for_workload(load_model_spec(ck.path), CORE, "fp32", 2, [3] * 4, [24] * 4, 8).layers_per_stage
    assert expected != [15, 15] and expected[1] < 15  # short prompts, many decode steps: the head's stage is lighter
    gear_id = "split-2-" + "x".join(map(str, expected))
    assert f"gear {gear_id}: stages [(0, {expected[0]}), ({expected[0]}, 30)]" in err
    assert f"layers split for these prompts: {expected}, modelled stage time" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["gear_id"] for r in rows} == {gear_id}

    out2 = tmp_path / "even.jsonl"
    assert main(["run", "--stages", "2", "--split", "even", "--prompts", str(prompts), "--out", str(out2),
                 "--max-new-tokens", "24"]) == 0
    even = [json.loads(line) for line in out2.read_text().splitlines()]
    assert {r["gear_id"] for r in even} == {"uniform-2"}
    assert [r["output_token_ids"] for r in even] == [r["output_token_ids"] for r in rows]  # the split changes no token


def test_batch_job_splits_only_its_own_local_stages(monkeypatch):
    """The ``batch_inference`` job's ``split``: a stored gear, remote workers, ``split: even`` and one stage keep the
    gear as it is (no worker measured); ``workload`` splits it (the real job run: test_batch_job_semantics)."""
    from flexpipe_dag.jobs.batch import BatchInferenceConfig, _split_for_job
    from flexpipe_dag.profiling import worker_split

    def refuse(*args, **kwargs):
        raise AssertionError("no worker is measured for a gear the job does not split")

    monkeypatch.setattr(worker_split, "measure_worker", refuse)
    gear = even_gear(30, 2, "m", 8, None, 1024)
    for fields in ({"gear_id": "g1"}, {"control_address": "127.0.0.1:0"}, {"split": "even"}, {"stages": 1}):
        config = BatchInferenceConfig(job_key="j", **fields)
        assert _split_for_job(None, config, None, gear, [], set(), None) is gear
    with pytest.raises(Exception, match="split"):
        BatchInferenceConfig(job_key="j", split="balanced")


def test_rows_the_run_refuses_do_not_decide_the_split(monkeypatch):
    """Only rows the runtime serves are priced, as it serves them: a row over the model's context (refused) or
    with token ids outside the vocabulary (malformed) leaves the split as it was; under truncate_context an
    over-long prompt is priced at its cut length."""
    from flexpipe_dag.profiling import worker_split
    from flexpipe_dag.runtime.batch import PromptRow
    from tests.test_runtime_helpers import checkpoint

    monkeypatch.setattr(worker_split, "measure_worker", lambda device, dtype, micro_batch_size, threads=1: CORE)
    ck = checkpoint()
    gear = even_gear(ck.num_layers, 2, ck.name, 8, None, 1024)
    max_context = ck.max_context_tokens
    plain = [PromptRow(f"r{i}", token_ids=[1, 2, 3], max_new_tokens=24) for i in range(8)]

    def split(rows, truncate=False):
        return worker_split.split_gear_for_rows(gear, ck, rows, set(), False, "cpu", "fp32", truncate)

    base_gear, base = split(plain)
    refused = [PromptRow("long", token_ids=[5] * (max_context - 10), max_new_tokens=24),
               PromptRow("oov", token_ids=[ck.config.vocab_size + 7], max_new_tokens=1000)]
    with_refused, priced = split(plain + refused)
    assert base is not None and priced is not None
    assert with_refused.gear_id == base_gear.gear_id and priced.work == base.work
    assert split(refused) == (gear, None)  # nothing the run will serve: nothing measured, the gear as it was
    # truncated: the long prompt priced at max_context - 24 tokens, as the runtime cuts it
    _, cut = split(plain + refused[:1], truncate=True)
    _, exact = split(plain + [PromptRow("cut", token_ids=[5] * (max_context - 24), max_new_tokens=24)])
    assert cut is not None and exact is not None and cut.work == exact.work != base.work


def test_split_refuses_costs_and_replicas_it_cannot_price():
    for bad in (WorkloadCost(float("nan"), 0.0, 0.0, 1), WorkloadCost(1.0, 0.0, float("inf"), 1),
                WorkloadCost(-1.0, 0.0, 5.0, 1)):
        with pytest.raises(ValueError, match="expected a finite time >= 0 ms"):
            workload_layer_counts(bad, 30, 3)
    for reps in ([1, 1.5], [1, float("inf")], [1, 0]):
        with pytest.raises(ValueError, match="whole counts >= 1"):
            workload_layer_counts(WorkloadCost(1.0, 0.0, 5.0, 1), 30, 2, reps)
