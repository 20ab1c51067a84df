"""Observations of real stage steps, and the measured stage times derived from them (pure data).

A :class:`StageObservation` is one micro-batch step of one pipeline stage as the runtime saw it
(:mod:`flexpipe_dag.runtime.observations` records them; the store keeps them). From many of them
:func:`stage_time_summaries` derives the measured stage time per micro-batch by stage and kind
(prefill / decode / mixed) and :func:`link_summaries` the transfer time per link, each with its
sample count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flexpipe_dag.core.errors import InputError

KINDS: tuple[str, ...] = ("prefill", "decode", "mixed")


def kind_of(prefill_seqs: int, decode_tokens: int) -> str:
    """``prefill`` (only whole prompts), ``decode`` (only one-token steps) or ``mixed``."""
    if decode_tokens == 0:
        return "prefill"
    if prefill_seqs == 0:
        return "decode"
    return "mixed"


@dataclass(frozen=True)
class StageObservation:
    """One micro-batch step of one stage.

    Attributes:
        gear_id, stage_index, device_id: where it ran (``device_id``: the stage's first replica).
        is_first / is_last: the stage holds the embedding / the final norm + LM head.
        layer_start, layer_end: the stage's decoder layers ``[start, end)``.
        kind: ``prefill`` / ``decode`` / ``mixed`` (see :func:`kind_of`).
        num_seqs: sequences in the micro-batch; ``prefill_seqs`` of them prefill whole prompts of
            ``prompt_tokens`` tokens in total, the other ``decode_tokens`` decode one token each.
        kv_context_tokens: KV tokens the attention read (cached + new, summed over sequences).
        attended_pairs: query-key pairs the attention scored.
        wall_ms: the step's compute time on the stage (forward, plus sampling on the last stage), ms.
        send_ms: time handing the activations to the next stage (sender side), ms; ``None`` on the last stage.
        send_bytes: bytes of those activations; ``dst_device_id``: the next stage's device.
        mb_id: the micro-batch id; ``t_s``: end of the step, seconds since the run's first step.
    """

    gear_id: str
    stage_index: int
    device_id: str
    is_first: bool
    is_last: bool
    layer_start: int
    layer_end: int
    kind: str
    num_seqs: int
    prefill_seqs: int
    prompt_tokens: int
    decode_tokens: int
    kv_context_tokens: int
    attended_pairs: int
    wall_ms: float
    send_ms: float | None = None
    send_bytes: int = 0
    dst_device_id: str | None = None
    mb_id: int = -1
    t_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError("observation", "kind", f"expected one of {KINDS}, got {self.kind!r}")
        if self.layer_end <= self.layer_start:
            raise InputError("observation", "layer_end", f"expected > layer_start {self.layer_start}, got {self.layer_end}")
        if not (self.wall_ms > 0 and np.isfinite(self.wall_ms)):
            raise InputError("observation", "wall_ms", f"expected a positive time, got {self.wall_ms}")
        if self.num_seqs < 1 or self.prefill_seqs + self.decode_tokens != self.num_seqs:
            raise InputError("observation", "num_seqs",
                             f"expected prefill_seqs + decode_tokens = num_seqs >= 1, got {self.prefill_seqs} + "
                             f"{self.decode_tokens} vs {self.num_seqs}")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_tokens(self) -> int:
        """New tokens the stage processed (prompt tokens + one per decode)."""
        return self.prompt_tokens + self.decode_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageObservation:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class StageTimeSummary:
    """Measured stage time per micro-batch of one (gear, stage, kind): sample count and quantiles (ms).

    ``mean_*`` describe the typical step of the group (sequences, tokens, context) so a cost model
    can be asked for the same step.
    """

    gear_id: str
    stage_index: int
    device_id: str
    kind: str
    count: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    mean_seqs: float
    mean_tokens: float
    mean_kv_context_tokens: float
    num_layers: int


@dataclass(frozen=True)
class LinkSummary:
    """Measured hand-off time over one link (sender side), with count and the mean message size."""

    src_device_id: str
    dst_device_id: str
    count: int
    median_ms: float
    mean_ms: float
    mean_bytes: float
    effective_gbps: float = field(default=float("nan"))  # sum(bytes) / sum(time)


def stage_time_summaries(observations: Iterable[StageObservation]) -> list[StageTimeSummary]:
    """Group by (gear, stage, device, layer count, kind): measured stage time per micro-batch."""
    groups: dict[tuple[str, int, str, int, str], list[StageObservation]] = defaultdict(list)  # gear, stage, device, layers, kind
    for o in observations:
        groups[(o.gear_id, o.stage_index, o.device_id, o.num_layers, o.kind)].append(o)
    out = []
    for (gear_id, s, dev, layers, kind), obs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], KINDS.index(kv[0][4]))):
        ms = np.array([o.wall_ms for o in obs])
        out.append(StageTimeSummary(
            gear_id, s, dev, kind, len(obs), float(np.median(ms)), float(np.quantile(ms, 0.1)),
            float(np.quantile(ms, 0.9)), float(ms.mean()), float(np.mean([o.num_seqs for o in obs])),
            float(np.mean([o.num_tokens for o in obs])), float(np.mean([o.kv_context_tokens for o in obs])), layers))
    return out


def link_summaries(observations: Iterable[StageObservation]) -> list[LinkSummary]:
    """Per directed link: hand-off time of the activations sent over it (observations with ``send_ms``)."""
    groups: dict[tuple[str, str], list[StageObservation]] = defaultdict(list)
    for o in observations:
        if o.send_ms is not None and o.dst_device_id is not None:
            groups[(o.device_id, o.dst_device_id)].append(o)
    out = []
    for (src, dst), obs in sorted(groups.items()):
        ms = np.array([o.send_ms for o in obs])
        nbytes = np.array([o.send_bytes for o in obs], dtype=float)
        eff = float(nbytes.sum() / (ms.sum() / 1e3) / 1e9) if ms.sum() > 0 else float("nan")
        out.append(LinkSummary(src, dst, len(obs), float(np.median(ms)), float(ms.mean()), float(nbytes.mean()), eff))
    return out
