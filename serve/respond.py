"""Submitting a request's checked prompts and answering it: an SSE stream (:class:`EngineStream`) or the whole
body once every choice finished. Whichever way the answer ends — done, the client gone, the engine stopping —
the request leaves the engine at once. A PD prefill leg is held only where its one hand-off is answered
(:func:`held_legs`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omforge.runtime.engine import RequestOutput
from omforge.runtime.input_processor import CheckedRequest
from omforge.serve.async_engine import AsyncEngine, EngineUnavailable, KVTransferFailed, QueueTimeout, RequestGroup
from omforge.serve.intake import RETRY_AFTER_S, submit
from omforge.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from omforge.serve.responses import SSE_DONE, ResponseBuilder, sse, usage
from omforge.serve.state import ServerState
from omforge.serve.tools import ToolPlan


async def respond(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest, kind: str,
                  prompts: list[CheckedRequest], echo: list[str], want_logprobs: bool,
                  arrival: float, scoring_only: bool = False, tools: ToolPlan | None = None) -> Response:
    """Submit the checked prompts and answer: an SSE stream, or the whole body once done (or the client gone)."""
    if await request.is_disconnected():  # gone while its prompt was tokenized: never queue it
        raise APIError(499, "the client closed the connection", code="client_disconnected")
    engine = state.engine
    rid = engine.new_request_id("chatcmpl" if kind == "chat" else "cmpl")
    builder = ResponseBuilder(kind, rid, state.response_model(body.model), state.token_text, want_logprobs, tools)
    prompts = held_legs(body, prompts)
    run = Run(submit(state, prompts, rid, arrival), [len(p.prompt_token_ids) for p in prompts], prompts[0].n, echo,
              scoring_only)
    cancel = functools.partial(engine.cancel, run.group)
    if body.stream:
        return EngineStream(stream(engine, run, builder, body.include_usage), cancel)
    return JSONResponse(await until_done_or_disconnect(request, collect(engine, run, builder), cancel))


def held_legs(body: CompletionRequest | ChatCompletionRequest, prompts: list[CheckedRequest]) -> list[CheckedRequest]:
    """The prompts to submit, no prefill leg among them that nobody would read. A ``kv_producer`` replica makes a
    request without ``kv_transfer_params`` a prefill leg (SMG's prefill leg carries none); it stays one only where
    its hand-off can be answered and read — one prompt, non-streamed, no prompt logprobs (a decode leg refuses
    them) — and otherwise runs as a plain request: nothing held, no hand-off, so the decode side prefills itself.
    Legs sent with ``kv_transfer_params`` were refused where they cannot be served (the protocol and the intake)."""
    if body.kv_transfer_params or not any(p.kv_transfer is not None and p.kv_transfer.is_prefill_leg
                                          for p in prompts):
        return prompts
    if len(prompts) == 1 and not body.stream and prompts[0].params.prompt_logprobs is None:
        return prompts
    return [replace(p, kv_transfer=None) for p in prompts]


@dataclass
class Run:
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
        reasoning = sum(o.num_reasoning_tokens for o in finals.values()) \
            if any(o.reasoning_text is not None for o in finals.values()) else None
        return usage(sum(self.prompt_lens), generated, sum(cached), reasoning)


async def collect(engine: AsyncEngine, run: Run, builder: ResponseBuilder) -> dict:
    """The whole (non-streaming) body, once every choice finished."""
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
    body = builder.full(choices, run.usage(finals), echo=bool(run.echo), scoring_only=run.scoring_only)
    handoff = next((o.kv_transfer_params for o in finals.values() if o.kv_transfer_params), None)
    if handoff is not None:  # a PD prefill leg: what the decode leg needs (vLLM's top-level field)
        body["kv_transfer_params"] = handoff
    return body


async def stream(engine: AsyncEngine, run: Run, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
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
                if out.new_reasoning_text:  # the thinking goes first: the step's answer text comes after it
                    yield builder.chunk(index, "", new_lp, None, reasoning=out.new_reasoning_text)
                    new_lp = None
                if builder.tools is not None:
                    for chunk in builder.tool_stream(index, out, new_lp):
                        yield chunk
                    continue
                if out.new_text or out.finished or new_lp:
                    yield builder.chunk(index, out.new_text, new_lp, out.finish_reason if out.finished else None)
    except EngineUnavailable as exc:
        yield sse(unavailable(exc).body())
        yield SSE_DONE
        return
    finally:  # closed early (the client went away, even before the first output): abort what is left, now
        engine.cancel(run.group)
    if include_usage:
        yield builder.usage_chunk(run.usage(finals))
    yield SSE_DONE


class EngineStream(StreamingResponse):
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


async def until_done_or_disconnect(request: Request, work: Any, on_gone: Callable[[], None]) -> dict:
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
                raise unavailable(exc) from None
        task.cancel()
        on_gone()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection")
    finally:
        watcher.cancel()


def unavailable(exc: EngineUnavailable) -> APIError:
    """The 503 of an ended request: a queue timeout is retryable (``Retry-After``, ``code: queue_timeout``)."""
    if isinstance(exc, KVTransferFailed):
        return APIError(503, str(exc), type="server_error", code="kv_transfer_failed")
    if isinstance(exc, QueueTimeout):
        return APIError(503, str(exc), type="server_overloaded", code="queue_timeout",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(503, str(exc), type="server_error")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
