"""Paged KV cache accounting (pure): fixed-size blocks, per-sequence block tables, reservations.

The scheduler owns one :class:`BlockAllocator`; every stage holds a K/V pool of the same number
of blocks (:mod:`flexpipe_dag.runtime.kv_cache`), so one block table addresses the same slots in
every stage (vLLM's design: the scheduler's KV manager decides, workers only read/write slots).

Admission reserves the worst case of a sequence (prompt + max new tokens) so a running sequence
never needs preemption; physical blocks are taken from that reservation as tokens are appended
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

    Invariants: ``used + free == num_blocks``; a sequence's table never holds more blocks than it
    reserved; the blocks reserved but not yet used are counted in :attr:`num_reserved_blocks`.
    """

    def __init__(self, num_blocks: int, block_size_tokens: int):
        if num_blocks < 1 or block_size_tokens < 1:
            raise ValueError(f"num_blocks and block_size_tokens must be >= 1, got {num_blocks}, {block_size_tokens}")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # seq id -> blocks reserved in total
        self._num_tokens: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size_tokens

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to admitted sequences (used ones included)."""
        return sum(self._reserved.values())

    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a new sequence of up to ``num_tokens`` tokens fits next to the current reservations."""
        return blocks_for_tokens(num_tokens, self.block_size_tokens) <= self.num_blocks - self.num_reserved_blocks

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit in the empty pool."""
        return blocks_for_tokens(num_tokens, self.block_size_tokens) <= self.num_blocks

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Reserve room for ``num_tokens`` tokens of a new sequence.

        Raises:
            KVCapacityError: not enough unreserved blocks.
            ValueError: ``seq_id`` already holds a reservation.
        """
        if seq_id in self._reserved:
            raise ValueError(f"sequence {seq_id} already has a KV reservation")
        need = blocks_for_tokens(num_tokens, self.block_size_tokens)
        have = self.num_blocks - self.num_reserved_blocks
        if need > have:
            raise KVCapacityError(f"sequence {seq_id} needs {need} KV blocks ({num_tokens} tokens), {have} free "
                                  f"of {self.num_blocks}")
        self._reserved[seq_id] = need
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
        while len(table) < need:
            table.append(self._free.pop())
        self._num_tokens[seq_id] = total
        return list(table)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def num_tokens(self, seq_id: int) -> int:
        return self._num_tokens[seq_id]

    def free(self, seq_id: int) -> None:
        """Return all of a sequence's blocks and its reservation (no-op for an unknown id)."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        self._reserved.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)

    def reset(self, num_blocks: int | None = None, block_size_tokens: int | None = None) -> None:
        """Drop every sequence and optionally resize the pool (used when a stage reconfigures).

        Raises:
            ValueError: sequences still hold blocks.
        """
        if self._tables:
            raise ValueError(f"{len(self._tables)} sequences still hold KV blocks")
        self.__init__(num_blocks or self.num_blocks, block_size_tokens or self.block_size_tokens)


def slot_mapping(block_table: list[int], start_pos: int, end_pos: int, block_size_tokens: int) -> list[int]:
    """Flat pool slots of token positions ``[start_pos, end_pos)``: ``block * block_size + offset``."""
    return [block_table[p // block_size_tokens] * block_size_tokens + p % block_size_tokens
            for p in range(start_pos, end_pos)]
