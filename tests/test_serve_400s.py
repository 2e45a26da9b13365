"""The errors a client can meet, documented and counted (issue 24, defect 11): ``/openapi.json`` lists each
route's errors (400, 401, 404, 408, 413; 429 and 503 where a route queues work, with ``Retry-After``) with
OpenAI's error body as a component schema, ``/metrics`` under the media type it is served with (Prometheus'
text format, not the ``application/json`` FastAPI assumed); every 400 — from the body's decoding, the request
models, the routes, the admission check, the submission — is counted in ``request_rejected_total``
(``invalid_parameter``; ``too_long`` for a context exceeded), and no other status is."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient

from omforge.serve.api import build_app
from omforge.serve.metrics import ServerMetrics
from server_process import ServerProcess

KEY = "sk-400s"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 65536  # --max-request-body-bytes
INVALID = "omforge:request_rejected_total{reason=invalid_parameter}"
TOO_LONG = "omforge:request_rejected_total{reason=too_long}"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64", "--max-model-len", "256",
                        "--max-request-body-bytes", str(LIMIT), api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


def request(url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def assert_error_body(doc: dict, raw: bytes) -> dict:
    """``raw`` matches the document's ErrorResponse schema (its required keys and their types)."""
    schema = doc["components"]["schemas"]["ErrorResponse"]
    data = json.loads(raw)
    assert set(schema["required"]) <= set(data), data
    inner = schema["properties"]["error"]
    assert set(inner["required"]) <= set(data["error"]), data
    types = {"string": str, "null": type(None)}
    for key, spec in inner["properties"].items():
        allowed = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        assert isinstance(data["error"][key], tuple(types[t] for t in allowed)), (key, data)
    return data["error"]


ROUTES = {("/v1/completions", "post"): {200, 400, 401, 404, 408, 413, 429, 503},
          ("/v1/chat/completions", "post"): {200, 400, 401, 404, 408, 413, 429, 503},
          ("/tokenize", "post"): {200, 400, 401, 404, 408, 413},
          ("/detokenize", "post"): {200, 400, 401, 404, 408, 413},
          ("/v1/models", "get"): {200, 401}, ("/health", "get"): {200, 503}, ("/metrics", "get"): {200},
          ("/v1/loads", "get"): {200, 401}, ("/version", "get"): {200}}


def test_openapi_lists_each_routes_errors_and_the_metrics_media_type(server: ServerProcess) -> None:
    status, text = server.get("/openapi.json")
    doc = json.loads(text)
    assert status == 200
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for (path, method), statuses in ROUTES.items():
        responses = doc["paths"][path][method]["responses"]
        assert {int(s) for s in responses} == statuses, (path, sorted(responses))
        for s in statuses - {200} - ({503} if path == "/health" else set()):
            assert responses[str(s)]["content"] == {"application/json": {"schema": ref}}, (path, s)
            assert ("Retry-After" in responses[str(s)].get("headers", {})) == (s in (429, 503)), (path, s)
        if path.startswith("/v1/") and method == "post":  # stream: true answers server-sent events
            assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "ErrorResponse" in doc["components"]["schemas"]
    status, headers, _ = request(server.url, "GET", "/metrics")
    documented = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert status == 200 and list(documented) == [headers["content-type"]]
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_each_error_a_route_answers_is_documented_and_only_400s_are_counted(server: ServerProcess) -> None:
    """400, 401, 404 and 413 provoked on each route that reads a body: documented for that route, in the
    documented body; only the 400 moves invalid_parameter."""
    _, text = server.get("/openapi.json")
    doc = json.loads(text)
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 1}, "/v1/chat/completions": {"messages": HI},
              "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}}
    for path, good in bodies.items():
        documented = {int(s) for s in doc["paths"][path]["post"]["responses"]}
        for expect, body, headers in ((400, b"{not json", AUTH), (401, json.dumps(good).encode(), {}),
                                      (404, json.dumps({**good, "model": "gpt-4"}).encode(), AUTH),
                                      (413, json.dumps({**good, "user": "x" * LIMIT}).encode(), AUTH)):
            before = server.metrics().get(INVALID, 0.0)
            status, _, raw = request(server.url, "POST", path, body, headers)
            assert status == expect and status in documented, (path, status, raw)
            assert_error_body(doc, raw)
            assert server.metrics().get(INVALID, 0.0) == before + (status == 400), (path, status)
    status, _, raw = request(server.url, "GET", "/v1/models")
    assert status == 401 and 401 in {int(s) for s in doc["paths"]["/v1/models"]["get"]["responses"]}
    assert_error_body(doc, raw)


