"""Load testing an OpenAI-compatible endpoint with real traffic: a trace replayed at its own arrival
times (open loop), and a concurrency sweep (closed loop), measured at the client.

Each request is a streaming ``/v1/completions`` call whose prompt is token ids of the bundled corpus
cut to the trace row's input length, with ``max_tokens`` its output length (both capped), greedy.
Per request: TTFT (sent to first token), TPOT ((last - first token) / (tokens - 1)), end-to-end
latency, output tokens; a request that fails (HTTP error, broken stream) is counted, never dropped.
A level's summary gives percentiles, req/s, output tokens/s and goodput (requests per second that met
both SLO targets). The knee of a sweep is the smallest concurrency whose throughput is within 10 %
of the sweep's best: more clients past it add latency, not throughput.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Throughput share of the sweep's best at which the knee is placed.
KNEE_SHARE = 0.9


@dataclass(frozen=True)
class LoadRequest:
    """One request of a load test: prompt token ids, output cap, arrival (seconds from the start)."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Measured:
    """What the client saw of one request (seconds); ``error`` is None when it succeeded.

    ``pipeline_ttft_s`` / ``pipeline_tpot_s``: the same request's latencies as the server measured them
    where the pipeline's tokens reach it (a FlexPipe server's ``pipeline_timings``; None from a server
    that sends none): the client's figure minus the pipeline's is what HTTP added.
    """

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    output_tokens: int
    error: str | None = None
    pipeline_ttft_s: float | None = None
    pipeline_tpot_s: float | None = None


def requests_from_workload(workload, tokenizer, *, max_prompt_tokens: int, max_tokens: int,
                           speedup: float = 1.0) -> list[LoadRequest]:
    """The workload's requests as load-test requests: arrivals divided by ``speedup``, lengths capped."""
    from flexpipe_dag.serving.prompts import timed_requests

    timed = timed_requests(workload, tokenizer, (), max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_tokens)
    t0 = timed[0].arrival_s if timed else 0.0
    return [LoadRequest(list(t.request.prompt_token_ids), t.request.max_new_tokens, (t.arrival_s - t0) / speedup)
            for t in timed]


