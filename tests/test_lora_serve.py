"""Multi-LoRA served (docs/lora.md, issue 49): a tiny random llama compiled with ``compile.lora`` (2 adapter slots)
and adapters made with ``peft`` (random A and B, saved as PEFT directories), on a real ``omforge serve`` over
127.0.0.1 with an API key. The official ``openai`` client selects an adapter by ``model``; ``/v1/models`` lists the
base and each adapter; vLLM's load/unload routes with their errors; three adapters over two slots swapped in on
demand under concurrent requests, each answer the greedy tokens of the same request alone; the adapter's tokens are
transformers' on PEFT's model; per-adapter metrics; a PD request with an adapter is a 400; a bundle without LoRA
refuses ``--lora-modules``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from lora_setup import BASE, compile_lora_bundle, make_model, make_peft_adapter

from server_process import ServerProcess

KEY = "lora-key"
PROMPTS = ([5, 17, 42, 99, 3, 250, 7, 8], [11, 12, 13, 14, 15], [200, 1, 64, 128, 9, 33], [40, 41, 42])
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-serve")
    hf = make_model(root)
    for i, name in enumerate("abcd"):
        make_peft_adapter(hf, root / name, seed=10 + i)
    make_peft_adapter(hf, root / "too-big", seed=20, rank=16)
    return root


@pytest.fixture(scope="module")
def bundle(root: Path) -> Path:
    return compile_lora_bundle(root, "bundle", {"max_loras": 2, "max_rank": 8}, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(root: Path, bundle: Path):  # noqa: ANN201
    srv = ServerProcess(bundle, "--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}", f"c={root / 'c'}",
                        api_key=KEY)
    yield srv
    srv.stop()


def _tokens(client, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[str]:  # noqa: ANN001
    """The greedy tokens of one completion, each as its text (the logprobs' ``tokens``)."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                    extra_body={"ignore_eos": True}, logprobs=0)
    assert out.model == model
    return out.choices[0].logprobs.tokens


def _post(server: ServerProcess, path: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_lists_the_base_and_each_adapter(server: ServerProcess, root: Path) -> None:
    models = {m.id: m for m in server.client().models.list().data}
    assert list(models) == [BASE, "a", "b", "c"]
    for name in "abc":
        extra = models[name].model_extra
        assert extra["parent"] == BASE and extra["root"] == str(root / name)
    assert "LoRA: 2 of 2 adapter slot(s)" in server.log()


def test_each_adapter_gives_its_own_tokens_and_the_base_model_its_own(server: ServerProcess, root: Path) -> None:
    """The adapter's greedy tokens are transformers' on PEFT's model; the base model's are the plain model's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client = server.client()
    prompt = PROMPTS[0]

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))

    def reference(adapter: str | None) -> list[str]:
        model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32, attn_implementation="eager")
        if adapter is not None:
            model = PeftModel.from_pretrained(model, root / adapter)
        with torch.no_grad():
            out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        return [tokenizer.decode([t], skip_special_tokens=False) for t in out[0, len(prompt):].tolist()]

    got = {m: _tokens(client, m, prompt) for m in (BASE, "a", "b")}
    assert got[BASE] == reference(None)
    assert got["a"] == reference("a")
    assert got["b"] == reference("b")
    assert len({tuple(v) for v in got.values()}) == 3  # the adapters change the answer
    chats = {m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True,
                                               extra_body={"ignore_eos": True}) for m in (BASE, "a")}
    assert chats["a"].model == "a" and chats[BASE].model == BASE
    assert [t.token for t in chats["a"].choices[0].logprobs.content] != \
        [t.token for t in chats[BASE].choices[0].logprobs.content]


def test_an_unknown_model_is_a_404(server: ServerProcess) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="nope", prompt=[1, 2, 3], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert "The model `nope` does not exist" in e.value.body["message"] and "'a'" in e.value.body["message"]


def test_more_adapters_than_slots_under_concurrency_lose_nothing(server: ServerProcess) -> None:
    """Three adapters and the base over two slots, 16 concurrent requests: every one finishes with the tokens of
    the same request alone (a mixed batch changes no one's greedy tokens), adapters swapped in on demand."""
    client = server.client()
    jobs = [(model, prompt) for prompt in PROMPTS for model in (BASE, "a", "b", "c")]
    alone = {(m, tuple(p)): _tokens(client, m, p) for m, p in set((m, tuple(p)) for m, p in jobs)}
    assert {m for (m, p), t in alone.items() if m != BASE and t != alone[(BASE, p)]} == {"a", "b", "c"}
    before = server.metrics()

    async def run() -> list[list[str]]:
        aclient = server.async_client(timeout=120.0)

        async def one(model: str, prompt: list[int]) -> list[str]:
            out = await aclient.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, logprobs=0, extra_body={"ignore_eos": True})
            return out.choices[0].logprobs.tokens

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(m, p) for m, p in jobs)), 240)
        finally:
            await aclient.close()

    for _ in range(2):  # bounded: two rounds
        results = asyncio.run(run())
        assert [alone[(m, tuple(p))] for m, p in jobs] == results
    after = server.metrics()
    for name in "abc":
        key = f"omforge:lora_requests_total{{lora_name={name}}}"
        assert after[key] - before.get(key, 0) == 8
    info = [k for k in after if k.startswith("omforge:lora_requests_info{")]
    assert len(info) == 1 and "max_lora=2" in info[0]
    # three adapters over two slots: swapped in on demand while the others waited
    assert after["omforge:lora_slot_evictions_total"] > before.get("omforge:lora_slot_evictions_total", 0)


