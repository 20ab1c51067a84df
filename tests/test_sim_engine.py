"""Checks of the simulator itself: closed-form latencies, throughput limits, queueing theory, KV preemption."""

from __future__ import annotations

import numpy as np
import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator, StageCosts, manual_gear, simulate
from flexpipe_dag.workload import Request, Workload


def _poisson(rate_rps: float, n: int, inp: int, out: int, seed: int, klass: str = "online") -> Workload:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate_rps, size=n))
    return Workload.from_requests([Request(f"r{i}", float(x), inp, out, klass) for i, x in enumerate(t)], name="poisson")


def test_single_request_latency_is_sum_of_stage_and_transfer_times():
    costs = [StageCosts(prefill_fixed_ms=1.0 + i, prefill_per_token_ms=0.01 * (i + 1), decode_fixed_ms=3.0 + i,
                        decode_per_seq_ms=0.5, decode_per_context_token_ms=0.001,
                        transfer_fixed_ms=0.25 * (i + 1), transfer_per_token_ms=0.001) for i in range(3)]
    timing = LinearStageTiming(costs)
    gear = manual_gear([4, 6, 2], replicas=[1, 2, 1], micro_batch_size=4, max_inflight_micro_batches=2)
    inp, out = 200, 6
    res = simulate(Workload.from_requests([Request("a", 1.5, inp, out)], name="one"), gear, timing)
    ttft = sum(timing.prefill_ms(s, inp) + timing.transfer_ms(s, inp) for s in range(3))
    decode = sum(sum(timing.decode_ms(s, 1, inp + k) + timing.transfer_ms(s, 1) for s in range(3)) for k in range(1, out))
    row = res.requests.iloc[0]
    assert row["ttft_ms"] == pytest.approx(ttft, rel=1e-9)
    assert row["e2e_ms"] == pytest.approx(ttft + decode, rel=1e-9)
    assert row["first_token_s"] == pytest.approx(1.5 + ttft / 1000)
    assert timing.transfer_ms(2, inp) == 0.0


def test_low_load_throughput_equals_offered_load():
    timing = LinearStageTiming.uniform(4, prefill_fixed_ms=2, prefill_per_token_ms=0.01, decode_fixed_ms=3, transfer_fixed_ms=0.2)
    gear = manual_gear([2, 2, 2, 2], micro_batch_size=8, max_inflight_micro_batches=4)
    w = _poisson(5.0, 4000, 100, 20, seed=1)
    res = simulate(w, gear, timing)
    offered = (len(w) - 1) / w.duration_s
    assert res.summary["completed"] == len(w)
    assert res.summary["throughput_rps"] == pytest.approx(offered, rel=0.01)
    assert res.summary["ttft_ms"]["p50"] < 50  # nearly no queueing


@pytest.mark.parametrize("replicas, expected_ms", [([1, 1, 1], 5.0), ([1, 2, 1], 3.0)])
def test_saturated_throughput_is_one_over_bottleneck(replicas, expected_ms):
    stage_ms = [2.0, 5.0, 3.0]
    timing = LinearStageTiming([StageCosts(prefill_fixed_ms=m) for m in stage_ms])
    gear = manual_gear([1, 1, 1], replicas=replicas, micro_batch_size=1, max_inflight_micro_batches=16)
    n = 2000
    w = Workload.from_requests([Request(f"r{i}", 0.0, 10, 1) for i in range(n)], name="burst")
    res = simulate(w, gear, timing)
    fin = np.sort(res.requests["finish_s"].to_numpy())
    rate = (n - 101) / (fin[-1] - fin[100])  # steady state, after the pipeline fills
    assert rate == pytest.approx(1000.0 / expected_ms, rel=1e-6)
    util = res.summary["stage_utilisation"]["manual"]
    assert max(util) == pytest.approx(1.0, rel=0.01)


def test_md1_queue_matches_pollaczek_khinchine():
    d_ms = 10.0
    timing = LinearStageTiming([StageCosts(prefill_fixed_ms=d_ms)])
    gear = manual_gear([1], micro_batch_size=1, max_inflight_micro_batches=1)
    rho = 0.7
    w = _poisson(rho / (d_ms / 1000), 60000, 10, 1, seed=3)
    res = simulate(w, gear, timing)
    wait_ms = res.requests["ttft_ms"].to_numpy() - d_ms
    expected = rho * d_ms / (2 * (1 - rho))  # M/D/1 mean wait (Pollaczek-Khinchine, deterministic service)
    assert wait_ms.mean() == pytest.approx(expected, rel=0.05)
    assert res.summary["stage_utilisation"]["manual"][0] == pytest.approx(rho, rel=0.02)


