"""`omforge serve` under load and at the edges of a request's life: 32 concurrent streams, clients that go away
(their blocks freed at once), metrics that move, and a SIGTERM that drains running requests."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import openai
import pytest

from server_process import ServerProcess


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "256")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_32_concurrent_streams_all_complete_with_correct_usage(server: ServerProcess) -> None:
    before = server.metrics()

    async def one(client, i: int) -> tuple[str, int, int, int]:  # noqa: ANN001
        stream = await client.completions.create(
            model="smollm2-135m", prompt=f"Request {i}: the number {i} in words is", max_tokens=16 + i % 5,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, pieces = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                pieces += bool(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens, usage.prompt_tokens, pieces

    async def main() -> list:
        client = server.async_client()
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 600)

    results = asyncio.run(main())
    for i, (text, completion_tokens, prompt_tokens, pieces) in enumerate(results):
        assert completion_tokens == 16 + i % 5, i
        assert text and pieces >= completion_tokens // 2, (i, text)
        assert prompt_tokens > 8
    after = server.metrics()
    assert after["omforge:generation_tokens_total"] - before["omforge:generation_tokens_total"] == sum(
        16 + i % 5 for i in range(32))
    assert after["omforge:request_success_total{finished_reason=length}"] - before.get(
        "omforge:request_success_total{finished_reason=length}", 0) == 32
    # they ran batched: far fewer steps than 32 requests one after another would take
    steps = after["omforge:step_duration_seconds_count"] - before["omforge:step_duration_seconds_count"]
    assert steps < 32 * 16 / 4, steps


def test_metrics_move_with_a_request(server: ServerProcess) -> None:
    before = server.metrics()
    server.client().completions.create(model="smollm2-135m", prompt="Hello", max_tokens=5, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    after = server.metrics()
    for name in ("omforge:time_to_first_token_seconds_count", "omforge:e2e_request_latency_seconds_count",
                 "omforge:request_prompt_tokens_count"):
        assert after[name] == before.get(name, 0) + 1, name
    assert after["omforge:inter_token_latency_seconds_count"] == before.get(
        "omforge:inter_token_latency_seconds_count", 0) + 4
    assert after["omforge:generation_tokens_total"] == before["omforge:generation_tokens_total"] + 5
    assert after["omforge:prompt_tokens_total"] > before["omforge:prompt_tokens_total"]
    for name in ("omforge:num_requests_running", "omforge:num_requests_waiting", "omforge:kv_cache_usage_perc",
                 "omforge:prefix_cache_hit_rate", "omforge:num_preemptions_total", "omforge:prefix_cache_hits_total"):
        assert name in after, name
    assert after["omforge:kv_cache_total_blocks"] == 256


def test_stream_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    aborted = server.metrics().get("omforge:request_success_total{finished_reason=abort}", 0)
    client = server.client()
    stream = client.completions.create(model="smollm2-135m", prompt="Write a very long story:", max_tokens=1500,
                                       temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()["omforge:kv_cache_used_blocks"] >= 1  # it is running and holds its blocks
    stream.close()  # the client goes away mid-stream
    server.wait_for_metric("omforge:kv_cache_used_blocks", lambda v: v == 0, timeout=10)
    assert server.metrics()["omforge:num_requests_running"] == 0
    server.wait_for_metric("omforge:request_success_total{finished_reason=abort}", lambda v: v == aborted + 1)


def test_non_stream_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    aborted = server.metrics().get("omforge:request_success_total{finished_reason=abort}", 0)
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "Tell me everything:", "max_tokens": 1500, "ignore_eos": true, "temperature": 0}'
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    server.wait_for_metric("omforge:kv_cache_used_blocks", lambda v: v >= 1)
    sock.close()
    server.wait_for_metric("omforge:kv_cache_used_blocks", lambda v: v == 0, timeout=10)
    server.wait_for_metric("omforge:request_success_total{finished_reason=abort}", lambda v: v == aborted + 1)
    # and the server still serves
    r = server.client().completions.create(model="smollm2-135m", prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_sigterm_drains_running_requests(smollm2_bundle: Path) -> None:
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "32", "--drain-timeout", "120")
    try:
        stream = srv.client().completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=40,
                                                 temperature=0.0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)  # the running request finishes although the server is shutting down
        assert rest[-1].usage.completion_tokens == 40
        assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
        assert srv.proc.wait(60) == 0
        log = srv.log()
        assert "shutting down, draining 1 sequence(s)" in log and "stopped" in log
        assert "executor released" in log  # LLMEngine.close() ran after the engine thread stopped (issue 12 defect 7)
    finally:
        srv.kill()


def test_drain_timeout_bounds_the_shutdown(smollm2_bundle: Path) -> None:
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64", "--drain-timeout", "2")
    try:
        stream = srv.client().completions.create(model="smollm2-135m", prompt="Go on forever:", max_tokens=1900,
                                                 temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # at the drain timeout the stream ends properly: an error event (the client raises it), then [DONE]
        with pytest.raises(openai.APIError, match="drain timeout"):
            for _ in chunks:
                pass
        assert srv.proc.wait(60) == 0
        assert time.monotonic() - t0 < 20  # 2 s of drain, then the unfinished request is ended
        log = srv.log()
        assert "Traceback" not in log and "Cancel" not in log, log[-2000:]
    finally:
        srv.kill()


def test_chat_stream_closed_after_the_role_chunk_aborts(server: ServerProcess) -> None:
    """The client leaves after the first chunk (the role, sent before any token): the request still stops."""
    aborted = server.metrics().get("omforge:request_success_total{finished_reason=abort}", 0)
    stream = server.client().chat.completions.create(model="smollm2-135m", max_tokens=1500, temperature=0.0,
                                                     messages=[{"role": "user", "content": "Write forever."}],
                                                     stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    server.wait_for_metric("omforge:request_success_total{finished_reason=abort}", lambda v: v == aborted + 1)
    server.wait_for_metric("omforge:kv_cache_used_blocks", lambda v: v == 0, timeout=10)


def test_the_kv_pool_is_resident_from_start_up(smollm2_bundle: Path) -> None:
    """--kv-cache-space-gb sizes the pool, start-up reports it, and its memory is in RSS before any request
    (written at allocation, not touched later as blocks are first used)."""
    srv = ServerProcess(smollm2_bundle, "--kv-cache-space-gb", "0.5")
    try:
        per_block = 2 * 30 * 3 * 64 * 4 * 64  # SmolLM2: K and V, 30 layers, 3 KV heads, head_dim 64, fp32, 64 tokens
        blocks = (1 << 29) // per_block
        assert f"{blocks} KV blocks of 64 tokens (0.50 GiB, allocated)" in srv.log()
        assert srv.metrics()["omforge:kv_cache_total_blocks"] == blocks
        rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{srv.proc.pid}/status").read_text()
                   .splitlines() if line.startswith("VmRSS:"))
        assert rss > 500e6 + 0.9 * (1 << 29), rss  # the weights (~540 MB) and the whole pool
    finally:
        assert srv.stop() == 0, srv.log()
