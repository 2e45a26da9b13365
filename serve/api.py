"""The HTTP API: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` and ``/v1/models``,
rerank and score (``routes_pooling``), vLLM's LoRA adapter routes (``routes_lora``), plus ``/health`` and
``/metrics``. This module assembles the app: the routers
(``routes_admin``, ``routes_completions``, ``routes_chat``, ``routes_pooling``) over one
:class:`~omforge.serve.state.ServerState`, the error handlers and the OpenAPI document. Requests are parsed and
checked by :mod:`omforge.serve.intake`, answered by :mod:`omforge.serve.respond`; the model runs on the engine
thread (:mod:`omforge.serve.async_engine`), bodies are built by :mod:`omforge.serve.responses`.

Every error is OpenAI's JSON shape with the matching status: 400 malformed JSON / invalid parameter (``param``
names it) / context exceeded, 401 missing or wrong key, 404 unknown model or route, 408 / 413 a body too slow /
too large, 429 queue full (with ``Retry-After``), 503 shutting down, engine failed, or a request that waited past
``max_queue_time_s`` (with ``Retry-After``; streaming: an error event and ``[DONE]``). Every 400 the app answers
— raised as an :class:`APIError` anywhere, a Starlette error, a FastAPI validation error — is counted in
``request_rejected_total``: ``too_long`` for a context exceeded, ``invalid_parameter`` for every other. A
client that goes away leaves the engine at once, streaming or not: before its request is queued (it never is:
499, counted as ``request_rejected{client_disconnected}``), while it waits, or while it runs. Tokenization,
chat-template rendering and the admission check run on a small pool of worker threads (the tokenizer releases
the GIL), so a long prompt never stalls the event loop.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omforge.serve import routes_admin, routes_chat, routes_completions, routes_lora, routes_pooling
from omforge.serve.openapi import describe_bodies
from omforge.serve.protocol import APIError, param_of
from omforge.serve.state import ServerState, app_state

log = logging.getLogger("omforge.serve")


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (kept on ``app.state``, where the routes' :data:`AppState` reads it)."""
    app = FastAPI(title="omforge", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  version=_version())
    app.state.omforge = state
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_middleware(InternalErrors)
    for module in (routes_admin, routes_completions, routes_chat, routes_pooling, routes_lora):
        app.include_router(module.router)
    describe_bodies(app)
    return app


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    metrics = (await app_state(request)).metrics
    if exc.status == 400:  # every 400 is counted, by what was wrong
        metrics.rejected("too_long" if exc.code == "context_length_exceeded" else "invalid_parameter")
    elif exc.code == "client_disconnected":
        metrics.rejected("client_disconnected")
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 no such route, 405 …) in OpenAI's shape; a 400 among them is counted too."""
    return await _api_error(request, APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's validation of a route's declared parameters (the routes read their bodies themselves and declare
    none today): a 400 naming the field, as :func:`omforge.serve.intake.parse` answers, not FastAPI's 422."""
    err = (exc.errors() or [{}])[0]
    param = param_of([p for p in err.get("loc", ()) if p not in ("body", "query", "path", "header", "cookie")])
    return await _api_error(request, APIError(400, f"{param}: {err.get('msg', 'invalid')}", param=param or None))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omforge")
    except PackageNotFoundError:
        return "0"


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes OpenAI's 500 body *here*, inside the app. Starlette's
    own ``Exception`` handler re-raises after answering, and uvicorn then drops the keep-alive connection, so the
    client's next request on it failed too. Once a response has started (a stream), the exception is the
    stream's own to report (an error event); it is re-raised."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            log.error("internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)
