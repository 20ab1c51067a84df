"""Framed messages between pipeline ranks over ``torch.distributed`` point-to-point send/recv.

A message is: a fixed ``int64[8]`` header (kind, metadata bytes, tensor rank, dtype code, up to 4
dims), then the pickled metadata as a ``uint8`` tensor, then the tensor itself. Shapes travel
ahead of data, so the receiver allocates exactly and sequence lengths may change every step
(gloo aborts on a size mismatch otherwise). The header and metadata always travel in host memory
(gloo), the tensor on ``device``: host memory under gloo, the rank's GPU under the
``cpu:gloo,cuda:nccl`` backend (NCCL). Because headers are gloo messages, a rank that is fed by
several others (stage replicas) can take the next header from whichever sender is ready
(:func:`recv_message_any`) and then the rest of that message from that sender.

Message kinds: ``BATCH`` (a micro-batch's metadata + input / activations), ``RESULT`` (last stage
-> driver: sampled tokens), ``RECONFIGURE`` / ``RECONFIGURED`` (new layer ranges, KV pool size),
``STOP``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

BATCH, RESULT, RECONFIGURE, RECONFIGURED, STOP = 1, 2, 3, 4, 5
KIND_NAMES = {BATCH: "BATCH", RESULT: "RESULT", RECONFIGURE: "RECONFIGURE", RECONFIGURED: "RECONFIGURED",
              STOP: "STOP"}
_HEADER_LEN = 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]


class TransportError(RuntimeError):
    """A peer closed the connection or sent a malformed frame."""


def send_message(dst: int, kind: int, meta: Any = None, tensor: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> None:
    """Send one framed message to rank ``dst`` (blocking). ``tensor`` has at most 4 dims."""
    payload = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
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
    dist.send(header, dst)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst)
    if tensor is not None:
        dist.send(tensor.contiguous().to(device), dst)


def recv_message(src: int, device: torch.device | str = "cpu") -> tuple[int, Any, torch.Tensor | None]:
    """Receive one framed message from rank ``src`` (blocking): ``(kind, meta, tensor or None)``."""
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src)
    return _rest(src, header, device)


def recv_message_any(device: torch.device | str = "cpu") -> tuple[int, int, Any, torch.Tensor | None]:
    """Receive the next framed message from whichever rank sends first: ``(src, kind, meta, tensor)``."""
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    src = dist.recv(header)
    return (src, *_rest(src, header, device))


def _rest(src: int, header: torch.Tensor, device) -> tuple[int, Any, torch.Tensor | None]:
    h = header.tolist()
    kind, nbytes, ndim = h[0], h[1], h[2]
    if kind not in KIND_NAMES or nbytes < 0:
        raise TransportError(f"malformed header from rank {src}: {h}")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dist.recv(buf, src)
    meta = pickle.loads(buf.numpy().tobytes())
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