async def _one(client, url: str, model: str, req: LoadRequest, headers: dict) -> Measured:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first = last = None
    tokens = 0
    timings: dict = {}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return Measured(None, None, time.monotonic() - sent, 0, f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Measured(None, None, time.monotonic() - sent, tokens, str(chunk["error"].get("message")))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk.get("choices"):
                    now = time.monotonic()
                    first = first if first is not None else now
                    last = now
                    timings = chunk.get("pipeline_timings") or timings
    except Exception as exc:  # a broken connection is a failed request, counted
        return Measured(None, None, time.monotonic() - sent, tokens, f"{type(exc).__name__}: {exc}")
    if first is None:
        return Measured(None, None, time.monotonic() - sent, tokens, "no token received")
    assert last is not None
    return Measured(first - sent, (last - first) / (tokens - 1) if tokens > 1 else None, last - sent, tokens,
                    pipeline_ttft_s=_seconds(timings.get("ttft_ms")), pipeline_tpot_s=_seconds(timings.get("tpot_ms")))


def _seconds(ms: object) -> float | None:
    """A ``pipeline_timings`` figure (ms) in seconds; None when absent or not a finite number >= 0."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < float("inf"):
        return None
    return ms / 1e3


async def replay(url: str, model: str, requests: Sequence[LoadRequest], api_key: str | None = None,
                 timeout_s: float = 600.0) -> tuple[list[Measured], float]:
    """Send each request at its ``arrival_s`` (open loop); returns the measurements (request order) and
    the wall seconds from the first send to the last answer."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()

        async def at(req: LoadRequest) -> Measured:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
            return await _one(client, endpoint, model, req, headers)

        out = await asyncio.gather(*(at(r) for r in requests))
        return list(out), time.monotonic() - t0


async def closed_loop(url: str, model: str, requests: Sequence[LoadRequest], concurrency: int,
                      api_key: str | None = None, timeout_s: float = 600.0) -> tuple[list[Measured], float]:
    """``concurrency`` clients, each sending the next request when its own ends, until all are sent."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/completions"
    todo = list(requests)
    out: list[Measured] = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        t0 = time.monotonic()

        async def worker() -> None:
            while todo:
                out.append(await _one(client, endpoint, model, todo.pop(0), headers))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out, time.monotonic() - t0


def summarize(measured: Sequence[Measured], wall_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Percentiles (ms), req/s, output tokens/s and goodput (req/s within both SLO targets) of one run."""
    ok = [m for m in measured if m.error is None]

    def pct(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p90": None, "p99": None}
        arr = 1e3 * np.asarray(values)
        return {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in (50, 90, 99)}

    # what HTTP added to each request: its client figure minus the server's pipeline figure (paired)
    added_ttft = [m.ttft_s - m.pipeline_ttft_s for m in ok if m.ttft_s is not None and m.pipeline_ttft_s is not None]
    added_tpot = [m.tpot_s - m.pipeline_tpot_s for m in ok if m.tpot_s is not None and m.pipeline_tpot_s is not None]
    good = [m for m in ok if m.ttft_s is not None and 1e3 * m.ttft_s <= slo_ttft_ms
            and (m.tpot_s is None or 1e3 * m.tpot_s <= slo_tpot_ms)]
    return {"requests": len(measured), "failed": len(measured) - len(ok),
            "errors": sorted({m.error for m in measured if m.error})[:5],
            "ttft_ms": pct([m.ttft_s for m in ok if m.ttft_s is not None]),
            "tpot_ms": pct([m.tpot_s for m in ok if m.tpot_s is not None]),
            "e2e_ms": pct([m.e2e_s for m in ok]),
            "pipeline_ttft_ms": pct([m.pipeline_ttft_s for m in ok if m.pipeline_ttft_s is not None]),
            "pipeline_tpot_ms": pct([m.pipeline_tpot_s for m in ok if m.pipeline_tpot_s is not None]),
            "http_added_ttft_ms": pct(added_ttft), "http_added_tpot_ms": pct(added_tpot),
            "req_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
            "output_tokens_per_s": round(sum(m.output_tokens for m in ok) / wall_s, 2) if wall_s > 0 else 0.0,
            "goodput_req_per_s": round(len(good) / wall_s, 3) if wall_s > 0 else 0.0,
            "slo_attainment": round(len(good) / len(measured), 4) if measured else 0.0, "wall_s": round(wall_s, 2)}


def knee(levels: dict[int, dict]) -> int | None:
    """The smallest concurrency whose req/s is within :data:`KNEE_SHARE` of the sweep's best (None: no level)."""
    if not levels:
        return None
    best = max(s["req_per_s"] for s in levels.values())
    return min(c for c, s in levels.items() if s["req_per_s"] >= KNEE_SHARE * best)


def plot(report: dict, path) -> None:
    """TTFT p50 / p99 and req/s against concurrency (the sweep), as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted((int(c), s) for c, s in report["sweep"].items())
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [c for c, _ in levels]
    ax.plot(xs, [s["ttft_ms"]["p50"] for _, s in levels], "o-", label="TTFT p50 (ms)")
    ax.plot(xs, [s["ttft_ms"]["p99"] for _, s in levels], "o--", label="TTFT p99 (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("ms")
    ax2 = ax.twinx()
    ax2.plot(xs, [s["req_per_s"] for _, s in levels], "s-", color="tab:green", label="req/s")
    ax2.set_ylabel("req/s")
    if report.get("knee") is not None:
        ax.axvline(report["knee"], color="grey", linestyle=":", label=f"knee: {report['knee']} clients")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax.set_title(f"{report['url']} - {report['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
