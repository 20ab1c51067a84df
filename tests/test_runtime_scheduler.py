"""Scheduler unit tests with hand-built outputs (no model, no torch)."""

from __future__ import annotations

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE, PRIORITY_ONLINE, Request, Scheduler


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(num_blocks=64, bs=4, mbs=2, inflight=2, budget=2048):
    clock = Clock()
    return Scheduler(BlockAllocator(num_blocks, bs), mbs, inflight, budget, clock=clock), clock


def req(rid, n_prompt=3, max_new=3, prio=PRIORITY_ONLINE, eos=(99,)):
    return Request(rid, list(range(1, n_prompt + 1)), max_new, priority=prio, eos_token_ids=eos)


def test_prefill_then_decode_feeds_last_token_and_stops_on_length():
    s, clock = make(mbs=1, inflight=1)
    s.add_request(req("a", n_prompt=5, max_new=3))
    mb = s.schedule()
    assert [q.token_ids for q in mb.seqs] == [[1, 2, 3, 4, 5]] and mb.seqs[0].start_pos == 0
    assert s.schedule() is None  # in-flight limit 1
    clock.t = 1.0
    assert s.update_from_output(mb.mb_id, [7]) == []
    mb = s.schedule()
    assert mb.seqs[0].token_ids == [7] and mb.seqs[0].start_pos == 5 and mb.seqs[0].output_index == 1
    s.update_from_output(mb.mb_id, [8])
    mb = s.schedule()
    clock.t = 3.0
    (out,) = s.update_from_output(mb.mb_id, [9])
    assert out.output_token_ids == [7, 8, 9] and out.finish_reason == "length"
    assert out.ttft_s == 1.0 and out.tpot_s == 1.0
    assert not s.has_unfinished() and s.allocator.num_used_blocks == 0


def test_eos_stops_and_frees_blocks():
    s, _ = make()
    s.add_request(req("a", max_new=10))
    mb = s.schedule()
    (out,) = s.update_from_output(mb.mb_id, [99])
    assert out.finish_reason == "stop" and out.output_token_ids == [99]
    assert s.allocator.num_used_blocks == 0 and s.allocator.num_reserved_blocks == 0


def test_abort_ends_queued_running_and_in_flight_requests_and_frees_their_blocks():
    s, clock = make(num_blocks=8, bs=4, mbs=1, inflight=2)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, n_prompt=4, max_new=8))  # 11 KV tokens = 3 blocks each: a and b fit, c waits
    first = s.schedule()  # a's prefill
    second = s.schedule()  # b's prefill
    assert [q.seq_id for q in first.seqs + second.seqs] == [0, 1] and s.num_waiting == 1
    s.update_from_output(first.mb_id, [7])  # a has one token and is not in flight; b is
    clock.t = 2.0
    ended = s.abort(["a", "b", "c", "never-submitted"])
    # a (running, idle) and c (queued) end now; b ends when its micro-batch comes back
    assert [(o.request_id, o.finish_reason, o.output_token_ids) for o in ended] == [("c", "abort", []),
                                                                                   ("a", "abort", [7])]
    assert ended[0].first_token_s == 2.0 and s.num_waiting == 0 and s.num_running == 1
    assert s.allocator.num_reserved_blocks == 3  # b's blocks: the stages still write them
    assert s.schedule() is None  # an aborted sequence is never scheduled again
    tokens = []
    (out,) = s.update_from_output(second.mb_id, [9], on_token=lambda *t: tokens.append(t))
    assert (out.request_id, out.finish_reason, out.output_token_ids, tokens) == ("b", "abort", [], [])
    assert not s.has_unfinished() and s.allocator.num_used_blocks == 0 and s.allocator.num_reserved_blocks == 0
    assert s.abort(["a", "b"]) == []  # already ended: ignored
    s.add_request(req("a", n_prompt=4, max_new=2))  # its id is free again
    mb = s.schedule()
    s.update_from_output(mb.mb_id, [5])
    (out,) = s.update_from_output(s.schedule().mb_id, [6])
    assert out.finish_reason == "length" and out.output_token_ids == [5, 6]


def test_several_micro_batches_in_flight_hold_disjoint_sequences():
    s, _ = make(mbs=2, inflight=3)
    for r in "abcdef":
        s.add_request(req(r))
    mbs = [s.schedule() for _ in range(3)]
    assert s.schedule() is None
    ids = [q.seq_id for mb in mbs for q in mb.seqs]
    assert len(ids) == 6 == len(set(ids))
    s.update_from_output(mbs[1].mb_id, [5, 5])
    nxt = s.schedule()
    assert {q.seq_id for q in nxt.seqs} == {q.seq_id for q in mbs[1].seqs}  # only those are free to decode


def test_online_admitted_before_offline():
    s, _ = make(mbs=1, inflight=1)
    s.add_request(req("offline", prio=PRIORITY_OFFLINE))
    s.add_request(req("online", prio=PRIORITY_ONLINE))
    mb = s.schedule()
    assert mb.seqs[0].seq_id == 1  # the online request, though it arrived second


