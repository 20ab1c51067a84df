"""``flexpipe loadtest``: drive an OpenAI-compatible endpoint (``flexpipe serve``, vLLM, ...) with a real
trace: a replay at the trace's own arrival times, then a concurrency sweep; TTFT / TPOT / end-to-end
percentiles, req/s, tokens/s, goodput at the SLO and the knee, printed, written as JSON and plotted.

Prompts are token ids (the bundled corpus, cut to each trace row's input length, with the tokenizer of
``--tokenizer``: the served model's), so lengths are exact; outputs are greedy and capped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import check_number

#: Most closed-loop clients one ``--concurrency`` level runs (each is a coroutine with its own connection).
MAX_CONCURRENCY = 10_000


def register(subparsers) -> None:
    p = subparsers.add_parser("loadtest", help="replay a trace against an OpenAI-compatible endpoint and sweep "
                                               "concurrency: latency percentiles, goodput, the knee")
    p.add_argument("--url", default=None, help="the API's base URL, e.g. http://127.0.0.1:8000/v1 (default: the "
                                               "live front door in the store, as `flexpipe servers` lists it)")
    p.add_argument("--trace", default="azure-conv", help="bundled trace name or file (arrivals and lengths)")
    p.add_argument("--requests", type=int, default=64, help="trace rows used (from the start)")
    p.add_argument("--speedup", type=float, default=1.0, help="replay the arrivals this many times faster")
    p.add_argument("--concurrency", default="1,2,4,8", help="closed-loop sweep levels ('' skips the sweep)")
    p.add_argument("--no-replay", action="store_true", help="skip the open-loop replay")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="cap on each prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each output")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="HF directory or GGUF file whose tokenizer builds the prompts "
                                                     "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--api-key-file", type=Path, default=None, help="file holding the API key")
    p.add_argument("--out", type=Path, default=Path("loadtest.json"), help="the results, JSON")
    p.add_argument("--plot", type=Path, default=None, help="PNG of latency and req/s vs concurrency")
    p.set_defaults(func=loadtest)


def _levels(text: str) -> list[int]:
    """The sweep's levels (``''``: no sweep).

    Raises:
        InputError: an item that is not an integer >= 1, or an empty item (``1,,2``; ``,``).
    """
    if not text.strip():
        return []
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(None, "--concurrency", f"expected comma-separated integers such as 1,2,4 ('' skips the "
                                                f"sweep), got {text!r}") from None
    if any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise InputError(None, "--concurrency", f"expected levels 1..{MAX_CONCURRENCY} (clients, one coroutine each), "
                                                f"got {text!r}")
    return levels


def base_url(url: str, field: str = "--url") -> str:
    """``url`` as the API's base (an http(s) URL with a host, no query, fragment or credentials; no trailing ``/``).

    Raises:
        InputError: naming ``field``: not such a URL (credentials: the API key goes in ``--api-key-file``, never in
            a URL that messages and the report print).
    """
    import httpx

    expected = "expected an http(s) URL such as http://127.0.0.1:8000/v1"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise InputError(None, field, f"{expected}, got {url!r}: {exc}") from None
    if parsed.userinfo:
        raise InputError(None, field, "expected no user or password in the URL (they would be printed in messages and "
                                      "the report); give the API key with --api-key-file")
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.query or parsed.fragment:
        raise InputError(None, field, f"{expected} (no query or fragment), got {url!r}")
    return url.rstrip("/")


def _model(url: str, api_key: str | None) -> str:
    import httpx

    try:
        resp = httpx.get(url + "/models", timeout=30, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError as exc:
        raise InputError(None, "--url", f"cannot reach {url}/models: {exc}") from None
    try:
        models = resp.json().get("data") if resp.status_code == 200 else None
    except (ValueError, AttributeError):
        models = None
    if not models or not isinstance(models, list) or not isinstance(models[0], dict) or "id" not in models[0]:
        hint = "" if url.endswith("/v1") else " (the base URL of an OpenAI-compatible API usually ends in /v1)"
        raise InputError(None, "--url", f"{url}/models answered {resp.status_code} without a model list{hint}: "
                                        f"{resp.text[:200]!r}")
    if not isinstance(models[0]["id"], str) or not models[0]["id"]:
        raise InputError(None, "--url", f"{url}/models names no model id: {resp.text[:200]!r}")
    return models[0]["id"]


def loadtest(args: argparse.Namespace) -> int:
    from flexpipe_dag.cli.serve import read_api_key
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.serving import loadtest as lt
    from flexpipe_dag.workload import head, load_trace
    from flexpipe_dag.workload.transform import MAX_SPEEDUP, MIN_SPEEDUP

    for name in ("requests", "max_prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise InputError(None, "--" + name.replace("_", "-"), f"expected >= 1, got {getattr(args, name)}")
    check_number(args.speedup, None, "--speedup", ge=MIN_SPEEDUP, le=MAX_SPEEDUP, unit="factor")
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        check_number(getattr(args, flag), None, "--" + flag.replace("_", "-"), gt=0, unit="milliseconds")
    levels = _levels(args.concurrency)
    api_key = read_api_key(args.api_key_file)
    if args.url is None:
        from flexpipe_dag.cli.servers import live_endpoint
        from flexpipe_dag.sql.store import Store

        args.url = base_url(live_endpoint(Store.from_url()), "the live front door in the store")
        print(f"the live front door in the store: {args.url}", file=sys.stderr)
    else:
        args.url = base_url(args.url)
    workload = head(load_trace(args.trace), args.requests)  # local inputs are checked before the network
    if len(workload) == 0:
        raise InputError(str(args.trace), None, "no requests in the trace")
    model = args.model or _model(args.url, api_key)
    tok = resolve_checkpoint(args.tokenizer).tokenizer()
    reqs = lt.requests_from_workload(workload, tok, max_prompt_tokens=args.max_prompt_tokens,
                                     max_tokens=args.max_tokens, speedup=args.speedup)
    report: dict = {"url": args.url, "model": model, "trace": str(args.trace), "requests": len(reqs),
                    "speedup": args.speedup, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                    "replay": None, "sweep": {}, "knee": None}
    if not args.no_replay:
        span = reqs[-1].arrival_s
        print(f"replay: {len(reqs)} requests of {args.trace} over {span:.0f} s (x{args.speedup:g})", file=sys.stderr)
        measured, wall = asyncio.run(lt.replay(args.url, model, reqs, api_key))
        report["replay"] = lt.summarize(measured, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    for c in levels:
        print(f"sweep: {c} concurrent client(s)", file=sys.stderr)
        measured, wall = asyncio.run(lt.closed_loop(args.url, model, reqs, c, api_key))
        report["sweep"][c] = lt.summarize(measured, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    report["knee"] = lt.knee(report["sweep"])
    _print(report)
    args.out.write_text(json.dumps(report, indent=1))
    if args.plot and report["sweep"]:
        lt.plot(report, args.plot)
    print(f"results in {args.out}" + (f", plot in {args.plot}" if args.plot and report["sweep"] else ""),
          file=sys.stderr)
    failed = (report["replay"] or {}).get("failed", 0) + sum(s["failed"] for s in report["sweep"].values())
    return 1 if failed else 0


def _print(report: dict) -> None:
    from tabulate import tabulate

    rows = []
    runs = ([("replay", report["replay"])] if report["replay"] else []) + [
        (f"{c} clients", s) for c, s in report["sweep"].items()]
    for name, s in runs:
        rows.append([name, s["requests"], s["failed"], s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["tpot_ms"]["p50"],
                     s["tpot_ms"]["p99"], s["e2e_ms"]["p50"], s["req_per_s"], s["output_tokens_per_s"],
                     s["goodput_req_per_s"], s["slo_attainment"]])
    print(tabulate(rows, headers=["run", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                                  "TPOT p99 ms", "e2e p50 ms", "req/s", "tok/s", "goodput req/s", "SLO att."]))
    for name, s in runs:
        added_ttft, added_tpot = s.get("http_added_ttft_ms", {}).get("p50"), s.get("http_added_tpot_ms", {}).get("p50")
        if added_ttft is not None:
            tpot = f", TPOT {added_tpot:+.2f} ms" if added_tpot is not None else ""
            print(f"{name}: HTTP added (each request's figure minus the server's pipeline_timings, p50): TTFT "
                  f"{added_ttft:+.2f} ms{tpot}")
    if report["knee"] is not None:
        print(f"knee: {report['knee']} concurrent clients (within 10 % of the best req/s)")
