"""`/openapi.json` describes every route with its request body, and a property-based API fuzzer (schemathesis,
coverage + fuzzing phases, fixed seed, bounded) drives the server from it: zero 5xx answers. The first run found
two 500s — an empty ``messages`` on /tokenize and a ``guided_json`` that is not JSON — now 400s."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compile_bundle, make_tiny_hf_dir, write_recipe
from server_process import ServerProcess

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("fuzz")
    hf = make_tiny_hf_dir(root / "hf", "qwen2")
    (hf / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                                           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    recipe = write_recipe(root / "recipe.yaml", {"name": "tiny-fuzz", "source": "hf", "path": "hf"},
                          compile={"max_seq_len": 256})
    srv = ServerProcess(compile_bundle(recipe, root / "bundle", root / "cache"), "--num-kv-blocks", "64",
                        api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_openapi_document_has_every_route_and_body(server: ServerProcess) -> None:
    status, text = server.get("/openapi.json")
    doc = json.loads(text)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
            "/metrics"} <= set(doc["paths"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"] and "ChatMessage" in schemas


def test_schemathesis_finds_no_server_error(server: ServerProcess) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis (the test extra) provides the st command"
    r = subprocess.run([st, "run", f"{server.url}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
                        "--checks", "not_a_server_error", "-n", "25", "--seed", "7", "--request-timeout", "60",
                        "--phases", "coverage,fuzzing"], capture_output=True, text=True, timeout=600)
    summary = r.stdout[-3000:]
    assert r.returncode == 0 and "ST101" not in r.stdout, summary
    assert " passed" in summary and "generated" in summary, summary
