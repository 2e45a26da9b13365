"""LoRA adapters at run time, vLLM's routes and shapes (docs/lora.md): ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, behind the API key. A 200
answers vLLM's plain-text ``Success: …`` line; 400 an adapter that cannot be read or does not fit the bundle, a name
already served (or the base model's), a bundle without LoRA slots; 404 unloading an adapter not loaded; 409
unloading one that requests still use. The adapter is parsed on a worker thread and registered in the engine's
registry, which is thread-safe (serve/async_engine.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from omforge.runtime.engine import LoraInUse, UnknownLora
from omforge.runtime.lora.adapter import LoraError, LoraNameTaken
from omforge.serve.async_engine import EngineUnavailable
from omforge.serve.intake import M, authorize, read_body
from omforge.serve.openapi import CLIENT_ERRORS, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from omforge.serve.state import AppState, ServerState

router = APIRouter()


LORA_ERRORS = (*CLIENT_ERRORS, 409, 503)
OK = {200: {"description": "Success: a line of text", "content": {"text/plain": {"schema": {"type": "string"}}}}}


async def _body(state: ServerState, request: Request, schema: type[M]) -> M:
    authorize(state, request)
    return await read_body(state, request, schema)


@router.post("/v1/load_lora_adapter", openapi_extra=openapi_body("LoadLoraAdapterRequest"),
             responses={**OK, **errors(*LORA_ERRORS)})
async def load_lora_adapter(request: Request, state: AppState) -> Response:
    body = await _body(state, request, LoadLoraAdapterRequest)
    name = body.lora_name
    if name == state.model_name:
        raise APIError(400, f"lora_name: '{name}' is the base model's name; pick another", param="lora_name")
    if state.engine.model.lora is None:
        raise APIError(400, "this bundle was compiled without compile.lora (no adapter slots): it serves no LoRA "
                       "adapters", param="lora_path")
    try:
        await state.engine.load_lora(name, body.lora_path)
    except LoraNameTaken as exc:
        raise APIError(400, str(exc), param="lora_name") from None
    except LoraError as exc:
        raise APIError(400, str(exc), param="lora_path") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=openapi_body("UnloadLoraAdapterRequest"),
             responses={**OK, **errors(*LORA_ERRORS)})
async def unload_lora_adapter(request: Request, state: AppState) -> Response:
    body = await _body(state, request, UnloadLoraAdapterRequest)
    name = body.lora_name
    try:
        await state.engine.unload_lora(name)
    except UnknownLora as exc:
        raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
    except LoraInUse as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
