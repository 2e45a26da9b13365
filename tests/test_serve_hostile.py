"""Requests a hostile or careless client sends, each answered as OpenAI / vLLM would (issue 46's probes, kept so they
stay answered): a template variable overriding the special tokens (was a 500), ``tool_choice: required`` over
tools whose parameters use local ``$defs`` (was a 400 blaming tool_choice), a prompt whose length alone proves it
cannot fit (was seconds of tokenizing first), a regex nothing matches (was an empty 200), ``stream_options``
without ``stream`` and a tool message naming no call (were 200s), the length field the client sent named in a
context error, a 4,000-digit number not echoed whole, the 408's ``Connection: close``, and a connection that
trickles its headers (was held as long as the client liked)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from omforge.serve.tools import constraint, functions
from server_process import ServerProcess

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "hi"}]
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 2.0
LOC_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {  # what pydantic writes for a model
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                       "country": {"type": "string", "maxLength": 12}},
                      "required": ["city", "country"]}},
    "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}, "unit": {"enum": ["c", "f"]}},
    "required": ["loc", "unit"]}}}


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64", "--max-model-len", "256",
                        "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"{}"), {k.lower(): v for k, v in resp.getheaders()}
    conn.close()
    return out


def error_of(status: int, data: dict, want: int = 400) -> dict:
    assert status == want, data
    return data["error"]


def test_template_variables_may_override_the_special_tokens(server: ServerProcess) -> None:
    kwargs = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    status, data, _ = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2,
                                                            "chat_template_kwargs": kwargs})
    assert status == 200, data
    status, data, _ = post(server, "/tokenize", {"messages": HI, "chat_template_kwargs": kwargs})
    assert status == 200 and data["count"] > 0, data


def test_required_tool_choice_keeps_local_defs_resolvable(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[LOC_TOOL], tool_choice="required", max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(args) == {"loc", "unit"} and set(args["loc"]) == {"city", "country"}, args


def test_the_required_wrapper_moves_each_tools_defs_to_its_root() -> None:
    recursive = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                         "at": {"$ref": "#/definitions/Loc"}},
        "definitions": {"Loc": {"type": "string"}}}}}
    schema = constraint("required", None, functions([LOC_TOOL, recursive]))
    assert set(schema["$defs"]) == {"t0.Loc", "t1.Loc", "t1.$root"}
    first, second = (b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    assert first["properties"]["loc"] == {"$ref": "#/$defs/t0.Loc"} and "$defs" not in first
    assert second["properties"]["kids"]["items"] == {"$ref": "#/$defs/t1.$root"}
    assert second["properties"]["at"] == {"$ref": "#/$defs/t1.Loc"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(server: ServerProcess,
                                                                         path: str) -> None:
    text = "hello " * 500_000  # 3 MB: 500,000 tokens against a context of 256
    body = {"model": MODEL, "prompt": text} if path == "/v1/completions" else \
        {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    t0 = time.monotonic()
    err = error_of(*post(server, path, body)[:2])
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    assert err["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),
    ({"guided_regex": "yes[^\\s\\S]"}, "guided_regex"),
])
def test_a_regex_nothing_matches_is_a_400(server: ServerProcess, extra: dict, param: str) -> None:
    err = error_of(*post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, **extra})[:2])
    assert err["param"] == param and "no text matches" in err["message"], err


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": HI, "stream": False, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": [*HI, {"role": "tool", "content": "7 degrees"}]},
     "messages[1].tool_call_id"),
])
def test_openai_400s_for_fields_out_of_place(server: ServerProcess, path: str, body: dict, param: str) -> None:
    err = error_of(*post(server, path, {"model": MODEL, **body})[:2])
    assert err["param"] == param, err


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_context_error_names_the_length_field_the_client_sent(server: ServerProcess, field: str) -> None:
    err = error_of(*post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, field: 10_000})[:2])
    assert err["param"] == field and err["code"] == "context_length_exceeded", err


def test_a_huge_number_is_not_echoed_back_whole(server: ServerProcess) -> None:
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body='{"prompt": "hi", "max_tokens": -' + "9" * 4000 + "}",
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 400 and len(err["message"]) < 300 and "4,000 digits" in err["message"], err


def test_the_408_for_a_slow_body_closes_the_connection(server: ServerProcess) -> None:
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
    status_line, *headers = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
    assert " 408 " in status_line, status_line
    assert "connection: close" in [h.lower() for h in headers], headers


def test_a_connection_that_trickles_its_headers_is_closed(server: ServerProcess) -> None:
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed_at = None
        for _ in range(30):  # one more header line every 0.25 s: a slowloris client
            time.sleep(0.25)
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed_at = time.monotonic() - t0
                break
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                closed_at = time.monotonic() - t0
                break
    assert closed_at is not None and closed_at < HEADER_TIMEOUT_S + 2, closed_at
    # the server still answers (only that connection was closed)
    status, data, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert status == 200, data
