"""batch_inference says what it does (issue #16 item 8): plain prompts and chat models, rows without
text, stage steps of every run (``stages:`` too) for ``flexpipe calibrate``, the stored run config that
relaunches a job, ``dagster job scaffold_config`` for every job, a description on every config field."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from flexpipe_dag.cli import main
from flexpipe_dag.core.errors import InputError
from tests.support import REPO

#: A prompt already in SmolLM2's chat template whose assistant turn is complete: the greedy answer is
#: ``<|im_end|>`` (id 2) at once, so its row has no text.
ANSWERED = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
            "The capital of France is Paris.")
PLAIN = "What is the capital of France?"


def _tokenizer():
    from tests.test_runtime_helpers import checkpoint

    return checkpoint().tokenizer()


def _wrapped_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


# -- chat template ---------------------------------------------------------------------------------------


def test_chat_template_modes_decide_how_plain_prompts_are_sent():
    from flexpipe_dag.runtime.chat_template import resolve_chat_template

    tok = _tokenizer()
    prompts = [PLAIN, ANSWERED, None]  # plain text, already templated, a token_ids row
    auto = resolve_chat_template("auto", tok, "SmolLM2", prompts)
    assert (auto.apply, auto.plain_prompts, auto.warn) == (True, 1, False)
    assert auto.message == ("1 plain-text prompt(s) wrapped in SmolLM2's chat template as a user message "
                            "(chat_template: auto; off sends them as they are)")
    off = resolve_chat_template("off", tok, "SmolLM2", prompts, source="--chat-template")
    assert (off.apply, off.plain_prompts, off.warn) == (False, 1, True)
    assert off.message == ("SmolLM2 is a chat model (its tokenizer has a chat template) and 1 prompt(s) are plain "
                           "text sent without it (--chat-template: off): it may answer them with an end-of-sequence "
                           "token and no text; --chat-template: auto wraps them")
    nothing_plain = resolve_chat_template("on", tok, "SmolLM2", [ANSWERED, None])
    assert (nothing_plain.apply, nothing_plain.plain_prompts, nothing_plain.message) == (False, 0, None)
    with pytest.raises(InputError, match=r"^chat_template: expected one of auto, on, off, got 'yes'$"):
        resolve_chat_template("yes", tok, "SmolLM2", prompts)


def test_chat_template_on_refuses_a_model_without_one():
    from flexpipe_dag.runtime.chat_template import resolve_chat_template

    class NoTemplate:  # a base model's tokenizer: no chat_template attribute set
        chat_template = None
        all_special_tokens = ["<s>", "</s>"]

    assert resolve_chat_template("auto", NoTemplate(), "base-7b", [PLAIN]).apply is False
    assert resolve_chat_template("off", NoTemplate(), "base-7b", [PLAIN]).message is None  # nothing to warn of
    with pytest.raises(InputError) as err:
        resolve_chat_template("on", NoTemplate(), "base-7b", [PLAIN], source="batch_inference config: chat_template")
    assert str(err.value) == ("batch_inference config: chat_template: 'on', but base-7b's tokenizer has no chat "
                              "template; use auto or off to send the prompts as they are")


def test_wrapped_prompt_is_one_user_message_with_the_generation_prompt():
    from flexpipe_dag.runtime.batch import PromptRow, to_requests
    from flexpipe_dag.runtime.chat_template import prompt_token_ids

    tok = _tokenizer()
    ids = prompt_token_ids(tok, PLAIN, True)
    assert ids == _wrapped_ids(tok, PLAIN)
    assert tok.decode(ids).endswith(f"<|im_start|>user\n{PLAIN}<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_token_ids(tok, PLAIN, False) == tok(PLAIN, add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tok, ANSWERED, True) == tok(ANSWERED, add_special_tokens=False)["input_ids"]  # as it is
    rows = [PromptRow("p", PLAIN), PromptRow("t", None, [5, 6, 7])]
    reqs = to_requests(rows, tok, (2,), chat_template=True)
    assert [r.prompt_token_ids for r in reqs] == [ids, [5, 6, 7]]


# -- rows without text -------------------------------------------------------------------------------------


def test_no_text_line_counts_and_names_the_rows():
    from flexpipe_dag.runtime.batch import no_text_line

    assert no_text_line([], 4) is None
    assert no_text_line(["a", "b"], 4, (2,)) == ("2 of 4 rows produced no text: their output is only "
                                                 "end-of-sequence / special tokens (end-of-sequence ids [2]) or "
                                                 "whitespace: 'a', 'b'")
    many = no_text_line([f"r{i}" for i in range(7)], 7, hint="try chat_template: auto")
    assert many == ("7 of 7 rows produced no text: their output is only end-of-sequence / special tokens or "
                    "whitespace: 'r0', 'r1', 'r2', 'r3', 'r4' and 2 more; try chat_template: auto")


# -- the Dagster job on the real runtime --------------------------------------------------------------------


def _host_profile():
    """A stored-profile stand-in for this host's probe: CPU workers ``<host>-cpu0/1`` of cluster ``<host>``."""
    from flexpipe_dag.core.cluster import ClusterProfile
    from flexpipe_dag.core.host import cpu_worker_device_id, local_cluster_id
    from tests.test_calibration_fit import cpu_cluster

    host = local_cluster_id()
    base = cpu_cluster()
    name = {d.device_id: cpu_worker_device_id(host, i) for i, d in enumerate(base.devices)}
    devices = [d.model_copy(update={"device_id": name[d.device_id], "node_id": host}) for d in base.devices]
    links = [link.model_copy(update={"src_device_id": name[link.src_device_id],
                                     "dst_device_id": name[link.dst_device_id]}) for link in base.links]
    return ClusterProfile(cluster_id=host, devices=devices, links=links, source="probe",
                          measured_at=base.measured_at)


