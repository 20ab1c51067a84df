"""The OpenAI-compatible HTTP API over a :class:`FrontDoorEngine` (FastAPI; served by uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template applied;
``stream: true`` answers server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (the process is up; how many pipeline instances serve), ``GET /ready`` (a pipeline
takes requests; each instance's open and finished requests), ``GET /metrics``
(Prometheus text). Errors use OpenAI's shape and status codes: 400 bad JSON, bad field or context
too long, 401 no or wrong API key, 404 unknown model, 429 too many open requests, 503 draining.
With an API key, every ``/v1`` route needs ``Authorization: Bearer KEY``; health, readiness and
metrics stay open, as in vLLM.

A generation's response, and a stream's chunk that carries its ``finish_reason``, add one field to
OpenAI's shape, as llama.cpp's server adds ``timings``: ``pipeline_timings`` (``ttft_ms``, ``tpot_ms``,
``e2e_ms``), the pipeline's own latencies measured where its tokens reach this server's pump threads,
before the event loop, SSE and the network (:func:`~flexpipe_dag.serving.frontdoor.engine.pipeline_timings`).
A client's own figures minus these are at least what HTTP added to that request. Batch API output lines
do not carry it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.serving.frontdoor.api_key import ApiKeyRequired
from flexpipe_dag.serving.frontdoor.batches import batch_file, cancel_batch, create_batch, get_batch, list_batches
from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine, Generation
from flexpipe_dag.serving.frontdoor.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from flexpipe_dag.serving.frontdoor.prepare import chat_generation, completion_generation
from flexpipe_dag.serving.frontdoor.protocol import (
    DEFAULT_BATCH_FILE_EXPIRY_S,
    MAX_FILE_EXPIRY_S,
    MIN_FILE_EXPIRY_S,
    APIError,
    BatchCreateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    field_path,
)
from flexpipe_dag.serving.frontdoor.responses import Shapes, chat_shapes, completion_shapes, list_object, usage

#: Header that marks a request's priority class (``online`` / ``offline``), as the body's ``priority``.
PRIORITY_HEADER = "X-FlexPipe-Priority"


class BatchAPI:
    """What the Files and Batches routes work on: the store (None: a server without one refuses them)
    and the :class:`~flexpipe_dag.serving.frontdoor.batches.BatchRunner` (set once the pipeline is live)."""

    def __init__(self, store=None):
        self.store = store
        self.runner = None

    def require_store(self):
        if self.store is None:
            raise APIError(400, "the Files and Batch APIs need the store: start flexpipe serve without --no-store",
                           code="no_store")
        return self.store


#: ``endpoint`` label of ``flexpipe_requests_total`` per route (a fixed set: a path nobody serves is
#: ``other``, so clients cannot mint label values).
ROUTE_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
                "/v1/models": "models", "/v1/models/{model_id:path}": "models", "/v1/files": "files", "/v1/files/{file_id}": "files",
                "/v1/files/{file_id}/content": "files", "/v1/batches": "batches", "/v1/batches/{batch_id}": "batches",
                "/v1/batches/{batch_id}/cancel": "batches", "/health": "health", "/ready": "ready",
                "/metrics": "metrics"}
#: Room for the multipart framing around an uploaded file, bytes.
MULTIPART_OVERHEAD_BYTES = 1024 * 1024


def _json_kind(value: object) -> str:
    """JSON's name for the type of a parsed value (``array``, ``string``, ``number``, ...)."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


def endpoint_label(scope) -> str:
    """The ``endpoint`` label of a request: its route's name in :data:`ROUTE_LABELS`, else ``other``."""
    route = scope.get("route")
    return ROUTE_LABELS.get(getattr(route, "path", None) or scope.get("path", ""), "other")


