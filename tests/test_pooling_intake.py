"""The pooling endpoints' intake (issue 64, items 6 and 7), on a real server of the tiny score bundle
(tests/pooling_setup.py) over httpx: a request whose own inputs take longer than ``--max-queue-time`` is answered,
not ended with a 503 by its own earlier inputs; ``input`` holds at most OpenAI's 2,048 items; rerank, score and
``/tokenize`` refuse a text that cannot fit the context by its characters, before the tokenizer runs."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from pooling_setup import NO, YES, compile_pooling

from server_process import ServerProcess

BOUND_S = 0.25


@pytest.fixture(scope="module")
def score_bundle(pooling_root: Path) -> Path:
    return compile_pooling(pooling_root, "score", max_seq_len=512, yes_token=YES, no_token=NO, prompt_format="qwen3")


@pytest.fixture(scope="module")
def server(score_bundle: Path):  # noqa: ANN201
    # one input a step, and a queue-time bound far below what a request of many inputs takes
    proc = ServerProcess(score_bundle, "--max-num-seqs", "1", "--max-queue-time", str(BOUND_S))
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_rerank_longer_than_the_queue_bound_is_answered(server: ServerProcess) -> None:
    """100 documents, one a step: longer than the queue-time bound on an idle server. Its inputs are queued in
    parts, each when the one before is done; the old server dated every part from the request's arrival, so a part
    queued after the bound had passed "waited too long" and the request ended in a 503, its work thrown away."""
    docs = [f"document {i} about foxes and dogs" for i in range(100)]
    t0 = time.monotonic()
    r = httpx.post(server.base_url + "/rerank", json={"query": "the quick brown fox", "documents": docs,
                                                      "return_documents": False}, timeout=300)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert sorted(x["index"] for x in r.json()["results"]) == list(range(100))
    assert took > BOUND_S  # it did outlast the bound
    assert server.metrics().get("omforge:request_rejected_total{reason=queue_timeout}", 0) == 0


def test_embeddings_input_holds_at_most_2048_items(server: ServerProcess) -> None:
    r = httpx.post(server.base_url + "/embeddings", json={"input": ["x"] * 2049})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "2,048" in r.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": "q", "documents": ["short", "fox " * 1_250_000]}, "documents"),
    ("/v1/rerank", {"query": "fox " * 1_250_000, "documents": ["short"]}, "documents"),  # one sequence, the pair
    ("/v1/score", {"text_1": "q", "text_2": ["short", "fox " * 1_250_000]}, "text_2"),
    ("/tokenize", {"prompt": "fox " * 1_250_000}, "prompt"),
])
def test_a_text_too_long_for_the_context_is_refused_before_the_tokenizer(server: ServerProcess, path: str,
                                                                          body: dict, param: str) -> None:
    """5 MB of text: 400 ``context_length_exceeded`` naming the field, by its characters alone (the old server
    tokenized it first — seconds of a tokenizer worker each, six of them stalled a small request for 25 s — and
    /tokenize answered it)."""
    t0 = time.monotonic()
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert "characters" in error["message"], error
    assert time.monotonic() - t0 < 10  # the body's transfer and parse; no tokenizing
