"""Exact, named request limits in the runtime (issue 16, item 7).

* KV need is prompt + ``max_new_tokens`` - 1 (the last sampled token is never written to the cache):
  a request needing exactly the pool is admitted and runs to completion, one token more is refused;
* with stage replicas the refusal names the binding limit (one lane's share, and the stage and
  replica whose pool is split over the lanes), not the whole pool;
* the model's max context (``max_position_embeddings`` from the checkpoint's config) is checked at
  intake by the in-process pipeline, the multi-process runtime and ``flexpipe run``, and the
  ``serve_trace`` job refuses caps over it before launch;
* ``--max-new-tokens`` / the batch job's ``max_new_tokens`` cap rows asking for more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.kv import kv_tokens_needed
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
from flexpipe_dag.runtime.lanes import lane_limit_text
from flexpipe_dag.runtime.scheduler import ContextLengthError, Request, Scheduler


def _run_to_completion(sched: Scheduler, token: int = 5) -> tuple[list, int]:
    """Serve every request with a fixed sampled token (no EOS); returns the outputs and the most KV
    tokens any sequence held."""
    done, most = [], 0
    while sched.has_unfinished():
        mb = sched.schedule()
        assert mb is not None, "scheduler stalled"
        most = max([most, *(sched.allocator.num_tokens(s.seq_id) for s in mb.seqs)])
        done += sched.update_from_output(mb.mb_id, [token] * len(mb.seqs))
    return done, most


def _run_to_completion_after(sched: Scheduler, mb) -> tuple[list, int]:
    """:func:`_run_to_completion` after handing back the already scheduled micro-batch ``mb``."""
    done = sched.update_from_output(mb.mb_id, [5] * len(mb.seqs))
    more, most = _run_to_completion(sched)
    return done + more, most


# -- KV need: prompt + max_new_tokens - 1 -----------------------------------------------------------
def test_kv_need_is_prompt_plus_new_tokens_minus_one():
    assert kv_tokens_needed(100, 45) == 144
    assert kv_tokens_needed(1, 1) == 1  # a one-token answer caches only the prompt
    assert Request("r", [1] * 100, 29).kv_tokens == 128


def test_a_request_needing_exactly_the_pool_runs_to_completion_and_one_token_more_is_refused():
    sched = Scheduler(BlockAllocator(8, 16), micro_batch_size=2, max_inflight_micro_batches=1)  # 128 tokens
    sched.add_request(Request("exact", [1] * 100, 29))  # 100 + 29 - 1 = 128
    [out], most = _run_to_completion(sched)
    assert out.request_id == "exact" and len(out.output_token_ids) == 29 and out.finish_reason == "length"
    assert most == 128  # the pool filled exactly: the reservation was enough, never exceeded
    assert sched.allocator.num_used_blocks == 0 and sched.allocator.num_reserved_blocks == 0
    with pytest.raises(KVCapacityError) as err:
        sched.add_request(Request("one-more", [1] * 100, 30))
    assert str(err.value) == (
        "request 'one-more' needs 129 KV tokens (prompt 100 + max_new_tokens 30 - 1: the last token is never "
        "cached); the KV pool holds 128 tokens; expected at most 128 (shorten the prompt or max_new_tokens, or "
        "raise the gear's kv_capacity_tokens)")
    assert sched.num_waiting == 0


def test_admission_reserves_the_same_need_two_exact_requests_share_the_pool():
    sched = Scheduler(BlockAllocator(8, 16), micro_batch_size=2, max_inflight_micro_batches=1)
    sched.add_request(Request("a", [1] * 48, 17))  # 64 KV tokens: 4 blocks
    sched.add_request(Request("b", [2] * 48, 17))  # 64 more: the pool's other 4 blocks
    mb = sched.schedule()
    assert mb is not None and len(mb.seqs) == 2  # both admitted at once
    assert sched.allocator.num_reserved_blocks == 8
    done, most = _run_to_completion_after(sched, mb)
    assert sorted(o.request_id for o in done) == ["a", "b"] and most == 64


# -- the binding limit, named -----------------------------------------------------------------------
def test_replicated_stage_refusal_names_the_lane_stage_and_replica():
    # gear replicas [1, 2], a 256-token pool per device: 2 lanes of 128 (stage 0's one replica holds both)
    sched = Scheduler(BlockAllocator(16, 16, num_lanes=2), micro_batch_size=2, max_inflight_micro_batches=1,
                      stage_replicas=(1, 2))
    with pytest.raises(KVCapacityError) as err:
        sched.add_request(Request("r", [1] * 100, 45))
    assert str(err.value) == (
        "request 'r' needs 144 KV tokens (prompt 100 + max_new_tokens 45 - 1: the last token is never cached); "
        "a sequence's KV stays in one lane, and lane 0 holds 128 tokens (stage 0, replica 0 of 1, splits its "
        "256-token pool over 2 lanes); expected at most 128 (shorten the prompt or max_new_tokens, or raise the "
        "gear's kv_capacity_tokens)")
    sched.add_request(Request("fits", [1] * 100, 29))  # exactly one lane
    [out], most = _run_to_completion(sched)
    assert out.request_id == "fits" and most == 128


def test_lane_limit_text_cases():
    assert lane_limit_text(1, 256) == "the KV pool holds 256 tokens"
    assert lane_limit_text(1, 256, (1, 1)) == "the KV pool holds 256 tokens"
    assert lane_limit_text(2, 128, (2, 2)) == ("a sequence's KV stays in one lane, and lane 0 holds 128 tokens "
                                               "(the pool of stage 0, replica 0 of 2)")
    # lanes = lcm(2, 3) = 6; stage 0's replicas each serve 3 lanes
    assert lane_limit_text(6, 40, (2, 3)) == ("a sequence's KV stays in one lane, and lane 0 holds 40 tokens "
                                              "(stage 0, replica 0 of 2, splits its 120-token pool over 3 lanes)")
    assert lane_limit_text(2, 64) == ("a sequence's KV stays in one lane, and lane 0 holds 64 tokens "
                                      "(the pool's 128 tokens split over 2 lanes)")
    with pytest.raises(ValueError, match=r"replicas per stage must be >= 1, got \[1, 0\]"):
        lane_limit_text(2, 64, (1, 0))


# -- the model's max context ------------------------------------------------------------------------
def test_scheduler_context_check_counts_prompt_plus_new_tokens():
    sched = Scheduler(BlockAllocator(64, 16), 2, 1, max_context_tokens=64)
    sched.add_request(Request("fits", [1] * 60, 4))  # 64: at the limit
    with pytest.raises(ContextLengthError) as err:
        sched.add_request(Request("long", [1] * 170, 8))
    assert str(err.value) == (
        "request 'long': prompt 170 + max_new_tokens 8 = 178 tokens exceed the model's max context of 64 tokens; "
        "expected at most 64 (shorten the prompt or max_new_tokens, or truncate: --truncate-context)")


def test_serve_trace_refuses_caps_over_the_models_context():
    from jobs.serve import ServeTraceConfig, check_context

    check_context(ServeTraceConfig(max_prompt_tokens=60, max_new_tokens=4), 64, "tiny")  # 64: fits
    check_context(ServeTraceConfig(max_prompt_tokens=600, max_new_tokens=4), None, "tiny")  # not known
    with pytest.raises(InputError) as err:
        check_context(ServeTraceConfig(max_prompt_tokens=96, max_new_tokens=12), 64, "tiny")
    assert str(err.value) == ("serve_trace config: max_prompt_tokens + max_new_tokens: 96 + 12 = 108 tokens exceed "
                              "tiny's max context of 64 tokens; expected at most 64")


def test_scoring_rows_over_the_max_context_are_reported_with_their_reason():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.batch import PromptRow
    from flexpipe_dag.runtime.score_runtime import score_units

    rows = [PromptRow("fits", token_ids=[1] * 64, line=1), PromptRow("long", token_ids=[1] * 65, line=2),
            PromptRow("choice", token_ids=[1] * 60, continuations=[[2] * 4, [3] * 5], line=3)]
    malformed: list = []
    units, state = score_units(rows, None, malformed, max_context_tokens=64)
    assert list(state) == ["fits"] and [len(u.token_ids) for u in units] == [64]
    assert [(m.line, m.reason) for m in malformed] == [
        (2, "id 'long': prompt: 65 tokens exceed the model's max context of 64 tokens; expected at most 64"),
        (3, "id 'choice': prompt + continuation 1: 65 tokens exceed the model's max context of 64 tokens; "
            "expected at most 64")]
    assert len(score_units(rows, None, [], max_context_tokens=None)[0]) == 4  # not known: not checked


# -- max_new_tokens caps ----------------------------------------------------------------------------
def _prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in (
        {"id": "less", "token_ids": [1, 2], "max_new_tokens": 3},
        {"id": "more", "token_ids": [1, 2], "max_new_tokens": 50},
        {"id": "default", "token_ids": [1, 2]},
    )) + "\n")
    return p


def test_max_new_tokens_caps_rows_asking_for_more(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts

    rows, bad = read_prompts(_prompts(tmp_path), max_new_tokens=5)
    assert not bad and [(r.request_id, r.max_new_tokens) for r in rows] == [("less", 3), ("more", 5), ("default", 5)]


def test_batch_job_max_new_tokens_caps_rows(tmp_path):
    pytest.importorskip("dagster")
    from jobs.batch import BatchInferenceConfig, _rows

    rows, bad = _rows(BatchInferenceConfig(job_key="j", prompts_path=str(_prompts(tmp_path)), max_new_tokens=4), None)
    assert not bad and [r.max_new_tokens for r in rows] == [3, 4, 4]


# -- the real model ---------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from tests.test_runtime_helpers import (  # noqa: E402
    MAX_NEW_TOKENS,
    checkpoint,
    gear,
    hf_reference,
    prompt_ids,
    requests,
)


def small_context_checkpoint(tmp_path: Path, max_position_embeddings: int = 64):
    """SmolLM2 with its config's ``max_position_embeddings`` lowered (weights and tokenizer linked)."""
    from flexpipe_dag.runtime.model_loader import Checkpoint

    src = checkpoint().path
    dst = tmp_path / "smollm2-ctx64"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = max_position_embeddings
    (dst / "config.json").write_text(json.dumps(config))
    return Checkpoint(path=dst, name=dst.name)


