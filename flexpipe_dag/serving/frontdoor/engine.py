"""The bridge between the HTTP server's event loop and the live pipeline behind a :class:`ServingRouter`.

A request becomes one runtime :class:`~flexpipe_dag.runtime.scheduler.Request` on the router (which
delivers its result exactly once, across gear shifts and lane failures). Its sampled tokens come back
on pump threads (``stream_tokens``), are handed to the event loop with ``call_soon_threadsafe``, and
:meth:`FrontDoorEngine.generate` turns them into text pieces: decoded incrementally (a piece that
ends inside a multi-byte character waits for the next token), cut at the first stop sequence, each
token index taken once (a request moved to another lane starts again there; what was sent stands).

A response that ends before its request finished (a stop sequence reached, a client that went away, a
server that is closing) cancels the request (:meth:`~flexpipe_dag.shift.router.ServingRouter.cancel`):
the pipeline stops generating for it and frees its KV blocks within a step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE, PRIORITY_ONLINE, Request, RequestOutput
from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics
from flexpipe_dag.serving.frontdoor.protocol import APIError, PriorityClass

#: Requests accepted and unfinished above which a new one gets 429 (``flexpipe serve --max-pending``).
DEFAULT_MAX_PENDING = 256


@dataclass(frozen=True)
class Generation:
    """One request as the engine serves it.

    Attributes:
        prompt_token_ids: the prompt, tokenised (a chat already in the model's template).
        max_tokens: most output tokens (EOS counts as one).
        temperature, top_p, seed: sampling (temperature 0 is greedy).
        stop: stop sequences; the text ends before the first one found.
        priority_class: ``online`` (admitted first) or ``offline``.
    """

    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    priority_class: PriorityClass = "online"


@dataclass
class Piece:
    """What a response gets next: new ``text`` (may be empty), and on the last piece a ``finish_reason``
    (``stop``: EOS or a stop sequence; ``length``: ``max_tokens``) with the token counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    pipeline_timings: dict[str, float | None] | None = None  # on the last piece: see :func:`pipeline_timings`


@dataclass
class _Stream:
    """One request's state, touched only on the event loop's thread."""

    gen: Generation
    accepted_s: float
    tokens: list[int] = field(default_factory=list)
    output: RequestOutput | None = None
    refusal: str | None = None
    closed: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_s: float | None = None
    submitted_s: float | None = None  # handed to the router
    # when each token and the result reached this process (monotonic, taken on the pump threads before
    # the event loop and HTTP): what a caller of the router directly measures
    token_arrival_s: list[float] = field(default_factory=list)
    result_s: float | None = None

    def arrived(self, method: str, at_s: float) -> None:
        """After ``method`` was applied: note when its new tokens (a re-sent index adds none) and the
        result reached the server (``at_s``)."""
        self.token_arrival_s.extend([at_s] * (len(self.tokens) - len(self.token_arrival_s)))
        if method == "on_output":
            self.result_s = at_s

    def on_token(self, index: int, token_id: int) -> None:
        if index == len(self.tokens):  # the next one; an index seen before (a restart elsewhere) is not resent
            self.tokens.append(token_id)
            if self.first_token_s is None:
                self.first_token_s = time.monotonic()
            self.wake.set()

    def on_output(self, out: RequestOutput) -> None:
        self.output = out
        self.tokens.extend(out.output_token_ids[len(self.tokens):])  # any the stream did not see
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        self.wake.set()

    def on_refused(self, reason: str) -> None:
        self.refusal = reason
        self.wake.set()

    def on_closed(self, reason: str) -> None:
        if self.output is None:
            self.closed = reason
            self.wake.set()


class FrontDoorEngine:
    """Serves :class:`Generation` requests on a live pipeline, for one event loop.

    Args:
        tokenizer: the model's ``transformers`` tokenizer (decodes the output).
        eos_token_ids: the model's end-of-sequence ids (a request stops at one).
        max_context_tokens: prompt + ``max_tokens`` limit (None: unchecked here).
        metrics: where latencies and counts go.
        max_pending: requests accepted and unfinished above which :meth:`check_admission` raises 429.
        default_max_tokens: ``max_tokens`` of a chat that sets none (0: :meth:`fair_share_tokens`).

    Call :meth:`attach` with the router (built with this engine's :meth:`router_callbacks`) once its
    pipeline is open, from the thread of the event loop that will serve.
    """

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_context_tokens: int | None,
                 metrics: FrontDoorMetrics, max_pending: int = DEFAULT_MAX_PENDING, default_max_tokens: int = 0):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context_tokens = max_context_tokens
        self.metrics = metrics
        self.max_pending = max_pending
        self.default_max_tokens = default_max_tokens
        self._fair_share: int | None = None  # the last steady state's (fair_share_tokens)
        self.router = None
        #: the :class:`~flexpipe_dag.shift.instances.InstanceFleet` over the router, once the server made one
        self.fleet = None
        self.draining = False
        #: why the pipeline failed (the server then stops), or None
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # _streams is read from pump threads
        self._seq = itertools.count(1)
        #: ``(on_result, on_refused, on_token)`` for requests that are not streams (the Batch API runner's
        #: lines): ``on_result(RequestOutput)``, ``on_refused(request_id, reason)``, ``on_token(request_id,
        #: index, token_id)``, each called on a pump thread
        self.other_requests: tuple[Callable, Callable, Callable] | None = None
        # events for streams, in arrival order, handed to the loop in one wake-up per burst (a pipeline
        # step samples a token for every sequence: one wake-up for all of them, not one each)
        self._pending: list[tuple[_Stream, str, tuple, float]] = []
        self._flush_scheduled = False

    # -- router side (pump threads) -----------------------------------------------------------------
    def router_callbacks(self) -> dict[str, Callable]:
        """``on_result``, ``on_refused``, ``on_tokens``, ``on_metrics``, ``on_lane_sample`` for the
        :class:`ServingRouter`."""
        return {"on_result": self._from_thread("on_output"), "on_refused": self._from_thread("on_refused"),
                "on_tokens": self._from_thread("on_token"), "on_metrics": self.metrics.observe_sample,
                "on_lane_sample": self.metrics.observe_pipeline_sample}

    def _from_thread(self, method: str) -> Callable:
        def hand_over(request_id, *args) -> None:
            rid = request_id.request_id if isinstance(request_id, RequestOutput) else request_id
            payload = (request_id,) if isinstance(request_id, RequestOutput) else args
            with self._lock:
                stream = self._streams.get(rid)
                if stream is not None and self._loop is not None:
                    self._pending.append((stream, method, payload, time.monotonic()))
                    if self._flush_scheduled:
                        return
                    self._flush_scheduled = True
            if stream is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._flush)
            elif stream is None and self.other_requests is not None:
                on_result, on_refused, on_token = self.other_requests
                if method == "on_output":
                    on_result(*payload)
                else:
                    (on_token if method == "on_token" else on_refused)(rid, *payload)
        return hand_over

    def _flush(self) -> None:
        """Apply the streams' pending events on the loop, in the order they came."""
        with self._lock:
            items, self._pending = self._pending, []
            self._flush_scheduled = False
        for stream, method, payload, at_s in items:
            getattr(stream, method)(*payload)
            stream.arrived(method, at_s)

    def attach(self, router) -> None:
        """Serve on ``router`` (its pipeline open) from the running event loop."""
        self.router = router
        self._loop = asyncio.get_running_loop()

    # -- state --------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A pipeline takes requests and the server is not draining."""
        return (self.router is not None and not self.draining and self.router.active is not None
                and self.router.active.alive)

    @property
    def num_instances(self) -> int:
        """Pipeline instances requests are routed to now (0 before the pipeline is live)."""
        return len(self.router.instances) if self.router is not None else 0

    def metrics_exposition(self) -> bytes:
        """``/metrics``: the registry in Prometheus text format, without the series of pipelines that are
        gone (retired after a shift or a scale-in, or failed)."""
        live = None if self.router is None else [ln.lane_id for ln in self.router.lanes if ln.alive]
        return self.metrics.exposition(live)

    def instance_status(self) -> list[dict]:
        """Per serving instance: its id, gear, open requests and requests finished there (``/ready``)."""
        if self.fleet is None:
            return []
        return [{"instance_id": st.instance_id, "gear_id": st.gear_id, "open_requests": st.open_requests,
                 "requests_finished": st.requests_finished} for st in self.fleet.instances]

    @property
    def max_model_len(self) -> int | None:
        """The longest request (prompt + ``max_tokens``) the live pipeline serves: the context, or less
        where one lane of its KV pool holds less (``/v1/models``' ``max_model_len``, which load tools
        read); with several instances, the most one of them holds (the router sends a request to one that
        holds it); the context when no pipeline is live."""
        if self.router is None or self.router.active is None:
            return self.max_context_tokens
        lanes = self.router.instances or [self.router.active]
        return max(ln.runtime.longest_request_tokens for ln in lanes)  # the context already bounds each

    @property
    def pending(self) -> int:
        """Requests accepted and not yet finished."""
        with self._lock:
            return len(self._streams)

    def check_admission(self) -> None:
        """Raises:
            APIError: 503 while draining or before the pipeline is live; 429 when ``max_pending``
                requests are already open."""
        if not self.ready:
            raise APIError(503, "the server is draining or its pipeline is not live; retry shortly",
                           type="service_unavailable", code="not_ready")
        if self.pending >= self.max_pending:
            raise APIError(429, f"{self.pending} requests are open (limit {self.max_pending}); retry later",
                           type="rate_limit_error", code="queue_full")

    def _steady(self) -> bool:
        """Every instance requests are routed to is in its steady state (no shift under way: refusals are
        final)."""
        router = self.router
        lanes: list = router.instances if router is not None else []
        return bool(lanes) and all(ln.refusal_policy == "final" for ln in lanes)

    @property
    def fair_share_tokens(self) -> int | None:
        """What a request that sets no ``max_tokens`` may generate by default: what one lane of the KV pool
        holds (``max_model_len``) divided by the gear's micro-batch size, at least 16, so a full micro-batch of
        such requests fits one lane together. The scheduler reserves a request's whole prompt + ``max_tokens``
        at admission (no preemption): the rest of the context as a default would let one such request hold
        the pool and keep every other request waiting. Taken from the instances in their steady state
        and kept through a shift (a warming gear's pool is small until it grows); with several instances, the
        smallest of theirs (a default then fits whichever takes it). None before a pipeline was live."""
        lanes: list = [ln for ln in self.router.instances if ln.refusal_policy == "final"] if self.router is not None else []
        if lanes:
            self._fair_share = min(max(16, ln.runtime.longest_request_tokens // max(1, ln.gear.micro_batch_size))
                                   for ln in lanes)
        return self._fair_share

    @property
    def served_limit_tokens(self) -> int | None:
        """The longest request (prompt + ``max_tokens``) the door admits: :attr:`max_model_len` while the
        instances serve in their steady state (with several, the most one of them holds: the router sends a
        request to one that holds it), else the context: during a shift a request the new gear's pool cannot
        hold yet waits for it to grow, and the pipeline's own check decides then."""
        return self.max_model_len if self._steady() else self.max_context_tokens

    def check_context(self, prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """The request's ``max_tokens``: when None, ``default_max_tokens`` (else :attr:`fair_share_tokens`), cut
        to what :attr:`served_limit_tokens` leaves after the prompt.

        Raises:
            APIError: 400 ``context_length_exceeded`` when prompt + ``max_tokens`` exceed
                :attr:`served_limit_tokens` (``/v1/models``' ``max_model_len`` in the steady state).
        """
        limit = self.served_limit_tokens
        if limit is None:
            if max_tokens is None:
                raise APIError(400, "max_tokens is required (this model's context length is unknown)",
                               param="max_tokens")
            return max_tokens
        default = self.default_max_tokens or self.fair_share_tokens or limit
        wanted = max_tokens if max_tokens is not None else min(default, limit - prompt_tokens)
        if prompt_tokens + max(wanted, 1) > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + max(wanted, 1)} tokens ({prompt_tokens} in the {param}, "
                                f"{max(wanted, 1)} in the completion). Please reduce the length of the {param} "
                                "or the completion.", param=param, code="context_length_exceeded")
        return wanted

    def fail_open(self, reason: str) -> int:
        """The pipeline failed: refuse new requests and end every open one with a 503 naming ``reason``
        (on the event loop's thread). Returns how many were open."""
        self.failure = reason
        self.draining = True
        with self._lock:
            open_streams = list(self._streams.values())
        for stream in open_streams:
            stream.on_closed(reason)
        return len(open_streams)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503) and wait up to ``timeout_s`` for the open ones to finish; the
        ones still open then end with a 503. Returns how many were cut off."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            left = list(self._streams.values())
        for stream in left:
            stream.on_closed(f"shutdown after a {timeout_s:g} s drain")
        return len(left)

    # -- serving (event loop) -----------------------------------------------------------------------
    async def generate(self, gen: Generation) -> AsyncGenerator[Piece, None]:
        """Serve ``gen``; yields text pieces as tokens come, the last with its finish reason and counts.

        Raises:
            APIError: 400 when the pipeline refuses the request (larger than its KV pool, over the
                context); 503 when the server closes before it finished.
        """
        assert self.router is not None, "attach() the router first"
        request_id = f"fd-{next(self._seq)}-{uuid.uuid4().hex[:8]}"
        stream = _Stream(gen, time.monotonic())
        with self._lock:
            self._streams[request_id] = stream
        cls = gen.priority_class
        self.metrics.running.labels(cls).inc()
        try:
            stream.submitted_s = time.monotonic()
            self.router.submit([Request(request_id, list(gen.prompt_token_ids), gen.max_tokens,
                                        priority=PRIORITY_ONLINE if cls == "online" else PRIORITY_OFFLINE,
                                        temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
                                        eos_token_ids=self.eos_token_ids)])
            async for piece in self._pieces(stream):
                yield piece
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            self.metrics.running.labels(cls).dec()
            # a stop sequence, or the client left (False: its result was on its way, not yet applied here)
            if stream.output is None and stream.refusal is None and self.router.cancel(request_id):
                self.metrics.cancelled.labels(cls).inc()

    async def _pieces(self, stream: _Stream) -> AsyncIterator[Piece]:
        gen, sent_text, counted = stream.gen, "", 0
        detok = IncrementalDetokenizer(self.tokenizer)
        hold = max((len(s) for s in gen.stop), default=1) - 1  # a stop sequence's start may be at the end
        while True:
            await stream.wake.wait()
            stream.wake.clear()
            if stream.refusal is not None:
                raise APIError(400, f"the pipeline refused the request: {stream.refusal}", param="max_tokens")
            if stream.closed is not None:
                raise APIError(503, f"the server closed before the request finished: {stream.closed}",
                               type="service_unavailable", code="server_closed")
            tokens = list(stream.tokens)
            output = stream.output
            done = output is not None
            text = detok.text_of(tokens, final=done)
            finish = output.finish_reason if output is not None else None
            cut = _first_stop(text, gen.stop, max(len(sent_text) - hold, 0))
            completion_tokens = len(tokens)
            if cut is not None:
                text, finish, done = text[:cut], "stop", True
                completion_tokens = tokens_through_stop(self.tokenizer, tokens, gen.stop)
            elif not done:
                text = text[:max(len(text) - hold, 0)]  # the end may be a stop sequence's start
                if text.endswith("\ufffd"):  # a character whose bytes are not all out yet
                    text = text.rstrip("\ufffd")
            piece = text[len(sent_text):] if text.startswith(sent_text) else ""
            sent_text += piece
            if tokens and not counted:  # its prefill is done: counted whether the client stays to the end or not
                self.metrics.prompt_tokens.labels(gen.priority_class).inc(len(gen.prompt_token_ids))
            new_tokens = len(tokens) - counted
            counted = len(tokens)
            self.metrics.generation_tokens.labels(gen.priority_class).inc(new_tokens)
            if done:
                self._observe(stream, completion_tokens)
                yield Piece(piece, finish, len(gen.prompt_token_ids), completion_tokens,
                            pipeline_timings(stream, completion_tokens, cut=cut is not None))
                return
            if piece:
                yield Piece(piece)

    def _observe(self, stream: _Stream, completion_tokens: int) -> None:
        cls = stream.gen.priority_class
        now = time.monotonic()
        first = stream.first_token_s or now
        self.metrics.ttft.labels(cls).observe(first - stream.accepted_s)
        self.metrics.e2e.labels(cls).observe(now - stream.accepted_s)
        if completion_tokens > 1:
            self.metrics.tpot.labels(cls).observe((now - first) / (completion_tokens - 1))


