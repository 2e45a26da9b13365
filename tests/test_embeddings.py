"""Embeddings (issue 47 item 3): a ``task: embed`` bundle of a tiny random Qwen3 against transformers' last-token
pooling, through the engine's batching, and ``/v1/embeddings`` through the official openai client and LangChain's
``OpenAIEmbeddings`` on a real server; the 400s of a model asked for the other task."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
from pooling_setup import EOS, compile_pooling

from server_process import ServerProcess

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a compiler and server for large language "
         "models, hello world, this is omforge", "dog"]
MODEL = "tiny-qwen3-pool"


@pytest.fixture(scope="module")
def root(pooling_root: Path) -> Path:
    return pooling_root


@pytest.fixture(scope="module")
def embed_bundle(root: Path) -> Path:
    return compile_pooling(root, "embed", matryoshka=True, append_eos=True, prompt_format="qwen3")


@pytest.fixture(scope="module")
def server(embed_bundle: Path):  # noqa: ANN201
    proc = ServerProcess(embed_bundle)
    yield proc
    proc.stop()


def _ids(bundle: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(text).ids + [EOS]


def _reference(root: Path, seqs: list[list[int]]) -> np.ndarray:
    """transformers' Qwen3Model (AutoModel) on each sequence alone: the last token's final hidden state, L2
    normalized (Qwen3-Embedding's last_token_pool, then F.normalize)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(root / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=-1).numpy())
    return np.stack(out)


def test_embeddings_match_transformers_last_token_pooling(root: Path, embed_bundle: Path) -> None:
    from omforge.runtime.llm import LLM

    seqs = [_ids(embed_bundle, t) for t in TEXTS]
    ref = _reference(root, seqs)
    with LLM(embed_bundle) as llm:
        got = np.stack(llm.embed(TEXTS))  # one padded batch: lengths differ
        short = np.stack(llm.embed(TEXTS, dimensions=16))
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 1 - 1e-4, cos
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)
    mrl = ref[:, :16] / np.linalg.norm(ref[:, :16], axis=-1, keepdims=True)  # matryoshka: truncate, renormalize
    assert short.shape == (len(TEXTS), 16) and np.abs(short - mrl).max() < 1e-4


def test_one_step_batches_waiting_requests_with_the_same_vectors(embed_bundle: Path) -> None:
    from omforge.runtime.pooling import PoolingEngine

    engine = PoolingEngine(embed_bundle, max_num_batched_tokens=2048)
    alone = [engine.run([t])[0] for t in TEXTS]
    for i, t in enumerate(TEXTS * 2):
        engine.add_request(t, request_id=f"r{i}")
    outs = engine.step()  # every waiting request fits one step's budget: one execution, all finished
    assert len(outs) == 2 * len(TEXTS) and all(o.finished for o in outs) and not engine.has_unfinished()
    for i, out in enumerate(outs):
        assert out.request_id == f"r{i}" and np.abs(out.pooled - alone[i % len(TEXTS)]).max() < 1e-5
    # a smaller budget (the longest input × the batch): the same requests over several steps, the same vectors
    small = PoolingEngine(embed_bundle, max_num_batched_tokens=128)
    for i, t in enumerate(TEXTS * 2):
        small.add_request(t, request_id=f"r{i}")
    steps = []
    while small.has_unfinished():
        steps.append(small.step())
    assert 1 < len(steps) < 2 * len(TEXTS)
    for out in (o for step in steps for o in step):
        assert np.abs(out.pooled - alone[int(out.request_id[1:]) % len(TEXTS)]).max() < 1e-5


