"""Framed messages between pipeline ranks over ``torch.distributed`` point-to-point send/recv.

A message starts with a *head*: a ``uint8`` buffer of exactly :data:`HEAD_BYTES` bytes holding an
``int64[12]`` header (kind, payload bytes, tensor rank, dtype code, up to 4 dims, whether the body is
inline) and, when they fit, the body: the payload (JSON of the kind's dataclass,
:data:`~flexpipe_dag.runtime.messages.PAYLOAD_TYPES`; checked on receipt, never unpickled) and, for
a tensor in host memory, the tensor's bytes (16-byte aligned after the payload). A body that does
not fit follows as one ``uint8`` message of exactly its size, and a tensor on a GPU (the
``cpu:gloo,cuda:nccl`` backend: NCCL) follows as itself. Sizes travel in the header ahead of the
data, so the receiver allocates exactly (gloo aborts on a size mismatch otherwise); what a header
claims is checked against :data:`MAX_PAYLOAD_BYTES` and :data:`MAX_TENSOR_BYTES` before anything is
allocated.

Why a fixed head: a point-to-point send waits until the receiver has posted its receive, and on a
busy host each such rendezvous waits for the sending process's communication thread to get a CPU
(measured: about 1 ms per part on a 2-core host whose cores both compute). A decode micro-batch's
message is one head, and an :class:`Inbox` posts its receive for the next head as soon as it has
taken a message, so the sender's head completes while the receiver is still computing: the
receiver finds its next micro-batch already there.

Because heads are gloo messages, a rank fed by several others (stage replicas) can take the next
head from whichever sender is ready (``Inbox(None)``) and the rest of that message from that sender.

Message kinds: :class:`~flexpipe_dag.runtime.messages.MessageKind`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flexpipe_dag.runtime.messages import (
    PAYLOAD_TYPES,
    MessageError,
    MessageKind,
    from_json,
    to_json,
)

_HEADER_LEN = 12
_HEADER_BYTES = _HEADER_LEN * 8
_NO_PAYLOAD = b"null"  # a kind without payload still sends a (non-empty) one
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
#: Bytes of every message's head (header + an inline body when it fits): a decode micro-batch's
#: metadata and activations (32 sequences x 576-wide fp32: 74 KiB plus a few KiB of JSON) fit.
HEAD_BYTES = 128 << 10
#: Largest JSON payload a header may announce, bytes (a micro-batch's metadata is kilobytes).
MAX_PAYLOAD_BYTES = 64 << 20
#: Largest tensor a header may announce, bytes (a micro-batch's activations are megabytes).
MAX_TENSOR_BYTES = 4 << 30
_ALIGN = 16


class TransportError(RuntimeError):
    """A peer closed the connection or sent a malformed frame."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def send_message(dst: int, kind: MessageKind, meta: Any = None, tensor: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> None:
    """Send one framed message to rank ``dst`` (blocking).

    Args:
        kind: the frame kind; ``meta`` must be an instance of its payload type
            (:data:`~flexpipe_dag.runtime.messages.PAYLOAD_TYPES`, ``None`` for ``STOP``).
        tensor: at most 4 dims, any of the dtypes in the header's table; it travels on ``device``
            (host memory inline in the frame, a GPU as a message of its own).

    Raises:
        TypeError: ``meta`` is not the kind's payload type.
        ValueError: a tensor of more than 4 dims.
    """
    send_framed(dst, frame(kind, meta, tensor, device))


def send_framed(dst: int, parts: list[torch.Tensor]) -> float:
    """Send a framed message's parts (:func:`frame`) to ``dst``, blocking; returns the milliseconds
    from the receiver taking the head to the last part delivered (0 for a one-part message).

    A point-to-point send waits until the receiver has posted its receive, so the head's send
    holds the time the receiver was still busy; what follows is the transfer itself (what link
    calibration fits).
    """
    works = [_posted(dist.isend(part, dst)) for part in parts]  # all at once: gloo delivers them in order
    works[0].wait()
    t0 = time.monotonic()
    for work in works[1:]:
        work.wait()
    return (time.monotonic() - t0) * 1e3


def _sender_rank(work: Any) -> int:
    """The rank an any-source ``irecv`` (default group: group rank = global rank) got its message from.
    torch 2.13 deprecates ``Work.source_rank`` (a warning per call, printed into progress bars) and its own
    ``dist.recv`` reads ``_source_rank``; older releases have the public one only."""
    read = getattr(work, "_source_rank", None) or work.source_rank
    return int(read())


def _posted(work: Any) -> Any:
    """A point-to-point operation's handle (``isend`` / ``irecv`` return one in a process group)."""
    if work is None:
        raise TransportError("the process group posted no operation (this rank is not in the group)")
    return work