def test_exact_kv_pool_gives_transformers_greedy_output_in_process():
    """Prompt 1 (38 tokens) + 12 new tokens needs 49 KV tokens: a pool of 7 blocks of 7 holds exactly that."""
    from flexpipe_dag.runtime.local import LocalPipeline

    req = requests(2)[1]
    assert len(req.prompt_token_ids) == 38 and req.kv_tokens == 49
    pipe = LocalPipeline.from_layer_ranges(checkpoint(), [(0, 15), (15, 30)], num_blocks=7, block_size_tokens=7)
    sched = Scheduler(BlockAllocator(7, 7), 1, 1, max_context_tokens=pipe.max_context_tokens)
    sched.add_request(req)
    done, most = [], 0
    while sched.has_unfinished():
        mb = sched.schedule()
        assert mb is not None
        most = max(most, sched.allocator.num_tokens(mb.seqs[0].seq_id))
        done += sched.update_from_output(mb.mb_id, pipe.step(mb))
    assert most == 49 and [o.output_token_ids for o in done] == [hf_reference()["1"]]
    assert len(hf_reference()["1"]) == MAX_NEW_TOKENS  # no early EOS: the pool really filled
    with pytest.raises(KVCapacityError, match="needs 50 KV tokens .*the KV pool holds 49 tokens"):
        pipe.generate([Request("one-more", list(req.prompt_token_ids), MAX_NEW_TOKENS + 1)])