def test_openai_client_float_base64_dimensions_and_token_ids(server: ServerProcess, embed_bundle: Path) -> None:
    client = server.client()
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    vecs = np.array([d.embedding for d in floats.data])
    seqs = [_ids(embed_bundle, t) for t in TEXTS]
    assert vecs.shape == (len(TEXTS), 64) and floats.usage.prompt_tokens == sum(map(len, seqs))
    # the client's default asks for base64 and decodes it; the raw body is little-endian float32
    assert np.allclose([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data], vecs,
                       atol=1e-7)
    raw = httpx.post(f"{server.base_url}/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, vecs[0].astype(np.float32))
    short = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=8, encoding_format="float")
    mrl = vecs[:, :8] / np.linalg.norm(vecs[:, :8], axis=-1, keepdims=True)
    assert np.abs(np.array([d.embedding for d in short.data]) - mrl).max() < 1e-5
    # more inputs than the server holds at once (max_num_seqs 16 + one batch waiting): served in batches
    many_texts = client.embeddings.create(model=MODEL, input=TEXTS * 12, encoding_format="float")
    assert np.abs(np.array([d.embedding for d in many_texts.data]) - np.tile(vecs, (12, 1))).max() < 1e-5
    one = client.embeddings.create(model=MODEL, input=seqs[0], encoding_format="float")  # token ids
    many = client.embeddings.create(model=MODEL, input=seqs, encoding_format="float")  # lists of token ids
    assert np.abs(np.array(one.data[0].embedding) - vecs[0]).max() < 1e-5
    assert np.abs(np.array([d.embedding for d in many.data]) - vecs).max() < 1e-5


def test_langchain_openai_embeddings(server: ServerProcess) -> None:
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=MODEL, base_url=server.base_url, api_key="unused", check_embedding_ctx_length=False,
                          max_retries=0)
    docs = np.array(lc.embed_documents(TEXTS))
    ref = np.array([d.embedding for d in server.client().embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="float").data])
    assert np.abs(docs - ref).max() < 1e-5
    assert np.abs(np.array(lc.embed_query(TEXTS[1])) - ref[1]).max() < 1e-5


def test_concurrent_requests_get_the_vectors_of_one_at_a_time(server: ServerProcess) -> None:
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(16)]
    client = server.client()
    alone = [client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding
             for t in texts]

    async def together() -> list[list[float]]:
        async with server.async_client() as aclient:
            rs = await asyncio.gather(*(aclient.embeddings.create(model=MODEL, input=t, encoding_format="float")
                                        for t in texts))
        return [r.data[0].embedding for r in rs]

    assert np.abs(np.array(asyncio.run(together())) - np.array(alone)).max() < 1e-5


