"""Iteration-level continuous batching for a pipeline (pure: no torch, plain data in and out).

Shape follows vLLM v1 (``vllm/v1/core/sched/interface.py``): :meth:`Scheduler.schedule` returns
the next micro-batch to push into the pipeline, or ``None``; when the last stage's sampled tokens
come back, :meth:`Scheduler.update_from_output` appends them, stops sequences on EOS or
``max_new_tokens`` and frees their KV blocks; :meth:`Scheduler.abort` ends requests nobody waits for
(vLLM's ``finish_abort``). Several micro-batches are in flight at once (up to
``max_inflight_micro_batches``) so stages overlap; a sequence is in at most one of them, since
its next token depends on the previous one.

Policy:

* admission in priority order (``priority`` 0 = online first, larger = offline), then arrival;
  a request is admitted when its lane of the KV pool can reserve :func:`~flexpipe_dag.core.kv.kv_tokens_needed` tokens
  (``prompt + max_new_tokens - 1``: the last sampled token is returned, never fed back, so its K/V
  is never written) and the running set is below ``micro_batch_size x max_inflight_micro_batches``;
  the head of the queue is never overtaken, so a large online request is not starved;
* a micro-batch takes running sequences not in flight (decode, 1 token each) in priority order,
  then newly admitted ones (whole-prompt prefill) while ``max_tokens_per_micro_batch`` allows
  (a lone prefill larger than the budget still runs alone);
* with ``chunked_prefill`` a prompt is instead cut into chunks that fill what the budget leaves
  after the decodes (Sarathi-Serve's stall-free batching, OSDI'24; vLLM's
  ``enable_chunked_prefill``): a sequence part-way through its prompt continues before a new one
  starts, its chunks sample nothing, and the first token comes out of the last chunk. Every
  micro-batch then costs about the same, so a long prompt neither stalls the decodes that share
  its micro-batch nor leaves the other stages idle while it passes;
* a request whose prompt + ``max_new_tokens`` exceed the model's max context
  (:class:`ContextLengthError`), or whose :func:`~flexpipe_dag.core.kv.kv_tokens_needed` could never fit one lane of the
  pool (:class:`~flexpipe_dag.runtime.kv_blocks.KVCapacityError`, naming the binding lane, stage and
  replica), is refused at :meth:`Scheduler.add_request`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.kv import kv_tokens_needed
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError
from flexpipe_dag.runtime.lanes import lane_limit_text


class ContextLengthError(ValueError):
    """A request's prompt + ``max_new_tokens`` exceed the model's max context (the message says by how much)."""


#: Words every context refusal's message holds (how a report tells them from other refusals).
CONTEXT_REFUSAL = "exceed the model's max context"
#: What a KV refusal tells the user to raise by default (an entry point names its own knob).
KV_CAPACITY_KNOB = "the gear's kv_capacity_tokens"


#: Priority of online (latency-critical) requests; offline batch work uses larger numbers.
PRIORITY_ONLINE = 0
PRIORITY_OFFLINE = 1


@dataclass
class Request:
    """One generation request.

    ``temperature == 0`` is greedy; ``seed`` makes a sampled request reproducible. ``probe``: the serving
    front's own request (a shift's or a new instance's warm-up, verification or canary), scheduled by its
    ``priority`` like any other but never counted in the metric samples' online figures (``rps``,
    ``completed``, latencies): it is nobody's traffic.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    priority: int = PRIORITY_ONLINE
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    probe: bool = False

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise InputError(None, f"request {self.request_id}.prompt_token_ids", "expected at least one token")
        if self.max_new_tokens < 1:
            raise InputError(None, f"request {self.request_id}.max_new_tokens",
                             f"expected >= 1, got {self.max_new_tokens}")

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens this request can ever hold (:func:`~flexpipe_dag.core.kv.kv_tokens_needed`)."""
        return kv_tokens_needed(len(self.prompt_token_ids), self.max_new_tokens)


@dataclass
class ScheduledSeq:
    """One sequence's share of a micro-batch: the tokens to feed and where they go in the KV pool."""

    seq_id: int
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    output_index: int  # index of the output token this step samples
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def is_prefill(self) -> bool:
        return self.start_pos == 0