def _logs(instance, run_id: str, level: int) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if e.dagster_event is None and e.level == level]


@pytest.mark.slow
def test_stages_run_wraps_plain_prompts_reports_rows_without_text_and_feeds_calibrate(tmp_path, capsys, monkeypatch):
    import logging

    from dagster import DagsterInstance

    from flexpipe_dag.core.host import cpu_worker_device_id, local_cluster_id
    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.profiling import worker_split
    from flexpipe_dag.resources.store_resource import StoreResource
    from tests.test_runtime_helpers import checkpoint
    from tests.test_workload_split import CORE

    # the worker's figures fixed, so the layer split of these (templated) prompts is known
    monkeypatch.setattr(worker_split, "measure_worker", lambda device, dtype, micro_batch_size, threads=1: CORE)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "plain", "prompt": PLAIN}) + "\n"
                       + json.dumps({"id": "answered", "prompt": ANSWERED}) + "\n")
    store = StoreResource()  # FLEXPIPE_HOME's SQLite, the store `flexpipe calibrate` opens
    instance = DagsterInstance.ephemeral()
    result = batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": {
        "job_key": "chat-1", "prompts_path": str(prompts), "stages": 2, "max_new_tokens": 6}}}},
        resources={"store": store}, instance=instance)
    assert result.success
    db = store.get_store()
    (job,) = db.jobs()
    rows = {r.request_key: r for r in db.results(job.id)}
    tok = _tokenizer()
    # the plain prompt went in the chat template; the templated one as it was, and it got only EOS
    assert rows["plain"].prompt_tokens == len(_wrapped_ids(tok, PLAIN)) and rows["plain"].output_text.strip()
    assert rows["answered"].prompt_tokens == len(tok(ANSWERED, add_special_tokens=False)["input_ids"])
    assert (rows["answered"].output_token_ids, rows["answered"].output_text, rows["answered"].status) == ([2], "", "done")
    assert result.output_for_node("run_batch") == {"job_id": job.id, "status": "done"}
    metadata = next(e for e in result.events_for_node("run_batch") if e.event_type_value == "STEP_OUTPUT") \
        .event_specific_data.metadata  # the op's output carries the run's metadata
    no_text = ("1 of 2 rows produced no text: their output is only end-of-sequence / special tokens "
               "(end-of-sequence ids [2]) or whitespace: 'answered'; the plain-text prompts went in the model's "
               "chat template: check the prompts themselves")
    assert metadata["no_text"].value == 1 and metadata["no_text_rows"].value == no_text
    assert metadata["chat_template"].value == "auto" and metadata["chat_template_applied"].value is True
    warnings = _logs(instance, result.run_id, logging.WARNING)
    assert no_text in warnings
    # the layers split for the prompts as sent (the plain one in the chat template), as `flexpipe run --stages`
    split = worker_split.split_for_workload(load_model_spec(checkpoint().path), CORE, "fp32", 2,
                                            [rows["plain"].prompt_tokens, rows["answered"].prompt_tokens], [6, 6], 8)
    gear_key = "split-2-" + "x".join(map(str, split.layers_per_stage)) if split.layers_per_stage != [15, 15] \
        else "uniform-2"
    assert split.describe() in _logs(instance, result.run_id, logging.INFO) and job.gear_key == gear_key
    # every stage step is recorded, as this host's probed CPU workers
    host = local_cluster_id()
    (run,) = db.observed_runs()
    assert (run["run_key"], run["gear_key"], run["cluster_key"]) == (result.run_id, gear_key, host)
    assert run["steps"] == metadata["observed_steps"].value > 0
    observed = db.read_observations(run_key=result.run_id)
    assert {o.device_id for o in observed} == {cpu_worker_device_id(host, 0), cpu_worker_device_id(host, 1)}
    assert (f"stage steps recorded for cluster {host}, which has no stored profile yet: profile it (the "
            "profile_refresh job on this host), then `flexpipe calibrate`") in warnings
    # calibrate: one clear line while the host has no profile, a calibration once it has one
    capsys.readouterr()
    assert main(["calibrate", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == (f"flexpipe calibrate: error: none of the {run['steps']} observed stage steps is usable: they ran "
                   f"on clusters without a stored profile ({host}); profile the cluster they ran on (the "
                   "profile_refresh job on its host), then calibrate\n")
    db.save_profile(_host_profile())
    assert main(["calibrate", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"calibrated {host} (profile v1) for SmolLM2-135M (fp32) from {run['steps']} steps of 1 run(s)")
    assert "dry run: nothing stored" in out


@pytest.mark.slow
def test_stored_config_relaunches_the_job_with_the_same_rows(tmp_path):
    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.resources.store_resource import StoreResource

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Name a colour."}) + "\n"
                       + json.dumps({"id": "b", "token_ids": [504, 2988, 314]}) + "\n")
    given = {"job_key": "relaunch-1", "prompts_path": str(prompts), "stages": 1, "max_new_tokens": 4}
    first = StoreResource(database_url=f"sqlite:///{tmp_path / 'first.db'}")
    assert batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": given}}},
                                              resources={"store": first}).success
    (job,) = first.get_store().jobs()
    assert job.config == {
        "job_key": "relaunch-1", "prompts_path": str(prompts), "trace": "", "num_requests": 64,
        "max_prompt_tokens": 256, "max_new_tokens": 4, "gear_id": "", "stages": 1, "split": "workload",
        "micro_batch_size": 8, "model": "", "chat_template": "auto", "priority": 0, "step_timeout_s": 120.0, "kv_pool_tokens_max": 8192,
        "truncate_context": False, "control_address": "", "secret_file": ""}
    # the tide sensor's run config, on a store that never saw the job: the same rows
    again = StoreResource(database_url=f"sqlite:///{tmp_path / 'again.db'}")
    assert batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": job.config}}},
                                              resources={"store": again}).success

    def rows(res):
        (j,) = res.get_store().jobs()
        return [(r.request_key, r.prompt_tokens, r.output_token_ids, r.output_text, r.status)
                for r in sorted(res.get_store().results(j.id), key=lambda r: r.request_key)]

    assert rows(again) == rows(first) and len(rows(first)) == 2
    assert again.get_store().jobs()[0].config == job.config


