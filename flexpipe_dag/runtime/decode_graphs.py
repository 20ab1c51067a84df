"""CUDA graphs for decode steps: a stage's micro-batch of decodes replayed at a padded static shape.

A decode step on a GPU is mostly kernel launches: SmolLM2's 30 layers take about 15 kernels each, and
at small batches the launches, not the weight reads, set the step time. vLLM and SGLang capture the
decode step as a CUDA graph per batch size and replay it (one launch for the step). This does the
same for FlexPipe's stage forward (:meth:`~flexpipe_dag.runtime.stage.StageModule.forward_index`):

* a micro-batch of decodes only (every sequence one new token) of ``S`` sequences whose longest
  context is ``L`` tokens is padded to a **bucket** ``(S_b, L_b)``: ``S_b`` the next of
  :data:`DECODE_GRAPH_BATCH_SIZES`, ``L_b`` the next power of two from
  :data:`MIN_CONTEXT_BUCKET_TOKENS` (at most the pool's capacity or the model's context); prefill and
  mixed steps, and larger ones, run as before;
* the step's inputs are copied into the bucket's static buffers: padding rows repeat row 0 (its
  token or hidden state, position, slot and context), so their keys / values are row 0's again,
  written to row 0's slot (``BatchIndex.write_rows``: the copy is of row 0's own K/V, bit for bit);
  context slots past a sequence's length are slot 0, masked out;
* ``capture=True`` (a CUDA device): the bucket's first step is run once eagerly on a side stream (the
  warm-up, which also produces its result), then captured into a ``torch.cuda.CUDAGraph`` that every
  later step of the bucket replays; all graphs share one memory pool (steps never overlap, and each
  output is copied out before the next replay). ``capture=False``: the same padded computation runs
  eagerly, which is how the CPU tests check its arithmetic (greedy outputs unchanged) and how a
  graph problem on a GPU can be told from a padding one (``RuntimeOptions(decode_graphs="eager")``).

The attention of a padded step reads ``L_b`` context slots per sequence instead of ``L``: at most twice
the keys, which at decode is small next to the weights (the reason buckets double).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexpipe_dag.runtime.attention import AttentionGroup, BatchIndex
from flexpipe_dag.runtime.graph_modes import DECODE_GRAPH_MODES
from flexpipe_dag.runtime.kv_cache import PagedKVPool

#: Sequences per decode micro-batch a graph is captured for; a step is padded up to the next one, and
#: a larger step runs without a graph. The sizes vLLM captures by default start the same way.
DECODE_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: The shortest context bucket, tokens; buckets double from it up to the KV pool's capacity.
MIN_CONTEXT_BUCKET_TOKENS = 256



def batch_bucket(num_seqs: int) -> int | None:
    """The captured batch size a step of ``num_seqs`` sequences is padded to (None: larger than all)."""
    return next((b for b in DECODE_GRAPH_BATCH_SIZES if b >= num_seqs), None)


def context_bucket(ctx_tokens: int, capacity_tokens: int) -> int | None:
    """The context length, tokens, a step whose longest context is ``ctx_tokens`` is padded to: the next
    power of two from :data:`MIN_CONTEXT_BUCKET_TOKENS`, capped at ``capacity_tokens`` (the pool's
    slots); None when ``ctx_tokens`` exceeds the capacity."""
    if ctx_tokens > capacity_tokens:
        return None
    bucket = MIN_CONTEXT_BUCKET_TOKENS
    while bucket < ctx_tokens:
        bucket *= 2
    return min(bucket, capacity_tokens)


@dataclass
class _Bucket:
    """One ``(S_b, L_b)`` shape: its static input buffers, the index over them, and its graph."""

    x: torch.Tensor  # int64 [S_b] token ids (first stage) or [S_b, hidden] hidden states
    positions: torch.Tensor  # int64 [S_b]
    slots: torch.Tensor  # int64 [S_b] the new tokens' pool slots (padding: row 0's)
    write_rows: torch.Tensor  # int64 [S_b] row whose K/V each slot gets (padding: 0)
    ctx_slots: torch.Tensor  # int64 [S_b, L_b]
    key_pos: torch.Tensor  # int64 [L_b] 0 .. L_b - 1
    rows: torch.Tensor  # int64 [S_b] 0 .. S_b - 1
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the graph's static output

    def index(self) -> BatchIndex:
        """The padded micro-batch's layout, computed from the buffers (inside a capture, too)."""
        s_b, l_b = self.ctx_slots.shape
        mask = (self.key_pos[None, :] <= self.positions[:, None])[:, None, None, :]  # up to the new token
        group = AttentionGroup(self.rows, None, self.ctx_slots, mask, False, s_b, 1, l_b)
        return BatchIndex(self.positions, self.slots, self.rows, [group], write_rows=self.write_rows)


