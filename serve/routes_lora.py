"""LoRA adapters at run time, vLLM's routes and shapes (docs/lora.md, "Runtime loading"): ``POST
/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, behind
the API key, and off unless the server was started with ``--enable-runtime-lora`` (or
``OMFORGE_ALLOW_RUNTIME_LORA_UPDATING=1``) and ``--lora-dirs``: off, both answer a 404 saying how to turn them on.

A 200 answers vLLM's plain-text ``Success: …`` line; 400 a name that is not :data:`~.access.NAME_RULE`, a name
already served (or the base model's), a registry full (``--max-cpu-loras``), an adapter that does not fit the bundle,
and — one message whatever the reason — a ``lora_path`` that is missing, outside the ``--lora-dirs``, unreadable or
not an adapter (the reason goes to the server's log only); 404 unloading an adapter not loaded; 409 unloading one
that requests still use. The adapter is parsed on a worker thread and registered in the engine's registry, which is
thread-safe (serve/async_engine.py)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from omforge.runtime.engine import LoraInUse, UnknownLora
from omforge.runtime.lora.access import PATH_REFUSED, LoraNameInvalid, LoraPathRefused, check_name, confine
from omforge.runtime.lora.adapter import LoraError, LoraNameTaken
from omforge.runtime.lora.registry import LoraLimit, LoraUnreadable
from omforge.serve.async_engine import EngineUnavailable
from omforge.serve.intake import M, authorize, read_body
from omforge.serve.openapi import CLIENT_ERRORS, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from omforge.serve.state import AppState, ServerState

router = APIRouter()
log = logging.getLogger("omforge.serve")

LORA_ERRORS = (*CLIENT_ERRORS, 409, 503)
OK = {200: {"description": "Success: a line of text", "content": {"text/plain": {"schema": {"type": "string"}}}}}
RUNTIME_LORA_OFF = ("loading and unloading LoRA adapters at run time is off on this server; start it with "
                    "--enable-runtime-lora --lora-dirs DIR … (or OMFORGE_ALLOW_RUNTIME_LORA_UPDATING=1 and "
                    "--lora-dirs) to turn it on")


async def _body(state: ServerState, request: Request, schema: type[M]) -> M:
    """The authorized request's body with a valid ``lora_name``: 404 while runtime loading is off, 400 for a name
    outside the rule (which never repeats a long name)."""
    authorize(state, request)
    if state.engine.model.lora is None:
        raise APIError(404, "this bundle was compiled without compile.lora (no adapter slots): it serves no LoRA "
                       "adapters", code="runtime_lora_disabled")
    if state.lora_dirs is None:
        raise APIError(404, RUNTIME_LORA_OFF, code="runtime_lora_disabled")
    body = await read_body(state, request, schema)
    try:
        check_name(body.lora_name)
    except LoraNameInvalid as exc:
        raise APIError(400, str(exc), param="lora_name") from None
    return body


@router.post("/v1/load_lora_adapter", openapi_extra=openapi_body("LoadLoraAdapterRequest"),
             responses={**OK, **errors(*LORA_ERRORS)})
async def load_lora_adapter(request: Request, state: AppState) -> Response:
    body = await _body(state, request, LoadLoraAdapterRequest)
    name = body.lora_name
    if name == state.model_name:
        raise APIError(400, f"lora_name: '{name}' is the base model's name; pick another", param="lora_name")
    registry = state.engine.model.lora
    try:
        if name not in registry.names():  # type: ignore[union-attr]  # (a name taken: the engine's 400)
            registry.check_room()  # type: ignore[union-attr]  # before reading a file that could not be kept
        path = confine(body.lora_path, state.lora_dirs or ())
        await state.engine.load_lora(name, str(path))
    except LoraNameTaken as exc:
        raise APIError(400, str(exc), param="lora_name") from None
    except LoraLimit as exc:
        raise APIError(400, str(exc), param="lora_name", code="lora_limit") from None
    except (LoraPathRefused, LoraUnreadable) as exc:
        detail = exc.detail if isinstance(exc, LoraPathRefused) else str(exc)
        log.warning("load_lora_adapter '%s' refused: %s", name, detail)
        raise APIError(400, PATH_REFUSED, param="lora_path") from None
    except LoraError as exc:  # read, but does not fit the bundle (names the adapter and the field, no path)
        raise APIError(400, str(exc), param="lora_path") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error") from None
    log.info("load_lora_adapter '%s' from %s", name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=openapi_body("UnloadLoraAdapterRequest"),
             responses={**OK, **errors(*LORA_ERRORS)})
async def unload_lora_adapter(request: Request, state: AppState) -> Response:
    body = await _body(state, request, UnloadLoraAdapterRequest)
    name = body.lora_name
    try:
        await state.engine.unload_lora(name)
    except UnknownLora:
        raise APIError(404, f"the LoRA adapter '{name}' is not loaded", param="lora_name",
                       code="model_not_found") from None
    except LoraInUse as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
