"""Attack review, bounded input (issue #15): every hostile file or flag is refused with one short line.

Each case runs the real command line in a subprocess (so a hang, a crash or a memory blow-up shows
up as such) and asserts: exit status 2; stderr exactly one line, no traceback, at most
:data:`MAX_ERROR_CHARS` characters and no raw control or bidirectional character; the command's own
time under :data:`MAX_WALL_S`; its peak resident memory under :data:`MAX_RSS_MIB` (the review's
attacks took 2.2-7 GB); and nothing in the store. The rest call the loaders in-process.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from flexpipe_dag.core.errors import InputError
from tests.support import EXAMPLES, REPO

#: Longest stderr line accepted: ~200 characters of user input plus the file, field and expectation.
MAX_ERROR_CHARS = 600
#: Seconds the command itself may take (measured inside the process, without the interpreter's start).
MAX_WALL_S = 5.0
#: Peak resident memory of the whole command, MiB: a command's own floor is 120-460 MiB (plan and simulate
#: import pandas, matplotlib and the planner); the review's attacks took 2.2-7 GiB.
MAX_RSS_MIB = 1024

# Peak memory is this process's VmHWM (its own address space since exec): ru_maxrss would carry the
# forking parent's peak over exec, the whole test session's.
_WRAPPER = """
import json, os, sys, time
from flexpipe_dag.cli import main
start = time.monotonic()
try:
    rc = main(sys.argv[1:])
finally:
    with open("/proc/self/status") as status:
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(os.environ["FLEXPIPE_TEST_STATS"], "w") as fh:
        json.dump({"wall_s": time.monotonic() - start, "rss_mib": hwm_kib / 1024}, fh)
