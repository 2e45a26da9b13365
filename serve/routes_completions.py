"""``POST /v1/completions``: prompts (text or token ids, one or a batch) tokenized and checked on a worker
thread, then answered by :func:`omforge.serve.respond.respond`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omforge.serve.intake import arriving, check, encode
from omforge.serve.openapi import GENERATION_ERRORS, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError, CompletionRequest
from omforge.serve.respond import respond
from omforge.serve.state import AppState

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi_body("CompletionRequest"),
             responses=errors(*GENERATION_ERRORS, stream=True))
async def completions(request: Request, state: AppState) -> Response:
    async with arriving(state, request, CompletionRequest) as (body, arrival):
        tokenizer = state.tokenizer
        prompts = body.prompts()
        texts = [p if isinstance(p, str) else None for p in prompts]
        if any(t is not None for t in texts) and tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids", param="prompt")
        ids = await state.offload(lambda: [encode(state, p, True, "prompt") if isinstance(p, str) else list(p)
                                           for p in prompts])
        params = body.engine_params()
        length_param = "max_tokens" if body.max_tokens else "prompt"
        lora = state.lora_of(body.model)
        checked = await state.offload(lambda: [check(state, i, params, length_param, lora) for i in ids])
        echo = []
        if body.echo:
            echo = await state.offload(lambda: [t if t is not None else (tokenizer.decode(i) if tokenizer else "")
                                                for t, i in zip(texts, ids)])
        return await respond(state, request, body, "completion", checked, echo, body.logprobs is not None, arrival,
                             scoring_only=body.scoring_only)