def create_app(engine: FrontDoorEngine, model_name: str, api_key: str | None = None, lifespan=None,
               batch_api: BatchAPI | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The API app over ``engine`` serving ``model_name`` (``api_key``: required on ``/v1`` when set;
    ``batch_api``: the Files and Batches routes' store and runner; ``max_body_bytes``: larger JSON bodies
    get 413, unread; an upload to ``/v1/files`` may be as large as the store keeps a file)."""
    batches = batch_api or BatchAPI()
    app = FastAPI(title="FlexPipe", description="OpenAI-compatible front door of a FlexPipe pipeline",
                  lifespan=lifespan)
    created = int(time.time())

    def refused(request: Request, err: APIError) -> JSONResponse:
        """An error answer, counted in ``flexpipe_requests_total`` under the route."""
        engine.metrics.requests.labels(endpoint_label(request.scope), f"error_{err.status}").inc()
        return JSONResponse(err.body(), status_code=err.status)

    def file_upload_limit() -> int:
        return (batches.store.max_api_file_bytes if batches.store is not None else 0) + MULTIPART_OVERHEAD_BYTES

    app.add_middleware(BodySizeLimit,  # type: ignore[arg-type]
                       limit_for=lambda path: file_upload_limit() if path == "/v1/files" else max_body_bytes,
                       on_refused=lambda path: engine.metrics.requests.labels(
                           ROUTE_LABELS.get(path, "other"), "error_413").inc())

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug, not the client's fault: still OpenAI's shape, counted, and the connection kept."""
        return refused(request, APIError(500, f"internal error ({type(exc).__name__}); the server logged it",
                                         type="server_error"))

    if api_key is not None:  # added last: outermost, so a request without the key is refused unread
        app.add_middleware(ApiKeyRequired, api_key=api_key,  # type: ignore[arg-type]
                           refusal=lambda scope: refused(Request(scope), APIError(
                               401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               type="authentication_error", code="invalid_api_key")))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return refused(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # JSON it cannot decode
            return refused(request, APIError(400, "the request body could not be parsed: expected a JSON object (at "
                                                  "most a few thousand levels deep, integers of at most 4,300 digits)"))
        if exc.status_code == 400 and request.url.path == "/v1/files":  # the multipart parser's refusal
            return refused(request, APIError(400, f"file: the upload is not valid multipart/form-data ({exc.detail}); "
                                                  "send the file as the part 'file' (with a filename of a few "
                                                  "hundred characters at most) and 'purpose=batch'", param="file"))
        return refused(request, APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                                         type=kind))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return refused(request, APIError(400, f"the body is not valid JSON: {err.get('msg', '')}"))
        param = field_path(err.get("loc", ()))
        if param is None:  # the body as a whole: empty, or not a JSON object
            kind = request.headers.get("content-type") or "none"
            got = err.get("input")
            if err.get("type") == "missing":
                msg = "the request body is empty; expected a JSON object"
            elif kind.split(";")[0].strip().lower() == "application/json" and not isinstance(got, dict):
                msg = f"the request body is a JSON {_json_kind(got)}; expected a JSON object"
            else:
                msg = f"the request body must be a JSON object sent as Content-Type: application/json (got {kind!r})"
            return refused(request, APIError(400, msg))
        msg = f"{param}: {err.get('msg')}"
        if param == "file" and "UploadFile" in str(err.get("msg")):  # pydantic's words, and the text echoed
            return refused(request, APIError(400, "file: expected a file part (a multipart field with a filename)",
                                             param="file"))
        if "input" in err and param:
            msg += f" (got {json.dumps(err['input'], default=str)[:80]})"
        return refused(request, APIError(400, msg, param=param))

    def authorised(request: Request) -> None:
        """The key is checked by the middleware, before the body is read; this marks the routes it guards."""

    def check(body: _Sampling, request: Request) -> None:
        if body.model != model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0])
        header = request.headers.get(PRIORITY_HEADER)
        if header is not None:
            if header not in ("online", "offline"):
                raise APIError(400, f"{PRIORITY_HEADER}: expected online or offline, got {header!r}",
                               param=PRIORITY_HEADER)
            body.priority = body.priority or header  # type: ignore[assignment]
        engine.check_admission()

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.failure:
            return JSONResponse({"status": "failed", "reason": engine.failure}, status_code=503)
        return JSONResponse({"status": "ok", "instances": engine.num_instances})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        live = engine.router.active.gear.gear_id if engine.ready and engine.router else None
        return JSONResponse({"ready": engine.ready, "gear_id": live, "pending": engine.pending,
                             "instances": engine.instance_status()},
                            status_code=200 if engine.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics_exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "flexpipe",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorised)])
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(body: CompletionRequest, request: Request):
        check(body, request)
        gen = await asyncio.to_thread(completion_generation, engine, body)  # tokenising: off the event loop
        return await _respond(engine, gen, body, "completions", completion_shapes(model_name), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check(body, request)
        gen = await asyncio.to_thread(chat_generation, engine, body)  # tokenising: off the event loop
        return await _respond(engine, gen, body, "chat_completions", chat_shapes(model_name), request)

    @app.post("/v1/files", dependencies=[Depends(authorised)])
    async def upload_file(request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
                          anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
                          seconds: Annotated[str | None, Form(alias="expires_after[seconds]")] = None) -> dict:
        store = batches.require_store()
        limit = store.max_api_file_bytes
        form = await request.form()  # parsed once (cached): read as sent, repeats and empty values included
        for name in ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]"):
            if len(form.getlist(name)) > 1:
                raise APIError(400, f"{name}: sent {len(form.getlist(name))} times; send it once", param=name)
        if "expires_after" in form:  # a JSON object in one field is not read: say so rather than keep the default
            raise APIError(400, "expires_after: send it as two form fields, expires_after[anchor]=created_at and "
                                "expires_after[seconds]=N (as the OpenAI SDKs do)", param="expires_after")
        if purpose != "batch":
            raise APIError(400, f"purpose: only 'batch' is served, got {purpose!r}", param="purpose")
        expires_after_s = file_expiry_s(_form_text(form, "expires_after[anchor]"),
                                        _form_text(form, "expires_after[seconds]"))
        content = await file.read(limit + 1)
        if len(content) > limit:
            raise APIError(413, f"file larger than {limit} bytes", param="file", code="file_too_large")
        info = await asyncio.to_thread(  # tens of MB into the database: off the event loop, which serves the streams
            store.save_api_file, f"file-{uuid.uuid4().hex}", purpose, upload_filename(file.filename), content,
            expires_at_s=int(time.time()) + expires_after_s)
        return _stored_file(info)

    @app.get("/v1/files", dependencies=[Depends(authorised)])
    async def list_files(limit: int = 10000, purpose: str | None = None, after: str | None = None,
                         order: str = "desc") -> dict:
        """The uploaded files that have not expired, newest first (``order=asc``: oldest first), from the file
        after ``after`` on (a batch's output and error files are named by its batch, not listed)."""
        if not 1 <= limit <= 10000:
            raise APIError(400, f"limit: expected 1..10000, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: expected 'asc' or 'desc', got {order!r}", param="order")
        try:
            infos, more = batches.require_store().list_api_files(limit, purpose, after=after, order=order)
        except InputError as exc:
            raise APIError(400, f"{exc.field}: {exc.problem}", param=exc.field) from None
        return list_object([_stored_file(i) for i in infos], more)

    def find_file(file_id: str):
        """``(store, stored file's facts, None)`` for an upload that has not expired, ``(store, None, generated
        file)`` for a batch's output or error file.

        Raises:
            APIError: 404 neither (an expired upload included).
        """
        store = batches.require_store()
        info = store.api_file(file_id)
        made = batch_file(store, file_id, batches.runner) if info is None else None
        if (info is None or info.expired()) and made is None:
            raise _no_file(file_id)
        return store, info, made

    @app.get("/v1/files/{file_id}", dependencies=[Depends(authorised)])
    async def file_info(file_id: str) -> dict:
        _, info, made = find_file(file_id)
        if info is not None:
            return _stored_file(info)
        return _file_object(file_id, len(made.content), made.created_at, f"{file_id}.jsonl", "batch_output",
                            made.expires_at)

    @app.get("/v1/files/{file_id}/content", dependencies=[Depends(authorised)])
    async def file_content(file_id: str) -> Response:
        store, info, made = find_file(file_id)
        content = await asyncio.to_thread(store.api_file_content, file_id) if info is not None else made.content
        if content is None:  # deleted since it was found
            raise _no_file(file_id)
        return Response(content, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=[Depends(authorised)])
    async def delete_file(file_id: str) -> dict:
        """Delete an uploaded file (409 while a batch that has not ended reads it; a batch's output and error
        files are made from its results and are not stored files: 400)."""
        store = batches.require_store()
        done = store.delete_api_file(file_id)
        if done.readers:
            raise APIError(409, f"file {file_id} is the input of batch(es) that have not ended: "
                                f"{', '.join(done.readers[:5])}; cancel them or wait for them to end",
                           param="file_id", code="file_in_use")
        if not done.deleted:
            if batch_file(store, file_id, batches.runner) is not None:
                raise APIError(400, f"file {file_id} is a batch's output or error file, made from its results when "
                                    "read; it is not a stored file and cannot be deleted", param="file_id")
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches", dependencies=[Depends(authorised)])
    async def create(body: BatchCreateRequest) -> dict:
        expiry = body.output_expires_after
        # every line of the input file is read and checked (300,000 lines: 3.4 s): off the event loop, whose
        # streams and health checks stalled for as long
        return await asyncio.to_thread(create_batch, batches.require_store(), body.input_file_id, body.endpoint,
                                       body.completion_window, body.metadata,
                                       expiry.seconds if expiry is not None else DEFAULT_BATCH_FILE_EXPIRY_S)

    @app.get("/v1/batches", dependencies=[Depends(authorised)])
    async def list_all(limit: int = 20, after: str | None = None) -> dict:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit: expected 1..100, got {limit}", param="limit")
        return list_batches(batches.require_store(), batches.runner, limit, after)

    @app.get("/v1/batches/{batch_id}", dependencies=[Depends(authorised)])
    async def retrieve(batch_id: str) -> dict:
        return get_batch(batches.require_store(), batch_id, batches.runner)

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=[Depends(authorised)])
    async def cancel(batch_id: str) -> dict:
        return cancel_batch(batches.require_store(), batch_id, batches.runner)

    return app