def test_admission_waits_for_kv_and_refuses_what_never_fits():
    s, _ = make(num_blocks=4, bs=4, mbs=4, inflight=1)  # 16 tokens
    with pytest.raises(KVCapacityError):
        s.add_request(req("huge", n_prompt=10, max_new=10))
    s.add_request(req("a", n_prompt=5, max_new=3))  # 8 tokens -> 2 blocks
    s.add_request(req("b", n_prompt=5, max_new=3))
    s.add_request(req("c", n_prompt=5, max_new=3))  # must wait
    mb = s.schedule()
    assert len(mb.seqs) == 2 and s.num_waiting == 1
    s.update_from_output(mb.mb_id, [99, 5])  # a stops
    mb = s.schedule()
    assert len(mb.seqs) == 2 and s.num_waiting == 0  # c admitted once a freed its blocks


def test_token_budget_splits_prefills():
    s, _ = make(mbs=4, inflight=4, budget=8)
    for r in "abc":
        s.add_request(req(r, n_prompt=5))
    first = s.schedule()
    assert len(first.seqs) == 1
    assert len(s.schedule().seqs) == 1


def test_chunked_prefill_fills_the_budget_after_decodes_and_samples_only_from_the_last_chunk():
    clock = Clock()
    s = Scheduler(BlockAllocator(64, 4), 4, 1, 6, clock=clock, chunked_prefill=True)
    s.add_request(req("a", n_prompt=3, max_new=4))
    mb = s.schedule()
    assert [q.token_ids for q in mb.seqs] == [[1, 2, 3]]
    s.update_from_output(mb.mb_id, [7])
    s.add_request(req("b", n_prompt=13, max_new=2))
    s.add_request(req("c", n_prompt=2, max_new=2))
    got = []  # (request, index, token) as streamed
    chunks = []
    for tok in (8, 9, 10):
        mb = s.schedule()
        chunks.append([(q.seq_id, q.start_pos, len(q.token_ids)) for q in mb.seqs])
        assert mb.num_tokens <= 6
        clock.t += 1.0
        s.update_from_output(mb.mb_id, [tok] * len(mb.seqs), on_token=lambda r, i, t: got.append((r, i, t)))
    # the decode of a comes first; b's prompt fills the rest of each budget (5, 5, then its last 3),
    # c waits behind b (a part-done prompt goes before a new one) and starts with what is left
    assert chunks == [[(0, 3, 1), (1, 0, 5)], [(0, 4, 1), (1, 5, 5)], [(0, 5, 1), (1, 10, 3), (2, 0, 2)]]
    assert got == [("a", 1, 8), ("a", 2, 9), ("a", 3, 10), ("b", 0, 10), ("c", 0, 10)]  # b's first token: its last chunk's
    assert s.allocator.num_tokens(1) == 13


def test_chunked_prefill_budget_below_the_micro_batch_size_caps_its_sequences():
    with pytest.raises(InputError, match="max_tokens_per_micro_batch"):
        Scheduler(BlockAllocator(64, 4), 4, 1, 0, chunked_prefill=True)
    s = Scheduler(BlockAllocator(64, 4), 4, 1, 2, chunked_prefill=True)
    s.add_requests([req(x, n_prompt=1, max_new=3) for x in "abc"])
    mb = s.schedule()
    assert [q.token_ids for q in mb.seqs] == [[1], [1]]  # two of the three one-token prompts
    s.update_from_output(mb.mb_id, [5, 6])
    assert [q.token_ids for q in s.schedule().seqs] == [[5], [6]]  # the two decodes fill the budget


def test_output_count_mismatch_raises():
    s, _ = make()
    s.add_request(req("a"))
    mb = s.schedule()
    with pytest.raises(ValueError):
        s.update_from_output(mb.mb_id, [1, 2])


def test_duplicate_request_id_is_refused():
    s, _ = make()
    s.add_request(req("a"))
    with pytest.raises(ValueError):
        s.add_request(req("a"))


def test_live_metrics_window():
    from flexpipe_dag.runtime.live_metrics import LiveMetrics, StageCounters

    m = LiveMetrics("g1", start_s=100.0)
    m.record_arrivals(4)
    m.record_tokens(10)
    m.record_finished(0.1, 0.02, 0.5)
    m.record_finished(0.3, None, 0.3)
    s = m.sample(102.0, queue_length=3, running=2, kv_blocks_used=5, kv_blocks_total=20, micro_batches_sent=7,
                 stages=[StageCounters(6, 1.5), StageCounters(4, 0.5)])
    assert (s.t_s, s.rps, s.tokens_per_s, s.completed, s.source) == (2.0, 2.0, 5.0, 2, "live")
    assert s.kv_used_fraction == 0.25 and s.tpot_p50_ms == pytest.approx(20.0)
    assert [st.queue_length for st in s.stages] == [1, 2] and s.stages[0].busy_fraction == 0.75
    s2 = m.sample(104.0, queue_length=0, running=0, kv_blocks_used=0, kv_blocks_total=20, micro_batches_sent=7,
                  stages=[StageCounters(7, 2.5), StageCounters(7, 2.5)])
    assert s2.ttft_p50_ms is None and s2.stages[1].busy_fraction == 1.0 and s2.rps == 0.0
