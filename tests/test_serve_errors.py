"""`omforge serve`: every refusal is OpenAI's error shape with the right status, seen through the official
client (which raises the matching exception class) or raw HTTP where the client cannot send the mistake."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import openai
import pytest

from server_process import ServerProcess

KEY = "sk-test-errors"


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64", "--max-model-len", "1024", "--log-level", "info",
                        api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # noqa: ANN201
    return server.client()


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.headers, json.loads(data)  # headers: case-insensitive


def assert_openai_error(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_metrics_know_the_pool_before_any_request(server: ServerProcess) -> None:
    """The first test on this server: no request has run a step yet."""
    status, text = server.get("/metrics")
    assert status == 200
    assert 'omforge:kv_cache_total_blocks{model_name="smollm2-135m"} 64.0' in text, text[:2000]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(server: ServerProcess, body: bytes) -> None:
    status, _, data = raw_post(server.url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 400
    assert "JSON" in assert_openai_error(data)["message"]


@pytest.mark.parametrize("body", [b"[" * 10000, b'{"prompt": "hi", "logit_bias": ' + b'{"a": ' * 5000 + b"1"
                                  + b"}" * 5001])
def test_deeply_nested_json_is_400(server: ServerProcess, body: bytes) -> None:
    status, _, data = raw_post(server.url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and "nest" in assert_openai_error(data)["message"]


def test_non_ascii_api_key_is_401(server: ServerProcess) -> None:
    status, _, body = raw_post(server.url, "/v1/completions", b'{"prompt": "hi"}', {"Authorization": "Bearer clé"})
    assert status == 401 and assert_openai_error(body)["code"] == "invalid_api_key"


def test_prompt_token_ids_outside_the_vocabulary_name_prompt(client) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=[1, 2, 10**9], max_tokens=2)
    assert e.value.body["param"] == "prompt" and e.value.body["code"] != "context_length_exceeded"
    assert "[0, 49152)" in e.value.body["message"]


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "conversation"])
def test_reserved_chat_template_kwargs_are_400(client, key: str) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template_kwargs": {key: True}})
    assert e.value.body["param"] == "chat_template_kwargs" and key in e.value.body["message"]


def test_unknown_model_is_404(client) -> None:  # noqa: ANN001
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]


def test_a_huge_unknown_model_name_is_not_echoed_in_full(client) -> None:  # noqa: ANN001
    """Issue 64's probe: after a 1 MB name every 404 was 1 MB; the answer repeats at most 128 characters of it."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="m" * 200_000, prompt="hi", max_tokens=2)
    message = e.value.body["message"]
    assert e.value.body["code"] == "model_not_found" and len(message) < 1_000 and "200000 characters" in message


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(n=1000), "n"),  # more sequences than max_num_seqs: never admissible, so a 400 (not a 429 to retry)
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(frequency_penalty=9), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed="abc"), "seed"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"min_tokens": 9, "max_tokens": 4}), "min_tokens"),
    (dict(logit_bias={"1": 500}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(extra_body={"frobnicate": True}), "frobnicate"),
    (dict(stop=[""]), "stop"),
    (dict(suffix="tail"), "suffix"),
])
def test_invalid_parameter_is_400_naming_it(client, kwargs: dict, param: str) -> None:  # noqa: ANN001
    kwargs = {"max_tokens": 4, **kwargs}
    extra = kwargs.pop("extra_body", {})
    if "max_tokens" in extra:
        kwargs["max_tokens"] = extra.pop("max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="hi", extra_body=extra or None, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert param.split("[")[0] in e.value.body["message"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"content": "no role"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
    (dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=3), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "yaml"}), "response_format"),
    (dict(messages=[{"role": "user", "content": "hi"}],
          tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
])
def test_invalid_chat_request_is_400_naming_it(client, kwargs: dict, param: str) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body


def test_prompt_plus_max_tokens_beyond_the_context_is_400(client) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=1024)
    assert e.value.body["code"] == "context_length_exceeded" and "1024" in e.value.body["message"]
    long_prompt = " hello" * 1100
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": long_prompt}])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"


def test_missing_or_wrong_key_is_401(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong-key").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer"}):
        status, _, body = raw_post(server.url, "/v1/chat/completions", b'{"messages": []}', headers)
        assert status == 401 and assert_openai_error(body)["code"] == "invalid_api_key"
    assert server.get("/health")[0] == 200  # health and metrics stay open for probes