def test_kv_exhaustion_preempts_and_loses_nothing():
    timing = LinearStageTiming.uniform(2, prefill_fixed_ms=1, prefill_per_token_ms=0.001, decode_fixed_ms=2, decode_per_seq_ms=0.1)
    gear = manual_gear([1, 1], micro_batch_size=16, max_inflight_micro_batches=2, kv_block_size_tokens=16,
                       kv_capacity_tokens=16 * 64)  # 64 blocks
    reqs = [Request(f"r{i}", 0.01 * i, 100, 200) for i in range(40)]
    reqs.append(Request("huge", 0.0, 900, 400))  # 1300 tokens > the whole pool: rejected, not lost
    res = simulate(Workload.from_requests(reqs, name="kv"), gear, timing)
    s = res.summary
    assert s["preemptions"] > 0
    assert s["completed"] == 40 and s["rejected"] == 1 and s["unfinished"] == 0
    assert res.requests.set_index("request_id").loc["huge", "rejected"]
    assert max(x.kv_used_fraction for x in res.samples) <= 1.0
    assert any(x.stages[0].kv_blocks_used == 64 for x in res.samples) or s["kv_used_fraction"]["max"] > 0.9


def test_online_before_offline():
    timing = LinearStageTiming.uniform(1, prefill_fixed_ms=100)
    gear = manual_gear([1], micro_batch_size=1, max_inflight_micro_batches=1)
    reqs = [Request(f"off{i}", 0.0, 10, 1, "offline") for i in range(20)]
    reqs.append(Request("on", 0.35, 10, 1, "online"))
    res = simulate(Workload.from_requests(reqs, name="mix"), gear, timing).requests.set_index("request_id")
    # the online request waits only for the offline job in service (0.3 -> 0.4), then runs 0.4 -> 0.5
    assert res.loc["on", "finish_s"] == pytest.approx(0.5)
    # 20 offline jobs and the online one, prefill_fixed_ms=100 each, back to back from t=0
    assert res[res["class"] == "offline"]["finish_s"].max() == pytest.approx(len(reqs) * 100 / 1000)


def test_timing_stage_count_must_match_gear():
    with pytest.raises(InputError, match="stages"):
        Simulator(Workload.from_requests([], name="e"), manual_gear([1, 1]), LinearStageTiming.uniform(3))


def test_kv_capacity_from_config_override():
    timing = LinearStageTiming.uniform(1, prefill_fixed_ms=1, decode_fixed_ms=1)
    gear = manual_gear([1], micro_batch_size=8, kv_capacity_tokens=0)
    w = Workload.from_requests([Request("a", 0, 100, 100)], name="x")
    assert simulate(w, gear, timing).summary["rejected"] == 0  # 0 = unbounded pool
    assert simulate(w, gear, timing, SimConfig(kv_capacity_tokens=64)).summary["rejected"] == 1


@pytest.mark.parametrize("pool_tokens", [1, 15])
def test_kv_pool_under_one_block_is_one_block_not_unbounded(pool_tokens):
    """A pool smaller than a block (16 tokens) holds one block, as the runtime sizes it: a request needing
    more is rejected, one that fits in the block is served (it used to read as 0 blocks = unbounded)."""
    timing = LinearStageTiming.uniform(1, prefill_fixed_ms=1, decode_fixed_ms=1)
    gear = manual_gear([1], micro_batch_size=8, kv_capacity_tokens=0)
    w = Workload.from_requests([Request("big", 0, 100, 10), Request("small", 1, 4, 4)], name="x")
    summary = simulate(w, gear, timing, SimConfig(kv_capacity_tokens=pool_tokens)).summary
    assert (summary["rejected"], summary["completed"]) == (1, 1)
    on_gear = manual_gear([1], micro_batch_size=8, kv_capacity_tokens=pool_tokens)
    assert simulate(w, on_gear, timing).summary["rejected"] == 1