def test_load_and_unload_adapters_at_run_time(server: ServerProcess, root: Path) -> None:
    client = server.client()
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(root / "d")}, key=None)[0] == 401
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}, key="wrong")[0] == 401
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(root / "d")})
    assert (status, text) == (200, "Success: LoRA adapter 'd' added successfully.")
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b", "c", "d"]
    d_tokens = _tokens(client, "d", PROMPTS[1])
    assert d_tokens != _tokens(client, BASE, PROMPTS[1])

    errors = [({"lora_name": "d", "lora_path": str(root / "d")}, 400, "already loaded"),
              ({"lora_name": BASE, "lora_path": str(root / "d")}, 400, "the base model's name"),
              ({"lora_name": "e", "lora_path": str(root / "missing")}, 400, "does not exist"),
              ({"lora_name": "e", "lora_path": str(root / "too-big")}, 400, "exceeds the bundle's max_rank 8"),
              ({"lora_name": "e"}, 400, "lora_path")]
    for body, want, words in errors:
        status, text = _post(server, "/v1/load_lora_adapter", body)
        assert status == want and words in json.loads(text)["error"]["message"], (body, text)
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b", "c", "d"]

    status, text = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    # in use: a stream of d is running (1,000 tokens: seconds, far longer than the unload's round trip)
    stream = client.completions.create(model="d", prompt=PROMPTS[0], max_tokens=1000, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    status, text = _post(server, "/v1/unload_lora_adapter", {"lora_name": "d"})
    assert status == 409 and "in use" in json.loads(text)["error"]["message"]
    assert sum(1 for _ in stream) > 0  # it finishes
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "d"}) == \
        (200, "Success: LoRA adapter 'd' removed successfully.")
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b", "c"]
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="d", prompt=[1, 2], max_tokens=2)
    # loaded again under another name: the same tokens as before
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "d2", "lora_path": str(root / "d")})[0] == 200
    assert _tokens(client, "d2", PROMPTS[1]) == d_tokens
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "d2"})[0] == 200


def _serve_exit(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omforge", "serve", str(bundle), "--port", "0", *args],
                          capture_output=True, text=True, timeout=180)


def test_start_up_errors_are_one_line(root: Path, bundle: Path) -> None:
    plain = compile_lora_bundle(root, "plain", None)
    cases = [
        (plain, ["--lora-modules", f"a={root / 'a'}"], "lora_modules: this bundle was compiled without compile.lora"),
        (bundle, ["--lora-modules", f"a={root / 'missing'}"], f"adapter 'a': {root / 'missing'} does not exist"),
        (bundle, ["--lora-modules", f"big={root / 'too-big'}"], "adapter 'big': r = 16 exceeds"),
        (bundle, ["--lora-modules", "a"], "--lora-modules: expected NAME=PATH, got 'a'"),
        (bundle, ["--max-loras", "3"], "max_loras must be 1 … 2 (the bundle's compile.lora.max_loras), got 3"),
    ]
    for where, args, words in cases:
        done = _serve_exit(where, *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr)


def test_an_adapter_with_kv_transfer_params_is_a_400(server: ServerProcess) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="a", prompt=[1, 2, 3], max_tokens=2,
                                           extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    assert e.value.body["param"] == "kv_transfer_params"
    assert "LoRA adapters are not supported with kv_transfer_params" in e.value.body["message"]
