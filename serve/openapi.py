"""``/openapi.json``: the routes read their request bodies themselves (:func:`omforge.serve.intake.parse`, with
its own size limit and timeout), so FastAPI does not know them; each route names its body (:func:`body`) and
the errors it answers (:func:`errors`), and the request models and OpenAI's error body are added as component
schemas (what API fuzzers and clients read)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from omforge.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from omforge.serve.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest

BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest,
          RerankRequest, ScoreRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest)

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "description": "OpenAI's error body (serve/protocol.py APIError.body).",
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"},
        "type": {"type": "string", "description": "invalid_request_error, server_overloaded, server_error"},
        "param": {"type": ["string", "null"], "description": "the request field at fault, where one is"},
        "code": {"type": ["string", "null"], "description": "e.g. context_length_exceeded, queue_full"}}}}}

WHY = {
    400: "Malformed JSON or an invalid parameter (`param` names it), or a context too long "
         "(`code: context_length_exceeded`)",
    401: "Missing or wrong API key (when the server has one)",
    404: "The request names a model (or a LoRA adapter) this server does not serve",
    408: "The request body did not arrive in time",
    409: "The LoRA adapter is in use by requests in flight",
    413: "The request body is larger than --max-request-body-bytes",
    429: "The waiting queue is full (retryable: Retry-After)",
    503: "Shutting down, the engine failed, or the request waited past max_queue_time_s (retryable: Retry-After)",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
CLIENT_ERRORS = (400, 401, 404, 408, 413)  # what every route that reads a body can answer
GENERATION_ERRORS = (*CLIENT_ERRORS, 429, 503)  # … and the routes that queue work on the engine

_STATUS = {"content": {"application/json": {"schema": {
    "type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}}}}
HEALTH: dict[int | str, dict[str, Any]] = {
    200: {"description": "Serving: {\"status\": \"ok\"}", **_STATUS},
    503: {"description": "Draining or the engine failed: {\"status\": \"draining\"} or the failure", **_STATUS}}

_RANK = {"type": "object", "properties": {k: {"type": t} for k, t in (
    ("dp_rank", "integer"), ("num_running_reqs", "integer"), ("num_waiting_reqs", "integer"),
    ("num_total_reqs", "integer"), ("num_used_tokens", "integer"), ("max_total_num_tokens", "integer"),
    ("token_usage", "number"), ("cache_hit_rate", "number"), ("max_running_requests", "integer"))}}
LOADS: dict[int | str, dict[str, Any]] = {200: {
    "description": "The engine after its latest step, one rank (serve/metrics.py ServerMetrics.loads)",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["timestamp", "dp_rank_count", "loads"], "properties": {
            "timestamp": {"type": "string"}, "dp_rank_count": {"type": "integer"},
            "loads": {"type": "array", "items": _RANK}}}}}}}
VERSION: dict[int | str, dict[str, Any]] = {200: {"description": "omforge's version: {\"version\": \"0.1.0\"}",
                                                  "content": {"application/json": {"schema": {
                                                      "type": "object", "required": ["version"],
                                                      "properties": {"version": {"type": "string"}}}}}}}

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"  # the text exposition format generate_latest writes


class PrometheusResponse(Response):
    """``/metrics``' response class: its media type is what the document lists (Prometheus' text format)."""

    media_type = PROMETHEUS


def body(name: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: its request body is the component schema ``name`` (one of :data:`BODIES`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def errors(*statuses: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses``: each status with why it is answered and the error body (429 and 503 with their
    ``Retry-After``); ``stream``: the 200 may also be server-sent events (``stream: true``)."""
    out: dict[int | str, dict[str, Any]] = {}
    if stream:
        out[200] = {"description": "The answer; with stream: true, server-sent events ending with data: [DONE]",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    for status in statuses:
        out[status] = {"description": WHY[status], "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        if status in (429, 503):
            out[status]["headers"] = RETRY_AFTER
    return out


def describe_bodies(app: FastAPI) -> None:
    """``app.openapi()`` with the request models and the error body as component schemas."""
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES],
                                         ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs["$defs"])
            schemas["ErrorResponse"] = ERROR_SCHEMA
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