DEEP = b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
KINDS: list[tuple[str, str, bytes]] = [
    ("body: not JSON", "/v1/completions", b'{"prompt": "hi",'),
    ("body: not an object", "/v1/completions", b'["hi"]'),
    ("body: nested too deeply", "/v1/completions", DEEP),
    ("body: an integer of 5,000 digits", "/v1/completions", b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}"),
    ("body: a lone surrogate (tokenize)", "/tokenize", b'{"prompt": "\\ud800"}'),
    ("model: an unknown field", "/v1/completions", b'{"prompt": "hi", "frobnicate": 1}'),
    ("model: a role outside the API's", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("model: a string for an integer", "/detokenize", b'{"tokens": ["1"]}'),
    ("intake: prompt and messages (tokenize)", "/tokenize",
     b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}'),
    ("intake: tool_choice names no tool", "/v1/chat/completions", json.dumps({
        "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}).encode()),
    ("route: an image part", "/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode()),
    ("route: a token id outside the vocabulary (detokenize)", "/detokenize", b'{"tokens": [99999999]}'),
    ("params: a logit_bias key that is no token id", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"a": 1}}'),
    ("check: temperature out of range", "/v1/completions", b'{"prompt": "hi", "temperature": 9}'),
    ("check: a schema no JSON matches", "/v1/completions",
     b'{"prompt": "hi", "structured_outputs": {"json": {"$ref": "#"}}}'),
    ("submit: a batch that can never fit", "/v1/completions",
     json.dumps({"prompt": [[1, 2]] * 2000, "max_tokens": 1}).encode()),
]


@pytest.mark.parametrize(("path", "body"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_every_kind_of_400_is_counted(server: ServerProcess, path: str, body: bytes) -> None:
    before = server.metrics()
    status, _, raw = request(server.url, "POST", path, body, AUTH)
    assert status == 400, raw
    after = server.metrics()
    assert after[INVALID] == before.get(INVALID, 0.0) + 1 and after.get(TOO_LONG) == before.get(TOO_LONG)


def test_a_context_too_long_is_counted_as_too_long(server: ServerProcess) -> None:
    before = server.metrics()
    status, _, raw = request(server.url, "POST", "/v1/completions",
                             json.dumps({"prompt": [1] * 300, "max_tokens": 1}).encode(), AUTH)
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    after = server.metrics()
    assert after[TOO_LONG] == before.get(TOO_LONG, 0.0) + 1 and after.get(INVALID) == before.get(INVALID)


def test_fastapi_and_starlette_400s_are_openai_errors_and_counted() -> None:
    """No route declares FastAPI-validated parameters today; one that did would answer FastAPI's 422 in its own
    shape, uncounted. The app's handlers make it (and a Starlette HTTPException 400) an OpenAI 400, counted."""
    state: Any = SimpleNamespace(metrics=ServerMetrics("m"))
    app = build_app(state)

    @app.get("/probe/{n}")
    async def probe(n: int) -> dict:
        if n < 0:
            raise HTTPException(400, "n must not be negative")
        return {"n": n}

    def counted() -> float:
        return state.metrics.registry.get_sample_value("omforge:request_rejected_total",
                                                       {"model_name": "m", "reason": "invalid_parameter"}) or 0.0

    with TestClient(app) as client:
        r = client.get("/probe/seven")
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert counted() == 1
        r = client.get("/probe/-1")
        assert r.status_code == 400 and r.json()["error"]["message"] == "n must not be negative"
        assert counted() == 2
        assert client.get("/probe/3").json() == {"n": 3} and client.get("/nowhere").status_code == 404
        assert counted() == 2
