"""The routes beside generation: ``/health``, ``/metrics``, ``/v1/models``, vLLM's ``/tokenize`` and
``/detokenize`` (tokenizing on a worker thread, so a long prompt never stalls the event loop), and what a gateway
in front of several replicas reads (docs/cluster.md): ``/v1/loads`` (the engine's load, SGLang's and SMG's shape)
and vLLM's ``/version``, by which SMG classifies a worker as vLLM-compatible."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omforge.serve.intake import authorize, check_characters, parse, render_chat
from omforge.serve.openapi import CLIENT_ERRORS, HEALTH, LOADS, VERSION, PrometheusResponse, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError, DetokenizeRequest, TokenizeRequest
from omforge.serve.state import AppState

router = APIRouter()


@router.get("/health", responses=HEALTH)
async def health(state: AppState) -> Response:
    engine = state.engine
    if engine.healthy and not engine.draining:
        return JSONResponse({"status": "ok"})
    reason = "draining" if engine.draining else f"engine failed: {engine.failure}"
    return JSONResponse({"status": reason}, status_code=503)


@router.get("/metrics", response_class=PrometheusResponse)
async def metrics(state: AppState) -> Response:
    return PrometheusResponse(state.metrics.render())


@router.get("/v1/models", responses=errors(401))
async def models(request: Request, state: AppState) -> Response:
    authorize(state, request)
    base = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "omforge",
            "max_model_len": state.max_model_len}
    lora = state.engine.model.lora
    adapters = [{**base, "id": name, "root": path, "parent": state.model_name}  # LoRA adapters, vLLM's shape
                for name, path in (lora.served() if lora is not None else {}).items()]
    return JSONResponse({"object": "list", "data": [base, *adapters]})


@router.get("/v1/loads", responses={**LOADS, **errors(401)})
async def loads(request: Request, state: AppState) -> Response:
    """The engine's state after its latest step: queue lengths, KV blocks in use, the prefix-cache hit rate."""
    authorize(state, request)
    return JSONResponse(state.metrics.loads(state.engine.model.block_size, state.engine.model.max_num_seqs))


@router.get("/version", responses=VERSION)
async def version(request: Request) -> Response:
    """vLLM's route (``{"version": …}``, open like ``/health``): omforge's version, as /openapi.json states it."""
    return JSONResponse({"version": request.app.version})


@router.post("/tokenize", openapi_extra=openapi_body("TokenizeRequest"), responses=errors(*CLIENT_ERRORS))
async def tokenize(request: Request, state: AppState) -> Response:
    body = await parse(state, request, TokenizeRequest)
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="prompt")
    if body.prompt is not None:
        check_characters(state, body.prompt, "prompt")  # before the tokenizer (messages: render_chat checks)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await state.offload(tokenizer.encode, body.prompt, special)
    else:
        ids = await state.offload(render_chat, state, body.chat(), bool(body.add_special_tokens))
    answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    return Response(await state.offload(json.dumps, answer), media_type="application/json")


@router.post("/detokenize", openapi_extra=openapi_body("DetokenizeRequest"), responses=errors(*CLIENT_ERRORS))
async def detokenize(request: Request, state: AppState) -> Response:
    body = await parse(state, request, DetokenizeRequest)
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    vocab = state.engine.model.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await state.offload(state.tokenizer.decode, body.tokens, False)})
