"""The API key check, in front of the app (a plain ASGI middleware).

With a key, a ``/v1`` request without ``Authorization: Bearer KEY`` is answered 401 before its body is
read, as OpenAI does; health, readiness and metrics stay open, as in vLLM. A plain ASGI middleware,
not Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``), which carries every chunk of a
streamed response through a memory stream and a task switch: per output token, that cost the server
about as much CPU as the rest of its token path.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from flexpipe_dag.serving.frontdoor.limits import Receive, Scope, Send

#: Path prefix whose requests need the key.
GUARDED_PREFIX = "/v1"


class ApiKeyRequired:
    """Refuse guarded requests without the bearer ``api_key``.

    Args:
        app: the ASGI app behind.
        api_key: the key clients send as ``Authorization: Bearer KEY``.
        refusal: the ASGI response (e.g. a ``JSONResponse`` in OpenAI's error shape, counted) for the
            scope of a refused request.
    """

    def __init__(self, app, api_key: str, refusal: Callable[[Scope], Any]):
        self.app, self.refusal = app, refusal
        self._key = api_key.encode()

    def authorised(self, scope: Scope) -> bool:
        """Whether the request of ``scope`` may pass: unguarded, or with the right bearer key."""
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            return True
        header = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.authorised(scope):
            await self.app(scope, receive, send)
        else:
            await self.refusal(scope)(scope, receive, send)
