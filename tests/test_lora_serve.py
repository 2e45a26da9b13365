"""Multi-LoRA served (docs/lora.md, issue 49): a tiny random llama compiled with ``compile.lora`` (2 adapter slots)
and adapters made with ``peft`` (random A and B, saved as PEFT directories), on a real ``omforge serve`` over
127.0.0.1 with an API key. The official ``openai`` client selects an adapter by ``model``; ``/v1/models`` lists the
base and each adapter; vLLM's load/unload routes with their errors; three adapters over two slots swapped in on
demand under concurrent requests, each answer the greedy tokens of the same request alone; the adapter's tokens are
transformers' on PEFT's model; per-adapter metrics; a PD request with an adapter is a 400; a bundle without LoRA
refuses ``--lora-modules``. Runtime loading (issue 64 item 5) is off without ``--enable-runtime-lora``, reads only
inside ``--lora-dirs`` (one message for every path refused), holds at most ``--max-cpu-loras`` adapters and takes
only bounded, valid names.
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
    for i, name in enumerate("abc"):
        make_peft_adapter(hf, root / name, seed=10 + i)
    allowed = root / "allowed"  # --lora-dirs: what runtime loads may read
    make_peft_adapter(hf, allowed / "d", seed=13)
    make_peft_adapter(hf, allowed / "too-big", seed=20, rank=16)
    return root


@pytest.fixture(scope="module")
def bundle(root: Path) -> Path:
    return compile_lora_bundle(root, "bundle", {"max_loras": 2, "max_rank": 8}, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(root: Path, bundle: Path):  # noqa: ANN201
    srv = ServerProcess(bundle, "--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}", f"c={root / 'c'}",
                        "--enable-runtime-lora", "--lora-dirs", str(root / "allowed"), "--max-cpu-loras", "5",
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
    allowed = root / "allowed"
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(allowed / "d")},
                 key=None)[0] == 401
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}, key="wrong")[0] == 401
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(allowed / "d")})
    assert (status, text) == (200, "Success: LoRA adapter 'd' added successfully.")
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b", "c", "d"]
    d_tokens = _tokens(client, "d", PROMPTS[1])
    assert d_tokens != _tokens(client, BASE, PROMPTS[1])

    errors = [({"lora_name": "d", "lora_path": str(allowed / "d")}, 400, "already loaded"),
              ({"lora_name": BASE, "lora_path": str(allowed / "d")}, 400, "the base model's name"),
              ({"lora_name": "e", "lora_path": str(allowed / "missing")}, 400, "no LoRA adapter this server may load"),
              ({"lora_name": "e", "lora_path": str(allowed / "too-big")}, 400, "exceeds the bundle's max_rank 8"),
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
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "d2", "lora_path": "d"})[0] == 200  # relative
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
        (bundle, ["--lora-modules", f"big={root / 'allowed' / 'too-big'}"], "adapter 'big': r = 16 exceeds"),
        (bundle, ["--enable-runtime-lora"], "enable_runtime_lora needs lora_dirs (--lora-dirs DIR"),
        (bundle, ["--enable-runtime-lora", "--lora-dirs", str(root / "nowhere")], f"lora_dirs: {root / 'nowhere'} "
         "is not a directory"),
        (bundle, ["--lora-modules", f"a b={root / 'a'}"], "lora_name: 'a b' is not an adapter name"),
        (bundle, ["--lora-modules", f"a={root / 'a'}", "--max-cpu-loras", "1"],
         "max_cpu_loras must be a whole number at least max_loras (2) and the lora_modules given (1), got 1"),
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


def _refusal(server: ServerProcess, path: str, name: str = "e") -> str:
    status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert status == 400, (path, text)
    error = json.loads(text)["error"]
    assert error["param"] == "lora_path", (path, text)
    return error["message"]


def test_runtime_loads_read_only_inside_the_lora_dirs_and_say_nothing_of_the_file_system(
        server: ServerProcess, root: Path) -> None:
    """issue 64 item 5: a load read any path on the server and its error told whether the path existed. Every path
    that is missing, outside ``--lora-dirs`` (absolute, ``..``, a symlink out, a PEFT file symlinked out), not an
    adapter or unreadable now gets the same one-line 400; why is in the server's log."""
    allowed = root / "allowed"
    (allowed / "notes.txt").write_text("not an adapter")
    (allowed / "empty").mkdir(exist_ok=True)
    broken = allowed / "broken"  # a PEFT directory whose files are garbage
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    link = allowed / "link-out"
    if not link.is_symlink():
        link.symlink_to(root / "a")  # a valid adapter, outside
    sneaky = allowed / "sneaky"  # inside, but its weights are a symlink to an adapter outside
    sneaky.mkdir(exist_ok=True)
    (sneaky / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    if not (sneaky / "adapter_model.safetensors").is_symlink():
        (sneaky / "adapter_model.safetensors").symlink_to(root / "a" / "adapter_model.safetensors")
    paths = [str(root / "a"), str(allowed / ".." / "a"), "../a", str(link), str(sneaky), str(allowed / "missing"),
             "/etc/passwd", "/nonexistent/x.gguf", str(allowed / "notes.txt"), str(allowed / "empty"), str(broken),
             "a\u0000b", "x" * 5000]
    messages = {path: _refusal(server, path) for path in paths}
    assert len(set(messages.values())) == 1, messages
    (message,) = set(messages.values())
    assert message.startswith("lora_path: no LoRA adapter this server may load there")
    assert str(root) not in message and "exist" not in message
    assert [m.id for m in server.client().models.list().data] == [BASE, "a", "b", "c"]
    log = server.log()
    assert "outside --lora-dirs" in log and "does not exist" in log  # the reasons, for the operator


def test_runtime_adapter_names_are_bounded_and_validated(server: ServerProcess, root: Path) -> None:
    """issue 64 item 5: names had no bound (after a 1 MB name every 404 was 1 MB). A name is 1 … 64 characters of
    letters, digits and . _ - : /; anything else is a 400 that does not repeat a long name."""
    path = str(root / "allowed" / "d")
    for name in ("x" * 65, "a b", "../d", "-d", "d\n", "é"):
        status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_name", (name, text)
    huge = "n" * (1 << 20)
    for route, body in (("/v1/load_lora_adapter", {"lora_name": huge, "lora_path": path}),
                        ("/v1/unload_lora_adapter", {"lora_name": huge})):
        status, text = _post(server, route, body)
        assert status == 400 and len(text) < 400, (route, len(text))
        assert "1048576 characters; an adapter name is 1 … 64 characters" in json.loads(text)["error"]["message"]
    longest = "org/sql-v1.2:" + "x" * 51
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": longest, "lora_path": path})[0] == 200
    assert server.client().completions.create(model=longest, prompt=[1, 2], max_tokens=2).model == longest
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": longest})[0] == 200


def test_the_registry_holds_at_most_max_cpu_loras_adapters(server: ServerProcess, root: Path) -> None:
    """issue 64 item 5: 100 loads under new names took 1.4 GB. With --max-cpu-loras 5 (a, b, c at start), two
    more load and the next is a 400 naming the flag, answered before the file is read; an unload makes room."""
    path = str(root / "allowed" / "d")
    for name in ("d", "d2"):
        assert _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})[0] == 200
    for name in ("e", "f"):
        status, text = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        error = json.loads(text)["error"]
        assert status == 400 and error["code"] == "lora_limit", text
        assert error["message"] == ("5 LoRA adapters are loaded, the most this server holds (--max-cpu-loras 5); "
                                    "unload one first")
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": path})[1].find("already") > 0
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "d"})[0] == 200
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": path})[0] == 200
    for name in ("e", "d2"):
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert [m.id for m in server.client().models.list().data] == [BASE, "a", "b", "c"]


def test_runtime_loading_is_off_unless_enabled(root: Path, bundle: Path) -> None:
    """issue 64 item 5: the load route was on for anyone (no --api-key needed). Without --enable-runtime-lora both
    routes answer a 404 saying how to turn them on, and nothing is loaded or unloaded."""
    srv = ServerProcess(bundle, "--lora-modules", f"a={root / 'a'}")
    try:
        for route, body in (("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(root / "allowed" / "d")}),
                            ("/v1/unload_lora_adapter", {"lora_name": "a"})):
            status, text = _post(srv, route, body, key=None)
            error = json.loads(text)["error"]
            assert status == 404 and error["code"] == "runtime_lora_disabled", text
            assert "--enable-runtime-lora" in error["message"] and "OMFORGE_ALLOW_RUNTIME_LORA_UPDATING=1" in \
                error["message"]
        assert [m.id for m in srv.client().models.list().data] == [BASE, "a"]
        assert "runtime loading off (--enable-runtime-lora)" in srv.log()
    finally:
        srv.stop()