def test_in_process_pipeline_reads_the_max_context_from_the_config(tmp_path):
    from flexpipe_dag.runtime.local import LocalPipeline

    ck = small_context_checkpoint(tmp_path)
    assert ck.max_context_tokens == 64
    pipe = LocalPipeline.from_layer_ranges(ck, [(0, 30)], num_blocks=64, block_size_tokens=16)
    assert pipe.max_context_tokens == 64
    long_ids = [t for ids in prompt_ids() for t in ids][:170]
    with pytest.raises(ContextLengthError, match="prompt 170 \\+ max_new_tokens 8 = 178 tokens exceed the model's "
                                                 "max context of 64 tokens"):
        pipe.generate([Request("long", long_ids, 8)])


@pytest.mark.slow
def test_flexpipe_run_refuses_over_context_and_caps_max_new_tokens(tmp_path, capsys):
    """The issue's case: a 64-token-context checkpoint and a 170-token prompt. ``flexpipe run`` refuses it
    naming the numbers (exit 1); a row asking for 50 new tokens is cut to ``--max-new-tokens 4`` (so
    it fits the context) and matches transformers' greedy output."""
    from flexpipe_dag.cli import main

    ck = small_context_checkpoint(tmp_path)
    long_ids = [t for ids in prompt_ids() for t in ids][:170]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "long", "token_ids": long_ids, "max_new_tokens": 8}) + "\n"
                       + json.dumps({"id": "short", "token_ids": list(prompt_ids()[1]), "max_new_tokens": 50}) + "\n")
    out = tmp_path / "results.jsonl"
    code = main(["run", "--stages", "1", "--model", str(ck.path), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "4", "--kv-capacity-tokens", "256"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 1 and summary["refused"] == 1 and summary["refused_context"] == 1 and summary["finished"] == 1
    assert summary["max_context_tokens"] == 64
    assert ("refused long: request 'long': prompt 170 + max_new_tokens 4 = 174 tokens exceed the model's max "
            "context of 64 tokens") in captured.err
    [res] = [json.loads(line) for line in out.read_text().splitlines()]
    assert res["id"] == "short" and res["output_token_ids"] == hf_reference()["1"][:4]


@pytest.mark.slow
def test_replicated_pipeline_serves_a_request_filling_one_lane_and_names_the_lane_when_refusing():
    """Replicas [1, 2] with a 96-token pool: 2 lanes of 48 KV tokens. A 37-token prompt + 12 new tokens
    needs exactly 48 (served, transformers' output); a 44-token one needs 55 (refused, naming the lane)."""
    from flexpipe_dag.runtime.pipeline import PipelineRuntime

    reqs = requests(8)
    fits = [r for r in reqs if r.request_id in ("4", "6")]
    too_big = reqs[2]
    assert [r.kv_tokens for r in fits] == [48, 48] and too_big.kv_tokens == 55
    g = gear([(0, 15), (15, 30)], kv_capacity_tokens=96, device_ids=[["cpu0"], ["cpu1-0", "cpu1-1"]])
    assert [st.replicas for st in g.stages] == [1, 2]
    with PipelineRuntime(g, checkpoint()) as rt:
        outs = rt.generate([*fits, too_big])
        refused = rt.refused
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {"4": ref["4"], "6": ref["6"]}
    assert refused == {"2": (
        "request '2' needs 55 KV tokens (prompt 44 + max_new_tokens 12 - 1: the last token is never cached); "
        "a sequence's KV stays in one lane, and lane 0 holds 48 tokens (stage 0, replica 0 of 1, splits its "
        "96-token pool over 2 lanes); expected at most 48 (shorten the prompt or max_new_tokens, or raise the "
        "gear's kv_capacity_tokens)")}