def pipeline_timings(stream: _Stream, completion_tokens: int, cut: bool = False) -> dict[str, float | None]:
    """The pipeline's own latencies for a finished ``stream``, ms, as a caller of the router in this
    process would measure them: from the hand-over to the router to the first token (``ttft_ms``) and to
    the result (``e2e_ms``) reaching the server, and ``tpot_ms`` = (result - first token) /
    (``completion_tokens`` - 1) (None for one token). With ``cut`` (a stop sequence ended the response
    before the pipeline's result) the figures end at the arrival of token ``completion_tokens``, the one
    that completed the stop.

    HTTP's share of a client's latency is at least the client's figure minus these: request parsing and
    admission before the hand-over; the event loop, SSE and the network after the arrival. At least: a
    pump thread notes an arrival once it holds the GIL, so event-loop work that keeps it waiting
    (up to the interpreter's 5-ms switch interval, more when the host's cores are short) counts as the
    pipeline's here.
    """
    arrivals = stream.token_arrival_s
    assert stream.submitted_s is not None and (arrivals or stream.result_s is not None), \
        "a finished stream has had a token or its result"
    first = arrivals[0] if arrivals else stream.result_s
    done = arrivals[min(completion_tokens, len(arrivals)) - 1] if cut or stream.result_s is None else stream.result_s
    assert first is not None and done is not None

    def ms(seconds: float) -> float:
        return round(1e3 * seconds, 3)

    return {"ttft_ms": ms(first - stream.submitted_s), "e2e_ms": ms(done - stream.submitted_s),
            "tpot_ms": ms((done - first) / (completion_tokens - 1)) if completion_tokens > 1 else None}


