"""Pure parts of the shift executor: the request ledger (exactly-once) and the residency plan."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.shift.ledger import INTERNAL_PREFIX, RequestLedger
from flexpipe_dag.shift.residency import plan_residency
from tests.support import join_or_fail


@dataclass
class Req:
    request_id: str


@dataclass
class Out:
    request_id: str
    tokens: tuple = ()


def test_each_output_is_delivered_once_whichever_lane_finishes_first():
    got = []
    led = RequestLedger(on_result=got.append)
    for i in range(3):
        led.accept(Req(str(i)), "old")
    led.assign("1", "new")  # moved after the old lane failed
    assert led.moved == 1 and [e.request.request_id for e in led.open_on("new")] == ["1"]
    assert led.finish(Out("1"), "old")  # the old lane finished it after all: first wins
    assert not led.finish(Out("1"), "new")
    assert led.finish(Out("0"), "old") and led.finish(Out("2"), "old")
    assert [o.request_id for o in got] == ["1", "0", "2"]
    assert led.duplicates_dropped == 1 and led.num_open() == 0
    assert led.counts()["finished"] == 3 and led.num_finished_by("old") == 3


def test_duplicate_and_reserved_ids_are_refused():
    led = RequestLedger()
    led.accept(Req("a"), "x")
    with pytest.raises(InputError, match="already submitted"):
        led.accept(Req("a"), "x")
    with pytest.raises(InputError, match="reserved"):
        led.accept(Req(INTERNAL_PREFIX + "1"), "x")


def test_held_requests_and_refusals():
    refused = []
    led = RequestLedger(on_refused=lambda rid, why: refused.append((rid, why)))
    led.accept(Req("h"), None)
    assert [e.request.request_id for e in led.open_on(None)] == ["h"] and led.num_open() == 1
    led.assign("h", "lane")
    assert led.open_on(None) == [] and led.num_open("lane") == 1
    assert led.refuse("h", "too long") and not led.refuse("h", "again")
    assert refused == [("h", "too long")] and led.num_open() == 0


def test_probes_are_not_delivered_to_the_caller_and_fail_with_their_lane():
    got = []
    led = RequestLedger(on_result=got.append)
    ok = led.accept(Req(INTERNAL_PREFIX + "1"), "new", internal=True).probe
    bad = led.accept(Req(INTERNAL_PREFIX + "2"), "new", internal=True).probe
    led.finish(Out(INTERNAL_PREFIX + "1", (5,)), "new")
    assert ok.result(0.1).tokens == (5,) and got == []
    assert led.fail_internal("new", "stage 1 failed") == 1
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        bad.result(0.1)
    with pytest.raises(TimeoutError):
        led.accept(Req(INTERNAL_PREFIX + "3"), "new", internal=True).probe.result(0.01)
    assert led.num_open() == 0  # probes never count as caller requests


def test_concurrent_finishes_deliver_exactly_once():
    got = []
    led = RequestLedger(on_result=got.append)
    n = 200
    for i in range(n):
        led.accept(Req(str(i)), "a")

    def finisher(lane):
        for i in range(n):
            led.finish(Out(str(i)), lane)

    threads = [threading.Thread(target=finisher, args=(lane,)) for lane in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        join_or_fail(t, 60)
    assert sorted(o.request_id for o in got) == sorted(str(i) for i in range(n))
    assert led.duplicates_dropped == 2 * n


GIB = 2**30


def _rows(*stages):
    return [{"device_ids": devs, "param_bytes": p, "kv_pool_bytes": kv} for devs, p, kv in stages]


@dataclass
class Prompted:
    request_id: str
    prompt_token_ids: list
    max_new_tokens: int = 4


def test_ended_entries_release_their_request_and_only_the_newest_are_remembered():
    got = []
    led = RequestLedger(on_result=got.append, ended_kept=3)
    for i in range(6):
        led.accept(Prompted(f"r{i}", list(range(1000))), "lane")
    led.accept(Prompted("probe", [1]), "lane", internal=True)
    led.assign("r5", "other")  # moved: still open, its request kept whole
    for i in range(4):
        assert led.finish(Out(f"r{i}"), "lane")
    led.cancel("r4")
    # r0 and r1 are forgotten (3 newer ended: r2, r3, r4); their late duplicates are dropped unseen
    with pytest.raises(KeyError):
        led.get("r0")
    assert not led.finish(Out("r0"), "other") and led.duplicates_dropped == 0
    assert not led.finish(Out("r3"), "other") and led.duplicates_dropped == 1  # remembered: counted
    assert led.get("r3").request.request_id == "r3" and not hasattr(led.get("r3").request, "prompt_token_ids")
    assert led.get("r5").request.prompt_token_ids == list(range(1000))
    assert led.open_tokens("other") == 1004 and led.open_tokens("lane") == 5  # the probe's 1 + 4
    # the counts are running totals: forgotten entries still count, probes never do
    assert led.counts() == {"held": 0, "pending": 1, "finished": 4, "refused": 0, "failed": 0, "cancelled": 1,
                            "moved": 1, "duplicates_dropped": 1}
    led.accept(Prompted("r0", [1]), "lane")  # a forgotten id may come again
    assert led.counts()["pending"] == 2
    assert led.fail_internal("lane", "gone") == 1 and led.probe("probe").done
    assert [o.request_id for o in got] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ValueError, match="at least 1"):
        RequestLedger(ended_kept=0)


def test_residency_modes():
    old = _rows((["d0"], 4 * GIB, 2 * GIB))
    new = _rows((["d0"], 2 * GIB, 1 * GIB), (["d1"], 2 * GIB, 1 * GIB))
    kw = dict(full_kv_tokens=1024, block_size_tokens=16, min_kv_tokens=128, reserve_fraction=0.0)
    assert plan_residency(old, new, {"d0": 10 * GIB, "d1": 10 * GIB}, 0, **kw).mode == "shadow"
    # d0 holds old 6 GiB + new weights 2 GiB, leaving 0.5 GiB of the 1 GiB pool: half the tokens
    plan = plan_residency(old, new, {"d0": int(8.5 * GIB), "d1": 10 * GIB}, 0, **kw)
    assert plan.mode == "degraded" and plan.warm_kv_tokens == 512 and "'d0'" in plan.reason
    assert plan_residency(old, new, {"d0": int(8.05 * GIB), "d1": 10 * GIB}, 0, **kw).mode == "cold"
    # unlisted devices share the host pool; the reserve counts
    assert plan_residency(old, new, {}, int(11.5 * GIB), **kw).mode == "degraded"
    assert plan_residency(old, new, {}, 12 * GIB, **kw).mode == "shadow"
    assert plan_residency(old, new, {}, 12 * GIB, **{**kw, "reserve_fraction": 0.05}).mode == "degraded"
    with pytest.raises(ValueError, match="reserve_fraction"):
        plan_residency(old, new, {}, GIB, **{**kw, "reserve_fraction": 1.0})
