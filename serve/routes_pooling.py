"""The pooling endpoints of an embed or score bundle (runtime/pooling.py): ``POST /v1/embeddings``, ``POST
/v1/rerank`` (also ``/rerank`` and ``/v2/rerank``, as vLLM serves them) and ``POST /v1/score`` (also ``/score``).

Each input is one engine request of its own (tokenized and checked on a worker thread, then batched by the engine
with whatever else is waiting); the answer comes once all are done, or the request leaves the engine when the
client goes. A model of another task answers 400 naming its task: embeddings need an embed bundle; rerank and
score take a score bundle (the reranker's P(yes)) or an embed bundle (the cosine of the query's and each document's
embeddings, the query in the model's instruction format, as vLLM scores with an embedding model).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omforge.contract.manifest import PoolingSection
from omforge.runtime.engine import RequestRejected
from omforge.runtime.pooling import PoolingParams, encode_text, score_inputs, scores_of
from omforge.runtime.sampling_params import SamplingParamsError
from omforge.runtime.tokenizer import TextTokenizer
from omforge.serve.async_engine import AsyncEngine, RequestGroup
from omforge.serve.intake import check_characters, parse, submit
from omforge.serve.openapi import GENERATION_ERRORS, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError
from omforge.serve.protocol_pooling import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    embedding_response,
    rerank_response,
    score_response,
)
from omforge.serve.respond import until_done_or_disconnect
from omforge.serve.state import AppState, ServerState

router = APIRouter()


@router.post("/v1/embeddings", openapi_extra=openapi_body("EmbeddingRequest"), responses=errors(*GENERATION_ERRORS))
async def embeddings(request: Request, state: AppState) -> Response:
    with state.engine.arriving():
        arrival = time.monotonic()
        body = await parse(state, request, EmbeddingRequest)
        pooling = _pooling(state, "/v1/embeddings", ("embed",))
        tokenizer = state.tokenizer
        inputs = body.inputs()
        if tokenizer is None and any(isinstance(i, str) for i in inputs):
            raise APIError(400, "this model has no tokenizer: send input token ids", param="input")
        for i, text in enumerate(inputs):
            if isinstance(text, str):
                check_characters(state, text, "input", what=f"input[{i}]" if len(inputs) > 1 else "the input")
        seqs = await state.offload(lambda: [encode_text(tokenizer, pooling, i) if isinstance(i, str) else i
                                            for i in inputs])
        vectors = await _run(state, request, "embd", seqs, PoolingParams(body.dimensions), "input", arrival)
    return JSONResponse(embedding_response(state.model_name, vectors, body.encoding_format,
                                           sum(len(s) for s in seqs)))


@router.post("/v1/rerank", openapi_extra=openapi_body("RerankRequest"), responses=errors(*GENERATION_ERRORS))
@router.post("/rerank", openapi_extra=openapi_body("RerankRequest"), responses=errors(*GENERATION_ERRORS))
@router.post("/v2/rerank", openapi_extra=openapi_body("RerankRequest"), responses=errors(*GENERATION_ERRORS))
async def rerank(request: Request, state: AppState) -> Response:
    with state.engine.arriving():
        arrival = time.monotonic()
        body = await parse(state, request, RerankRequest)
        pooling = _pooling(state, request.url.path, ("score", "embed"))
        tokenizer = _tokenizer(state)
        _check_pairs(state, pooling, body.query, body.texts(), "query", "documents")
        seqs = await state.offload(score_inputs, tokenizer, pooling, body.query, body.texts(), body.instruction)
        scores = scores_of(pooling, await _run(state, request, "rerank", seqs, PoolingParams(), "documents",
                                               arrival))
    return JSONResponse(rerank_response(state.engine.new_request_id("rerank"), state.model_name, body, scores,
                                        sum(len(s) for s in seqs)))


@router.post("/v1/score", openapi_extra=openapi_body("ScoreRequest"), responses=errors(*GENERATION_ERRORS))
@router.post("/score", openapi_extra=openapi_body("ScoreRequest"), responses=errors(*GENERATION_ERRORS))
async def score(request: Request, state: AppState) -> Response:
    with state.engine.arriving():
        arrival = time.monotonic()
        body = await parse(state, request, ScoreRequest)
        pooling = _pooling(state, request.url.path, ("score", "embed"))
        groups = body.pairs()
        tokenizer = _tokenizer(state)
        for query, docs in groups:
            _check_pairs(state, pooling, query, docs, "text_1", "text_2")
        per_group = await state.offload(lambda: [score_inputs(tokenizer, pooling, q, docs, body.instruction)
                                                 for q, docs in groups])
        seqs = [s for group in per_group for s in group]
        results = await _run(state, request, "score", seqs, PoolingParams(), "text_2", arrival)
        scores, at = [], 0
        for group in per_group:
            scores += scores_of(pooling, results[at:at + len(group)])
            at += len(group)
    return JSONResponse(score_response(state.engine.new_request_id("score"), state.model_name, scores,
                                       sum(len(s) for s in seqs)))


def _pooling(state: ServerState, route: str, tasks: tuple[str, ...]) -> PoolingSection:
    """The bundle's pooling section, or a 400 naming the model's task when ``route`` needs another."""
    pooling = state.engine.model.pooling
    task = pooling.task if pooling is not None else "generate"
    if task not in tasks:
        need = " or ".join(f"task: {t}" for t in tasks)
        raise APIError(400, f"{route}: the model '{state.model_name}' is for task {task}; this endpoint needs a "
                       f"bundle compiled with {need}", param="model", code="wrong_model_task")
    assert pooling is not None
    return pooling


def _check_pairs(state: ServerState, pooling: PoolingSection, query: str, documents: Sequence[str],
                 query_param: str, doc_param: str) -> None:
    """Before the tokenizer: 400 ``context_length_exceeded`` for a sequence that cannot fit the context by its
    characters alone (:func:`check_characters`) — a score bundle's pair (query and document are one sequence), an
    embed bundle's query and each document on its own."""
    if pooling.task == "score":
        for i, doc in enumerate(documents):
            check_characters(state, doc, doc_param, extra=len(query), what=f"{doc_param}[{i}] with its query")
    else:
        check_characters(state, query, query_param, what=query_param)
        for i, doc in enumerate(documents):
            check_characters(state, doc, doc_param, what=f"{doc_param}[{i}]")