class IncrementalDetokenizer:
    """A growing token list's text, decoding only the last few tokens per call (not the whole list).

    The method of Hugging Face's text-generation-inference and vLLM: decode a window from
    ``prefix_offset`` with and without the new tokens and append the difference, so a tokenizer that
    drops or merges a leading space at a window's start still gives the right text. A window whose
    text ends in U+FFFD (a character whose bytes are not all out) waits for the next token.

    Args:
        tokenizer: a ``transformers`` tokenizer (special tokens are skipped).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def text_of(self, tokens: list[int], final: bool = False) -> str:
        """The text of ``tokens`` (the same list, grown since the last call); ``final`` flushes a
        trailing incomplete character as it decodes."""
        if self._read_offset >= len(tokens):
            return self.text
        decode = self.tokenizer.decode
        prefix = decode(tokens[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        new = decode(tokens[self._prefix_offset:], skip_special_tokens=True)
        if new.endswith("\ufffd") and not final:
            return self.text
        if len(new) > len(prefix) or final:
            self.text += new[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(tokens)
        return self.text


def tokens_through_stop(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> int:
    """The fewest leading tokens of ``tokens`` whose text holds one of ``stops``: the completion's
    token count when it ends at a stop sequence (the tokens sampled after it are not the answer's),
    ``len(tokens)`` when none holds one. A binary search: ``log2(len(tokens))`` decodes."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop(tokenizer.decode(tokens[:mid], skip_special_tokens=True), stops, 0) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first of ``stops`` begins in ``text`` at or after ``start``, else None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
