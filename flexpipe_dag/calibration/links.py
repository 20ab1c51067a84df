"""Effective link latency and bandwidth from observed activation hand-offs (numpy only).

The runtime times, on the sending stage, how long handing a micro-batch's activations to the next
stage took (``send_ms`` for ``send_bytes``), from the moment the receiver took the message's header
(:func:`~flexpipe_dag.runtime.transport.send_framed`), so the time the receiver spent finishing its
previous micro-batch is left out. Scheduling noise still only adds time, so the time is an *upper*
bound on the transfer: the fit uses the lower envelope. Steps are binned by message size (powers of two); in each bin with at least
``min_per_bin`` hand-offs the ``quantile`` (default 10th percentile) time stands for the transfer
(the hand-offs that found the receiver waiting). A straight line ``t = latency + bytes / bandwidth``
is fitted to the bins by least squares weighted by bin counts; with bins of one size only, the
profiled latency is kept and only the bandwidth is fitted. Under ``min_observations`` hand-offs, or a
line with a non-positive slope, the profiled link is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinkFit:
    """Fitted (or kept) figures of one directed link.

    ``fitted`` is False when the profile was kept (``notes`` says why). ``num_bins``: size bins used.
    """

    src_device_id: str
    dst_device_id: str
    prior_bandwidth_gbps: float
    prior_latency_us: float
    bandwidth_gbps: float
    latency_us: float
    num_observations: int
    num_bins: int
    fitted: bool
    notes: tuple[str, ...] = ()


def fit_link(src: str, dst: str, send_bytes: np.ndarray, send_ms: np.ndarray, prior_bandwidth_gbps: float,
             prior_latency_us: float, *, min_observations: int = 20, min_per_bin: int = 5,
             quantile: float = 0.1) -> LinkFit:
    """Fit one link's effective latency (us) and bandwidth (GB/s) from hand-off times (see module doc).

    Raises:
        ValueError: the arrays differ in length.
    """
    b = np.asarray(send_bytes, dtype=float)
    t = np.asarray(send_ms, dtype=float)
    if b.shape != t.shape:
        raise ValueError(f"send_bytes {b.shape} and send_ms {t.shape} differ")
    ok = (b > 0) & np.isfinite(t) & (t > 0)
    b, t = b[ok], t[ok]
    keep = LinkFit(src, dst, prior_bandwidth_gbps, prior_latency_us, prior_bandwidth_gbps, prior_latency_us,
                   len(b), 0, False)
    if len(b) < min_observations:
        return _note(keep, f"{len(b)} hand-offs < {min_observations}: profile kept")
    bins = np.floor(np.log2(b)).astype(int)
    xs, ys, ws = [], [], []
    for k in np.unique(bins):
        sel = bins == k
        if sel.sum() >= min_per_bin:
            xs.append(float(np.median(b[sel])))
            ys.append(float(np.quantile(t[sel], quantile)))
            ws.append(float(sel.sum()))
    if not xs:
        return _note(keep, f"no message size has {min_per_bin} hand-offs: profile kept")
    x, y, w = np.array(xs), np.array(ys), np.array(ws)
    if len(x) >= 2 and x.max() >= 4 * x.min():
        A = np.stack([np.ones_like(x), x], axis=1) * np.sqrt(w)[:, None]
        (lat_ms, ms_per_byte), *_ = np.linalg.lstsq(A, y * np.sqrt(w), rcond=None)
        if ms_per_byte <= 0:
            return _note(keep, "hand-off time does not grow with message size: profile kept")
        lat_ms = max(0.0, float(lat_ms))
    else:
        lat_ms = prior_latency_us / 1e3
        per_byte = (y - lat_ms) / x
        ms_per_byte = float(np.average(per_byte, weights=w))
        if ms_per_byte <= 0:
            return _note(keep, "hand-offs are faster than the profiled latency alone: profile kept")
    bw = 1.0 / (ms_per_byte / 1e3) / 1e9
    if not math.isfinite(bw):
        return _note(keep, "non-finite bandwidth: profile kept")
    return LinkFit(src, dst, prior_bandwidth_gbps, prior_latency_us, float(bw), float(lat_ms * 1e3), len(b),
                   len(x), True, () if len(x) >= 2 else ("one message size: latency kept from the profile",))


def _note(fit: LinkFit, note: str) -> LinkFit:
    return LinkFit(**{**fit.__dict__, "notes": fit.notes + (note,)})
