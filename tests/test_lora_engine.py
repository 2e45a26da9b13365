"""Multi-LoRA in the engine and the offline API (docs/lora.md, issue 49), over a tiny random llama compiled with
``compile.lora`` and PEFT adapters: ``LLM(bundle, lora_modules=…).generate(…, lora=…)`` with more adapters than
resident slots gives each prompt the tokens it gets alone; the prefix cache never serves one adapter's KV to
another or to the base model; adapters loaded and unloaded between steps, with their errors; the engine options'
errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from lora_setup import compile_lora_bundle, make_model, make_peft_adapter

from omforge.runtime.engine import LoraInUse, UnknownLora
from omforge.runtime.engine_config import EngineConfigError
from omforge.runtime.llm import LLM
from omforge.runtime.lora.adapter import LoraError, LoraNameTaken
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ([5, 17, 42, 99, 3, 250, 7, 8, 9], [11, 12, 13, 14, 15], [200, 1, 64, 128, 9, 33])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-engine")
    hf = make_model(root)
    for i, name in enumerate("abc"):
        make_peft_adapter(hf, root / name, seed=30 + i, rank=2 + i)
    return root


@pytest.fixture(scope="module")
def bundle(root: Path) -> Path:
    return compile_lora_bundle(root, "bundle", {"max_loras": 2, "max_rank": 4})


@pytest.fixture
def llm(root: Path, bundle: Path):  # noqa: ANN201
    with LLM(bundle, lora_modules={n: str(root / n) for n in "abc"}, max_loras=1, max_num_seqs=8) as llm:
        yield llm


def test_mixed_adapters_over_one_slot_each_get_their_own_tokens(llm: LLM) -> None:
    jobs = [(p, lora) for p in PROMPTS for lora in (None, "a", "b", "c")]
    alone = [llm.generate([p], GREEDY, lora=lora)[0].token_ids for p, lora in jobs]
    slots = llm.engine.lora
    loads = slots.loads
    mixed = llm.generate([p for p, _ in jobs], GREEDY, lora=[lora for _, lora in jobs])
    assert [o.token_ids for o in mixed] == alone
    assert slots.loads > loads and slots.evictions > 0  # one slot, three adapters: swapped in turn
    assert all(slots.pinned(n) == 0 for n in "abc")
    for i in range(0, len(jobs), 4):  # each adapter changes the base model's answer
        base = alone[i]
        assert all(alone[i + k] != base for k in (1, 2, 3)), jobs[i]


def test_prefix_cache_is_per_adapter(llm: LLM) -> None:
    prompt = list(range(3, 3 + 40))  # several full blocks
    params = replace(GREEDY, max_tokens=1)

    def cached(lora: str | None) -> int:
        return llm.generate([prompt], params, lora=lora)[0].num_cached_tokens

    assert cached("a") == 0
    hit = cached("a")
    assert hit > 0
    assert cached("b") == 0 and cached(None) == 0
    assert cached("b") == hit and cached(None) == hit


def test_adapters_come_and_go_between_steps(llm: LLM, root: Path) -> None:
    engine = llm.engine
    with pytest.raises(UnknownLora, match="the LoRA adapter 'nope' is not loaded"):
        engine.add_request(PROMPTS[0], GREEDY, lora="nope")
    with pytest.raises(LoraNameTaken, match="adapter 'a' is already loaded"):
        engine.lora.load("a", root / "b")
    with pytest.raises(LoraError, match="adapter 'x': .* does not exist"):
        engine.lora.load("x", root / "missing")
    with pytest.raises(UnknownLora):
        engine.lora.unregister("nope")
    engine.lora.load("a2", root / "a")
    assert engine.lora.names() == ("a", "b", "c", "a2")
    assert llm.generate([PROMPTS[1]], GREEDY, lora="a2")[0].token_ids == \
        llm.generate([PROMPTS[1]], GREEDY, lora="a")[0].token_ids
    engine.add_request(PROMPTS[1], GREEDY, lora="a2")  # waiting: a2 is in use
    with pytest.raises(LoraInUse, match="'a2' is in use by 1 sequence"):
        engine.lora.unregister("a2")
    while engine.has_unfinished():
        engine.step()
    engine.lora.unregister("a2")
    assert engine.lora.names() == ("a", "b", "c")
    with pytest.raises(UnknownLora):
        llm.generate([PROMPTS[1]], GREEDY, lora="a2")
    with pytest.raises(SamplingParamsError, match="LoRA adapters are not supported with kv_transfer_params"):
        engine.check_request(PROMPTS[0], replace(GREEDY, kv_transfer_params={"do_remote_decode": True}), "a")


def test_engine_options_errors(root: Path, bundle: Path) -> None:
    plain = compile_lora_bundle(root, "plain", None)
    with pytest.raises(EngineConfigError, match="lora_modules: this bundle was compiled without compile.lora"):
        LLM(plain, lora_modules={"a": str(root / "a")})
    with pytest.raises(EngineConfigError, match=r"max_loras must be 1 … 2 .*got 3"):
        LLM(bundle, max_loras=3)
    with pytest.raises(LoraError, match="adapter 'c': r = 4 exceeds"):
        compile_small = compile_lora_bundle(root, "small", {"max_loras": 1, "max_rank": 2})
        LLM(compile_small, lora_modules={"c": str(root / "c")})
    with LLM(plain) as base, pytest.raises(UnknownLora, match="compiled without compile.lora"):
        base.generate([PROMPTS[0]], GREEDY, lora="a")


def test_the_storage_tier_keys_blocks_by_adapter(root: Path, bundle: Path, tmp_path: Path) -> None:
    """The tier below the pool stores blocks under their hash chain, which starts from the adapter's digest: a
    restarted engine finds adapter a's blocks for a's request only, never for the base model's or b's."""
    prompt = list(range(3, 56))  # 3 full blocks of 16 before its last token
    opts = dict(lora_modules={n: str(root / n) for n in "ab"}, max_loras=1, enable_hierarchical_cache=True,
                hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with LLM(bundle, **opts) as first:  # writes a's blocks through to the directory
        want = first.generate([prompt], GREEDY, lora="a")[0].token_ids
    with LLM(bundle, **opts) as second:  # nothing carried over but the directory

        def hits() -> int:
            return second.engine.hicache.stats().tiers["storage"].hits

        second.generate([prompt], GREEDY)
        second.generate([prompt], GREEDY, lora="b")
        assert hits() == 0
        assert second.generate([prompt], GREEDY, lora="a")[0].token_ids == want
        assert hits() == 3


def test_an_adapter_is_checked_once(root: Path, bundle: Path) -> None:
    """issue 61: whether a request's adapter is served is checked once — offline (``add_request``: the registry's
    ``use``) and served (held from parsing to submission; the submission and the engine do not look again), and a
    model neither the base nor an adapter is still a 404."""
    import contextlib

    from fastapi.testclient import TestClient

    from omforge.runtime.engine import LLMEngine
    from omforge.serve.api import build_app
    from omforge.serve.async_engine import AsyncEngine
    from omforge.serve.metrics import ServerMetrics
    from omforge.serve.state import ServerState

    engine = LLMEngine(bundle, lora_modules={"a": str(root / "a")}, max_loras=1, num_kv_blocks=64)
    registry = engine.lora
    assert registry is not None
    engine.add_request(PROMPTS[0], replace(GREEDY, n=2), lora="a")
    assert registry.num_checks == 1
    while engine.has_unfinished():
        engine.step()
    assert registry.users("a") == 0

    served = AsyncEngine(engine, max_waiting_requests=4, max_queue_delay_s=0)
    app = build_app(ServerState(served, ServerMetrics("base"), "base", None, engine.max_model_len, 0))

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # noqa: ANN202
        served.start()
        yield
        served.stop()

    app.router.lifespan_context = lifespan
    body = {"model": "a", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0.0, "n": 2}
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert registry.num_checks == 2 and registry.users("a") == 0
        missing = client.post("/v1/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    engine.close()
    assert len(answer.json()["choices"]) == 2