def frame(kind: MessageKind, meta: Any, tensor: torch.Tensor | None, device) -> list[torch.Tensor]:
    """The tensors of one framed message, in sending order: the head, then the body when it does not
    fit the head, then a GPU tensor.

    Raises:
        TypeError, ValueError: as :func:`send_message`.
    """
    want = PAYLOAD_TYPES[MessageKind(kind)]
    if (meta is None) != (want is None) or (want is not None and not isinstance(meta, want)):
        raise TypeError(f"{MessageKind(kind).name} carries {want.__name__ if want else 'no payload'}, "
                        f"got {type(meta).__name__}")
    payload = _NO_PAYLOAD if meta is None else to_json(meta)
    header = [0] * _HEADER_LEN
    header[0], header[1], header[2] = int(kind), len(payload), -1
    on_gpu = False
    if tensor is not None:
        if tensor.dim() > 4:
            raise ValueError(f"tensor rank {tensor.dim()} > 4")
        header[2], header[3] = tensor.dim(), _DTYPES.index(tensor.dtype)
        for i, d in enumerate(tensor.shape):
            header[4 + i] = d
        tensor = tensor.contiguous().to(device)
        on_gpu = tensor.device.type != "cpu"
    body_len = _aligned(len(payload)) + (0 if tensor is None or on_gpu else tensor.numel() * tensor.element_size())
    inline = _HEADER_BYTES + body_len <= HEAD_BYTES
    header[8] = int(inline)
    head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
    head[:_HEADER_BYTES] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    body = head[_HEADER_BYTES:_HEADER_BYTES + body_len] if inline else torch.empty(body_len, dtype=torch.uint8)
    body[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if tensor is not None and not on_gpu:
        raw_start = _aligned(len(payload))
        body[raw_start:].view(tensor.dtype).copy_(tensor.reshape(-1))
    parts = [head] if inline else [head, body]
    if tensor is not None and on_gpu:
        parts.append(tensor)
    return parts


class Inbox:
    """Receives framed messages from rank ``src`` (or, with None, from whichever rank sends first),
    with the receive for the next message's head always posted ahead (see the module docstring).

    Args:
        src: the sending rank, or None for any.
        device: where a tensor that travels on its own (a GPU's) is received.
    """

    def __init__(self, src: int | None, device: torch.device | str = "cpu"):
        self.src, self.device = src, device
        self._head: torch.Tensor | None = None
        self._work: Any = None

    def _post(self) -> None:
        self._head = torch.empty(HEAD_BYTES, dtype=torch.uint8)
        self._work = _posted(dist.irecv(self._head, self.src))

    def recv(self) -> tuple[int, MessageKind, Any, torch.Tensor | None]:
        """The next message: ``(src, kind, payload, tensor or None)``; blocks until it is here. After a
        ``STOP`` nothing more is posted (the sender is gone after it).

        Raises:
            TransportError: a malformed header or payload (naming the sender).
        """
        if self._work is None:
            self._post()
        work, head = self._work, self._head
        assert work is not None and head is not None
        work.wait()
        self._work = self._head = None
        src = self.src if self.src is not None else _sender_rank(work)
        kind, meta, tensor = _unframe(src, head, self.device)
        if kind != MessageKind.STOP:
            self._post()
        return src, kind, meta, tensor


def recv_message(src: int, device: torch.device | str = "cpu") -> tuple[MessageKind, Any, torch.Tensor | None]:
    """Receive one framed message from rank ``src`` (blocking): ``(kind, payload, tensor or None)``.

    Raises:
        TransportError: a malformed header or payload (naming the sender).
    """
    head = torch.empty(HEAD_BYTES, dtype=torch.uint8)
    dist.recv(head, src)
    return _unframe(src, head, device)


def check_header(src: int, h: list[int]) -> None:
    """Refuse a header whose claims are malformed or over the limits, before anything is allocated.

    Raises:
        TransportError: naming the sender and what is wrong.
    """
    nbytes, ndim = h[1], h[2]
    if (h[0] not in MessageKind._value2member_map_ or not 0 <= nbytes <= MAX_PAYLOAD_BYTES or not -1 <= ndim <= 4
            or not -1 <= h[3] < len(_DTYPES) or (ndim >= 0 and h[3] < 0)
            or any(d < 0 for d in h[4:4 + max(ndim, 0)]) or h[8] not in (0, 1)):
        raise TransportError(f"malformed header from rank {src}: {h[:9]}")
    if ndim >= 0:
        elements = 1
        for d in h[4:4 + ndim]:
            elements *= d
        if elements * _DTYPES[h[3]].itemsize > MAX_TENSOR_BYTES:
            raise TransportError(f"header from rank {src} announces a tensor of {h[4:4 + ndim]} {_DTYPES[h[3]]} "
                                 f"over the {MAX_TENSOR_BYTES}-byte limit")


def _unframe(src: int, head: torch.Tensor, device) -> tuple[MessageKind, Any, torch.Tensor | None]:
    h = head[:_HEADER_BYTES].view(torch.int64).tolist()
    check_header(src, h)
    kind, nbytes, ndim = MessageKind(h[0]), h[1], h[2]
    shape = h[4:4 + ndim] if ndim >= 0 else None
    dtype = _DTYPES[h[3]] if ndim >= 0 else None
    on_gpu = shape is not None and torch.device(device).type != "cpu"
    tensor_bytes = 0
    if shape is not None and not on_gpu:
        tensor_bytes = dtype.itemsize  # type: ignore[union-attr]
        for d in shape:
            tensor_bytes *= d
    body_len = _aligned(nbytes) + tensor_bytes
    if h[8]:
        if _HEADER_BYTES + body_len > HEAD_BYTES:
            raise TransportError(f"malformed header from rank {src}: an inline body of {body_len} bytes does not fit "
                                 f"the {HEAD_BYTES}-byte head")
        body = head[_HEADER_BYTES:_HEADER_BYTES + body_len]
    else:
        body = torch.empty(body_len, dtype=torch.uint8)
        dist.recv(body, src)
    want = PAYLOAD_TYPES[kind]
    data = body[:nbytes].numpy().tobytes()
    try:
        if want is None:
            if data != _NO_PAYLOAD:
                raise MessageError(f"{kind.name} carries no payload, got {nbytes} bytes")
            meta = None
        else:
            meta = from_json(want, data, f"rank {src}")
    except MessageError as exc:
        raise TransportError(f"malformed {kind.name} from rank {src}: {exc}") from None
    tensor = None
    if shape is not None and dtype is not None:
        if on_gpu:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src)
        else:
            start = _aligned(nbytes)
            tensor = body[start:start + tensor_bytes].view(dtype).view(shape)
    return kind, meta, tensor