def test_embed_bundle_400s(server: ServerProcess, root: Path) -> None:
    url = server.base_url
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi"})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_task"
        assert "task embed" in r.json()["error"]["message"]
    long = httpx.post(url + "/embeddings", json={"input": list(range(1, 130))})  # max_seq_len 128
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert "129 tokens" in long.json()["error"]["message"]
    huge = httpx.post(url + "/embeddings", json={"input": ["hi", "hello " * 200_000]})  # refused before tokenizing
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    assert huge.json()["error"]["param"] == "input" and "characters" in huge.json()["error"]["message"]
    for empty in ("", [], [""], [[]]):
        r = httpx.post(url + "/embeddings", json={"input": empty})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", (empty, r.text)
    bad = httpx.post(url + "/embeddings", json={"input": "x", "dimensions": 65})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    assert httpx.get(url + "/models").json()["data"][0]["id"] == MODEL
    # a bundle not trained for matryoshka refuses dimensions
    plain = ServerProcess(compile_pooling(root, "embed", append_eos=True))
    try:
        r = httpx.post(plain.base_url + "/embeddings", json={"input": "x", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        assert "matryoshka" in r.json()["error"]["message"]
    finally:
        plain.stop()


def test_generate_bundle_refuses_pooling_endpoints(root: Path) -> None:
    gen = ServerProcess(compile_pooling(root, "generate"))
    try:
        for path, body in (("/embeddings", {"input": "hello"}),
                           ("/rerank", {"query": "q", "documents": ["d"]}),
                           ("/score", {"text_1": "q", "text_2": "d"})):
            r = httpx.post(gen.base_url + path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "wrong_model_task" and "task generate" in err["message"], err
        ok = httpx.post(gen.base_url + "/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        gen.stop()


def test_over_long_input_refused_offline(embed_bundle: Path) -> None:
    from omforge.runtime.engine import RequestRejected
    from omforge.runtime.pooling import PoolingEngine

    with pytest.raises(RequestRejected, match="129 tokens.*maximum of 128"):
        PoolingEngine(embed_bundle).add_request(list(range(1, 130)))


def test_base_model_checkpoint_loads_as_its_causal_lm(root: Path, tmp_path: Path) -> None:
    """Qwen3-Embedding ships the base model alone (``embed_tokens.weight``, ``layers.N…``: no ``model.``)."""
    import shutil

    from transformers import AutoModel

    from omforge.export.weights import check_names, load_hf_dir

    compile_pooling(root, "embed")  # makes the tiny model
    AutoModel.from_pretrained(root / "hf").save_pretrained(tmp_path)
    shutil.copy(root / "hf" / "tokenizer.json", tmp_path / "tokenizer.json")
    causal, base = load_hf_dir(root / "hf"), load_hf_dir(tmp_path)
    check_names(base)
    assert set(base.tensors) == set(causal.tensors)
    assert all(np.array_equal(base.tensors[k], causal.tensors[k]) for k in causal.tensors)


@pytest.mark.parametrize(("name", "task"), [("qwen3-embedding-0.6b-random.yaml", "embed"),
                                            ("qwen3-reranker-0.6b-random.yaml", "score")])
def test_shipped_pooling_recipes(name: str, task: str) -> None:
    from omforge.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent.parent / "models" / name)
    assert recipe.task == task and recipe.model.config["family"] == "qwen3"
    assert recipe.pooling.prompt_format == "qwen3" and recipe.pooling.matryoshka == (task == "embed")


def test_tiny_pooling_recipes_compile_for_ascend_on_the_fake_atc(tmp_path: Path) -> None:
    """tests/recipes/tiny-qwen3-{embed,rerank}.yaml for ascend: prefill-only gears over (num_seqs, max_query_len),
    no KV pool, every ATC rule kept and every op inside the CANN matrix; the FAKE atc builds the OM."""
    import json

    import fake_atc
    import onnx

    from helpers import compile_bundle
    from omforge.compile.ascend.atc_conformance import check_bundle
    from omforge.compile.ascend.cann_matrix import bundle_rows

    for name, output in (("tiny-qwen3-embed", "pooled"), ("tiny-qwen3-rerank", "logits")):
        recipe = Path(__file__).parent / "recipes" / f"{name}.yaml"
        asc = compile_bundle(recipe, tmp_path / name, tmp_path / "cache", target="ascend")
        manifest = json.loads((asc / "manifest.json").read_text())
        assert manifest["kv"] is None and manifest["ascend"]["num_slots"] == 0
        assert manifest["ascend"]["gear_dims"] == ["num_seqs", "max_query_len"]
        # 1 and the most sequences a step of max_num_tokens 2048 holds, at lengths 128 and 256 (max_seq_len)
        assert manifest["ascend"]["gears"] == [[1, 128], [1, 256], [8, 256], [16, 128]]
        assert [p["name"] for p in manifest["buckets"]["profiles"]] == ["pool"]
        assert manifest["ascend"]["memory"]["kv_pool_bytes"] == 0
        graph = onnx.load(str(asc / "ascend" / "step.onnx"), load_external_data=False).graph
        assert [i.name for i in graph.input] == ["input_ids", "position_ids", "pool_index"]
        assert [o.name for o in graph.output] == [output]
        assert all(r.ok for r in check_bundle(asc)["om/step"])
        assert bundle_rows(asc)[1] == []
        assert fake_atc.build_bundle(asc, asc / "ascend" / "step.onnx")[0].is_file()


@pytest.mark.parametrize(("extra", "message"), [
    ("task: embedding\n", "task: 'embedding' is not allowed; expected 'generate', 'embed' or 'score'"),
    ("task: score\npooling: {yes_token: 9}\n", "pooling: task score needs pooling.yes_token and pooling.no_token"),
    ("pooling: {normalize: true}\n", "pooling: is for task embed or score; this recipe's task is generate"),
    ("task: embed\npooling: {prompt_format: qwen2}\n", "pooling.prompt_format: 'qwen2' is not allowed"),
])
def test_recipe_task_errors_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    from omforge.recipe import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: t, source: random, config: {vocab_size: 8}}\n" + extra)
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert str(err.value).startswith(f"{recipe}: {message}"), str(err.value)
