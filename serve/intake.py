"""From an HTTP request to checked prompts on the engine: the API key, the body parsed into its request model,
the chat template, the engine's admission check and the submission — each failure an :class:`APIError` with
OpenAI's status and body. Every function takes the :class:`ServerState` it needs."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from omforge.runtime.engine import RequestRejected, UnknownLora
from omforge.runtime.input_processor import CheckedRequest
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError
from omforge.runtime.tokenizer import ChatTemplateError
from omforge.serve.async_engine import EngineUnavailable, Overloaded, RequestGroup
from omforge.serve.body import read_json
from omforge.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_satisfiable,
    validation_message,
)
from omforge.serve.state import ServerState

RETRY_AFTER_S = 1  # what a 429 tells the client to wait; the queue moves every engine step
G = TypeVar("G", CompletionRequest, ChatCompletionRequest)
B = TypeVar("B", TokenizeRequest, DetokenizeRequest)
M = TypeVar("M", bound=BaseModel)


def authorize(state: ServerState, request: Request) -> None:
    """Raise 401 unless the request carries ``Authorization: Bearer KEY`` (when the server has a key)."""
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    # bytes: compare_digest refuses non-ASCII str (a 500 before); the header arrives as latin-1 text
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode("utf-8", "surrogateescape"),
                                                                state.api_key.encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")


@asynccontextmanager
async def arriving(state: ServerState, request: Request, schema: type[G]) -> AsyncIterator[tuple[G, float]]:
    """A completion or chat request from its arrival to its answer: its arrival time, its authorized body, its
    adapter held (:func:`holding`), its options supported — all the while counted as arriving so the engine's
    batch-fill wait knows it is coming. A pooling model (task embed | score) answers no completion or chat request
    (400 naming its task)."""
    with state.engine.arriving():
        arrival = time.monotonic()
        authorize(state, request)
        pooling = state.engine.model.pooling
        if pooling is not None:
            raise APIError(400, f"{request.url.path}: the model '{state.model_name}' is for task "
                           f"{pooling.task} (a pooling bundle: /v1/embeddings, /v1/rerank, /v1/score); "
                           "completions and chat need a bundle compiled with task: generate", param="model",
                           code="wrong_model_task")
        body = await read_body(state, request, schema)
        with holding(state, body.model):
            body.check_supported()
            yield body, arrival


async def parse(state: ServerState, request: Request, schema: type[B]) -> B:
    """The authorized request's body as ``schema``, for this server's model (the base or a served adapter), with
    only supported options: the routes that run no generation (a completion or chat request: :func:`arriving`)."""
    authorize(state, request)
    body = await read_body(state, request, schema)
    lora = state.engine.model.lora
    if body.model is not None and body.model != state.model_name and (lora is None or body.model not in lora):
        raise model_not_found(state, body.model)
    body.check_supported()
    return body


@contextmanager
def holding(state: ServerState, model: str | None) -> Iterator[None]:
    """The adapter ``model`` selects held until the request is submitted (:meth:`AsyncEngine.holding`: the one
    check that it is served); a model that is neither the base nor a served adapter is a 404."""
    with ExitStack() as held:
        try:
            held.enter_context(state.engine.holding(state.lora_of(model)))
        except UnknownLora:
            raise model_not_found(state, str(model)) from None
        yield


async def read_body(state: ServerState, request: Request, schema: type[M]) -> M:
    """The request's JSON body (bounded in time and size) as ``schema``: a 400 naming the field that does not fit,
    or the nesting that is too deep. Authorization is the caller's (first)."""
    data = await read_json(request, state.body_timeout, state.max_body_bytes)
    try:
        return schema.model_validate(data)
    except RecursionError:  # a deep structure inside an accepted field (logit_bias, a message …)
        raise APIError(400, "the request body nests too deeply") from None
    except ValidationError as exc:
        param, what = validation_message(exc)
        raise APIError(400, f"{param}: {what}", param=param) from None


MAX_ECHOED_NAME = 128  # characters of an unknown model name a 404 repeats (a 1 MB name is not answered in full)


