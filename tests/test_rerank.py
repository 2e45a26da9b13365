"""Rerank and score (issue 47 item 3): a ``task: score`` bundle of a tiny random Qwen3 in Qwen3-Reranker's form —
P(yes) from the last position's ``[no, yes]`` logits of the judge prompt — against the same formula on
transformers' Qwen3ForCausalLM logits; ``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``) and ``/v1/score`` in
vLLM's and Jina/Cohere's shapes over httpx on a real server; an embed bundle's scores are cosines."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from pooling_setup import NO, YES, compile_pooling

from server_process import ServerProcess

QUERY = "the quick brown fox"
DOCS = ["the lazy dog", "hello world, this is omforge", "a compiler and server for large language models", "fox"]


@pytest.fixture(scope="module")
def root(pooling_root: Path) -> Path:
    return pooling_root


@pytest.fixture(scope="module")
def score_bundle(root: Path) -> Path:
    # the tiny tokenizer spells the judge prompt in ~380 tokens
    return compile_pooling(root, "score", max_seq_len=512, yes_token=YES, no_token=NO, prompt_format="qwen3")


@pytest.fixture(scope="module")
def server(score_bundle: Path):  # noqa: ANN201
    proc = ServerProcess(score_bundle)
    yield proc
    proc.stop()


def _reference(root: Path, bundle: Path, query: str, docs: list[str]) -> list[float]:
    """The model card's formula on transformers' logits: the judge prompt (prefix, pair, suffix tokenized apart),
    the last position's logits of [no, yes], log-softmax, exp of yes."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from omforge.runtime.pooling_prompts import QWEN3_INSTRUCTION, QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX

    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    scores = []
    with torch.no_grad():
        for doc in docs:
            pair = f"<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
            ids = encode(QWEN3_RERANK_PREFIX) + encode(pair) + encode(QWEN3_RERANK_SUFFIX)
            last = model(torch.tensor([ids])).logits[0, -1]
            two = torch.nn.functional.log_softmax(torch.stack([last[NO], last[YES]]), dim=-1)
            scores.append(float(two[1].exp()))
    return scores


def test_scores_match_the_reference_formula(root: Path, score_bundle: Path) -> None:
    from omforge.compile.bundle import describe
    from omforge.contract.manifest import load_manifest
    from omforge.runtime.llm import LLM

    manifest = load_manifest(score_bundle)
    pooling = manifest.pooling
    assert pooling.task == "score" and pooling.score_token_ids == (NO, YES) and pooling.size == 2
    assert f"task score, last-token pooling of output logits, score = P(yes) over token ids {[NO, YES]}" in \
        describe(manifest)  # omforge inspect
    ref = _reference(root, score_bundle, QUERY, DOCS)
    with LLM(score_bundle) as llm:
        got = llm.score(QUERY, DOCS)
    assert np.abs(np.array(got) - np.array(ref)).max() < 1e-4, (got, ref)


def test_rerank_and_score_endpoints(server: ServerProcess, score_bundle: Path) -> None:
    from omforge.runtime.llm import LLM

    with LLM(score_bundle) as llm:
        expected = llm.score(QUERY, DOCS)
    docs = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    r = httpx.post(f"{server.url}/v1/rerank", json={"query": QUERY, "documents": docs}).json()
    results = r["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert all(abs(x["relevance_score"] - expected[x["index"]]) < 1e-5 for x in results)
    assert [x["document"]["text"] for x in results] == [DOCS[x["index"]] for x in results]
    assert r["usage"]["total_tokens"] > 0 and r["model"] == "tiny-qwen3-pool"
    for path in ("/rerank", "/v2/rerank"):  # vLLM's aliases
        top = httpx.post(server.url + path, json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                                  "return_documents": False}).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and "document" not in top[0]
    one = httpx.post(f"{server.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in one["data"]] == list(range(len(DOCS))) and one["object"] == "list"
    assert np.abs(np.array([d["score"] for d in one["data"]]) - expected).max() < 1e-5
    pairs = httpx.post(f"{server.url}/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert np.abs(np.array([d["score"] for d in pairs["data"]]) - expected[:2]).max() < 1e-5


def test_score_bundle_400s(server: ServerProcess) -> None:
    url = server.url
    for path, body in (("/v1/embeddings", {"input": "hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_task", r.text
        assert "task score" in r.json()["error"]["message"]
    uneven = httpx.post(url + "/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_1"
    empty = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    long = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": ["the lazy dog " * 200]})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"


def test_embed_bundle_scores_are_cosines_of_instructed_query(root: Path) -> None:
    from omforge.runtime.llm import LLM
    from omforge.runtime.pooling_prompts import QWEN3_INSTRUCTION

    with LLM(compile_pooling(root, "embed", max_seq_len=512, append_eos=True, prompt_format="qwen3")) as llm:
        scores = llm.score(QUERY, DOCS)
        q, *docs = llm.embed([f"Instruct: {QWEN3_INSTRUCTION}\nQuery:{QUERY}", *DOCS])
    assert np.abs(np.array(scores) - np.array([float(q @ d) for d in docs])).max() < 1e-5
