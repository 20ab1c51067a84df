"""Paged KV cache accounting (pure): fixed-size blocks, per-sequence block tables, reservations.

The scheduler owns one :class:`BlockAllocator`; every stage holds a K/V pool of the same number
of blocks (:mod:`flexpipe_dag.runtime.kv_cache`), so one block table addresses the same slots in
every stage (vLLM's design: the scheduler's KV manager decides, workers only read/write slots).

Admission reserves the worst case of a sequence (prompt + max new tokens - 1: the last sampled
token is never written; :func:`~flexpipe_dag.core.kv.kv_tokens_needed`) so a running
sequence never needs preemption; physical blocks are taken from that reservation as tokens are appended
and all of them return to the free list when the sequence finishes.
"""

from __future__ import annotations

from flexpipe_dag.core.errors import InfeasibleError


class KVCapacityError(InfeasibleError):
    """A sequence needs more KV blocks than are free (or than the pool holds at all)."""


def blocks_for_tokens(num_tokens: int, block_size_tokens: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size_tokens)``."""
    return -(-num_tokens // block_size_tokens)


class BlockAllocator:
    """Free list of ``num_blocks`` KV blocks of ``block_size_tokens`` tokens each.

    With ``num_lanes`` > 1 (stage replicas, :mod:`~flexpipe_dag.runtime.lanes`) the blocks are split
    into equal per-lane ranges (lane ``l`` owns ``[l x n / L, (l + 1) x n / L)``) and a sequence takes
    blocks only from the lane it was reserved in.

    Invariants: ``used + free == num_blocks``; a sequence's table never holds more blocks than it
    reserved; the blocks reserved but not yet used are counted in :attr:`num_reserved_blocks`.

    Raises:
        ValueError: sizes below 1, or ``num_blocks`` not a multiple of ``num_lanes``.
    """

    def __init__(self, num_blocks: int, block_size_tokens: int, num_lanes: int = 1):
        self._setup(num_blocks, block_size_tokens, num_lanes)

    def _setup(self, num_blocks: int, block_size_tokens: int, num_lanes: int) -> None:
        """(Re)build an empty pool of these sizes (checks them first)."""
        if num_blocks < 1 or block_size_tokens < 1 or num_lanes < 1:
            raise ValueError(f"num_blocks, block_size_tokens and num_lanes must be >= 1, got {num_blocks}, "
                             f"{block_size_tokens}, {num_lanes}")
        if num_blocks % num_lanes:
            raise ValueError(f"{num_blocks} KV blocks do not split evenly into {num_lanes} lanes")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.num_lanes = num_lanes
        self.blocks_per_lane = num_blocks // num_lanes
        per = self.blocks_per_lane
        # pop() hands out each lane's lowest block first
        self._free: list[list[int]] = [list(range((lane + 1) * per - 1, lane * per - 1, -1)) for lane in range(num_lanes)]
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # seq id -> blocks reserved in total
        self._lane: dict[int, int] = {}
        self._num_tokens: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size_tokens

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - sum(len(f) for f in self._free)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to admitted sequences (used ones included)."""
        return sum(self._reserved.values())

    def lane_reserved_blocks(self, lane: int) -> int:
        """Blocks promised to the sequences of ``lane``."""
        return sum(n for seq, n in self._reserved.items() if self._lane[seq] == lane)

    def can_reserve(self, num_tokens: int, lane: int = 0) -> bool:
        """Whether a new sequence of up to ``num_tokens`` tokens fits in ``lane`` next to its reservations."""
        return blocks_for_tokens(num_tokens, self.block_size_tokens) <= (self.blocks_per_lane
                                                                         - self.lane_reserved_blocks(lane))

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit in an empty lane (the whole pool with one lane)."""
        return blocks_for_tokens(num_tokens, self.block_size_tokens) <= self.blocks_per_lane

    def reserve(self, seq_id: int, num_tokens: int, lane: int = 0) -> None:
        """Reserve room for ``num_tokens`` tokens of a new sequence in ``lane``.

        Raises:
            KVCapacityError: not enough unreserved blocks in the lane.
            ValueError: ``seq_id`` already holds a reservation, or no such lane.
        """
        if seq_id in self._reserved:
            raise ValueError(f"sequence {seq_id} already has a KV reservation")
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"lane {lane} outside 0..{self.num_lanes - 1}")
        need = blocks_for_tokens(num_tokens, self.block_size_tokens)
        have = self.blocks_per_lane - self.lane_reserved_blocks(lane)
        if need > have:
            raise KVCapacityError(f"sequence {seq_id} needs {need} KV blocks ({num_tokens} tokens), {have} free "
                                  f"of {self.blocks_per_lane}" + (f" in lane {lane}" if self.num_lanes > 1 else ""))
        self._reserved[seq_id] = need
        self._lane[seq_id] = lane
        self._tables[seq_id] = []
        self._num_tokens[seq_id] = 0

    def append(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Grow a sequence by ``num_new_tokens`` tokens; returns its block table (block ids in order).

        Raises:
            KVCapacityError: the sequence outgrows its reservation.
        """
        table = self._tables[seq_id]
        total = self._num_tokens[seq_id] + num_new_tokens
        need = blocks_for_tokens(total, self.block_size_tokens)
        if need > self._reserved[seq_id]:
            raise KVCapacityError(f"sequence {seq_id} grows to {total} tokens, beyond its reservation of "
                                  f"{self._reserved[seq_id]} blocks")
        free = self._free[self._lane[seq_id]]
        while len(table) < need:
            table.append(free.pop())
        self._num_tokens[seq_id] = total
        return list(table)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def num_tokens(self, seq_id: int) -> int:
        return self._num_tokens[seq_id]

    def free(self, seq_id: int) -> None:
        """Return all of a sequence's blocks and its reservation (no-op for an unknown id)."""
        table = self._tables.pop(seq_id, [])
        lane = self._lane.pop(seq_id, 0)
        self._free[lane].extend(reversed(table))
        self._reserved.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)

    def reset(self, num_blocks: int | None = None, block_size_tokens: int | None = None,
              num_lanes: int | None = None) -> None:
        """Drop every sequence and optionally resize the pool (used when a stage reconfigures).

        Raises:
            ValueError: sequences still hold blocks.
        """
        if self._tables:
            raise ValueError(f"{len(self._tables)} sequences still hold KV blocks")
        self._setup(num_blocks or self.num_blocks, block_size_tokens or self.block_size_tokens,
                    num_lanes or self.num_lanes)


def slot_mapping(block_table: list[int], start_pos: int, end_pos: int, block_size_tokens: int) -> list[int]:
    """Flat pool slots of token positions ``[start_pos, end_pos)``: ``block * block_size + offset``."""
    return [block_table[p // block_size_tokens] * block_size_tokens + p % block_size_tokens
            for p in range(start_pos, end_pos)]
