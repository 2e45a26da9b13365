"""The HTTP API: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus ``/health``
and ``/metrics``. Routing, parsing, auth and streaming only; the model runs on the engine thread
(:mod:`omforge.serve.async_engine`), bodies are built by :mod:`omforge.serve.responses`.

Every error is OpenAI's JSON shape with the matching status: 400 malformed JSON / invalid parameter (``param``
names it) / context exceeded, 401 missing or wrong key, 404 unknown model or route, 408 / 413 a body too slow /
too large, 429 queue full (with ``Retry-After``), 503 shutting down, engine failed, or a request that waited past
``max_queue_time_s`` (with ``Retry-After``; streaming: an error event and ``[DONE]``). A client that goes away
leaves the engine at once, streaming or not: before its request is queued (it never is: 499, counted as
``request_rejected{client_disconnected}``), while it waits, or while it runs. Tokenization, chat-template
rendering and the admission check run on a small pool of worker threads (the tokenizer releases the GIL), so a
long prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omforge.runtime.engine import RequestOutput, RequestRejected
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError
from omforge.runtime.structured import StructuredOutput
from omforge.runtime.tokenizer import ChatTemplateError
from omforge.serve.async_engine import AsyncEngine, EngineUnavailable, Overloaded, QueueTimeout, RequestGroup
from omforge.serve.body import read_json
from omforge.serve.metrics import ServerMetrics
from omforge.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_satisfiable,
    validation_message,
)
from omforge.serve.responses import SSE_DONE, ResponseBuilder, sse, token_text_fn, usage
from omforge.serve.tools import ToolPlan, choice_mode, constraint, functions

log = logging.getLogger("omforge.serve")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait; the queue moves every engine step
TOKENIZE_THREADS = 4  # worker threads for tokenization and chat templates (the tokenizer releases the GIL)
T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_model_len: int
    created: int
    tool_format: str | None = None  # serve/tools.py FORMATS; None: tool_choice auto is refused
    body_timeout: float = 30.0  # seconds a client gets to send its whole request body (then 408)
    max_body_bytes: int = 8 << 20  # a larger request body is refused with a 413


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="omforge", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  version=_version())
    tokenizer = state.engine.engine.tokenizer
    token_text = token_text_fn(tokenizer) if tokenizer is not None else (lambda i: str(i))
    workers = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="omforge-tokenize")

    async def offload(fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tokenizer worker (tokenizing, templates, JSON of token lists): the event loop
        keeps answering, and at most ``TOKENIZE_THREADS`` such jobs run at once."""
        return await asyncio.get_running_loop().run_in_executor(workers, functools.partial(fn, *args))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status == 400:  # every 400 is counted, by what was wrong
            state.metrics.rejected("too_long" if exc.code == "context_length_exceeded" else "invalid_parameter")
        elif exc.code == "client_disconnected":
            state.metrics.rejected("client_disconnected")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    app.add_middleware(InternalErrors)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        # bytes: compare_digest refuses non-ASCII str (a 500 before); the header arrives as latin-1 text
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode("utf-8", "surrogateescape"),
                                                                    state.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    async def parse(request: Request, schema: type[BaseModel]) -> Any:
        authorize(request)
        data = await read_json(request, state.body_timeout, state.max_body_bytes)
        try:
            body = schema.model_validate(data)
        except RecursionError:  # a deep structure inside an accepted field (logit_bias, a message …)
            raise APIError(400, "the request body nests too deeply") from None
        except ValidationError as exc:
            param, what = validation_message(exc)
            raise APIError(400, f"{param}: {what}", param=param) from None
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                           f"'{state.model_name}'", param="model", code="model_not_found")
        body.check_supported()
        return body

    def check(ids: list[int], params: SamplingParams, length_param: str) -> SamplingParams:
        try:
            checked = state.engine.check(ids, params)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except RequestRejected as exc:
            if exc.param is not None:  # not a length: e.g. prompt token ids outside the vocabulary
                raise APIError(400, str(exc), param=exc.param) from None
            raise APIError(400, str(exc), param=length_param, code="context_length_exceeded") from None
        if checked.structured is not None:
            check_satisfiable(checked.structured)
        return checked

    def submit(prompts: list[tuple[list[int], SamplingParams]], request_id: str, arrival: float) -> RequestGroup:
        num_seqs = sum(p.n for _, p in prompts)
        if num_seqs > state.engine.capacity:  # never admissible: a 429 would have the client retry forever
            raise APIError(400, f"prompt: {len(prompts)} prompt(s) × n make {num_seqs} sequences, more than this "
                           f"server ever holds ({state.engine.capacity}: max_num_seqs + max_waiting_requests); "
                           "send fewer per request", param="prompt")
        try:
            return state.engine.submit(prompts, request_id, arrival)
        except Overloaded as exc:
            raise APIError(429, str(exc), type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable",
                           headers={"Retry-After": str(5 * RETRY_AFTER_S)}) from None

    # --- endpoints ----------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if state.engine.healthy and not state.engine.draining:
            return JSONResponse({"status": "ok"})
        reason = "draining" if state.engine.draining else f"engine failed: {state.engine.failure}"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "omforge",
             "max_model_len": state.max_model_len}]})

    _describe_bodies(app)

    @app.post("/tokenize", openapi_extra=_body("TokenizeRequest"))
    async def tokenize(request: Request) -> Response:
        body: TokenizeRequest = await parse(request, TokenizeRequest)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await offload(tokenizer.encode, body.prompt, special)
        else:
            ids = await offload(render_chat, body.chat(), bool(body.add_special_tokens))
        answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
        return Response(await offload(json.dumps, answer), media_type="application/json")

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> Response:
        body: DetokenizeRequest = await parse(request, DetokenizeRequest)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = state.engine.engine.config["vocab_size"]
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": await offload(tokenizer.decode, body.tokens, False)})

    def render_chat(body: ChatCompletionRequest, add_special_tokens: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """The chat template over the request's messages (and ``tools``, as transformers passes them), encoded
        (raises APIError 400 on a template error)."""
        extra = {"tools": tools} if tools else {}
        try:
            text = tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=body.add_generation_prompt,
                                                 **extra, **(body.chat_template_kwargs or {}))
        except ChatTemplateError as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        with state.engine.arriving():
            return await _completions(request, time.monotonic())

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        with state.engine.arriving():
            return await _chat_completions(request, time.monotonic())

    async def _completions(request: Request, arrival: float) -> Response:
        body: CompletionRequest = await parse(request, CompletionRequest)
        prompts = body.prompts()
        texts = [p if isinstance(p, str) else None for p in prompts]
        if any(t is not None for t in texts) and tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids", param="prompt")
        ids = await offload(lambda: [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts])
        params = body.engine_params()
        checked = await offload(lambda: [(i, check(i, params, "max_tokens" if body.max_tokens else "prompt"))
                                         for i in ids])
        echo = []
        if body.echo:
            echo = await offload(lambda: [t if t is not None else (tokenizer.decode(i) if tokenizer else "")
                                          for t, i in zip(texts, ids)])
        return await respond(request, body, "completion", checked, echo, body.logprobs is not None, arrival,
                             scoring_only=body.scoring_only)

    async def _chat_completions(request: Request, arrival: float) -> Response:
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer and no chat template", param="messages")
        body.conversation()  # content parts checked on the event loop: a 400 before any work
        fns = functions(body.tools)
        mode, name = choice_mode(body.tool_choice, fns)
        plan = None
        if mode == "auto" and state.tool_format is None:
            raise APIError(400, "tool_choice auto: this model's chat template writes no tool-call format omforge "
                           "reads (hermes, llama3_json, mistral); name one with --tool-call-parser, or use "
                           "tool_choice required or a named function", param="tools")
        if mode != "none":
            plan = ToolPlan(mode, name, state.tool_format)
        ids = await offload(render_chat, body, False, body.tools if mode != "none" else None)
        params = body.sampling_params(body.max_new_tokens(), body.num_logprobs())
        if (schema := constraint(mode, name, fns)) is not None:
            if params.structured is not None:
                raise APIError(400, f"tool_choice {mode} constrains the output; it cannot be combined with "
                               f"{params.structured.param}", param="tool_choice")
            params.structured = StructuredOutput("json", schema, "tool_choice")
        checked = await offload(check, ids, params, "max_completion_tokens" if body.max_new_tokens() else "messages")
        return await respond(request, body, "chat", [(ids, checked)], [], bool(body.logprobs), arrival,
                             tools=plan)

    async def respond(request: Request, body: Any, kind: str, prompts: list[tuple[list[int], SamplingParams]],
                      echo: list[str], want_logprobs: bool, arrival: float, scoring_only: bool = False,
                      tools: ToolPlan | None = None) -> Response:
        """Submit the checked prompts and answer: an SSE stream, or the whole body once done (or the client gone)."""
        if await request.is_disconnected():  # gone while its prompt was tokenized: never queue it
            raise APIError(499, "the client closed the connection", code="client_disconnected")
        rid = state.engine.new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        builder = ResponseBuilder(kind, rid, state.model_name, token_text, want_logprobs, tools)
        run = _Run(submit(prompts, rid, arrival), [len(ids) for ids, _ in prompts], prompts[0][1].n, echo,
                   scoring_only)
        if body.stream:
            return _EngineStream(_stream(state.engine, run, builder, body.include_usage),
                                 functools.partial(state.engine.cancel, run.group))
        return JSONResponse(await _until_done_or_disconnect(request, _collect(state.engine, run, builder),
                                                            functools.partial(state.engine.cancel, run.group)))

    return app


BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def _body(name: str) -> dict[str, Any]:
    """The request body of a route in the OpenAPI document (the routes read their bodies themselves, so FastAPI
    does not know them): the pydantic model's schema, under components."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _describe_bodies(app: FastAPI) -> None:
    """``/openapi.json`` with the request models as component schemas (what API fuzzers and clients read)."""
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES],
                                         ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


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


@dataclass
class _Run:
    """A submitted request as the response sees it: choice ``index = prompt * n + sequence``."""

    group: RequestGroup
    prompt_lens: list[int]
    n: int
    echo: list[str]  # completions with echo: the prompt text per prompt
    scoring_only: bool = False  # echo + max_tokens 0: the one token the engine generated is left out

    def choice(self, out: RequestOutput) -> tuple[int, int]:
        prompt = self.group.prompt_of.get(out.request_id, 0)
        return prompt, prompt * self.n + out.index

    def usage(self, finals: dict[int, RequestOutput]) -> dict:
        cached = [0] * len(self.prompt_lens)
        for out in finals.values():
            p, _ = self.choice(out)
            cached[p] = max(cached[p], out.num_cached_tokens)
        generated = 0 if self.scoring_only else sum(len(o.token_ids) for o in finals.values())
        return usage(sum(self.prompt_lens), generated, sum(cached))


async def _collect(engine: AsyncEngine, run: _Run, builder: ResponseBuilder) -> dict:
    finals: dict[int, RequestOutput] = {}
    try:
        async for outs in engine.outputs(run.group):
            for out in outs:
                finals[run.choice(out)[1]] = out
    finally:  # cancelled (client gone), even before the first output: abort what is left
        engine.cancel(run.group)
    choices = []
    for index in sorted(finals):
        out = finals[index]
        prompt, _ = run.choice(out)
        prefix = run.echo[prompt] if run.echo else ""
        choices.append((index, prefix + ("" if run.scoring_only else out.text), out))
    return builder.full(choices, run.usage(finals), echo=bool(run.echo), scoring_only=run.scoring_only)


async def _stream(engine: AsyncEngine, run: _Run, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: (chat) a role chunk per choice, then one chunk per choice per step that adds text or ends it,
    the usage chunk when asked, ``[DONE]``. An engine error mid-stream is sent as an error event."""
    finals: dict[int, RequestOutput] = {}
    num_choices = len(run.prompt_lens) * run.n
    try:
        if builder.kind == "chat":
            for index in range(num_choices):
                yield builder.chunk(index, "", None, None, role=True)
        # the echoed prompt goes first; with logprobs it waits for the prompt's logprobs (the first output)
        echo_later = builder.want_logprobs and bool(run.echo)
        for prompt, text in enumerate(run.echo if not echo_later else []):
            for index in range(prompt * run.n, (prompt + 1) * run.n):
                builder.start_offset(index, len(text))
                yield builder.chunk(index, text, None, None)
        async for outs in engine.outputs(run.group):
            for out in outs:
                prompt, index = run.choice(out)
                if echo_later and index not in finals:
                    yield builder.echo_chunk(index, run.echo[prompt], out)
                finals[index] = out
                if run.scoring_only:
                    if out.finished:
                        yield builder.chunk(index, "", None, "length")
                    continue
                new_lp = out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if builder.want_logprobs else None
                if builder.tools is not None:
                    for chunk in builder.tool_stream(index, out, new_lp):
                        yield chunk
                    continue
                if out.new_text or out.finished or new_lp:
                    yield builder.chunk(index, out.new_text, new_lp, out.finish_reason if out.finished else None)
    except EngineUnavailable as exc:
        yield sse(_unavailable(exc).body())
        yield SSE_DONE
        return
    finally:  # closed early (the client went away, even before the first output): abort what is left, now
        engine.cancel(run.group)
    if include_usage:
        yield builder.usage_chunk(run.usage(finals))
    yield SSE_DONE


class _EngineStream(StreamingResponse):
    """An SSE response that aborts its request (``on_close``, idempotent) the moment the response ends for any
    reason — Starlette saw the client disconnect, the send failed, the stream finished. The generator's own
    ``finally`` is not enough: a client already gone when the response starts has the stream task cancelled
    before the generator ever runs, and the request then stayed queued until its first output."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_done_or_disconnect(request: Request, work: Any, on_gone: Callable[[], None]) -> dict:
    """Await ``work`` unless the client disconnects first; then cancel it and call ``on_gone`` (which aborts the
    request at once, whether or not ``work`` had started)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            try:
                return task.result()
            except EngineUnavailable as exc:
                raise _unavailable(exc) from None
        task.cancel()
        on_gone()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection")
    finally:
        watcher.cancel()


def _unavailable(exc: EngineUnavailable) -> APIError:
    """The 503 of an ended request: a queue timeout is retryable (``Retry-After``, ``code: queue_timeout``)."""
    if isinstance(exc, QueueTimeout):
        return APIError(503, str(exc), type="server_overloaded", code="queue_timeout",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(503, str(exc), type="server_error")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