class DecodeGraphs:
    """Runs one stage's decode-only micro-batches padded to static shapes, as CUDA graphs or eagerly.

    Args:
        module: the stage (:class:`~flexpipe_dag.runtime.stage.StageModule`, on its device).
        pool: its KV pool.
        capture: True: capture each bucket's step as a ``torch.cuda.CUDAGraph`` on first use and replay
            it (the pool must be on a CUDA device); False: run the padded step eagerly.

    Raises:
        ValueError: ``capture`` with a pool that is not on a CUDA device.

    Attributes:
        captures, replays, eager_steps: graphs captured, steps replayed, padded steps run eagerly.
    """

    def __init__(self, module, pool: PagedKVPool, capture: bool):
        if capture and pool.k.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV pool on a CUDA device, not {pool.k.device}")
        self.module, self.pool, self.capture = module, pool, capture
        self.device = pool.k.device
        #: the longest context a bucket pads to: the pool's slots, or the model's context when shorter (no
        #: sequence is longer, and every bucket's scratch stays in the graphs' shared memory pool)
        self.max_context_tokens = min(pool.capacity_tokens,
                                      int(getattr(module.config, "max_position_embeddings", 0) or pool.capacity_tokens))
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        #: every capture on one stream of the stage's own device (graphs sharing a pool should be captured
        #: on the same stream, torch.cuda.graph's docs); torch's default capture stream is on the current
        #: device, which for a stage on cuda:1 would be cuda:0
        self._capture_stream = torch.cuda.Stream(self.device) if capture else None
        self.captures = self.replays = self.eager_steps = 0

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The ``(S_b, L_b)`` shapes run so far (captured ones with ``capture``), sorted."""
        return sorted(self._buckets)

    def accepts(self, index: BatchIndex) -> bool:
        """Whether ``index`` is a micro-batch this runs: decodes only, within the largest bucket."""
        if len(index.groups) != 1 or index.groups[0].q_len != 1 or index.write_rows is not None:
            return False
        group = index.groups[0]
        return (batch_bucket(group.num_seqs) is not None
                and context_bucket(group.ctx_len, self.max_context_tokens) is not None)

    def run(self, x: torch.Tensor, index: BatchIndex) -> torch.Tensor:
        """The stage's output for the decode micro-batch ``index`` (:meth:`accepts` it) with input ``x``
        (``[S]`` token ids or ``[S, hidden]``): ``[S, vocab]`` logits on the last stage, else ``[S, hidden]``;
        a tensor of its own (not a graph's buffer)."""
        group = index.groups[0]
        s = group.num_seqs
        s_b = batch_bucket(s)
        l_b = context_bucket(group.ctx_len, self.max_context_tokens)
        assert s_b is not None and l_b is not None, "run() a micro-batch accepts() took"
        bucket = self._buckets.get((s_b, l_b))
        if bucket is None:
            bucket = self._buckets[(s_b, l_b)] = self._new_bucket(s_b, l_b, x)
        self._fill(bucket, x, index, s)
        if not self.capture:
            self.eager_steps += 1
            return self._step(bucket)[:s]
        if bucket.graph is None:
            return self._capture(bucket)[:s]
        with torch.cuda.device(self.device):
            bucket.graph.replay()
        self.replays += 1
        assert bucket.out is not None
        return bucket.out[:s].clone()

    # -- internals ----------------------------------------------------------------------------------
    def _new_bucket(self, s_b: int, l_b: int, x: torch.Tensor) -> _Bucket:
        dev = self.device
        shape = (s_b,) if x.dim() == 1 else (s_b, x.shape[1])
        dtype = torch.long if x.dim() == 1 else self.pool.k.dtype

        def longs(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=dev)

        return _Bucket(torch.zeros(shape, dtype=dtype, device=dev), longs(s_b), longs(s_b), longs(s_b),
                       longs(s_b, l_b), torch.arange(l_b, device=dev), torch.arange(s_b, device=dev))

    def _fill(self, b: _Bucket, x: torch.Tensor, index: BatchIndex, s: int) -> None:
        """Copy the step's inputs into ``b``'s buffers; padding rows repeat row 0."""
        group = index.groups[0]
        x = x.to(device=self.device, dtype=b.x.dtype)
        ctx = group.ctx_slots  # [S, L] (rows in packed order: a decode group's token rows are 0 .. S - 1)
        b.x[:s] = x
        b.x[s:] = x[0]
        b.positions[:s] = index.positions
        b.positions[s:] = index.positions[0]
        b.slots[:s] = index.new_slots
        b.slots[s:] = index.new_slots[0]
        b.write_rows[:s] = b.rows[:s]
        b.write_rows[s:] = 0
        b.ctx_slots.zero_()
        b.ctx_slots[:s, :ctx.shape[1]] = ctx
        b.ctx_slots[s:] = b.ctx_slots[0]

    def _step(self, b: _Bucket) -> torch.Tensor:
        with torch.inference_mode():
            return self.module.forward_index(b.x, b.index(), self.pool)

    def _capture(self, b: _Bucket) -> torch.Tensor:
        """Warm up on a side stream (this step's result), then capture ``b``'s step into its graph.

        All of it with the stage's device current (``torch.cuda.graph`` synchronises and captures on the
        current device), and ``thread_local`` capture errors: the worker's background sender may call
        into CUDA / NCCL from its own thread meanwhile, which ``global`` mode would make fail."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                result = self._step(b).clone()  # the K/V writes repeat identically in the capture's replays
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                b.out = self._step(b)
        b.graph = graph
        self.captures += 1
        return result


def make_decode_graphs(mode: str, module, pool: PagedKVPool) -> DecodeGraphs | None:
    """The :class:`DecodeGraphs` a stage runs with for ``mode``
    (:data:`~flexpipe_dag.runtime.graph_modes.DECODE_GRAPH_MODES`): ``auto``
    captures on a CUDA pool (not with a ``dynamic`` RoPE, :func:`graph_safe_rope`) and runs none on a CPU;
    ``eager`` pads without capture; ``off``: None.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in DECODE_GRAPH_MODES:
        raise ValueError(f"decode_graphs: expected one of {', '.join(DECODE_GRAPH_MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and (pool.k.device.type != "cuda" or not graph_safe_rope(module))):
        return None
    return DecodeGraphs(module, pool, capture=mode == "auto")


def graph_safe_rope(module) -> bool:
    """Whether the stage's rotary embedding can be captured: not a ``dynamic`` RoPE type, whose
    ``transformers`` update compares the sequence length with its cache (a GPU -> CPU sync) and swaps
    its ``inv_freq`` buffer (a graph would keep reading the old one); default, ``llama3`` and
    ``longrope`` update nothing or update in place."""
    return "dynamic" not in str(getattr(getattr(module, "rotary_emb", None), "rope_type", "default"))