def model_not_found(state: ServerState, model: str) -> APIError:
    """404 ``model_not_found`` (vLLM's words) naming what this server serves: the base model and its adapters."""
    names = state.engine.model.lora.names() if state.engine.model.lora is not None else ()
    adapters = f" and the LoRA adapter(s) {', '.join(repr(n) for n in names)}" if names else ""
    shown = model if len(model) <= MAX_ECHOED_NAME else f"{model[:MAX_ECHOED_NAME]}… ({len(model)} characters)"
    return APIError(404, f"The model `{shown}` does not exist; this server serves '{state.model_name}'{adapters}",
                    param="model", code="model_not_found")


def render_chat(state: ServerState, body: ChatCompletionRequest, add_special_tokens: bool = False,
                tools: list[dict] | None = None) -> list[int]:
    """The chat template over the request's messages (and ``tools``, as transformers passes them), encoded
    (raises APIError 400 on a template error). Runs on a tokenizer worker."""
    extra = {"tools": tools} if tools else {}
    try:
        text = state.tokenizer.apply_chat_template(body.conversation(),
                                                   add_generation_prompt=body.add_generation_prompt,
                                                   **extra, **(body.chat_template_kwargs or {}))
    except ChatTemplateError as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    return encode(state, text, add_special_tokens, "messages")


def encode(state: ServerState, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """``text``'s token ids, refusing (400 ``context_length_exceeded``) before tokenizing a text whose character
    count alone proves it cannot fit the context: each token spells at most ``max_token_chars`` characters
    (a 7 MB prompt cost 8 s of a tokenizer worker before the length check refused it; now microseconds)."""
    assert state.tokenizer is not None
    check_characters(state, text, param)
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_characters(state: ServerState, text: str, param: str, extra: int = 0, what: str = "the prompt") -> None:
    """400 ``context_length_exceeded`` for a text that cannot fit the context by its character count alone (each
    token spells at most ``max_token_chars`` characters); every route checks a client's text with it before
    tokenizing. ``extra``: characters of other text in the same sequence (a rerank pair's query); ``what`` names
    the text in the message."""
    assert state.tokenizer is not None
    most = state.tokenizer.max_token_chars * state.max_model_len
    chars = len(text) + extra
    if chars > most:
        raise APIError(400, f"{param}: {what} is {chars:,} characters, which cannot fit this model's context "
                       f"of {state.max_model_len} tokens (at most {most:,} characters with this tokenizer)",
                       param=param, code="context_length_exceeded")


def check(state: ServerState, ids: list[int], params: SamplingParams, length_param: str,
          lora: str | None = None) -> CheckedRequest:
    """The engine's admission check as a 400 (``length_param`` names the field of a too-long request), once per
    prompt, on a tokenizer worker; ``lora``: the adapter the request's model selects."""
    try:
        checked = state.engine.check(ids, params, lora)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except RequestRejected as exc:
        if exc.param is not None:  # not a length: e.g. prompt token ids outside the vocabulary
            raise APIError(400, str(exc), param=exc.param) from None
        raise APIError(400, str(exc), param=length_param, code="context_length_exceeded") from None
    if checked.params.structured is not None:
        check_satisfiable(checked.params.structured)
    return checked


def submit(state: ServerState, prompts: list[CheckedRequest], request_id: str, arrival: float,
           continuing: bool = False) -> RequestGroup:
    """Queue the checked prompts as one group (one adapter, held: :func:`holding`): 400 if they could never fit,
    429 when full (``continuing``: the next part of a request already admitted, 429 only past the capacity), 503
    when stopping."""
    num_seqs = sum(p.n for p in prompts)
    capacity = state.engine.capacity
    if num_seqs > capacity:  # never admissible: a 429 would have the client retry forever
        raise APIError(400, f"prompt: {len(prompts)} prompt(s) × n make {num_seqs} sequences, more than this "
                       f"server ever holds ({capacity}: max_num_seqs + max_waiting_requests); "
                       "send fewer per request", param="prompt")
    try:
        return state.engine.submit(prompts, request_id, arrival, continuing)
    except Overloaded as exc:
        raise APIError(429, str(exc), type="server_overloaded", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="unavailable",
                       headers={"Retry-After": str(5 * RETRY_AFTER_S)}) from None