class BackgroundSender:
    """Framed messages sent in order by a thread of their own, at most ``max_pending`` waiting.

    A stage hands a micro-batch on and goes straight back to receiving and computing the next one
    while this thread delivers it (hand-offs overlapped with compute; point-to-point sends block
    until the receiver has posted its receive). Once ``max_pending`` messages wait, :meth:`send`
    blocks, so a slow consumer bounds the activations held. Messages to one rank arrive in the
    order they were sent, as with :func:`send_message`, and each send is timed as :func:`send_framed`
    times it (``on_sent(tag, transfer_ms)`` once it is delivered: the transfer after the receiver took
    the header, not the wait for the receiver). A send that fails is raised, as a
    :class:`TransportError` naming it, by the next :meth:`send` or :meth:`flush`.

    Args:
        max_pending: messages that may wait to be sent (>= 1).
        on_sent: called in the sender thread after each delivery with the message's ``tag``.

    Raises:
        ValueError: ``max_pending`` < 1.
    """

    def __init__(self, max_pending: int = 2, on_sent: Callable[[Any, float], None] | None = None):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._on_sent = on_sent
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flexpipe-sender", daemon=True)
        self._thread.start()

    def send(self, dst: int, kind: MessageKind, meta: Any = None, tensor: torch.Tensor | None = None,
             device: torch.device | str = "cpu", tag: Any = None) -> None:
        """Queue one framed message to ``dst`` (framed now, so a bad one raises here, as :func:`send_message`).

        Raises:
            TypeError, ValueError: as :func:`send_message`.
            TransportError: an earlier send failed.
        """
        self._raise_failure()
        parts = frame(kind, meta, tensor, device)
        while True:
            try:
                self._queue.put((dst, parts, tag), timeout=0.5)
                return
            except queue.Full:
                self._raise_failure()

    def flush(self) -> None:
        """Wait until every queued message is delivered.

        Raises:
            TransportError: a send failed.
        """
        while self._queue.unfinished_tasks:
            self._raise_failure()
            with self._queue.all_tasks_done:
                self._queue.all_tasks_done.wait(timeout=0.5)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise TransportError(f"a background send failed: {type(self._error).__name__}: {self._error}")

    def _run(self) -> None:
        while True:
            dst, parts, tag = self._queue.get()
            try:
                if self._error is None:
                    transfer_ms = send_framed(dst, parts)
                    if self._on_sent is not None:
                        self._on_sent(tag, transfer_ms)
            except BaseException as exc:  # the stage's loop raises it at its next send or flush
                self._error = exc
            finally:
                self._queue.task_done()


def batch_input_ids(batch) -> torch.Tensor:
    """The first stage's input for a :class:`~flexpipe_dag.runtime.scheduler.MicroBatch`: the new
    tokens of every sequence, packed, ``int64 [T]``. Lives here (not in ``stage``) so the driver
    never imports transformers."""
    return torch.tensor([t for s in batch.seqs for t in s.token_ids], dtype=torch.long)
