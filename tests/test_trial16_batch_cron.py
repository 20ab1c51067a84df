"""Findings of the issue-16 trial on batch jobs, request limits and crons, one test per finding.

* 3: every ``batch_inference`` run stores its config on the job row (not only the first); a queued job stored
  with ``{}`` is not admitted by the tide, which says so;
* 5: ``kv_pool_tokens_max`` caps the pool of a ``stages:`` run too;
* 6: ``--truncate-context`` cuts only the prompt (as vLLM's ``truncate_prompt_tokens``): a row whose
  ``max_new_tokens`` alone fill the context is refused with its numbers;
* 8: cron values, steps and dates checked field by field before Dagster's check; uneven steps warned about;
* 13: the KV refusal names the knob of the entry point; ``stages: 99`` names the job field.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.jobs.cron import check_cron, cron_warnings
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
from flexpipe_dag.runtime.scheduler import Request, Scheduler

#: SmolLM2-135M as ``_gear`` sees a checkpoint: its name and layer count.
SMOL = SimpleNamespace(name="SmolLM2-135M", num_layers=30)


# -- 3. the job row holds the latest run's config; an empty one is named by the tide ------------------------------
def test_each_run_stores_its_config_priority_and_source_on_the_job_row(store):
    first = {"job_key": "jb1", "prompts_path": "mix.jsonl", "max_new_tokens": 2, "priority": 0}
    second = {"job_key": "jb1", "prompts_path": "p3.jsonl", "max_new_tokens": 3, "priority": 5}
    job_id = store.get_or_create_job("jb1", "batch", priority=0, source_path="mix.jsonl", config=first)
    assert store.get_or_create_job("jb1", "batch", priority=5, source_path="p3.jsonl", config=second) == job_id
    (job,) = store.jobs()
    assert (job.config, job.priority, job.source_path) == (second, 5, "p3.jsonl")
    # a job stored before with {} is filled in by its next run; a call without a config leaves the row alone
    legacy = store.get_or_create_job("old", "batch")
    assert store.jobs(kind="batch")[1].config == {}
    store.get_or_create_job("old", "batch", priority=2, source_path="q.jsonl", config={"job_key": "old"})
    store.get_or_create_job("old", "batch")
    row = next(j for j in store.jobs() if j.id == legacy)
    assert (row.config, row.priority, row.source_path) == ({"job_key": "old"}, 2, "q.jsonl")


def test_tide_names_a_queued_job_with_no_stored_config_instead_of_skipping_it_silently():
    from flexpipe_dag.control.service import evaluate_tide
    from flexpipe_dag.control.tide import TideConfig, TideForecaster
    from flexpipe_dag.jobs.tide import no_config_line
    from flexpipe_dag.workload.bundled import load_tide_trace
    from tests.test_control_semantics_dagster import JobsInMemory

    forecaster = TideForecaster(load_tide_trace())
    trough_s = float(min(range(0, 86400, 600), key=forecaster.profile_at))
    db = JobsInMemory()
    db.add("configured")
    db.add("stored-empty")
    db.rows[1].config = {}
    ev = evaluate_tide(db, None, TideConfig(hysteresis_samples=1), epoch_s=trough_s, forecaster=forecaster)
    assert ev.decision.action == "admit"
    assert [j.job_key for j in ev.admit] == ["configured"] and ev.no_config == ("stored-empty",)
    assert db.rows[1].status == "queued"
    assert no_config_line(ev.no_config) == (
        "not admitted, no stored config (inference_jobs.config is empty): stored-empty; run each once with "
        "`dagster job execute -j batch_inference` and its config, which stores it")
    assert no_config_line([f"j{i}" for i in range(7)]).startswith(
        "not admitted, no stored config (inference_jobs.config is empty): j0, j1, j2, j3, j4 and 2 more; ")
    assert no_config_line(()) is None


# -- 5. kv_pool_tokens_max caps a stages: run -------------------------------------------------------------------
def test_kv_pool_tokens_max_caps_a_stages_run_and_its_refusal_names_the_job_field():
    from jobs.batch import KV_KNOB, BatchInferenceConfig, _gear

    gear = _gear(BatchInferenceConfig(job_key="j", prompts_path="p.jsonl", stages=1, kv_pool_tokens_max=256),
                 None, SMOL)
    assert gear.kv_capacity_tokens == 256 and [st.kv_capacity_tokens for st in gear.stages] == [256]
    default = _gear(BatchInferenceConfig(job_key="j", prompts_path="p.jsonl", stages=2), None, SMOL)
    assert [st.kv_capacity_tokens for st in default.stages] == [8192, 8192]
    # the trial's row: a 300-token prompt with max_new_tokens 4 needs 303 KV tokens, over the 256-token pool
    sched = Scheduler(BlockAllocator(16, 16), 8, 1, kv_capacity_knob=KV_KNOB)
    with pytest.raises(KVCapacityError) as err:
        sched.add_request(Request("r", [1] * 300, 4))
    assert str(err.value) == (
        "request 'r' needs 303 KV tokens (prompt 300 + max_new_tokens 4 - 1: the last token is never cached); "
        "the KV pool holds 256 tokens; expected at most 256 (shorten the prompt or max_new_tokens, or raise the "
        "job's kv_pool_tokens_max)")


# -- 6. truncation cuts only the prompt -------------------------------------------------------------------------
def test_truncate_context_refuses_a_row_whose_max_new_tokens_alone_fill_the_context(tmp_path):
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_request_limits import small_context_checkpoint
    from tests.test_runtime_helpers import gear

    rt = PipelineRuntime(gear([(0, 30)]), small_context_checkpoint(tmp_path), RuntimeOptions(truncate_context=True))
    assert rt.max_context_tokens == 64
    kept = rt._fit_context([Request("p3-new100", [7] * 3, 100), Request("p10-new64", list(range(10)), 64),
                            Request("p100-new8", list(range(100)), 8), Request("p10-new63", list(range(10)), 63),
                            Request("fits", [7] * 5, 8)])
    assert [(r.request_id, len(r.prompt_token_ids), r.max_new_tokens) for r in kept] == [
        ("p100-new8", 56, 8), ("p10-new63", 1, 63), ("fits", 5, 8)]
    assert kept[0].prompt_token_ids == list(range(44, 100)) and kept[1].prompt_token_ids == [9]
    assert rt.truncated == {"p100-new8": "prompt 100 -> 56 tokens (the last ones kept); max context 64 tokens",
                            "p10-new63": "prompt 10 -> 1 tokens (the last ones kept); max context 64 tokens"}
    assert rt.refused == {
        "p3-new100": "request 'p3-new100': prompt 3 + max_new_tokens 100 = 103 tokens exceed the model's max "
                     "context of 64 tokens, and max_new_tokens alone leaves no room for one prompt token "
                     "(truncation cuts only the prompt); expected max_new_tokens at most 63",
        "p10-new64": "request 'p10-new64': prompt 10 + max_new_tokens 64 = 74 tokens exceed the model's max "
                     "context of 64 tokens, and max_new_tokens alone leaves no room for one prompt token "
                     "(truncation cuts only the prompt); expected max_new_tokens at most 63"}


# -- 8. crons: each field's values and steps, dates that never come, uneven steps ------------------------------
@pytest.mark.parametrize(("cron", "said"), [
    ("60 * * * *", "'60 * * * *': the minute value 60 is outside the minute range 0-59"),
    ("0 24 * * *", "'0 24 * * *': the hour value 24 is outside the hour range 0-23"),
    ("0 0 32 * *", "'0 0 32 * *': the day of month value 32 is outside the day of month range 1-31"),
    ("0 0 * 13 *", "'0 0 * 13 *': the month value 13 is outside the month range 1-12"),
    ("0 0 * * 8", "'0 0 * * 8': the day of week value 8 is outside the day of week range 0-6 (7 is also Sunday)"),
    ("*/0 * * * *", "'*/0 * * * *': the minute step is 0; expected a step of 1 or more"),
    ("0-59/0 * * * *", "'0-59/0 * * * *': the minute step is 0; expected a step of 1 or more"),
    ("0 0 31 2 *", "'0 0 31 2 *': day of month 31 never falls in month 2 (at most 29 days), so the cron never fires"),
    ("0 0 31 4,6 *", "'0 0 31 4,6 *': day of month 31 never falls in month 4, 6 (at most 30 days), so the cron "
                     "never fires"),
    ("0 0 * JAN-DEC/13 *", "'0 0 * JAN-DEC/13 *': the month step 13 is beyond the month range 1-12: it matches "
                           "month 1 only, so the cron does not fire every 13 months"),
    ("0 0 * * MON-FRI/9", "'0 0 * * MON-FRI/9': the day of week step 9 is beyond the day of week range 1-5: it "
                          "matches day of week 1 only, so the cron does not fire every 9 days"),
])
def test_a_five_field_cron_out_of_range_names_the_field_and_its_range(cron, said):
    with pytest.raises(InputError) as err:
        check_cron(cron, "environment variable FLEXPIPE_PROFILE_REFRESH_CRON")
    assert str(err.value).startswith(f"environment variable FLEXPIPE_PROFILE_REFRESH_CRON: {said}")
    assert "expected a 5-field cron expression" not in str(err.value)


@pytest.mark.parametrize("cron", ["0 0 * * 7", "0 0 * jan-dec/2 *", "0 0 * * MON-FRI", "0 0 L * *", "@daily",
                                  "0 0 29 2 *", "0 0-21/3 * * *", "10/15 * * * *", "0 0 30 2,4 *"])
def test_valid_crons_pass_untouched(cron):
    assert check_cron(f" {cron} ", "x") == cron and cron_warnings(cron) == ()


def test_an_uneven_step_is_accepted_with_a_warning_saying_when_it_fires(caplog):
    caplog.set_level(logging.WARNING, logger="flexpipe_dag.jobs.cron")
    assert check_cron("*/45 * * * *", "environment variable FLEXPIPE_PROFILE_REFRESH_CRON") == "*/45 * * * *"
    assert check_cron("0 */7 * * *", "environment variable FLEXPIPE_PROFILE_REFRESH_CRON") == "0 */7 * * *"
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable FLEXPIPE_PROFILE_REFRESH_CRON: '*/45 * * * *': the minute step 45 (*/45) does not "
        "divide the minute range 0-59 (60 minutes): it fires at minute 0, 45, so the gap from minute 45 to the "
        "next minute 0 is 15 minutes, not 45",
        "environment variable FLEXPIPE_PROFILE_REFRESH_CRON: '0 */7 * * *': the hour step 7 (*/7) does not divide "
        "the hour range 0-23 (24 hours): it fires at hour 0, 7, 14, 21, so the gap from hour 21 to the next hour 0 "
        "is 3 hours, not 7"]


# -- 13. messages name the entry point's knob --------------------------------------------------------------------
def test_batch_job_stages_out_of_range_names_the_job_field_not_a_cli_flag():
    from jobs.batch import BatchInferenceConfig, _gear

    with pytest.raises(InputError) as err:
        _gear(BatchInferenceConfig(job_key="j", prompts_path="p.jsonl", stages=99), None, SMOL)
    assert str(err.value) == "batch_inference config: stages: expected 1..30 (SmolLM2-135M's layers), got 99"


def test_flexpipe_run_kv_refusal_names_its_flag(tmp_path, monkeypatch):
    """``flexpipe run`` hands the runtime ``--kv-capacity-tokens`` as the knob its KV refusals name."""
    pytest.importorskip("torch")
    import flexpipe_dag.runtime.pipeline as pipeline
    from flexpipe_dag.cli import main

    seen = []

    class Stop(Exception):
        pass

    def capture(self, gear, ckpt, options):
        seen.append(options.kv_capacity_knob)
        raise Stop

    monkeypatch.setattr(pipeline.PipelineRuntime, "__init__", capture)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [1, 2, 3]}\n')
    with pytest.raises(Stop):
        main(["run", "--stages", "1", "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl")])
    assert seen == ["--kv-capacity-tokens"]
    sched = Scheduler(BlockAllocator(2, 16), 8, 1, kv_capacity_knob=seen[0])
    with pytest.raises(KVCapacityError, match=r"expected at most 32 \(shorten the prompt or max_new_tokens, or raise "
                                              r"--kv-capacity-tokens\)$"):
        sched.add_request(Request("r", [1] * 30, 4))


def test_max_new_tokens_help_says_a_row_asking_for_more_gets_the_cap():
    from jobs.batch import BatchInferenceConfig

    said = BatchInferenceConfig.model_fields["max_new_tokens"].description
    assert said == ("tokens generated per request: a row without max_new_tokens gets this, a row asking for more "
                    "gets this (the cap)")


@pytest.mark.slow
def test_batch_job_stages_run_refuses_over_its_kv_cap_and_a_rerun_stores_its_own_config(tmp_path):
    """The trial's jobs: ``stages: 1`` with ``kv_pool_tokens_max: 256`` refuses a 300-token prompt with
    max_new_tokens 4 (needs 303) naming the job field; the same key run again with another prompts file,
    max_new_tokens and priority leaves that config on the job row."""
    import json

    from dagster import DagsterInstance

    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.resources.store_resource import StoreResource
    from tests.test_batch_job_semantics import _logs

    mix, p3 = tmp_path / "mix.jsonl", tmp_path / "p3.jsonl"
    mix.write_text(json.dumps({"id": "long", "token_ids": [504] * 300, "max_new_tokens": 4}) + "\n"
                   + json.dumps({"id": "a", "token_ids": [504, 2988, 314]}) + "\n")
    p3.write_text(json.dumps({"id": "b", "token_ids": [504, 2988, 314]}) + "\n")
    store = StoreResource(database_url=f"sqlite:///{tmp_path / 'store.db'}")
    instance = DagsterInstance.ephemeral()
    first = {"job_key": "jb1", "prompts_path": str(mix), "stages": 1, "max_new_tokens": 4, "kv_pool_tokens_max": 256}
    result = batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": first}}},
                                                resources={"store": store}, instance=instance)
    assert result.success
    db = store.get_store()
    (job,) = db.jobs()
    assert [r.request_key for r in db.results(job.id)] == ["a"]
    assert ("refused long: request 'long' needs 303 KV tokens (prompt 300 + max_new_tokens 4 - 1: the last token is "
            "never cached); the KV pool holds 256 tokens; expected at most 256 (shorten the prompt or "
            "max_new_tokens, or raise the job's kv_pool_tokens_max)") in _logs(instance, result.run_id, logging.WARNING)
    second = {"job_key": "jb1", "prompts_path": str(p3), "stages": 1, "max_new_tokens": 3, "priority": 5}
    assert batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": second}}},
                                              resources={"store": store}).success
    (job,) = db.jobs()
    assert {k: job.config[k] for k in second} == second and job.config["kv_pool_tokens_max"] == 8192
    assert (job.priority, job.source_path) == (5, str(p3))
    assert sorted(r.request_key for r in db.results(job.id)) == ["a", "b"]


@pytest.mark.slow
def test_flexpipe_run_truncate_context_refuses_rows_whose_max_new_tokens_fill_the_context(tmp_path, capsys):
    """The trial's run: a 64-token-context copy, ``--truncate-context --max-new-tokens 200``: rows (prompt 3,
    max_new_tokens 100) and (prompt 10, 64) are refused with their numbers, not served as prompt 1 / output 63;
    a 100-token prompt with 8 new tokens is served with its prompt cut to 56."""
    import json

    pytest.importorskip("torch")
    from flexpipe_dag.cli import main
    from tests.test_request_limits import small_context_checkpoint

    ck = small_context_checkpoint(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in (
        {"id": "p3", "token_ids": [504, 2988, 314], "max_new_tokens": 100},
        {"id": "p10", "token_ids": [504] * 10, "max_new_tokens": 64},
        {"id": "long", "token_ids": [504, 2988, 314, 260] * 25, "max_new_tokens": 8})))
    out = tmp_path / "results.jsonl"
    code = main(["run", "--stages", "1", "--model", str(ck.path), "--prompts", str(prompts), "--out", str(out),
                 "--truncate-context", "--max-new-tokens", "200", "--kv-capacity-tokens", "256"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 1
    assert {k: summary[k] for k in ("finished", "refused", "refused_context", "truncated_context", "over_context")} == {
        "finished": 1, "refused": 2, "refused_context": 2, "truncated_context": 1, "over_context": 3}
    assert ("refused p3: request 'p3': prompt 3 + max_new_tokens 100 = 103 tokens exceed the model's max context of "
            "64 tokens, and max_new_tokens alone leaves no room for one prompt token (truncation cuts only the "
            "prompt); expected max_new_tokens at most 63") in captured.err
    assert ("64-token max context (prompt + max_new_tokens): 1 served with the prompt truncated from the left, 2 "
            "refused: max_new_tokens alone leaves no room for the prompt") in captured.err
    [res] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (res["id"], res["prompt_tokens"]) == ("long", 56) and res["output_tokens"] <= 8
