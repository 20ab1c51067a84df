"""All stages of a gear in this process, chained without communication.

The single-device runtime and the reference the multi-process pipeline is checked against: the
same :class:`~flexpipe_dag.runtime.stage.StageModule` forward, KV pools and scheduler, one
micro-batch at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flexpipe_dag.runtime.decode_graphs import make_decode_graphs
from flexpipe_dag.runtime.kv_blocks import BlockAllocator
from flexpipe_dag.runtime.model_loader import Checkpoint, load_stage_module
from flexpipe_dag.runtime.sampling import sample_tokens
from flexpipe_dag.runtime.scheduler import MicroBatch, Request, RequestOutput, Scheduler
from flexpipe_dag.runtime.stage import StageModule, batch_input_ids


class LocalPipeline:
    """Stage modules in order with one KV pool each (same block count on every stage).

    Args:
        stages: first has the embedding, last the norm + head.
        num_blocks, block_size_tokens: KV pool geometry.
        decode_graphs: ``auto`` / ``off`` / ``eager`` (:data:`~flexpipe_dag.runtime.graph_modes.DECODE_GRAPH_MODES`,
            as ``RuntimeOptions.decode_graphs``: CUDA graphs for decode steps of stages on a GPU).

    Raises:
        ValueError: an unknown ``decode_graphs``.

    Attributes:
        max_context_tokens: the model's max context (its config's ``max_position_embeddings``;
            ``None`` if absent): :meth:`generate` refuses a request whose prompt + ``max_new_tokens``
            exceed it, as the pipeline's scheduler does.
    """

    def __init__(self, stages: list[StageModule], num_blocks: int, block_size_tokens: int,
                 decode_graphs: str = "auto"):
        self.stages = stages
        self.num_blocks, self.block_size_tokens = num_blocks, block_size_tokens
        value = getattr(stages[0].config, "max_position_embeddings", None) if stages else None
        self.max_context_tokens: int | None = int(value) if value else None
        self.pools = [st.new_kv_pool(num_blocks, block_size_tokens) for st in stages]
        #: per stage, its padded decode path (None: the stage runs every step as it comes)
        self.graphs = [make_decode_graphs(decode_graphs, st, pool) for st, pool in zip(stages, self.pools)]

    @classmethod
    def from_layer_ranges(cls, ckpt: Checkpoint, ranges: list[tuple[int, int]], num_blocks: int,
                          block_size_tokens: int, dtype: str = "fp32", decode_graphs: str = "auto") -> LocalPipeline:
        """Load each range as its own stage (only its tensors)."""
        n = len(ranges)
        stages = [load_stage_module(ckpt, a, b, first=i == 0, last=i == n - 1, dtype=dtype)
                  for i, (a, b) in enumerate(ranges)]
        return cls(stages, num_blocks, block_size_tokens, decode_graphs)

    def step(self, batch: MicroBatch) -> list[int]:
        """Run one micro-batch through every stage and sample; one token id per sequence."""
        x = batch_input_ids(batch)
        for st, pool, graphs in zip(self.stages, self.pools, self.graphs):
            x = st(batch, x, pool, graphs)
        return sample_tokens(x, batch.seqs)

    def generate(self, requests: Iterable[Request], micro_batch_size: int = 8,
                 on_result: Callable[[RequestOutput], None] | None = None, *,
                 max_tokens_per_micro_batch: int = 2048, chunked_prefill: bool = False) -> list[RequestOutput]:
        """Serve ``requests`` to completion with continuous batching; results in finishing order.

        ``max_tokens_per_micro_batch`` and ``chunked_prefill``: as the
        :class:`~flexpipe_dag.runtime.scheduler.Scheduler` takes them.

        Raises:
            ContextLengthError: a request's prompt + ``max_new_tokens`` exceed :attr:`max_context_tokens`.
            KVCapacityError: a request's KV need (prompt + ``max_new_tokens`` - 1) exceeds the pool.
        """
        sched = Scheduler(BlockAllocator(self.num_blocks, self.block_size_tokens), micro_batch_size, 1,
                          max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                          max_context_tokens=self.max_context_tokens, chunked_prefill=chunked_prefill)
        sched.add_requests(requests)
        done: list[RequestOutput] = []
        while sched.has_unfinished():
            mb = sched.schedule()
            if mb is None:
                raise RuntimeError("scheduler stalled with unfinished requests")
            for out in sched.update_from_output(mb.mb_id, self.step(mb)):
                done.append(out)
                if on_result:
                    on_result(out)
        return done