def _tokenizer(state: ServerState) -> TextTokenizer:
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; rerank and score take text", param="model")
    return state.tokenizer


async def _run(state: ServerState, request: Request, kind: str, seqs: list[list[int]], params: PoolingParams,
               param: str, arrival: float) -> list[np.ndarray]:
    """Check every sequence (a 400 naming ``param`` or ``dimensions``), queue them in parts of ``max_num_seqs``
    (a request of many inputs — OpenAI takes 2,048, LangChain sends 1,000 — never needs more room in the queue than
    one batch) and return their results in order, or leave the engine at once when the client goes. Each part is
    queued when the one before it is done, as a continuation (admission does not refuse it: it takes the room its
    predecessor left); the engine's queue-time bound counts only its time in the queue (runtime/pooling.py), so
    the request's own tokenizing and earlier parts never end it with a 503."""
    engine = state.engine
    checked = []
    for ids in seqs:
        try:
            checked.append(engine.check(ids, params))
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except RequestRejected as exc:
            code = None if exc.param is not None else "context_length_exceeded"
            raise APIError(400, f"{param}: {exc}", param=param, code=code) from None
    results: list[np.ndarray] = []
    step = max(1, engine.model.max_num_seqs)
    for at in range(0, len(seqs), step):
        if await request.is_disconnected():
            raise APIError(499, "the client closed the connection", code="client_disconnected")
        part = checked[at:at + step]
        group = submit(state, part, engine.new_request_id(kind), arrival, continuing=at > 0)
        results += await until_done_or_disconnect(request, _collect(engine, group, len(part)),
                                                  functools.partial(engine.cancel, group))
    return results


async def _collect(engine: AsyncEngine, group: RequestGroup, count: int) -> Sequence[np.ndarray]:
    results: list[np.ndarray | None] = [None] * count
    async for outputs in engine.outputs(group):
        for out in outputs:
            results[group.prompt_of[out.request_id]] = out.pooled
    return results  # type: ignore[return-value]
