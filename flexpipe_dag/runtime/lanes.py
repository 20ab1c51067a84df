"""Stage replicas as lanes (pure): which worker serves which micro-batch, and where its KV lives.

A gear may give a stage ``r_s`` replicas (data-parallel copies of its layers on ``r_s`` devices).
The runtime runs one worker process per replica and routes work along *lanes*: with
``L = lcm(r_0, ..., r_{n-1})`` lanes, lane ``l`` passes through replica ``l mod r_s`` of every
stage ``s``. A sequence is pinned to one lane when it is admitted (its KV cache lives in the
replicas of that lane), and every micro-batch holds sequences of one lane, so a replica sees only
its own sequences. A non-replicated stage serves every lane; a stage with two replicas serves the
even lanes on one and the odd lanes on the other, doubling that stage's throughput.

KV blocks: the scheduler's block ids are global, ``lane x blocks_per_lane + i``; replica ``k`` of
stage ``s`` serves the ``L / r_s`` lanes ``k, k + r_s, ...`` and holds ``L / r_s x blocks_per_lane``
blocks, addressing lane ``l``'s block ``i`` at ``(l // r_s) x blocks_per_lane + i``.

Ranks: the driver is rank 0; worker ``w`` (rank ``w + 1``) serves ``(stage, replica)`` in stage
order, replicas consecutive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneLayout:
    """Ranks, routes and KV geometry of a gear with ``replicas[s]`` workers for stage ``s``.

    Args:
        replicas: replicas per stage, each >= 1.
        total_blocks: KV blocks a replica may hold at most (the gear's pool size); the per-lane
            share is chosen so that the busiest replica stays within it.

    Raises:
        ValueError: an empty gear, a replica count below 1, or fewer blocks than lanes per replica.
    """

    replicas: tuple[int, ...]
    total_blocks: int

    def __post_init__(self):
        if not self.replicas or min(self.replicas) < 1:
            raise ValueError(f"replicas per stage must be >= 1, got {list(self.replicas)}")
        if self.blocks_per_lane < 1:
            raise ValueError(f"{self.total_blocks} KV blocks cannot be shared by {self.max_lanes_per_replica} lanes")

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_lanes(self) -> int:
        """``lcm`` of the replica counts."""
        return math.lcm(*self.replicas)

    @property
    def num_workers(self) -> int:
        return sum(self.replicas)

    @property
    def world_size(self) -> int:
        """Driver + workers."""
        return 1 + self.num_workers

    @property
    def max_lanes_per_replica(self) -> int:
        return self.num_lanes // min(self.replicas)

    @property
    def blocks_per_lane(self) -> int:
        return self.total_blocks // self.max_lanes_per_replica

    @property
    def num_blocks(self) -> int:
        """Blocks the scheduler accounts for: every lane's share."""
        return self.blocks_per_lane * self.num_lanes

    def rank(self, stage: int, replica: int) -> int:
        """Process-group rank of ``(stage, replica)``."""
        if not (0 <= stage < self.num_stages and 0 <= replica < self.replicas[stage]):
            raise ValueError(f"no replica {replica} of stage {stage} in {list(self.replicas)}")
        return 1 + sum(self.replicas[:stage]) + replica

    def locate(self, worker: int) -> tuple[int, int]:
        """``(stage, replica)`` of worker ``worker`` (rank ``worker + 1``)."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} outside 0..{self.num_workers - 1}")
        for stage, r in enumerate(self.replicas):
            if worker < r:
                return stage, worker
            worker -= r
        raise AssertionError("unreachable")

    def lanes_of(self, stage: int, replica: int) -> list[int]:
        """Lanes served by ``(stage, replica)``, ascending."""
        return list(range(replica, self.num_lanes, self.replicas[stage]))

    def lane_rank(self, stage: int, lane: int) -> int:
        """Rank serving ``lane`` at ``stage``; ``stage == num_stages`` means the driver (rank 0)."""
        if stage == self.num_stages:
            return 0
        return self.rank(stage, lane % self.replicas[stage])

    def upstream(self, stage: int, replica: int) -> list[int]:
        """Ranks that send to ``(stage, replica)`` (the driver for stage 0)."""
        if stage == 0:
            return [0]
        return sorted({self.lane_rank(stage - 1, lane) for lane in self.lanes_of(stage, replica)})

    def downstream(self, stage: int, replica: int) -> list[int]:
        """Ranks ``(stage, replica)`` sends to (the driver after the last stage)."""
        return sorted({self.lane_rank(stage + 1, lane) for lane in self.lanes_of(stage, replica)})

    def replica_blocks(self, stage: int) -> int:
        """KV blocks each replica of ``stage`` holds."""
        return self.num_lanes // self.replicas[stage] * self.blocks_per_lane

    def local_block(self, stage: int, block: int) -> int:
        """A global block id as the replica of ``stage`` that serves its lane addresses it."""
        lane, i = divmod(block, self.blocks_per_lane)
        return lane // self.replicas[stage] * self.blocks_per_lane + i


def gear_layout(gear, total_blocks: int) -> LaneLayout:
    """The :class:`LaneLayout` of a :class:`~flexpipe_dag.core.gear.Gear` (``replicas`` per stage)."""
    return LaneLayout(tuple(st.replicas for st in gear.stages), total_blocks)


def lane_limit_text(num_lanes: int, lane_tokens: int, replicas: Sequence[int] = ()) -> str:
    """The binding KV limit of one sequence, for a refusal: its lane's share, and which stage sets it.

    A sequence's KV stays in the lane it was admitted to, so one lane's share (``lane_tokens``) is what
    it may use, not the whole pool. The share is set by the stage with the fewest replicas: each of
    its replicas splits its pool over ``num_lanes / replicas`` lanes; it is named with the replica
    serving lane 0.

    Args:
        num_lanes: lanes of the pool (1: no stage replicas).
        lane_tokens: KV tokens one lane holds.
        replicas: replicas per stage (``lcm`` must equal ``num_lanes`` to be used); empty: not known.

    Returns:
        e.g. ``"the KV pool holds 256 tokens"`` or ``"a sequence's KV stays in one lane, and lane 0
        holds 128 tokens (stage 0, replica 0 of 1, splits its 256-token pool over 2 lanes)"``.

    Raises:
        ValueError: ``replicas`` holds a count below 1.
    """
    if replicas and min(replicas) < 1:
        raise ValueError(f"replicas per stage must be >= 1, got {list(replicas)}")
    if num_lanes <= 1:
        return f"the KV pool holds {lane_tokens} tokens"
    text = f"a sequence's KV stays in one lane, and lane 0 holds {lane_tokens} tokens"
    if replicas and math.lcm(*replicas) == num_lanes:
        stage = min(range(len(replicas)), key=lambda s: (replicas[s], s))
        per_replica = num_lanes // replicas[stage]
        if per_replica == 1:  # every stage replicated alike: the replica's pool is the lane's
            return text + f" (the pool of stage {stage}, replica 0 of {replicas[stage]})"
        return (text + f" (stage {stage}, replica 0 of {replicas[stage]}, splits its {per_replica * lane_tokens}"
                f"-token pool over {per_replica} lanes)")
    return text + f" (the pool's {num_lanes * lane_tokens} tokens split over {num_lanes} lanes)"
