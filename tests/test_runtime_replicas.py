"""Stage replicas in the runtime: lanes (pure), the lane-aware KV allocator and scheduler, and real
pipelines with replicated stages (exact greedy output, reconfiguration, a killed replica named)."""

from __future__ import annotations

import signal

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.kv_blocks import BlockAllocator
from flexpipe_dag.runtime.lanes import LaneLayout
from flexpipe_dag.runtime.scheduler import Request, Scheduler


def test_lane_layout_routes_and_kv_split():
    lay = LaneLayout((1, 2, 3), total_blocks=120)
    assert lay.num_lanes == 6 and lay.num_workers == 6 and lay.world_size == 7
    assert [lay.locate(w) for w in range(6)] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert [lay.rank(*lay.locate(w)) for w in range(6)] == [1, 2, 3, 4, 5, 6]
    assert lay.lanes_of(1, 1) == [1, 3, 5] and lay.lanes_of(2, 0) == [0, 3]
    assert lay.upstream(0, 0) == [0] and lay.downstream(0, 0) == [2, 3]
    assert lay.upstream(2, 0) == [2, 3] and lay.downstream(2, 1) == [0]
    # the busiest replica (stage 0 serves all 6 lanes) stays within the gear's pool
    assert lay.blocks_per_lane == 20 and lay.replica_blocks(0) == 120 and lay.replica_blocks(2) == 40
    # lane 4's block 7 (global 87): stage 1 replica 0 holds lanes 0, 2, 4 -> third slot
    assert lay.local_block(1, 4 * 20 + 7) == 2 * 20 + 7 and lay.local_block(0, 87) == 87
    with pytest.raises(ValueError):
        LaneLayout((1, 0), 10)
    with pytest.raises(ValueError):
        LaneLayout((1, 4), 3)  # 4 lanes cannot share 3 blocks


def test_allocator_keeps_each_lane_in_its_block_range():
    a = BlockAllocator(8, 4, num_lanes=2)
    a.reserve(1, 12, lane=1)
    assert a.append(1, 12) == [4, 5, 6]
    assert not a.can_reserve(8, lane=1) and a.can_reserve(16, lane=0)
    a.reserve(2, 16, lane=0)
    assert a.append(2, 5) == [0, 1] and a.num_used_blocks == 5
    a.free(1)
    assert a.can_reserve(16, lane=1) and a.num_used_blocks == 2
    assert not a.fits_ever(17)  # larger than one lane


def test_scheduler_pins_sequences_to_lanes_and_balances_them():
    sched = Scheduler(BlockAllocator(64, 16, num_lanes=2), micro_batch_size=2, max_inflight_micro_batches=1)
    for i in range(4):
        sched.add_request(Request(f"r{i}", [1, 2, 3], 4))
    first, second = sched.schedule(), sched.schedule()
    assert sched.schedule() is None  # one in flight per lane
    assert {first.lane, second.lane} == {0, 1}
    lanes = {s.seq_id: mb.lane for mb in (first, second) for s in mb.seqs}
    assert sorted(lanes.values()) == [0, 0, 1, 1]  # two sequences per lane
    assert all(b // 32 == lanes[s.seq_id] for mb in (first, second) for s in mb.seqs for b in s.block_table)
    sched.update_from_output(first.mb_id, [7] * len(first.seqs))
    again = sched.schedule()
    assert again.lane == first.lane and {s.seq_id for s in again.seqs} == {s.seq_id for s in first.seqs}


def test_cli_stage_replicas_are_checked(capsys):
    from flexpipe_dag.cli import main
    from flexpipe_dag.core.gear_builders import even_gear

    g = even_gear(30, 2, "m", 8, None, 4096, [1, 2])
    assert [st.device_ids for st in g.stages] == [["worker0"], ["worker1.0", "worker1.1"]]
    for bad, why in (("1,x", "comma-separated"), ("1", "2 counts"), ("1,0", "2 counts")):
        assert main(["run", "--stages", "2", "--stage-replicas", bad, "--trace", "azure-conv"]) == 2
        assert why in capsys.readouterr().err


torch = pytest.importorskip("torch")

from flexpipe_dag.runtime.pipeline import PipelineRuntime, StageFailedError  # noqa: E402
from tests.test_runtime_helpers import checkpoint, gear, hf_reference, requests, signal_after_first_result  # noqa: E402


def _gear(ranges, replicas, **kw):
    return gear(ranges, device_ids=[[f"cpu{s}-{k}" for k in range(r)] for s, r in enumerate(replicas)], **kw)


def _check(outs, reqs):
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}