@dataclass
class MicroBatch:
    """What one pipeline step computes; travels with the activations from stage to stage."""

    mb_id: int
    seqs: list[ScheduledSeq]
    lane: int = 0  # the replicas it runs on (flexpipe_dag.runtime.lanes)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class RequestOutput:
    """A finished request. Times in seconds of the scheduler's clock; ``tpot_s`` is ``None`` for one token."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens) or "abort" (Scheduler.abort)
    arrival_s: float
    first_token_s: float
    finish_s: float
    priority: int = PRIORITY_ONLINE
    probe: bool = False  # the request's ``probe``

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_token_ids)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass
class _Seq:
    seq_id: int
    req: Request
    order: int
    arrival_s: float
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    in_flight: bool = False
    first_token_s: float | None = None
    lane: int = 0
    aborted: bool = False  # aborted while in flight: ends when its micro-batch comes back

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.req.priority, self.order)


def _phase(s: _Seq) -> int:
    """Order within a micro-batch: decodes (0), then prompts part-way through their chunks (1), then new ones (2)."""
    if s.num_computed == 0:
        return 2
    return 1 if s.num_computed < len(s.req.prompt_token_ids) else 0


class Scheduler:
    """Continuous-batching scheduler over one KV :class:`BlockAllocator`.

    With stage replicas the allocator has several lanes (:mod:`~flexpipe_dag.runtime.lanes`): a
    request is pinned at admission to the lane with the fewest running sequences that has room,
    every micro-batch holds one lane's sequences, lanes take turns, and each lane may have
    ``max_inflight_micro_batches`` in flight (the running set grows with the lanes).

    Args:
        allocator: the pipeline's KV block accounting (capacity = min over stages).
        micro_batch_size: most sequences per micro-batch.
        max_inflight_micro_batches: most micro-batches in the pipeline at once, per lane.
        max_tokens_per_micro_batch: token budget of one micro-batch (prefill tokens + 1 per decode).
        clock: seconds, monotonic (injectable for tests).
        max_context_tokens: the model's max context (prompt + generated tokens; the checkpoint's
            ``max_position_embeddings``); ``None``: not checked.
        stage_replicas: replicas per stage of the gear the allocator's lanes come from (names the
            binding stage and replica in a KV refusal); empty: not known (one lane: not needed).
        kv_capacity_knob: what a KV refusal tells the user to raise (the entry point's flag or field).
        chunked_prefill: cut prompts into chunks that fill the token budget (see the module's policy).
    """

    def __init__(self, allocator: BlockAllocator, micro_batch_size: int, max_inflight_micro_batches: int,
                 max_tokens_per_micro_batch: int = 2048, clock: Callable[[], float] = time.monotonic,
                 max_context_tokens: int | None = None, stage_replicas: tuple[int, ...] = (),
                 kv_capacity_knob: str = KV_CAPACITY_KNOB, chunked_prefill: bool = False):
        if max_tokens_per_micro_batch < 1:
            raise InputError(None, "max_tokens_per_micro_batch", f"expected >= 1, got {max_tokens_per_micro_batch}")
        self.chunked_prefill = chunked_prefill
        self.allocator = allocator
        self.kv_capacity_knob = kv_capacity_knob
        self.max_context_tokens = max_context_tokens
        self.stage_replicas = tuple(stage_replicas)
        self.micro_batch_size = micro_batch_size
        self.max_inflight_micro_batches = max_inflight_micro_batches
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.clock = clock
        self._waiting: list[_Seq] = []
        self._running: dict[int, _Seq] = {}
        self._inflight: dict[int, list[int]] = {}  # mb id -> seq ids
        self._inflight_lane: dict[int, int] = {}  # mb id -> lane
        self._next_lane = 0
        self._ids = itertools.count()
        self._mb_ids = itertools.count()
        self._request_ids: set[str] = set()
        self.admission_paused = False

    # -- intake ---------------------------------------------------------------------------------
    def add_request(self, req: Request, arrival_s: float | None = None) -> None:
        """Queue a request.

        Raises:
            ContextLengthError: prompt + max_new_tokens exceed the model's max context.
            KVCapacityError: the request's :func:`~flexpipe_dag.core.kv.kv_tokens_needed` exceed one lane of the KV pool
                (the whole pool without stage replicas); the message names the binding limit.
            InputError: the request id is already queued or running.
        """
        if req.request_id in self._request_ids:
            raise InputError(None, "request_id", f"{req.request_id!r} is already queued or running")
        prompt = len(req.prompt_token_ids)
        context = prompt + req.max_new_tokens
        limit = self.max_context_tokens
        if limit is not None and context > limit:
            raise ContextLengthError(
                f"request {req.request_id!r}: prompt {prompt} + max_new_tokens "
                f"{req.max_new_tokens} = {context} tokens {CONTEXT_REFUSAL} of {limit} tokens; expected at most "
                f"{limit} (shorten the prompt or max_new_tokens, or truncate: --truncate-context)")
        need = req.kv_tokens
        if not self.allocator.fits_ever(need):
            alloc = self.allocator
            lane_tokens = alloc.blocks_per_lane * alloc.block_size_tokens
            raise KVCapacityError(
                f"request {req.request_id!r} needs {need} KV tokens (prompt {prompt} + max_new_tokens "
                f"{req.max_new_tokens} - 1: the last token is never cached); "
                f"{lane_limit_text(alloc.num_lanes, lane_tokens, self.stage_replicas)}; expected at most "
                f"{lane_tokens} (shorten the prompt or max_new_tokens, or raise {self.kv_capacity_knob})")
        seq_id = next(self._ids)
        self._request_ids.add(req.request_id)
        self._waiting.append(_Seq(seq_id, req, seq_id, self.clock() if arrival_s is None else arrival_s))
        self._waiting.sort(key=lambda s: s.sort_key)

    def add_requests(self, reqs: Iterable[Request]) -> None:
        for r in reqs:
            self.add_request(r)

    # -- state ----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_inflight_micro_batches(self) -> int:
        return len(self._inflight)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # -- scheduling -----------------------------------------------------------------------------
    @property
    def num_lanes(self) -> int:
        return self.allocator.num_lanes

    def _admit(self) -> None:
        lanes = self.num_lanes
        limit = self.micro_batch_size * self.max_inflight_micro_batches * lanes
        while self._waiting and not self.admission_paused and len(self._running) < limit:
            head = self._waiting[0]
            need = head.req.kv_tokens
            load = [0] * lanes
            for s in self._running.values():
                load[s.lane] += 1
            room = [lane for lane in range(lanes) if self.allocator.can_reserve(need, lane)]
            if not room:
                break
            head.lane = min(room, key=lambda lane: (load[lane], lane))
            self.allocator.reserve(head.seq_id, need, head.lane)
            self._running[head.seq_id] = self._waiting.pop(0)

    def schedule(self) -> MicroBatch | None:
        """The next micro-batch, or ``None`` when the in-flight limit is reached or nothing is ready."""
        lanes = self.num_lanes
        if len(self._inflight) >= self.max_inflight_micro_batches * lanes:
            return None
        self._admit()
        busy = [0] * lanes
        for lane in self._inflight_lane.values():
            busy[lane] += 1
        ready_lanes = {s.lane for s in self._running.values() if not s.in_flight}
        for k in range(lanes):  # lanes take turns
            lane = (self._next_lane + k) % lanes
            if lane in ready_lanes and busy[lane] < self.max_inflight_micro_batches:
                mb = self._micro_batch(lane)
                if mb is not None:
                    self._next_lane = (lane + 1) % lanes
                    return mb
        return None

    def _micro_batch(self, lane: int) -> MicroBatch | None:
        ready = sorted((s for s in self._running.values() if not s.in_flight and s.lane == lane),
                       key=lambda s: (_phase(s), s.sort_key))
        picked: list[ScheduledSeq] = []
        budget = self.max_tokens_per_micro_batch
        for s in ready:
            if len(picked) >= self.micro_batch_size or (self.chunked_prefill and budget < 1):
                break
            prompt = s.req.prompt_token_ids
            if s.num_computed < len(prompt):  # (the rest of) the prompt
                end = len(prompt) if not self.chunked_prefill else min(len(prompt), s.num_computed + budget)
                tokens = list(prompt[s.num_computed:end])
            else:
                tokens = [s.outputs[-1]]
            if len(tokens) > budget and picked:
                continue
            budget -= len(tokens)
            table = self.allocator.append(s.seq_id, len(tokens))
            picked.append(ScheduledSeq(seq_id=s.seq_id, token_ids=tokens, start_pos=s.num_computed,
                                       block_table=table, output_index=len(s.outputs),
                                       temperature=s.req.temperature, top_k=s.req.top_k, top_p=s.req.top_p,
                                       seed=s.req.seed))
            s.num_computed += len(tokens)
            s.in_flight = True
        if not picked:
            return None
        mb = MicroBatch(mb_id=next(self._mb_ids), seqs=picked, lane=lane)
        self._inflight[mb.mb_id] = [p.seq_id for p in picked]
        self._inflight_lane[mb.mb_id] = lane
        return mb

    def update_from_output(self, mb_id: int, sampled_token_ids: list[int],
                           on_token: Callable[[str, int, int], None] | None = None) -> list[RequestOutput]:
        """Apply one finished micro-batch's sampled tokens; returns the requests that finished.

        ``on_token(request_id, index, token_id)`` is called for every sampled token (``index``: its
        0-based position among the request's outputs), before the finished requests are returned.

        Raises:
            KeyError: ``mb_id`` is not in flight.
            ValueError: the number of tokens differs from the micro-batch's sequences.
        """
        seq_ids = self._inflight.pop(mb_id)
        self._inflight_lane.pop(mb_id, None)
        if len(seq_ids) != len(sampled_token_ids):
            raise ValueError(f"micro-batch {mb_id}: {len(sampled_token_ids)} tokens for {len(seq_ids)} sequences")
        now = self.clock()
        finished: list[RequestOutput] = []
        for seq_id, tok in zip(seq_ids, sampled_token_ids):
            s = self._running[seq_id]
            s.in_flight = False
            if s.aborted:  # its token is not sent: the request ended when it was aborted
                finished.append(self._end(s, "abort", now))
                continue
            if s.num_computed < len(s.req.prompt_token_ids):
                continue  # a prompt chunk before the last: its sample is not a token of the output
            s.outputs.append(int(tok))
            if on_token is not None:
                on_token(s.req.request_id, len(s.outputs) - 1, int(tok))
            if s.first_token_s is None:
                s.first_token_s = now
            reason = None
            if int(tok) in s.req.eos_token_ids:
                reason = "stop"
            elif len(s.outputs) >= s.req.max_new_tokens:
                reason = "length"
            if reason:
                finished.append(self._end(s, reason, now))
        return finished

    def _end(self, s: _Seq, reason: str, now: float) -> RequestOutput:
        """Take ``s`` out of the scheduler (its KV blocks freed, if it held any) as finished for ``reason``."""
        if self._running.pop(s.seq_id, None) is not None:
            self.allocator.free(s.seq_id)
        self._request_ids.discard(s.req.request_id)
        first = s.first_token_s if s.first_token_s is not None else now
        return RequestOutput(s.req.request_id, list(s.req.prompt_token_ids), list(s.outputs), reason, s.arrival_s,
                             first, now, s.req.priority, s.req.probe)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """End requests nobody waits for any more (a client went away, a stop sequence was reached).

        A queued request leaves the queue, and a running one frees its KV blocks now. A request in a micro-batch
        that is still in the pipeline ends when that batch comes back, and :meth:`update_from_output`
        returns it then. Its blocks stay reserved until then, because the stages still write them, and its
        sampled token is dropped. Ids that are not queued or running are ignored: they already finished or
        were refused.

        Returns:
            The requests that ended now, each with ``finish_reason`` ``"abort"`` and the tokens it had
            sampled (``first_token_s`` is the abort time when it had none).
        """
        wanted = set(request_ids) & self._request_ids
        if not wanted:
            return []
        now = self.clock()
        ended = [self._end(s, "abort", now) for s in self._waiting if s.req.request_id in wanted]
        self._waiting = [s for s in self._waiting if s.req.request_id not in wanted]
        for s in [s for s in self._running.values() if s.req.request_id in wanted]:
            if s.in_flight:
                s.aborted = True
            else:
                ended.append(self._end(s, "abort", now))
        return ended

    def abort_inflight(self) -> list[str]:
        """Forget every in-flight micro-batch (after a pipeline failure); returns affected request ids."""
        ids: list[str] = []
        for seq_ids in self._inflight.values():
            ids.extend(self._running[i].req.request_id for i in seq_ids if i in self._running)
        self._inflight.clear()
        self._inflight_lane.clear()
        return ids
