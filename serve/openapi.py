"""``/openapi.json``: the routes read their request bodies themselves (:func:`omforge.serve.intake.parse`, with
its own size limit and timeout), so FastAPI does not know them; each route names its body (:func:`body`) and
the request models are added as component schemas (what API fuzzers and clients read)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from omforge.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def body(name: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: its request body is the component schema ``name`` (one of :data:`BODIES`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def describe_bodies(app: FastAPI) -> None:
    """``app.openapi()`` with the request models as component schemas."""
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
