"""Framed messages between pipeline ranks over ``torch.distributed`` point-to-point send/recv.

A message is: a fixed ``int64[8]`` header (kind, payload bytes, tensor rank, dtype code, up to 4
dims), then the payload as a ``uint8`` tensor (JSON of the kind's dataclass,
:data:`~flexpipe_dag.runtime.messages.PAYLOAD_TYPES`; checked on receipt, never unpickled), then
the tensor itself. Shapes travel
ahead of data, so the receiver allocates exactly and sequence lengths may change every step
(gloo aborts on a size mismatch otherwise); what a header claims is checked against
:data:`MAX_PAYLOAD_BYTES` and :data:`MAX_TENSOR_BYTES` before anything is allocated. The header and metadata always travel in host memory
(gloo), the tensor on ``device``: host memory under gloo, the rank's GPU under the
``cpu:gloo,cuda:nccl`` backend (NCCL). Because headers are gloo messages, a rank that is fed by
several others (stage replicas) can take the next header from whichever sender is ready
(:func:`recv_message_any`) and then the rest of that message from that sender.

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

_HEADER_LEN = 8
_NO_PAYLOAD = b"null"  # a kind without payload still sends a (non-empty) one
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
#: Largest JSON payload a header may announce, bytes (a micro-batch's metadata is kilobytes).
MAX_PAYLOAD_BYTES = 64 << 20
#: Largest tensor a header may announce, bytes (a micro-batch's activations are megabytes).
MAX_TENSOR_BYTES = 4 << 30


class TransportError(RuntimeError):
    """A peer closed the connection or sent a malformed frame."""


def send_message(dst: int, kind: MessageKind, meta: Any = None, tensor: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> None:
    """Send one framed message to rank ``dst`` (blocking).

    Args:
        kind: the frame kind; ``meta`` must be an instance of its payload type
            (:data:`~flexpipe_dag.runtime.messages.PAYLOAD_TYPES`, ``None`` for ``STOP``).
        tensor: at most 4 dims, any of the dtypes in the header's table.

    Raises:
        TypeError: ``meta`` is not the kind's payload type.
        ValueError: a tensor of more than 4 dims.
    """
    send_framed(dst, frame(kind, meta, tensor, device))


def send_framed(dst: int, parts: list[torch.Tensor]) -> float:
    """Send a framed message's parts (:func:`frame`) to ``dst``, blocking; returns the milliseconds the
    payload and tensor took once the header was through.

    A point-to-point send waits until the receiver has posted its receive, so the header's send
    holds the time the receiver was still busy; once it is through the receiver is taking the rest,
    and the time of the rest is the transfer itself (what link calibration fits).
    """
    dist.send(parts[0], dst)
    t0 = time.monotonic()
    for part in parts[1:]:
        dist.send(part, dst)
    return (time.monotonic() - t0) * 1e3


def frame(kind: MessageKind, meta: Any, tensor: torch.Tensor | None, device) -> list[torch.Tensor]:
    """The tensors of one framed message, in sending order: header, payload and the tensor if any."""
    want = PAYLOAD_TYPES[MessageKind(kind)]
    if (meta is None) != (want is None) or (want is not None and not isinstance(meta, want)):
        raise TypeError(f"{MessageKind(kind).name} carries {want.__name__ if want else 'no payload'}, "
                        f"got {type(meta).__name__}")
    payload = _NO_PAYLOAD if meta is None else to_json(meta)
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = kind, len(payload)
    if tensor is not None:
        if tensor.dim() > 4:
            raise ValueError(f"tensor rank {tensor.dim()} > 4")
        header[2], header[3] = tensor.dim(), _DTYPES.index(tensor.dtype)
        for i, d in enumerate(tensor.shape):
            header[4 + i] = d
    else:
        header[2] = -1
    parts = [header, torch.frombuffer(bytearray(payload), dtype=torch.uint8)]
    if tensor is not None:
        parts.append(tensor.contiguous().to(device))
    return parts


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


def recv_message(src: int, device: torch.device | str = "cpu") -> tuple[MessageKind, Any, torch.Tensor | None]:
    """Receive one framed message from rank ``src`` (blocking): ``(kind, payload, tensor or None)``.

    Raises:
        TransportError: a malformed header or payload (naming the sender).
    """
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src)
    return _rest(src, header, device)


def recv_message_any(device: torch.device | str = "cpu") -> tuple[int, MessageKind, Any, torch.Tensor | None]:
    """Receive the next framed message from whichever rank sends first: ``(src, kind, payload, tensor)``.

    Raises:
        TransportError: as :func:`recv_message`.
    """
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    src = dist.recv(header)
    return (src, *_rest(src, header, device))


def _rest(src: int, header: torch.Tensor, device) -> tuple[MessageKind, Any, torch.Tensor | None]:
    h = header.tolist()
    nbytes, ndim = h[1], h[2]
    if (h[0] not in MessageKind._value2member_map_ or not 0 <= nbytes <= MAX_PAYLOAD_BYTES or not -1 <= ndim <= 4
            or not -1 <= h[3] < len(_DTYPES) or (ndim >= 0 and h[3] < 0)
            or any(d < 0 for d in h[4:4 + max(ndim, 0)])):
        raise TransportError(f"malformed header from rank {src}: {h}")
    if ndim >= 0:
        elements = 1
        for d in h[4:4 + ndim]:
            elements *= d
        if elements * _DTYPES[h[3]].itemsize > MAX_TENSOR_BYTES:
            raise TransportError(f"header from rank {src} announces a tensor of {h[4:4 + ndim]} {_DTYPES[h[3]]} "
                                 f"over the {MAX_TENSOR_BYTES}-byte limit")
    kind = MessageKind(h[0])
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dist.recv(buf, src)
    want = PAYLOAD_TYPES[kind]
    try:
        if want is None:
            if buf.numpy().tobytes() != _NO_PAYLOAD:
                raise MessageError(f"{kind.name} carries no payload, got {nbytes} bytes")
            meta = None
        else:
            meta = from_json(want, buf.numpy().tobytes(), f"rank {src}")
    except MessageError as exc:
        raise TransportError(f"malformed {kind.name} from rank {src}: {exc}") from None
    tensor = None
    if ndim >= 0:
        tensor = torch.empty(h[4:4 + ndim], dtype=_DTYPES[h[3]], device=device)
        dist.recv(tensor, src)
    return kind, meta, tensor


def batch_input_ids(batch) -> torch.Tensor:
    """The first stage's input for a :class:`~flexpipe_dag.runtime.scheduler.MicroBatch`: the new
    tokens of every sequence, packed, ``int64 [T]``. Lives here (not in ``stage``) so the driver
    never imports transformers."""
    return torch.tensor([t for s in batch.seqs for t in s.token_ids], dtype=torch.long)
