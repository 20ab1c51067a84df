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
    engine.router = SimpleNamespace(active=SimpleNamespace(runtime=runtime))
    assert engine.max_model_len == want