def test_chunked_prefill_cuts_a_long_prompt_and_bounds_the_decode_stall():
    """One stage, one slot of 4; a short request decoding, then a 1,000-token prompt at 20 ms. Whole-prompt
    prefill stalls the short request's next token for the whole prompt; with a 100-token budget each
    iteration carries 99 prompt tokens next to the decode, then 100 once the short one is done, the long
    prompt's first token comes out of its last chunk, and every request produces exactly its tokens."""
    costs = StageCosts(prefill_fixed_ms=1.0, prefill_per_token_ms=0.1, decode_fixed_ms=5.0, decode_per_seq_ms=0.0,
                       decode_per_context_token_ms=0.0)
    timing = LinearStageTiming([costs])
    gear = manual_gear([2], micro_batch_size=4, max_inflight_micro_batches=1)
    w = Workload.from_requests([Request("short", 0.0, 10, 8), Request("long", 0.02, 1000, 5)], name="two")
    whole = simulate(w, gear, timing).requests.set_index("request_id")
    chunked = simulate(w, gear, timing, SimConfig(prefill_token_budget=100, chunked_prefill=True)).requests.set_index("request_id")
    pf, dec = (lambda n: timing.prefill_ms(0, n)), timing.decode_ms(0, 1, 0)
    first_short = pf(10)  # the short request's first token (2 ms); decodes every 5 ms after it
    admit = first_short + 4 * dec  # the long prompt joins at the first iteration boundary after 20 ms: 22 ms
    # whole: one iteration of the decode + the 1,000-token prompt, then the short one's last two tokens
    assert whole.loc["long", "ttft_ms"] == pytest.approx(admit + dec + pf(1000) - 20.0)
    assert whole.loc["short", "tpot_ms"] == pytest.approx((admit + dec + pf(1000) + 2 * dec - first_short) / 7)
    # chunked: three iterations of (99 prompt tokens + the decode) finish the short one, then 7 x 100 + 3
    short_done = admit + 3 * (dec + pf(99))
    assert chunked.loc["short", "tpot_ms"] == pytest.approx((short_done - first_short) / 7)
    assert chunked.loc["long", "ttft_ms"] == pytest.approx(short_done + 7 * pf(100) + pf(3) - 20.0)
    assert chunked.loc["short", "tpot_ms"] < 0.6 * whole.loc["short", "tpot_ms"]
    for res in (whole, chunked):
        assert list(res.loc[["short", "long"], "output_tokens"]) == [8, 5]


def test_chunked_prefill_budget_is_required_and_caps_the_sequences_per_micro_batch():
    with pytest.raises(InputError, match="prefill_token_budget"):
        SimConfig(chunked_prefill=True)
    timing = LinearStageTiming([StageCosts(prefill_fixed_ms=1.0, decode_fixed_ms=1.0)])
    gear = manual_gear([2], micro_batch_size=8, max_inflight_micro_batches=1)
    w = Workload.from_requests([Request(f"r{i}", 0.0, 1, 2) for i in range(4)], name="four")
    res = simulate(w, gear, timing, SimConfig(prefill_token_budget=2, chunked_prefill=True)).requests
    # two sequences per iteration: r0, r1 prefill then decode (2 ms), then r2, r3 (4 ms)
    assert sorted(res["finish_s"] * 1e3) == pytest.approx([2.0, 2.0, 4.0, 4.0])


class _Recording(LinearStageTiming):
    """A linear timing model that records the (tokens, prompts) of every prefill it prices."""

    def __init__(self, costs):
        super().__init__(costs)
        self.prefills: list[tuple[int, int]] = []

    def prefill_ms(self, stage_index, num_tokens, num_prompts=1):
        self.prefills.append((num_tokens, num_prompts))
        return super().prefill_ms(stage_index, num_tokens, num_prompts)


@pytest.mark.parametrize("config, expected", [
    (SimConfig(decode_context_quantum_tokens=0), [(60, 3)]),  # the three prompts share one iteration
    # chunks of a 25-token budget, as the runtime scheduler cuts them: 10 + 15; r10's decode, 5 + 19; r20's decode, 11
    (SimConfig(prefill_token_budget=25, chunked_prefill=True, decode_context_quantum_tokens=0),
     [(25, 2), (24, 2), (11, 1)]),
])
def test_each_iteration_tells_the_timing_model_how_many_prompts_share_its_prefill(config, expected):
    timing = _Recording([StageCosts(prefill_fixed_ms=1.0, prefill_per_token_ms=0.1, decode_fixed_ms=1.0)])
    w = Workload.from_requests([Request(f"r{n}", 0.0, n, 2) for n in (10, 20, 30)], name="three")
    simulate(w, manual_gear([2], micro_batch_size=4, max_inflight_micro_batches=1), timing, config)
    assert timing.prefills == expected


def test_the_runtime_scheduler_cuts_the_same_chunks_as_the_simulator():
    """The same three prompts and budget through the runtime's scheduler: its micro-batches carry the
    prompt tokens and prompts the simulator priced above."""
    from flexpipe_dag.runtime.kv_blocks import BlockAllocator
    from flexpipe_dag.runtime.observations import micro_batch_counts
    from flexpipe_dag.runtime.scheduler import Request as RuntimeRequest
    from flexpipe_dag.runtime.scheduler import Scheduler

    sched = Scheduler(BlockAllocator(64, 16), 4, 1, 25, chunked_prefill=True)
    sched.add_requests([RuntimeRequest(f"r{n}", list(range(1, n + 1)), 2) for n in (10, 20, 30)])
    seen = []
    while sched.has_unfinished():
        mb = sched.schedule()
        _, prefill_seqs, prompt_tokens, _, _, _ = micro_batch_counts(mb.seqs)
        if prefill_seqs:
            seen.append((prompt_tokens, prefill_seqs))
        sched.update_from_output(mb.mb_id, [7] * len(mb.seqs))
    assert seen == [(25, 2), (24, 2), (11, 1)]
