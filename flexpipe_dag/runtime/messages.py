"""Typed messages between the runtime's processes (pure: no torch), and their JSON wire form.

Three channels carry them:

* **parent -> driver** (a ``multiprocessing`` queue, this host): :class:`AddRequests`,
  :class:`AbortRequests`, :class:`Reconfigure`, :class:`FlushMetrics`, :class:`StopPipeline`;
* **driver / workers -> parent** (the same kind of queue, or for workers on other hosts the
  head's control store): :class:`StageReady`, :class:`ProcessFailed`, :class:`RequestFinished`,
  :class:`MetricsSampled`, :class:`Reconfigured`, :class:`RequestRefused`, :class:`Stopped`;
* **between ranks** (``torch.distributed``; :mod:`~flexpipe_dag.runtime.transport`): a
  :class:`MessageKind` in the frame header and its payload, :data:`PAYLOAD_TYPES`
  (a :class:`~flexpipe_dag.runtime.scheduler.MicroBatch`, a :class:`StepResult`, a
  :class:`StageReload`, nothing for ``STOP``).

Whatever crosses a network (rank to rank, the control store) travels as JSON written by
:func:`to_json` and is rebuilt by :func:`from_json`, which checks every field against the
dataclass's annotations and raises :class:`MessageError` naming what is wrong; nothing received
is unpickled. The shape follows DeepSpeed's ``PipeInstruction`` classes and vLLM's
``SchedulerOutput``: one small frozen dataclass per message.

Shared counters: one row of :data:`COUNTER_SLOTS` ``double`` values per rank in a shared array
(:func:`counter_index`); rank 0 (the driver) uses the slots of :class:`DriverCounter`, worker
ranks those of :class:`WorkerCounter`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Union

from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.runtime.scheduler import MicroBatch, Request, RequestOutput


class MessageError(ValueError):
    """A message received from another process does not have the expected type or fields."""


# -- frame kinds between ranks ---------------------------------------------------------------------
class MessageKind(IntEnum):
    """Kind of a framed message between ranks (the first value of the frame header).

    ``BATCH``: a micro-batch's metadata plus the stage input (token ids for stage 0, activations
    after); ``RESULT``: last stage -> driver, the sampled tokens; ``RECONFIGURE``: new layer ranges
    and KV pool, passed down the stages; ``RECONFIGURED``: last stage -> driver, every worker's new
    :class:`StageInfo`; ``STOP``: end the serving loop.
    """

    BATCH = 1
    RESULT = 2
    RECONFIGURE = 3
    RECONFIGURED = 4
    STOP = 5


# -- shared counters -------------------------------------------------------------------------------
#: ``double`` values per rank in the shared counter array (and in a remote worker's heartbeat).
COUNTER_SLOTS = 4


class WorkerCounter(IntEnum):
    """Counter slots of a worker rank.

    ``STEPS``: micro-batches this worker computed and handed on (a count); ``BUSY_S``: seconds spent
    computing, summed; ``STEP_STARTED``: the worker's ``time.monotonic()`` when the running step
    started, 0.0 while idle.
    """

    STEPS = 0
    BUSY_S = 1
    STEP_STARTED = 2


class DriverCounter(IntEnum):
    """Counter slots of the driver (rank 0).

    ``MICRO_BATCHES_SENT``: micro-batches sent into the pipeline (a count);
    ``MICRO_BATCHES_DONE``: micro-batches whose sampled tokens came back (a count). The watchdog
    looks for stalls while sent > done.
    """

    MICRO_BATCHES_SENT = 0
    MICRO_BATCHES_DONE = 3


def counter_index(rank: int, slot: int) -> int:
    """Index of ``slot`` (a :class:`WorkerCounter` or :class:`DriverCounter`) of ``rank`` in the shared array."""
    return rank * COUNTER_SLOTS + int(slot)


# -- configuration and stage facts -----------------------------------------------------------------
@dataclass(frozen=True)
class SchedulerConfig:
    """How the driver's :class:`~flexpipe_dag.runtime.scheduler.Scheduler` batches.

    Attributes:
        micro_batch_size: most sequences in one micro-batch (the gear's ``micro_batch_size``).
        max_inflight_micro_batches: most micro-batches in the pipeline at once, per lane.
        max_tokens_per_micro_batch: token budget of one micro-batch (prefill tokens + 1 per decode).
        max_context_tokens: the model's max context (prompt + generated tokens); ``None``: not checked.
        kv_capacity_knob: what a KV refusal tells the user to raise (the entry point's flag or field).
        stream_tokens: report every sampled token as it comes (:class:`TokensGenerated`), for streaming
            front ends; off, only finished requests are reported.
        chunked_prefill: cut prompts into chunks that fill the token budget
            (:class:`~flexpipe_dag.runtime.scheduler.Scheduler`).

    Raises:
        ValueError: a number below 1.
    """

    micro_batch_size: int
    max_inflight_micro_batches: int
    max_tokens_per_micro_batch: int = 2048
    max_context_tokens: int | None = None
    kv_capacity_knob: str = "the gear's kv_capacity_tokens"
    stream_tokens: bool = False
    chunked_prefill: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"SchedulerConfig.{f.name} must be >= 1, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class StageInfo:
    """What one worker (one replica of one stage) reports once it has loaded its layers.

    Attributes:
        stage_index, replica_index: which worker (replica 0 when the stage is not replicated).
        layer_start, layer_end: its decoder layers, ``[layer_start, layer_end)``.
        param_bytes: bytes of its parameters; kv_pool_bytes: bytes of its K/V pool.
        kv_capacity_tokens: tokens its K/V pool holds.
        pid, host: its process id and host name.
        observations_path: its per-step observation ring (:mod:`~flexpipe_dag.runtime.observations`),
            ``None`` before the ring exists.
    """

    stage_index: int
    replica_index: int
    layer_start: int
    layer_end: int
    param_bytes: int
    kv_pool_bytes: int
    kv_capacity_tokens: int
    pid: int
    host: str
    observations_path: str | None = None

    @property
    def slot(self) -> tuple[int, int]:
        """``(stage_index, replica_index)``: the key of a worker across processes."""
        return self.stage_index, self.replica_index

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the form of ``PipelineRuntime.stage_info``)."""
        return dataclasses.asdict(self)


def worker_slot(info: StageInfo) -> tuple[int, int]:
    """``(stage, replica)`` of a worker's info (a sort key); same as :attr:`StageInfo.slot`."""
    return info.slot


# -- parent -> driver ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequests:
    """Queue ``requests`` (each is admitted or answered with :class:`RequestRefused`)."""

    requests: tuple[Request, ...]


@dataclass(frozen=True)
class AbortRequests:
    """End these requests (:meth:`~flexpipe_dag.runtime.scheduler.Scheduler.abort`): each comes back as a
    :class:`RequestFinished` with ``finish_reason`` ``"abort"``, unless it finished or was refused first."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Reconfigure:
    """Move the running processes to a new gear: pause admission, drain, reload every stage, resume.

    Attributes:
        gear_id: the new gear (names later metric samples).
        ranges: per stage, ``(layer_start, layer_end)``.
        num_blocks: KV blocks of the new pool (per replica at most; :class:`~flexpipe_dag.runtime.lanes.LaneLayout`).
        block_size_tokens: tokens per KV block.
        micro_batch_size: most sequences per micro-batch under the new gear.
        max_inflight_micro_batches: most micro-batches in flight per lane under the new gear.
    """

    gear_id: str
    ranges: tuple[tuple[int, int], ...]
    num_blocks: int
    block_size_tokens: int
    micro_batch_size: int
    max_inflight_micro_batches: int


@dataclass(frozen=True)
class FlushMetrics:
    """Emit a metrics sample now (covering the time since the last one)."""


@dataclass(frozen=True)
class StopPipeline:
    """Drain running sequences, then stop every stage (queued requests are dropped)."""


DriverCommand = AddRequests | AbortRequests | Reconfigure | FlushMetrics | StopPipeline


# -- between ranks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """``RESULT`` payload: the tokens the last stage sampled for micro-batch ``mb_id``, one per sequence."""

    mb_id: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StageReload:
    """``RECONFIGURE`` / ``RECONFIGURED`` payload: the command, and the :class:`StageInfo` of every
    worker that has reloaded so far (all of them when it reaches the driver)."""

    command: Reconfigure
    infos: tuple[StageInfo, ...] = ()


#: Payload type of each frame kind (``None``: no payload).
PAYLOAD_TYPES: dict[MessageKind, type | None] = {
    MessageKind.BATCH: MicroBatch, MessageKind.RESULT: StepResult, MessageKind.RECONFIGURE: StageReload,
    MessageKind.RECONFIGURED: StageReload, MessageKind.STOP: None}


# -- driver / workers -> parent --------------------------------------------------------------------
@dataclass(frozen=True)
class StageReady:
    """Worker ``worker`` (rank ``worker + 1``) loaded its layers and serves."""

    worker: int
    info: StageInfo


@dataclass(frozen=True)
class ProcessFailed:
    """A process failed and is exiting.

    Attributes:
        source: the worker index, or ``"driver"``.
        message: exception type, message and a short traceback.
        in_transport: it failed while sending / receiving (so likely because a peer died).
    """

    source: int | str
    message: str
    in_transport: bool


@dataclass(frozen=True)
class RequestFinished:
    """A request finished."""

    output: RequestOutput


@dataclass(frozen=True)
class TokensGenerated:
    """Tokens sampled by one pipeline step (only with ``SchedulerConfig.stream_tokens``).

    Attributes:
        tokens: ``(request_id, index, token_id)`` per sequence of the step; ``index`` is the token's
            0-based position among the request's output tokens.
    """

    tokens: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class MetricsSampled:
    """A live metrics sample of the pipeline."""

    sample: MetricSample


@dataclass(frozen=True)
class Reconfigured:
    """Every worker reloaded under a :class:`Reconfigure`; their new infos, any order."""

    infos: tuple[StageInfo, ...]


@dataclass(frozen=True)
class RequestRefused:
    """The scheduler refused a request (e.g. larger than the KV pool, or a duplicate id)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Stopped:
    """The driver stopped every stage after :class:`StopPipeline`; it exits next."""


RuntimeEvent = (StageReady | ProcessFailed | RequestFinished | TokensGenerated | MetricsSampled | Reconfigured
                | RequestRefused | Stopped)


# -- JSON wire form --------------------------------------------------------------------------------
def to_json(obj: Any) -> bytes:
    """UTF-8 JSON of a dataclass instance (nested dataclasses, lists, tuples, dicts, scalars), tagged
    with its class name; the inverse of :func:`from_json`.

    Raises:
        TypeError: a value JSON cannot hold.
    """
    return json.dumps({"type": type(obj).__name__, "value": _plain(obj)}, separators=(",", ":")).encode()


def from_json(expected: type | tuple[type, ...], data: bytes | str, source: str = "a peer") -> Any:
    """Rebuild a dataclass written by :func:`to_json`, checking it against ``expected``'s annotations.

    Args:
        expected: the dataclass, or several: the tag picks one.
        data: the JSON bytes.
        source: who sent it, for the error message.

    Raises:
        MessageError: not JSON, another type than expected, a missing or unknown field, or a field of
            the wrong type.
    """
    allowed = expected if isinstance(expected, tuple) else (expected,)
    names = {c.__name__: c for c in allowed}
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageError(f"message from {source} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"type", "value"}:
        raise MessageError(f"message from {source}: expected {{'type', 'value'}}, got {_short(doc)}")
    cls = names.get(doc["type"]) if isinstance(doc["type"], str) else None
    if cls is None:
        raise MessageError(f"message from {source}: expected {' or '.join(names)}, got type {_short(doc['type'])}")
    return _decode(cls, doc["value"], f"{cls.__name__} from {source}")


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"{type(v).__name__} cannot travel as JSON")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _decode(tp: Any, v: Any, where: str) -> Any:  # one case per annotation form
    if tp is Any:
        return v
    if tp is type(None):
        if v is not None:
            raise MessageError(f"{where}: expected null, got {_short(v)}")
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type (an annotation, not an instance)
        if not isinstance(v, dict):
            raise MessageError(f"{where}: expected an object, got {_short(v)}")
        fields = {f.name for f in dataclasses.fields(tp)}
        missing, unknown = sorted(fields - set(v)), sorted(set(v) - fields)
        if missing or unknown:
            raise MessageError(f"{where}: " + "; ".join(
                ([f"missing field(s) {missing}"] if missing else []) + ([f"unknown field(s) {unknown}"] if unknown else [])))
        hints = _hints(tp)
        return tp(**{k: _decode(hints[k], v[k], f"{where}.{k}") for k in fields})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                return _decode(arg, v, where)
            except MessageError as exc:
                errors.append(str(exc))
        raise MessageError(errors[-1] if len(errors) == 1 else f"{where}: {_short(v)} matches none of {args}")
    if origin is tuple or origin is list or tp in (tuple, list):
        if not isinstance(v, list):
            raise MessageError(f"{where}: expected a list, got {_short(v)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(v) != len(args):
                raise MessageError(f"{where}: expected {len(args)} items, got {len(v)}")
            return tuple(_decode(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
        item = args[0] if args else Any
        out = [_decode(item, x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(v, dict):
            raise MessageError(f"{where}: expected an object, got {_short(v)}")
        value = args[1] if args else Any
        return {k: _decode(value, x, f"{where}.{k}") for k, x in v.items()}
    if tp is bool:
        if not isinstance(v, bool):
            raise MessageError(f"{where}: expected a boolean, got {_short(v)}")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise MessageError(f"{where}: expected an integer, got {_short(v)}")
        return v
    if tp is float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise MessageError(f"{where}: expected a number, got {_short(v)}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise MessageError(f"{where}: expected a string, got {_short(v)}")
        return v
    raise MessageError(f"{where}: annotation {tp!r} cannot be read from JSON")
