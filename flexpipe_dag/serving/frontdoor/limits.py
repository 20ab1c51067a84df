"""A cap on request bodies, read before the app parses them (an ASGI middleware).

uvicorn reads a body of any size, and FastAPI parses the whole of it before a route can look at its
fields: a 100 MB JSON body was read and parsed in full, then refused for its model name. This
middleware answers 413 in OpenAI's error shape when the declared ``Content-Length`` passes the limit
of the route (nothing of the body is read), or as soon as the bytes received of a chunked body do
(the app is told the client went away, and its answer is replaced by the 413).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

#: Largest JSON body of an API request, bytes (a full context of token ids is well under 1 MiB).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodySizeLimit:
    """Refuse bodies over ``limit_for(path)`` bytes with 413 ``request_too_large``.

    Args:
        app: the ASGI app behind.
        limit_for: the limit of a request path, bytes.
        on_refused: called with the path of each refused request (to count it).
    """

    def __init__(self, app, limit_for: Callable[[str], int], on_refused: Callable[[str], None] | None = None):
        self.app, self.limit_for, self.on_refused = app, limit_for, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, limit)
            return
        received = 0
        too_large = refused = False

        async def counted() -> Message:
            nonlocal received, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # read no further: to the app, the client went away
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def answered(message: Message) -> None:
            nonlocal refused
            if not too_large:
                await send(message)
            elif not refused:  # whatever the app makes of the cut body, the client gets the 413
                refused = True
                await self._refuse(scope, send, limit)

        try:
            await self.app(scope, counted, answered)
        except Exception:
            if not too_large:
                raise
        if too_large and not refused:
            await self._refuse(scope, send, limit)

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        if self.on_refused is not None:
            self.on_refused(scope["path"])
        body = json.dumps({"error": {"message": f"the request body is larger than {limit} bytes", "type":
                                     "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
