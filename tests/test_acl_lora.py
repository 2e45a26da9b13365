"""LoRA bundles (``compile.lora``) through the AscendCL executor on the FAKE pyACL (tests/fake_acl.py): the adapter
pools bound as resident device inputs like the KV pools, the plan's adapter loads written to host mirrors and copied
to the device slot by slot before the next execute, ``lora_slots`` per run. Checked against the ORT engine with the
same PEFT adapters (tests/lora_setup.py), float32 weights on both so the fake's plain twin equals ORT's numerics.
Nothing here ran on an NPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from lora_setup import BASE, compile_lora_bundle, make_model, make_peft_adapter

from fake_acl import FakeAcl
from helpers import compile_bundle, write_recipe

LORA = {"max_loras": 2, "max_rank": 4}
PROMPTS = [[5, 9, 2, 77], list(range(3, 40)), [7, 8], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama, adapters ``a`` and ``b``, its ort LoRA bundle ``ort`` and ascend one ``ascend`` (float32,
    FAKE OM on its plain twin)."""
    import fake_atc
    from test_acl_executor import plain_twin

    root = tmp_path_factory.mktemp("acl-lora")
    hf = make_model(root)
    for seed, name in enumerate("ab"):
        make_peft_adapter(hf, root / name, seed=seed)
    compile_lora_bundle(root, "ort", LORA)
    recipe = write_recipe(root / "ascend.yaml", {"name": BASE, "source": "hf", "path": "hf"},
                          compile={"target": "ascend", "weights": "float32", "max_seq_len": 256, "max_batch_size": 4,
                                   "max_num_tokens": 256, "kv_block_size": 16, "lora": LORA},
                          serve={"max_num_seqs": 4})
    asc = compile_bundle(recipe, root / "ascend", root / "cache")
    fake_atc.build_bundle(asc, plain_twin(asc, root / "plain", recipe))
    return root


def test_adapters_on_the_fake_acl_give_the_ort_engines_tokens(root: Path) -> None:
    """Mixed adapters (and the base model) in one batch, one adapter slot (max_loras 1: adapters are loaded into
    the slot between steps): greedy tokens equal the ORT engine's, and the adapters change them."""
    from omforge import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loras = [None, "a", "b", "a"]
    modules = {n: str(root / n) for n in "ab"}
    fake = FakeAcl()
    with LLM(root / "ascend", acl_module=fake, lora_modules=modules, max_loras=1) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy, lora=loras, use_tqdm=False)]
        base = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    with LLM(root / "ort", lora_modules=modules, max_loras=1) as ref:
        want = [o.token_ids for o in ref.generate(PROMPTS, greedy, lora=loras, use_tqdm=False)]
    assert got == want
    assert got[0] == base[0] and any(g != b for g, b in zip(got[1:], base[1:]))
    assert not [c for c in fake.calls if c.startswith("FAILED")] and fake.live == []


def test_a_loaded_slot_is_copied_once_and_read_by_the_next_run(root: Path) -> None:
    """An adapter written into a slot of the host pools reaches the device before the next execute, one copy per
    written slot of each pool; a step after it copies no LoRA bytes; slot 0 stays zero."""
    from omforge.contract.manifest import load_manifest
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.lora.adapter import load_adapter
    from omforge.runtime.lora.slots import LoraLoad
    from omforge.runtime.step import SeqWork

    m = load_manifest(root / "ascend", verify=False)
    fake = FakeAcl()
    with AclExecutor(root / "ascend", m, acl=fake) as ex:
        pools = ex.capabilities.lora_pools
        assert pools is not None and sorted(pools) == sorted(ex.lora_inputs) and len(pools) == 2 * len(
            m.lora.projections)
        base = ex.execute([SeqWork(PROMPTS[0], 0, [0], lora_slot=1)])  # slot 1 still empty: the base model
        LoraLoad(1, load_adapter("a", root / "a", m.model.config), m.lora).apply(pools)
        before = fake.copied["H2D"]
        adapted = ex.execute([SeqWork(PROMPTS[0], 0, [1], lora_slot=1)])
        lora_bytes = sum(p[1].nbytes for p in pools.values())
        step_bytes = fake.copied["H2D"] - before - lora_bytes
        assert 0 < step_bytes < lora_bytes  # the slot once, plus the step's own inputs
        assert np.abs(adapted - base).max() > 1e-3
        before = fake.copied["H2D"]
        again = ex.execute([SeqWork(PROMPTS[0], 0, [2], lora_slot=1)])
        assert fake.copied["H2D"] - before == step_bytes and np.allclose(again, adapted)
        for name, pool in pools.items():
            size = ex.model.in_size[name]
            buf, off, _ = fake.resolve(ex.model.in_ptr[name], size)
            device = np.frombuffer(bytes(buf[off:off + size]), pool.dtype)[:pool.size].reshape(pool.shape)
            assert np.array_equal(device, np.asarray(pool)) and not device[0].any()
    assert not [c for c in fake.calls if c.startswith("FAILED")] and fake.live == []