@pytest.mark.slow
def test_replicated_middle_stage_matches_hf_and_reconfigures_in_place():
    ranges = [(0, 10), (10, 20), (20, 30)]
    with PipelineRuntime(_gear(ranges, [1, 2, 1], micro_batch_size=4), checkpoint()) as rt:
        info = [(i["stage_index"], i["replica_index"], i["layer_start"]) for i in rt.stage_info]
        assert info == [(0, 0, 0), (1, 0, 10), (1, 1, 10), (2, 0, 20)] and len(set(rt.stage_pids())) == 4
        reqs = requests(8, prefix="rep-")
        _check(rt.generate(reqs), reqs)
        samples = rt.metric_samples
        pids = rt.stage_pids()
        moved = rt.reconfigure(_gear([(0, 4), (4, 25), (25, 30)], [1, 2, 1], micro_batch_size=1, gear_id="rep2"))
        assert [(i["stage_index"], i["replica_index"], i["layer_end"]) for i in moved] == \
            [(0, 0, 4), (1, 0, 25), (1, 1, 25), (2, 0, 30)] and rt.stage_pids() == pids
        reqs = requests(4, prefix="rep2-")
        _check(rt.generate(reqs), reqs)
        with pytest.raises(InputError, match="replicas"):
            rt.reconfigure(_gear(ranges, [1, 1, 1]))
    assert all(len(s.stages) == 3 for s in samples)  # per stage, replicas folded in


@pytest.mark.slow
def test_replicated_first_and_last_stages_match_hf():
    with PipelineRuntime(_gear([(0, 15), (15, 30)], [2, 3], micro_batch_size=2), checkpoint()) as rt:
        reqs = requests(8, prefix="rep23-")
        _check(rt.generate(reqs), reqs)


@pytest.mark.slow
def test_killed_replica_is_named_with_its_stage():
    with PipelineRuntime(_gear([(0, 15), (15, 30)], [1, 2], micro_batch_size=2), checkpoint()) as rt:
        reqs = requests(8, prefix="repkill-")
        for r in reqs:
            r.max_new_tokens, r.eos_token_ids = 40, ()
        kill_replica = signal_after_first_result(rt.stage_pids()[2], signal.SIGKILL, [])  # stage 1, replica 1
        with pytest.raises(StageFailedError) as err:
            rt.generate(reqs, on_result=kill_replica)
    assert (err.value.stage, err.value.replica) == (1, 1) and "stage 1 replica 1" in str(err.value)
    assert len(err.value.finished) >= 1


@pytest.mark.slow
def test_cli_names_refused_requests_and_exits_1(tmp_path, capsys):
    """A request larger than a lane's KV share is refused with its reason, and the run says so."""
    from flexpipe_dag.cli import main

    code = main(["run", "--stages", "2", "--stage-replicas", "1,2", "--trace", "azure-conv", "--num-requests", "2",
                 "--max-prompt-tokens", "64", "--max-new-tokens", "4", "--kv-capacity-tokens", "64",
                 "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 1 and "refused trace-00000:" in err and "KV" in err, err[-2000:]


def test_too_small_a_kv_pool_for_the_lanes_names_the_fix():
    from flexpipe_dag.core.errors import InfeasibleError

    with pytest.raises(InfeasibleError, match=r"--kv-capacity-tokens\) to >= 32"):
        PipelineRuntime(_gear([(0, 15), (15, 30)], [1, 2], kv_capacity_tokens=16), checkpoint())


def test_an_any_source_receive_reads_the_sender_without_the_deprecated_source_rank():
    """Replicated stages receive from any rank; torch 2.13 warns on every ``Work.source_rank`` call (it
    printed into ``run --stage-replicas``' progress bar), so the private ``_source_rank`` that ``dist.recv``
    itself reads is used where there is one, the public one on older releases."""
    from flexpipe_dag.runtime.transport import _sender_rank

    class Work:
        def _source_rank(self):
            return 3

        def source_rank(self):
            raise AssertionError("the deprecated source_rank was called")

    class OldWork:
        def source_rank(self):
            return 2

    assert _sender_rank(Work()) == 3 and _sender_rank(OldWork()) == 2
