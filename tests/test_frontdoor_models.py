"""``/v1/models``' ``max_model_len`` is the longest request the live pipeline serves: its context, or what
one lane of its KV pool holds when that is less (load tools size requests from it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.runtime.pipeline import PipelineRuntime
from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics
from tests.test_runtime_helpers import checkpoint


@pytest.mark.parametrize(("kv_tokens", "replicas", "want"), [(16, (1, 1), 17), (4096, (1, 1), 4097),
                                                              (4096, (2, 1), 2049), (65536, (1, 1), 8192)])
def test_max_model_len_is_the_context_or_one_lane_of_the_kv_pool(kv_tokens, replicas, want):
    ckpt = checkpoint()
    gear = even_gear(ckpt.num_layers, 2, ckpt.name, 4, None, kv_tokens)
    if replicas != (1, 1):
        gear = gear.model_copy(update={"stages": [s.model_copy(update={"device_ids": [f"cpu{s.stage_index}-{k}"
                                                                                      for k in range(r)]})
                                                  for s, r in zip(gear.stages, replicas)]})
    runtime = PipelineRuntime(gear, ckpt)  # not started: the figure comes from the gear and the checkpoint
    assert ckpt.max_context_tokens == 8192
    assert runtime.longest_request_tokens == want
    engine = FrontDoorEngine(None, (), ckpt.max_context_tokens, FrontDoorMetrics())
    assert engine.max_model_len == 8192  # no live pipeline yet: the context
    lane = SimpleNamespace(runtime=runtime, refusal_policy="final", gear=gear)
    engine.router = SimpleNamespace(active=lane, instances=[lane])
    assert engine.max_model_len == want


def test_several_instances_serve_the_longest_one_of_them_holds_with_the_same_defaults():
    """With several instances the door checks a request against the most one of them holds (the router sends
    it to that one), as it does for one: before, it checked against the context, so a request no instance
    held lost ``context_length_exceeded`` and a default ``max_tokens`` was not cut to what is left."""
    from flexpipe_dag.serving.frontdoor.protocol import APIError

    def lane(longest: int, policy: str = "final"):
        return SimpleNamespace(runtime=SimpleNamespace(longest_request_tokens=longest), refusal_policy=policy,
                               gear=SimpleNamespace(micro_batch_size=8))

    engine = FrontDoorEngine(None, (), 8192, FrontDoorMetrics(), default_max_tokens=256)
    one = [lane(2049)]
    engine.router = SimpleNamespace(active=one[0], instances=one)
    alone = (engine.max_model_len, engine.check_context(1881, None, "messages"))
    two = [lane(2049), lane(1025)]
    engine.router = SimpleNamespace(active=two[0], instances=two)
    assert (engine.max_model_len, engine.check_context(1881, None, "messages")) == alone == (2049, 168)
    with pytest.raises(APIError) as err:
        engine.check_context(2042, 8, "prompt")
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    two[1].refusal_policy = "retry"  # a shift under way: the pipeline's own check decides
    assert engine.served_limit_tokens == 8192