sys.exit(rc)
"""


def _refused(tmp_path: Path, *args: str, needles: tuple[str, ...] = ()) -> str:
    """Run ``flexpipe ARGS`` in a subprocess; assert a bounded one-line refusal and an empty store."""
    home = tmp_path / "home"
    stats = tmp_path / "stats.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEXPIPE_HOME": str(home), "FLEXPIPE_TEST_STATS": str(stats),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEXPIPE_DATABASE_URL", None)
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, timeout=60, env=env,
                          cwd=tmp_path)
    err = proc.stderr.decode("utf-8", errors="replace")
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    line = lines[0]
    assert line.startswith(f"flexpipe {args[0]}: error: "), line
    assert len(line) <= MAX_ERROR_CHARS, f"{len(line)} characters: {line[:300]}"
    assert line.isprintable(), f"raw control or bidirectional character in {line!r}"
    for needle in needles:
        assert needle in line, line
    figures = json.loads(stats.read_text())
    assert figures["wall_s"] < MAX_WALL_S, figures
    assert figures["rss_mib"] < MAX_RSS_MIB, figures
    _assert_store_empty(home / "flexpipe.db")
    return line


def _assert_store_empty(db: Path) -> None:
    if not db.exists():
        return
    with sqlite3.connect(db) as conn:
        tables = [r[0] for r in conn.execute("select name from sqlite_master where type='table'")]
        for table in tables:
            if table != "alembic_version":
                assert conn.execute(f'select count(*) from "{table}"').fetchone()[0] == 0, table


def _seed(tmp_path: Path, node: str, name: str = "c.yaml") -> Path:
    """A seed-form cluster file whose one node is ``node`` (YAML lines under ``- ``)."""
    path = tmp_path / name
    path.write_text("nodes:\n- " + node.replace("\n", "\n  ") + "\n")
    return path


# -- files that are not files, too big, or built to blow up the parser --------------------------------------
def test_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    _refused(tmp_path, "profile", "--cluster", str(bomb), needles=("aliases (*a0) are not accepted", "line 2"))


def test_dev_zero_is_refused_without_reading(tmp_path):
    _refused(tmp_path, "profile", "--cluster", "/dev/zero", needles=("/dev/zero: is a device", "regular file"))


def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    _refused(tmp_path, "profile", "--cluster", str(fifo), needles=("is a FIFO",))


def test_a_file_over_the_size_cap_is_refused_by_its_size(tmp_path):
    from flexpipe_dag.core.user_files import MAX_YAML_BYTES

    big = tmp_path / "big.yaml"
    with big.open("wb") as fh:  # sparse: the size is there, the disk blocks are not
        fh.truncate(MAX_YAML_BYTES + 1)
    _refused(tmp_path, "profile", "--cluster", str(big), needles=("over the 4 MiB limit for a cluster profile",))


def test_the_reader_refuses_past_the_cap_and_reads_up_to_it(tmp_path):
    from flexpipe_dag.core.user_files import read_user_bytes

    path = tmp_path / "t.csv"
    path.write_bytes(b"x" * 100)
    with pytest.raises(InputError, match="100 bytes is over the 64 bytes limit"):
        read_user_bytes(path, 64)
    assert read_user_bytes(path, 100) == b"x" * 100


@pytest.mark.parametrize("name, text", [("deep.yaml", "nodes: " + "[" * 5000 + "\n"),
                                        ("deep.json", "[" * 100_000)])
def test_deep_nesting_is_refused_not_crashed(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    _refused(tmp_path, "profile", "--cluster", str(path), needles=(name, "nested"))


def test_yaml_nesting_limit_is_64_levels():
    from flexpipe_dag.core.user_yaml import MAX_NESTING_DEPTH, load_user_yaml

    assert load_user_yaml("a: " + "[" * (MAX_NESTING_DEPTH - 1) + "]" * (MAX_NESTING_DEPTH - 1), "f") is not None
    with pytest.raises(InputError, match="nested deeper than 64 levels"):
        load_user_yaml("a: " + "[" * MAX_NESTING_DEPTH + "]" * MAX_NESTING_DEPTH, "f")


def test_non_utf8_trace_is_one_line(tmp_path):
    from tests.test_sim_cli import _files

    gear, timing = _files(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"arrival_s,input_tokens,output_tokens\n0,\xff\xfe,5\n")
    _refused(tmp_path, "simulate", "--gear-file", str(gear), "--timing", str(timing), "--trace", str(trace),
             needles=("trace.csv: not UTF-8 text",))


# -- nonsense values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, needle", [
    ("yes", "memory_gb: Input should be a valid number (got True)"),
    ("true", "memory_gb: Input should be a valid number (got True)"),
    ("'80'", "memory_gb: Input should be a valid number (got '80')"),
    ("1e308", "memory_gb: Input should be less than or equal to 16384"),
    (".inf", "memory_gb: Input should be a finite number"),
])
def test_memory_must_be_a_sane_number(tmp_path, value, needle):
    path = _seed(tmp_path, f"node_id: g1\ngeneration: A100\nmemory_gb: {value}")
    _refused(tmp_path, "profile", "--cluster", str(path), needles=(needle,))


def test_yaml_exponent_floats_are_numbers():
    from flexpipe_dag.core.cluster import parse_cluster_profile
    from flexpipe_dag.core.user_yaml import load_user_yaml

    doc = load_user_yaml("nodes:\n- {node_id: g1, generation: A100, memory_gb: 8e1, compute_score: 1E0}\n", "f")
    assert doc["nodes"][0]["memory_gb"] == 80.0
    assert parse_cluster_profile(doc).devices[0].compute_score == 1.0


def test_duplicate_keys_are_refused_in_cluster_and_control_files(tmp_path):
    from flexpipe_dag.control.settings import resolve_control_settings

    path = _seed(tmp_path, "node_id: g1\ngeneration: A100\nmemory_gb: 80\nmemory_gb: 40")
    _refused(tmp_path, "profile", "--cluster", str(path), needles=("duplicate key 'memory_gb'", "line 5"))
    control = tmp_path / "control.yaml"
    control.write_text("controller:\n  dwell_s: 10\ntide:\n  horizon_s: 60\ncontroller:\n  ema_alpha: 0.5\n")
    with pytest.raises(InputError, match=r"duplicate key 'controller'.*line 5"):
        resolve_control_settings(str(control))


def test_json_cluster_duplicate_keys_and_constants_are_refused(tmp_path):
    from flexpipe_dag.core.cluster import load_cluster_profile

    path = tmp_path / "c.json"
    path.write_text('{"cluster_id": "a", "cluster_id": "b", "nodes": []}')
    with pytest.raises(InputError, match="duplicate key 'cluster_id'"):
        load_cluster_profile(path)
    path.write_text('{"nodes": [{"node_id": "g", "generation": "A100", "memory_gb": NaN}]}')
    with pytest.raises(InputError, match="NaN is not a number JSON allows"):
        load_cluster_profile(path)


@pytest.mark.parametrize("node_id, shown", [
    ('"g\\0x"', r"'g\x00x' holds '\x00' at character 2"),
    ('"g\\u202Ex"', r"'g\u202ex' holds '\u202e' at character 2"),
    ('"g\\e[31mred\\e[0m"', r"'g\x1b[31mred\x1b[0m' holds '\x1b'"),
    ('"gpu 1"', "'gpu 1' holds ' ' at character 4"),
    ("g" * 100_000, "100000 characters; expected an id of at most 200"),
])
def test_ids_are_printable_and_fit_the_store(tmp_path, node_id, shown):
    path = _seed(tmp_path, f"node_id: {node_id}\ngeneration: A100\nmemory_gb: 80")
    _refused(tmp_path, "profile", "--cluster", str(path), needles=("nodes[0].node_id: ", shown))


def test_escape_sequences_in_a_value_are_shown_escaped(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('cluster_id: lab\nfleet:\n- {node_id: h1, gpu_model: "\\e]0;pwned\\a\\e[2J' + "x" * 5000 + '"}\n')
    line = _refused(tmp_path, "profile", "--cluster", str(path), needles=("fleet[0].gpu_model", r"\x1b]0;pwned\x07"))
    assert "x" * 201 not in line


def test_ids_in_gears_are_checked_too(tmp_path):
    from flexpipe_dag.core.gear_builders import load_gear
    from tests.test_sim_cli import _files

    gear, _ = _files(tmp_path)
    doc = json.loads(gear.read_text())
    doc["gear_id"] = "hand\u202e2"
    gear.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"gear_id: 'hand\\u202e2' holds"):
        load_gear(gear)
    doc["gear_id"], doc["stages"][0]["device_ids"] = "hand-2", ["w\x1b[0m"]
    gear.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"stages\[0\]\.device_ids\[0\]: 'w\\x1b\[0m' holds"):
        load_gear(gear)


def test_device_count_is_capped(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("cluster_id: x\nfleet:\n" + "".join(f"- {{node_id: h{i}, gpu_model: T4, count: 64, hosts: 3}}\n"
                                                         for i in range(200)))
    _refused(tmp_path, "profile", "--cluster", str(path), needles=("fleet: 38400 devices; expected at most 32768",))


def test_the_largest_fleet_allowed_loads_in_bounded_time(tmp_path):
    from flexpipe_dag.core.cluster import MAX_DEVICES, load_cluster_profile

    path = tmp_path / "fleet.yaml"
    path.write_text("cluster_id: x\nfleet:\n" + "".join(f"- {{node_id: h{i}, gpu_model: T4, count: 8}}\n"
                                                         for i in range(MAX_DEVICES // 8)))
    start = time.monotonic()
    profile = load_cluster_profile(path)
    assert len(profile.devices) == MAX_DEVICES and time.monotonic() - start < 20.0


def test_missing_tide_history_file_fails_at_load(tmp_path):
    from flexpipe_dag.control.settings import resolve_control_settings

    control = tmp_path / "control.yaml"
    control.write_text(f"tide:\n  history_file: {tmp_path / 'nope.csv'}\n")
    with pytest.raises(InputError, match=r"tide\.history_file: no such file: .*nope\.csv"):
        resolve_control_settings(str(control))
    control.write_text("tide:\n  history_file: servegen-tide\n")
    assert resolve_control_settings(str(control)).tide.history_file == "servegen-tide"


# -- model configs and GGUF files -------------------------------------------------------------------------
_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "max_position_embeddings": 2048}


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 1_000_000_000), ("num_hidden_layers", 1e9),
                                        ("vocab_size", 2**31 - 1), ("hidden_size", True)])
def test_model_config_counts_are_bounded_before_anything_allocates(tmp_path, key, value):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**_CONFIG, key: value}))
    _refused(tmp_path, "plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", str(model),
             needles=(f"config.json: {key}: expected an integer >= 1",))


def test_truncated_gguf_is_one_line(tmp_path):
    from flexpipe_dag.runtime.model_loader import default_model_source

    try:
        source = default_model_source()
    except InputError as exc:
        pytest.skip(f"no GGUF file to cut: {exc}")
    cut = tmp_path / "cut.gguf"
    with source.open("rb") as fh:
        cut.write_bytes(fh.read(200_000))  # the header and part of the vocabulary: IndexError inside the parser
    _refused(tmp_path, "plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", str(cut),
             needles=("cut.gguf: cannot read GGUF file: not a complete GGUF file",))


def test_checkpoint_resolution_checks_the_gguf_before_converting(tmp_path):
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(InputError, match="not a complete GGUF file"):
        resolve_checkpoint(cut, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# -- prompts ----------------------------------------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_tokenising(tmp_path):
    from flexpipe_dag.runtime.batch import MAX_PROMPT_BYTES, read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "big", "prompt": "word " * 10_000_000}) + "\n"  # 50 MB
                    + json.dumps({"id": "ok", "prompt": "hi"}) + "\n"
                    + json.dumps({"id": "wide", "prompt": "\u00e9" * (MAX_PROMPT_BYTES // 2 + 1)}) + "\n")
    tracemalloc.start()
    start = time.monotonic()
    try:
        rows, bad = read_prompts(path)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < MAX_WALL_S
    assert peak_bytes < 400 * 2**20  # the file and one parsed line, not a tokenised 50 MB
    assert [r.request_id for r in rows] == ["ok"]
    assert [(b.line, b.reason.split(";")[0]) for b in bad] == [
        (1, "field 'prompt': 50000000 characters"), (3, f"field 'prompt': {MAX_PROMPT_BYTES // 2 + 1} characters")]
    assert "checked before tokenising" in bad[0].reason


def test_prompt_ids_with_control_characters_are_malformed_rows(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a\x1b[2J", "prompt": "hi"}) + "\n" + json.dumps({"id": "ok", "prompt": "x"}) + "\n")
    rows, bad = read_prompts(path)
    assert [r.request_id for r in rows] == ["ok"] and r"'a\x1b[2J'" in bad[0].reason


def test_a_prompts_fifo_is_refused(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="is a FIFO"):
        read_prompts(fifo)


# -- simulator horizon ------------------------------------------------------------------------------------
@pytest.fixture
def sim_args(tmp_path):
    from tests.test_sim_cli import _files

    gear, timing = _files(tmp_path)
    return ["simulate", "--gear-file", str(gear), "--timing", str(timing), "--json"]


@pytest.mark.parametrize("arrival", ["1e15", "inf", "nan"])
def test_arrivals_beyond_the_horizon_are_refused_with_the_row(tmp_path, sim_args, arrival):
    trace = tmp_path / "t.csv"
    trace.write_text(f"arrival_s,input_tokens,output_tokens\n0,10,5\n{arrival},10,5\n")
    _refused(tmp_path, *sim_args, "--trace", str(trace), needles=("t.csv: row 2.arrival_s: got", "2678400"))


@pytest.mark.parametrize("factor, needle", [("1e-300", "--speedup: expected a finite number >= 0.001"),
                                            ("1e300", "<= 1e+06"), ("nan", "--speedup: expected a finite number")])
def test_speedup_is_bounded(tmp_path, sim_args, factor, needle):
    _refused(tmp_path, *sim_args, "--trace", "azure-conv", "--speedup", factor, needles=(needle,))


def test_a_slowdown_past_the_horizon_names_the_request(tmp_path, sim_args):
    trace = tmp_path / "t.csv"
    trace.write_text("request_id,arrival_s,input_tokens,output_tokens\nfirst,0,10,5\nlast,86400,10,5\n")
    _refused(tmp_path, *sim_args, "--trace", str(trace), "--speedup", "0.01",
             needles=("request 'last'.arrival_s: got 8.64e+06 s; expected 0..2678400 s",))


def test_the_simulator_refuses_an_endless_workload_itself():
    from flexpipe_dag.core.gear_builders import manual_gear
    from flexpipe_dag.sim import LinearStageTiming, Simulator
    from flexpipe_dag.workload.request import Request, Workload

    gear = manual_gear([15, 15], gear_id="hand-2", micro_batch_size=4, max_inflight_micro_batches=2)
    timing = LinearStageTiming.uniform(2, prefill_fixed_ms=2, prefill_per_token_ms=0.02, decode_fixed_ms=6,
                                       decode_per_seq_ms=0.1, transfer_fixed_ms=0.3)
    workload = Workload("w", (Request("a", 0.0, 10, 5), Request("b", 1e15, 10, 5)), source="w.csv")
    with pytest.raises(InputError, match=r"w\.csv: request 'b'\.arrival_s: got 1e\+15 s"):
        Simulator(workload, gear, timing)


@pytest.mark.parametrize("figure, value, needle", [
    ("dwell_s", "yes", "expected a number, got the boolean True"),
    ("dwell_s", "1e300", "1e+300 is beyond 1e+09"),
    ("hysteresis_samples", "1" + "0" * 400, "(401 characters) is beyond 1e+09"),
])
def test_control_figures_are_plain_numbers_of_sane_size(tmp_path, figure, value, needle):
    from flexpipe_dag.control.settings import resolve_control_settings

    control = tmp_path / "control.yaml"
    control.write_text(f"controller:\n  {figure}: {value}\n")
    with pytest.raises(InputError) as err:
        resolve_control_settings(str(control))
    assert err.value.field == f"controller.{figure}" and needle in err.value.problem and len(str(err.value)) < 400


def test_a_timing_table_that_is_a_device_is_refused(tmp_path):
    from tests.test_sim_cli import _files

    gear, _ = _files(tmp_path)
    _refused(tmp_path, "simulate", "--gear-file", str(gear), "--timing", "/dev/zero", "--trace", "azure-conv",
             needles=("/dev/zero: is a device; expected a regular file holding a stage timing table",))


@pytest.mark.parametrize(("cell", "got"), [("True", "True"), ("false", "False"), ("", "an empty (or NaN / NA) cell"),
                                         ("nan", "an empty (or NaN / NA) cell")])
def test_a_timing_table_boolean_is_no_number_of_ms(tmp_path, cell, got):
    """``True`` in a stage timing table is refused by row and column, not priced as 1 ms (a column of
    booleans only: pandas reads it as bool, which ``pd.to_numeric`` turned into 1 / 0); an empty or NaN cell is
    named as one, not as ``got nan``."""
    from tests.test_sim_cli import _files

    gear, timing = _files(tmp_path)
    lines = timing.read_text().splitlines()
    column = lines[0].split(",").index("decode_fixed_ms")
    rows = [line.split(",") for line in lines[1:]]
    for row in rows:
        row[column] = cell
    timing.write_text("\n".join([lines[0], *(",".join(row) for row in rows)]) + "\n")
    _refused(tmp_path, "simulate", "--gear-file", str(gear), "--timing", str(timing), "--trace", "azure-conv",
             needles=(f"row 1.decode_fixed_ms: got {got}; expected a number of ms",))


def test_the_batch_job_refuses_an_unprintable_job_key_before_the_store(tmp_path):
    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.resources.store_resource import StoreResource

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    store = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    with pytest.raises(InputError, match=r"job_key: 'job\\x1b\[2J' holds '\\x1b'"):
        batch_inference.execute_in_process(run_config={"ops": {"run_batch": {"config": {
            "job_key": "job\x1b[2J", "prompts_path": str(prompts), "stages": 1}}}}, resources={"store": store})
    _assert_store_empty(tmp_path / "fp.db")


def test_every_input_error_is_one_bounded_escaped_line():
    from flexpipe_dag.core.errors import MAX_MESSAGE_CHARS, shown

    err = InputError("a\nb.yaml", "f\x1b[0m", "bad value " + shown("x\u202e\n" * 10_000) + "\r\n" + "y" * 5000)
    text = str(err)
    assert text.isprintable() and "\n" not in text
    assert text.startswith(r"a\nb.yaml: f\x1b[0m: bad value 'x\u202e\nx\u202e")
    assert len(text) < MAX_MESSAGE_CHARS + 200 and "characters, cut)" in text
    assert shown(list(range(10**6))) == "a list of 1000000 items"


# -- attack review follow-up (issue #15): gears, YAML tags, prompt lines, CPU memory share --------------
def test_gear_json_is_strict_and_its_figures_bounded(tmp_path):
    from flexpipe_dag.core.gear_builders import load_gear
    from tests.test_sim_cli import _files

    gear, _ = _files(tmp_path)
    good = gear.read_text()
    assert load_gear(gear).gear_id == "hand-2"
    gear.write_text(good.replace('{"gear_id":"hand-2",', '{"gear_id":"hand-2","gear_id":"other",'))
    with pytest.raises(InputError, match=r"duplicate key 'gear_id'"):
        load_gear(gear)
    for field, value, needle in [("micro_batch_size", 10**18, "65536"), ("max_inflight_micro_batches", 10**18, "4096"),
                                 ("kv_block_size_tokens", 10**23, "65536"), ("stages[0].est_stage_ms", -1.0, "0")]:
        doc = json.loads(good)
        head, _, leaf = field.rpartition(".")
        (doc["stages"][0] if head else doc)[leaf] = value
        gear.write_text(json.dumps(doc))
        with pytest.raises(InputError, match=rf"^{gear}: {re.escape(field)}: .*{needle}.*\(got ") as err:
            load_gear(gear)
        assert "\n" not in str(err.value)
    # an empty file, a list, a list where the stages go: said in the file's terms, never a private class name
    as_yaml = gear.with_suffix(".yaml")
    for path, text, field, needle in [
            (as_yaml, "", None, "holds no document; expected a mapping of a gear's fields"),
            (as_yaml, "# nothing but a comment\n", None, "holds no document"),
            (gear, "[1, 2]", None, "holds a list; expected a mapping"),
            (gear, good.replace('"stages":[', '"stages":[7,', 1), "stages[0]",
             r"a valid dictionary \(a mapping of fields\) \(got 7\)")]:
        path.write_text(text)
        with pytest.raises(InputError, match=needle) as err:
            load_gear(path)
        assert err.value.field == field and "StagePlan" not in str(err.value) and "Gear" not in str(err.value)


@pytest.mark.parametrize("field, value, needle", [
    ("micro_batch_size", True, "Input should be a valid integer (got True)"),
    ("micro_batch_size", "32", "Input should be a valid integer (got '32')"),
    ("micro_batch_size", 16.0, "Input should be a valid integer (got 16.0)"),
    ("stages[0].stage_index", False, "Input should be a valid integer (got False)"),
    ("rps_min", True, "Input should be a valid number (got True)"),
])
def test_gear_figures_are_strict_numbers(tmp_path, field, value, needle):
    """A boolean or a string where a gear's number belongs is refused, as in a cluster profile, not read as
    1 / 0 / 32 (``micro_batch_size: true`` planned and simulated a micro-batch of 1)."""
    from flexpipe_dag.core.gear_builders import load_gear
    from tests.test_sim_cli import _files

    gear, _ = _files(tmp_path)
    doc = json.loads(gear.read_text())
    head, _, leaf = field.rpartition(".")
    (doc["stages"][0] if head else doc)[leaf] = value
    gear.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=rf"^{gear}: {re.escape(field)}: {re.escape(needle)}$"):
        load_gear(gear)
    if field == "micro_batch_size" and value is True:  # YAML's yes is a boolean too
        as_yaml = gear.with_suffix(".yaml")
        as_yaml.write_text(json.dumps(doc).replace("true", "yes"))
        with pytest.raises(InputError, match="micro_batch_size: Input should be a valid integer"):
            load_gear(as_yaml)


@pytest.mark.parametrize("text, tag", [("a: !!binary aGVsbG8=", "'binary'"), ("a: !!set {x}", "'set'"),
                                       ("a: !!timestamp 2024-01-01", "'timestamp'"), ("a: !local 1", "'!local'"),
                                       ("a: !!omap [{b: 1}]", "'omap'")])
def test_yaml_refuses_tags_outside_the_core_schema(tmp_path, text, tag):
    from flexpipe_dag.core.user_yaml import load_user_yaml

    with pytest.raises(InputError, match=rf"^c\.yaml: not valid YAML/JSON: tag {tag} is not accepted .*\(line 1,"):
        load_user_yaml(text, "c.yaml")
    assert load_user_yaml("a: !!str 5\nb: 2024-01-01\nc: !!int '7'\n", "c.yaml") == {"a": "5", "b": "2024-01-01", "c": 7}


def test_prompt_lines_split_at_newlines_only(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts

    path = tmp_path / "p.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"a{sep}b"} for i, sep in enumerate(("\u2028", "\u2029", "\u0085", "\x0c"))]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    got, bad = read_prompts(path)
    assert bad == [] and [(r.request_id, r.prompt, r.line) for r in got] == [
        (r["id"], r["prompt"], i) for i, r in enumerate(rows, start=1)]


def test_out_of_vocabulary_ids_name_their_row(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts, to_requests

    class Tokenizer:  # to_requests reads only the vocabulary size when rows carry token ids
        def __len__(self) -> int:
            return 100

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"id": "ok", "token_ids": [1, 2]}, {"id": "x", "prompt": ""}, {"id": "oov", "token_ids": [5, 100]})))
    rows, bad = read_prompts(path)
    reqs = to_requests(rows, Tokenizer(), (0,), bad)
    assert [r.request_id for r in reqs] == ["ok"]
    assert [b.line for b in bad] == [2, 3] and "id 100 is outside the model's vocabulary (0..99)" in bad[1].reason


def test_cpu_memory_share_counts_every_replica(monkeypatch):
    from flexpipe_dag.core.errors import InfeasibleError
    from flexpipe_dag.core.gear_builders import even_gear
    from flexpipe_dag.runtime import pipeline

    monkeypatch.setattr(pipeline, "host_memory_bytes", lambda: 100 * 2**30)
    monkeypatch.setattr(pipeline, "stage_memory_bytes", lambda gear, ckpt, dtype, device="cpu": [
        {"stage_index": st.stage_index, "device_ids": st.device_ids, "total_bytes": 30 * 2**30,
         "param_bytes": 20 * 2**30, "kv_pool_bytes": 10 * 2**30} for st in gear.stages])
    options = pipeline.RuntimeOptions()
    pipeline.check_gear_fits(even_gear(30, 2, "m", 1, None, 1000), None, options)  # 2 workers: 50 GiB each
    replicated = even_gear(30, 2, "m", 1, None, 1000, replicas=[3, 1])  # 4 workers: 25 GiB each
    with pytest.raises(InfeasibleError, match=r"needs 30\.00 GiB .* but the device has 25\.00 GiB"):
        pipeline.check_gear_fits(replicated, None, options)
    # a device with its own figure does not take a share of the host
    pipeline.check_gear_fits(replicated, None, pipeline.RuntimeOptions(device_memory_bytes={"worker0.0": 40 * 2**30}))