def test_unknown_route_is_404_in_openai_shape(server: ServerProcess) -> None:
    status, _, body = raw_post(server.url, "/v1/images/generations", b"{}", {"Authorization": f"Bearer {KEY}"})
    assert status == 404
    assert_openai_error(body)


def test_full_queue_is_429_with_retry_after(smollm2_bundle: Path) -> None:
    """One running + one waiting fill this server; the third request is refused at once, nothing is lost."""
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "32", "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        client = srv.client()
        results: dict[str, object] = {}

        def long_request(name: str) -> None:
            r = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=48,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            results[name] = r.usage.completion_tokens

        threads = [threading.Thread(target=long_request, args=(name,)) for name in ("a", "b")]
        threads[0].start()
        srv.wait_for_metric("omforge:num_requests_running", lambda v: v == 1)
        threads[1].start()
        srv.wait_for_metric("omforge:num_requests_waiting", lambda v: v == 1)
        status, headers, body = raw_post(srv.url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        assert assert_openai_error(body)["code"] == "queue_full"
        for t in threads:
            t.join(120)
        assert results == {"a": 48, "b": 48}  # the two admitted requests are unharmed
        assert srv.metrics()["omforge:request_rejected_total{reason=queue_full}"] == 1
        assert srv.stop() == 0
    finally:
        srv.kill()


def test_half_sent_bodies_get_408_and_the_server_keeps_serving(smollm2_bundle: Path) -> None:
    """50 clients that announce a body and never finish it: each gets a 408 after --body-timeout, none stays
    open, and the server still answers."""
    import socket
    import time

    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "32", "--body-timeout", "1")
    try:
        u = urlparse(srv.url)
        socks = []
        for _ in range(50):
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            socks.append(s)
        t0 = time.monotonic()
        for s in socks:
            head = s.recv(4096)
            assert head.startswith(b"HTTP/1.1 408"), head[:200]
            s.close()
        assert time.monotonic() - t0 < 20
        r = srv.client().completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_500_keeps_the_keep_alive_connection() -> None:
    """serve.api.InternalErrors on a real uvicorn server: an endpoint that raises (a route of this test; the
    server's own endpoints have no known 500 left) answers OpenAI's 500 body, and the same keep-alive connection
    serves the next request (Starlette's handler re-raised, and uvicorn dropped the connection)."""
    import socket
    import time

    import uvicorn
    from fastapi import FastAPI

    from omforge.serve.api import InternalErrors

    app = FastAPI()
    app.add_middleware(InternalErrors)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaboom")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(100):  # bounded wait for start-up
            if server.started:
                break
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/boom")
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and "kaboom" in assert_openai_error(body)["message"]
        conn.request("GET", "/ok")  # the same connection
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"ok": True}
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_json": ""}, "guided_json"),
])
def test_what_the_fuzzer_found_is_a_400(server: ServerProcess, path: str, body: dict, param: str) -> None:
    status, _, data = raw_post(server.url, path, json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and assert_openai_error(data)["param"] == param, data


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", json.dumps({"prompt": "hi \ud800", "max_tokens": 2}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["ok", "\udc00"], "max_tokens": 2}).encode(), "prompt"),
    ("/v1/completions", b'{"prompt": "raw bytes \xed\xa0\x80", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
     "messages[0].content"),
    ("/tokenize", json.dumps({"prompt": "\ud800"}).encode(), "prompt"),
])
def test_a_lone_surrogate_is_400_naming_the_field(server: ServerProcess, path: str, body: bytes, param: str) -> None:
    """Valid JSON, not Unicode text: the tokenizer raised a TypeError (a 500) on it."""
    status, _, data = raw_post(server.url, path, body, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and assert_openai_error(data)["param"] == param, data
    assert "surrogate" in data["error"]["message"]


@pytest.mark.parametrize("field", [b'"seed": ', b'"logit_bias": {"1": 1}, "user": "u", "metadata": '])
def test_an_integer_literal_beyond_the_digit_limit_is_400(server: ServerProcess, field: bytes) -> None:
    """json.loads refuses ints of over 4,300 digits with a ValueError, anywhere in the body (a 500 before)."""
    body = b'{"prompt": "hi", "max_tokens": 2, ' + field + b"9" * 5000 + b"}"
    status, _, data = raw_post(server.url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and "4300 digits" in assert_openai_error(data)["message"], data


def test_a_client_hanging_up_mid_body_is_logged_as_a_disconnect(server: ServerProcess) -> None:
    """Half a body, then the client's side of the connection closes: a disconnect in the log (the server's log
    level here is info), no internal error and no traceback; the server keeps serving."""
    import socket
    import time

    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        s.shutdown(socket.SHUT_WR)
        s.recv(4096)
    deadline = time.monotonic() + 20
    while "client disconnected while sending the body of POST /v1/completions" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert "internal error" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]
    status, _, _ = raw_post(server.url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}',
                            {"Authorization": f"Bearer {KEY}"})
    assert status == 200