@pytest.mark.slow
def test_flexpipe_run_chat_template_off_warns_and_counts_rows_without_text(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "plain", "prompt": "The capital of France is"}) + "\n"
                       + json.dumps({"id": "answered", "prompt": ANSWERED}) + "\n")
    out = tmp_path / "results.jsonl"
    assert main(["run", "--stages", "1", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "3",
                 "--chat-template", "off"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["no_text"] == 1 and summary["finished"] == 2
    assert ("warning: SmolLM2-135M-Instruct.Q4_1 is a chat model (its tokenizer has a chat template) and 1 prompt(s) are "
            "plain text sent without it (--chat-template: off)") in captured.err
    assert ("warning: 1 of 2 rows produced no text: their output is only end-of-sequence / special tokens "
            "(end-of-sequence ids [2]) or whitespace: 'answered'; --chat-template auto wraps plain prompts in the "
            "model's chat template") in captured.err
    tok = _tokenizer()
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    plain_ids = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    assert results["plain"]["prompt_tokens"] == len(plain_ids) and results["plain"]["output_text"].strip()  # as it is
    assert (results["answered"]["output_token_ids"], results["answered"]["output_text"]) == ([2], "")

    # a re-run with every row in --out starts no stage worker (it took ~11 s to find nothing to do)
    from flexpipe_dag.runtime.pipeline import PipelineRuntime

    def no_start(self):
        raise AssertionError("a re-run with nothing left started the pipeline")

    monkeypatch.setattr(PipelineRuntime, "start", no_start)
    before = out.read_bytes()
    assert main(["run", "--stages", "2", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "3",
                 "--chat-template", "off"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert (summary["rows"], summary["skipped_done"], summary["finished"], summary["failure"]) == (2, 2, 0, None)
    assert f"all 2 requests already have results in {out}: nothing to run" in captured.err
    assert out.read_bytes() == before


# -- flexpipe calibrate without usable observations ------------------------------------------------------------


def _calibrate_error(capsys, *args: str) -> str:
    assert main(["calibrate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1  # one line, no traceback
    return captured.err.removeprefix("flexpipe calibrate: error: ").rstrip("\n")


def test_calibrate_without_usable_observations_says_why_in_one_line(tmp_path, capsys):
    from flexpipe_dag.sql.store import Store
    from tests.test_calibration_fit import cpu_cluster, synthetic_run

    store = Store.from_url()
    assert _calibrate_error(capsys) == (
        "no observed steps in the store yet: the Dagster batch_inference job (gear_id: or stages:) or `flexpipe demo` "
        "record every stage step in the store (`flexpipe run` writes its results to a file only)")
    cluster = cpu_cluster()
    steps = synthetic_run(cluster, {"cpu0": {"compute": 1.0, "memory": 1.0, "overhead": 1.0}}, n=12)
    store.write_observations("remote-run", steps, cluster_key=None)
    assert _calibrate_error(capsys) == (
        "none of the 12 observed stage steps is usable: they ran on no cluster (gears that name none, on remote "
        "workers); profile the cluster they ran on (the profile_refresh job on its host), then calibrate")
    store.write_observations("run-a", steps, cluster_key="cpu-host")
    assert _calibrate_error(capsys) == (
        "none of the 24 observed stage steps is usable: they ran on clusters without a stored profile (cpu-host); "
        "profile the cluster they ran on (the profile_refresh job on its host), then calibrate")
    assert _calibrate_error(capsys, "--cluster-id", "cpu-host") == (
        "--cluster-id: cluster 'cpu-host' has observed steps but no stored profile: profile it (the profile_refresh "
        "job on its host), then calibrate")
    assert _calibrate_error(capsys, "--run-key", "nope") == "--run-key: no observed stage steps of run(s) nope"
    other = cpu_cluster().model_copy(update={"devices": [d.model_copy(update={"device_id": f"gpu{i}"})
                                                         for i, d in enumerate(cluster.devices)], "links": []})
    store.save_profile(other)
    assert _calibrate_error(capsys) == (
        "none of the 12 observed stage steps of cluster cpu-host ran on a device of its profile v1 (steps on cpu0; "
        "profile devices gpu0, gpu1): profile the devices the runs used")
    store.save_profile(cluster)  # v2: the devices the steps ran on
    small = tmp_path / "tiny-llama"
    small.mkdir()
    small.joinpath("config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192}))
    assert _calibrate_error(capsys, "--model", str(small)).endswith(
        "--model: the observed steps cover layers up to 15, but tiny-llama has 8: name the model the runs served")
    assert main(["calibrate", "--dry-run"]) == 0


# -- Dagster: scaffold_config and descriptions ---------------------------------------------------------------


#: Run-config sections Dagster itself defines (executor, loggers, its IO manager): not ours to describe.
DAGSTER_OWN = ("execution", "loggers", "resources.io_manager")


def test_dagster_scaffold_config_works_for_every_job():
    script = textwrap.dedent("""
        import json
        from click.testing import CliRunner
        from dagster._cli.job import job_cli  # as `dagster job`: the scaffolder loaded before the code location

        from flexpipe_dag.definitions import defs

        out = {}
        for job in defs.resolve_all_job_defs():
            res = CliRunner().invoke(job_cli, ["scaffold_config", "-m", "flexpipe_dag.definitions", "-j", job.name])
            out[job.name] = [res.exit_code, res.output, repr(res.exception)]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=True)
    import yaml

    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"batch_inference", "gear_shift", "serve_trace", "serve_frontdoor", "plan_gears",
            "profile_refresh"} <= set(results)
    for name, (code, output, exc) in results.items():
        assert code == 0, f"{name}: {exc}\n{output}"
    batch = yaml.safe_load(results["batch_inference"][1])["ops"]["run_batch"]["config"]
    assert batch["job_key"] == "" and batch["chat_template"] == "auto|off|on"
    assert yaml.safe_load(results["gear_shift"][1])["ops"]["apply_gear_shift"]["config"]["to_gear_id"] == ""
    assert yaml.safe_load(results["plan_gears"][1])["resources"]["io_manager"]["config"] == {"base_dir": ""}


def test_every_config_field_of_every_job_has_a_description():
    from dagster._config import ConfigTypeKind

    from flexpipe_dag.definitions import defs

    missing: list[str] = []
    described: dict[str, int] = {}

    def walk(job: str, config_type, path: str) -> None:
        for name, field in config_type.fields.items():
            where = f"{path}.{name}" if path else name
            if where.startswith(DAGSTER_OWN):
                continue
            if ConfigTypeKind.has_fields(field.config_type.kind):
                walk(job, field.config_type, where)
            elif name == "config" and field.config_type.kind == ConfigTypeKind.ANY:
                continue  # an asset or op that takes no config
            elif (field.description or "").strip():
                described[job] = described.get(job, 0) + 1
            else:
                missing.append(f"{job}: {where}")

    for job in defs.resolve_all_job_defs():
        walk(job.name, job.run_config_schema.config_type, "")
    assert missing == []
    assert sorted(described) == sorted(j.name for j in defs.resolve_all_job_defs())  # every job was walked
    batch = defs.resolve_job_def("batch_inference").run_config_schema.config_type.fields["ops"].config_type \
        .fields["run_batch"].config_type.fields["config"].config_type.fields
    assert sorted(batch) == sorted([
        "job_key", "prompts_path", "trace", "num_requests", "max_prompt_tokens", "max_new_tokens", "gear_id", "stages",
        "split", "micro_batch_size", "model", "chat_template", "priority", "step_timeout_s", "kv_pool_tokens_max",
        "truncate_context", "control_address", "secret_file"])