def upload_filename(name: str | None) -> str:
    """The name an uploaded file is listed under: the client's name without any directory part, its
    unprintable characters (control, line-break, bidirectional) dropped, at most 255 characters;
    ``upload.jsonl`` when nothing is left. Only ever shown: the content is stored in the database, not a file."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    clean = "".join(ch for ch in base if ch.isprintable()).strip()[:255]
    return clean if clean not in ("", ".", "..") else "upload.jsonl"


def file_expiry_s(anchor: str | None, seconds: str | None) -> int:
    """Seconds from its upload until a file expires: OpenAI's ``expires_after`` (``anchor`` ``created_at``,
    ``seconds`` from :data:`MIN_FILE_EXPIRY_S` to :data:`MAX_FILE_EXPIRY_S`), else OpenAI's default for a batch
    file, :data:`DEFAULT_BATCH_FILE_EXPIRY_S`.

    Raises:
        APIError: 400 an anchor other than ``created_at``, seconds that are not a whole number in range, or one
            of the two without the other.
    """
    if anchor is None and seconds is None:
        return DEFAULT_BATCH_FILE_EXPIRY_S
    if anchor != "created_at":
        got = "nothing (expires_after needs both anchor and seconds)" if anchor is None else repr(anchor)[:80]
        raise APIError(400, f"expires_after[anchor]: expected 'created_at', got {got}", param="expires_after[anchor]")
    span = f"a whole number of seconds from {MIN_FILE_EXPIRY_S} (1 hour) to {MAX_FILE_EXPIRY_S} (30 days)"
    digits = (seconds or "").strip()
    if not (digits.isdecimal() and digits.isascii() and len(digits) <= 12):  # int() of 5,000 digits raises
        got = "nothing (expires_after needs both anchor and seconds)" if seconds is None else repr(seconds)[:80]
        raise APIError(400, f"expires_after[seconds]: expected {span}, got {got}", param="expires_after[seconds]")
    value = int(digits)
    if not MIN_FILE_EXPIRY_S <= value <= MAX_FILE_EXPIRY_S:
        raise APIError(400, f"expires_after[seconds]: expected {span}, got {value}", param="expires_after[seconds]")
    return value


def _form_text(form, name: str) -> str | None:
    """A form field's value as sent (an empty one is ``""``, not missing); None when absent.

    Raises:
        APIError: 400 the field was sent as a file part.
    """
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"{name}: expected a text field, got a file part", param=name)
    return value


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")


def _file_object(file_id: str, size: int, created_at: int, filename: str, purpose: str,
                 expires_at: int | None = None) -> dict:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "expires_at": expires_at,
            "filename": filename, "purpose": purpose, "status": "processed"}


def _stored_file(info) -> dict:
    """OpenAI's file object of a stored file (the store's ``ApiFileInfo``)."""
    return _file_object(info.id, info.bytes, info.created_at, info.filename, info.purpose, info.expires_at)


async def _until_disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body is read) has gone away (ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(engine: FrontDoorEngine, gen: Generation, body: _Sampling, endpoint: str, shapes: Shapes,
                   request: Request):
    """The whole response, or (``stream``) server-sent events; a refusal before the first piece is a
    plain error response. A client that leaves before its whole response is ready cancels the request in
    the pipeline (streamed or not: vLLM's ``with_cancellation`` does the same for non-streamed requests), so
    an abandoned ``max_tokens`` of thousands holds no KV blocks and no seat."""
    pieces = engine.generate(gen)
    if not body.stream:
        async def whole() -> dict:
            text, last = "", None
            async for piece in pieces:  # an APIError is answered (and counted) by the app's handler
                text, last = text + piece.text, piece
            assert last is not None  # generate() ends with a finished piece or raises
            engine.metrics.requests.labels(endpoint, last.finish_reason or "stop").inc()
            return {**shapes.response(text, last.finish_reason, last.prompt_tokens, last.completion_tokens),
                    "pipeline_timings": last.pipeline_timings}

        answer, gone = asyncio.ensure_future(whole()), asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():  # the client left: the request is cancelled in the pipeline (generate's finally)
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
                await pieces.aclose()
                engine.metrics.requests.labels(endpoint, "aborted").inc()
        if answer.cancelled():
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return answer.result()
    first = await anext(pieces)  # an APIError here is answered (and counted) by the app's handler

    async def events() -> AsyncIterator[str]:
        outcome = "aborted"
        try:
            is_first, piece = True, first
            while True:
                chunk = {**shapes.head(shapes.chunk_obj),
                         "choices": [shapes.delta(piece.text, piece.finish_reason, is_first)]}
                if piece.finish_reason is not None:
                    chunk["pipeline_timings"] = piece.pipeline_timings
                yield f"data: {json.dumps(chunk)}\n\n"
                is_first = False
                if piece.finish_reason is not None:
                    outcome = piece.finish_reason
                    if body.include_usage:
                        tail = {**shapes.head(shapes.chunk_obj), "choices": [],
                                "usage": usage(piece.prompt_tokens, piece.completion_tokens)}
                        yield f"data: {json.dumps(tail)}\n\n"
                    break
                piece = await anext(pieces)
            yield "data: [DONE]\n\n"
        except APIError as exc:  # headers are out: the error goes in the stream, as OpenAI does
            outcome = f"error_{exc.status}"
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            engine.metrics.requests.labels(endpoint, outcome).inc()
            await pieces.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")