def test_a_body_over_max_request_body_bytes_is_413(server: ServerProcess, client) -> None:  # noqa: ANN001
    """Refused on its Content-Length, before the body is read (and through the official client, which sends one)."""
    import socket

    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 9000000\r\n\r\n")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert resp.status == 413 and resp.headers["Connection"] == "close"
        assert assert_openai_error(json.loads(resp.read()))["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="smollm2-135m", prompt="a " * (9 << 19), max_tokens=1)
    assert e.value.status_code == 413 and "--max-request-body-bytes" in e.value.body["message"]


def test_health_answers_while_a_long_prompt_is_tokenized(server: ServerProcess) -> None:
    """A /tokenize prompt as long as the length check admits (82,944 characters at --max-model-len 1024) of a text
    slow to encode takes a while; /health, polled meanwhile, keeps answering at once (the tokenizer's encode held
    the GIL in its worker thread and stalled the event loop for the whole time)."""
    import time

    prompt = ("ab1" * 30_000)[:82_000]  # no spaces: one long word for the BPE merges
    result: dict[str, Any] = {}

    def tokenize() -> None:
        t0 = time.monotonic()
        status, _, body = raw_post(server.url, "/tokenize", json.dumps({"prompt": prompt}).encode(),
                                   {"Authorization": f"Bearer {KEY}"})
        result.update(status=status, count=body.get("count"), seconds=time.monotonic() - t0)

    thread = threading.Thread(target=tokenize)
    thread.start()
    latencies = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert server.get("/health")[0] == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)
    thread.join()
    assert result["status"] == 200 and result["count"] > 40_000, result
    assert len(latencies) >= 3 and max(latencies) < result["seconds"] / 3, (latencies, result)


HI = [{"role": "user", "content": "hi"}]
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": 5}]}, *HI]},
     "messages[0].tool_calls[0].id"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": LOOP}}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
])
def test_loose_types_and_unsatisfiable_schemas_are_400(server: ServerProcess, path: str, body: dict,
                                                       param: str) -> None:
    """Strict types (pydantic coerced these into a request), roles outside OpenAI's, and a schema no JSON value
    matches (it ended at once: an empty 200); each 400 is counted as invalid_parameter."""
    name = "omforge:request_rejected_total{reason=invalid_parameter}"
    before = server.metrics().get(name, 0.0)
    status, _, data = raw_post(server.url, path, json.dumps({"max_tokens": 4, **body}).encode(),
                               {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and assert_openai_error(data)["param"] == param, data
    assert server.metrics()[name] == before + 1


def test_what_strict_types_still_accept(client) -> None:  # noqa: ANN001
    """An integer where a float is due, nulls, a tool call sent back, token-id prompts: as before."""
    r = client.chat.completions.create(model="smollm2-135m", messages=[CALL, {"role": "tool", "tool_call_id": "call_1",
                                       "content": "7 degrees"}, *HI], max_tokens=2, temperature=0, top_p=1,
                                       extra_body={"seed": None, "logit_bias": {"1": 5}})
    assert r.usage.completion_tokens >= 1
    r = client.completions.create(model="smollm2-135m", prompt=[[1, 2, 3], [4, 5]], max_tokens=1, temperature=0)
    assert len(r.choices) == 2


def test_every_400_is_counted(server: ServerProcess) -> None:
    """Malformed JSON, a surrogate, an unknown field, an out-of-range value: request_rejected_total counts each."""
    name = "omforge:request_rejected_total{reason=invalid_parameter}"
    before = server.metrics().get(name, 0.0)
    bodies = [b"{not json", b'{"prompt": "\\ud800"}', b'{"prompt": "hi", "frobnicate": 1}',
              b'{"prompt": "hi", "temperature": 9}']
    for body in bodies:
        assert raw_post(server.url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})[0] == 400
    assert server.metrics()[name] == before + len(bodies)


def test_a_batch_that_can_never_fit_is_400_naming_prompt(client) -> None:  # noqa: ANN001
    """More prompts than max_num_seqs + max_waiting_requests: no retry could ever succeed (it was a 429)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=[[1, 2]] * 2000, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "2000" in e.value.body["message"]
