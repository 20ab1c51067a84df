"""Can the new gear be resident next to the old one? Picks the shift mode (pure; plain data).

A shadow warm-up keeps both gears in memory. Per memory pool (a device with a known capacity, or
this host's memory shared by every device it does not list), the bytes needed are the old gear's
weights + KV pool on that pool, plus the new gear's weights, plus its KV pool. The design's seed
(``DESIGN.md``: "if memory is short, warm up weights only and grow the KV pool after the switch";
"keep 10-15 % of device memory in reserve") gives three modes:

* ``shadow`` - both gears fit with the new gear's full KV pool;
* ``degraded`` - the new gear's weights fit next to the old gear with a smaller KV pool of
  ``warm_kv_tokens`` (>= ``min_kv_tokens``); the pool is grown to ``full_kv_tokens`` after the
  switch, once the old gear is released;
* ``cold`` - not even that fits: the old gear must drain and give its memory back first (in
  place on the same processes when the stage count is unchanged, else stop and restart).

KV bytes grow linearly with tokens, so a pool's token budget is
``floor(free_bytes / new_kv_bytes_full x full_kv_tokens)`` rounded down to whole KV blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

ShiftMode = Literal["shadow", "degraded", "cold"]
#: Pool name of every device without its own capacity: they share this host's memory.
HOST_POOL = "host"


@dataclass(frozen=True)
class ResidencyPlan:
    """The chosen mode and the KV pool the new gear warms up with.

    ``pools``: per memory pool, ``capacity_bytes`` (after the reserve), ``old_bytes``,
    ``new_param_bytes``, ``new_kv_bytes`` (full pool) and ``kv_tokens_fit``.
    """

    mode: ShiftMode
    warm_kv_tokens: int
    full_kv_tokens: int
    reason: str
    pools: list[dict] = field(default_factory=list)


def plan_residency(old_rows: Sequence[Mapping], new_rows: Sequence[Mapping], device_capacity_bytes: Mapping[str, int],
                   host_capacity_bytes: int, *, full_kv_tokens: int, block_size_tokens: int, min_kv_tokens: int,
                   reserve_fraction: float = 0.10) -> ResidencyPlan:
    """Choose ``shadow`` / ``degraded`` / ``cold`` for warming ``new`` while ``old`` still serves.

    Args:
        old_rows, new_rows: per stage ``{"device_ids", "param_bytes", "kv_pool_bytes"}`` (the rows of
            :func:`flexpipe_dag.runtime.pipeline.stage_memory_bytes`); the new rows at its full pool.
        device_capacity_bytes: memory of the devices that have their own (others share the host).
        host_capacity_bytes: this host's memory, shared by every unlisted device.
        full_kv_tokens: the new gear's full KV pool, tokens (what ``new_rows`` were computed with).
        block_size_tokens: KV block size; the warm pool is a whole number of blocks.
        min_kv_tokens: smallest useful warm pool (below it the mode is ``cold``).
        reserve_fraction: memory kept free on every pool (design seed 10-15 %).

    Raises:
        ValueError: ``reserve_fraction`` outside ``[0, 1)`` or non-positive token figures.
    """
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction: expected [0, 1), got {reserve_fraction}")
    if full_kv_tokens < 1 or block_size_tokens < 1 or min_kv_tokens < 1:
        raise ValueError("full_kv_tokens, block_size_tokens and min_kv_tokens must be >= 1")

    def pool(dev: str) -> str:
        return dev if dev in device_capacity_bytes else HOST_POOL

    acc: dict[str, dict] = {}

    def charge(rows: Sequence[Mapping], key: str, value_key: str) -> None:
        for row in rows:
            for dev in row["device_ids"]:
                p = acc.setdefault(pool(dev), {"old_bytes": 0, "new_param_bytes": 0, "new_kv_bytes": 0})
                p[key] += int(row[value_key])

    charge(old_rows, "old_bytes", "param_bytes")
    charge(old_rows, "old_bytes", "kv_pool_bytes")
    charge(new_rows, "new_param_bytes", "param_bytes")
    charge(new_rows, "new_kv_bytes", "kv_pool_bytes")
    fit = math.inf
    pools = []
    for name, p in sorted(acc.items()):
        cap = device_capacity_bytes.get(name, host_capacity_bytes) if name != HOST_POOL else host_capacity_bytes
        usable = int(cap * (1 - reserve_fraction))
        free = usable - p["old_bytes"] - p["new_param_bytes"]
        if p["new_kv_bytes"] > 0:
            tokens = math.floor(max(0, free) / p["new_kv_bytes"] * full_kv_tokens) if free > 0 else 0
        else:
            tokens = math.inf if free >= 0 else 0
        fit = min(fit, tokens)
        pools.append({"pool": name, "capacity_bytes": usable, **p,
                      "kv_tokens_fit": None if tokens == math.inf else int(tokens)})
    if fit >= full_kv_tokens:
        return ResidencyPlan("shadow", full_kv_tokens, full_kv_tokens,
                             "both gears fit with the new gear's full KV pool", pools)
    warm = int(fit) // block_size_tokens * block_size_tokens
    tight = min(pools, key=lambda p: p["kv_tokens_fit"] if p["kv_tokens_fit"] is not None else math.inf)["pool"]
    if warm >= min_kv_tokens:
        return ResidencyPlan("degraded", warm, full_kv_tokens,
                             f"memory short on {tight!r}: new gear warms with {warm} of {full_kv_tokens} KV tokens, "
                             "pool grown after the switch", pools)
    return ResidencyPlan("cold", 0, full_kv_tokens,
                         f"memory short on {tight!r}: the new gear's weights and a {min_kv_tokens}-token KV pool do "
                         f"not fit next to the old gear (room for {warm} tokens)", pools)
