"""Session fixtures: the SmolLM2 export (made once per test session: it takes about a minute) and its
transformers reference; the tiny export of every family for the fusion tests (about 8 s each, made once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import SMOLLM2_RECIPE, TINY_HF_CONFIGS, TINY_RECIPE, compile_bundle, export_tiny
from omforge.file_lock import locked


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every xdist worker of this run shares (the run's base temp, above each worker's own), else the
    session's own: what is built there under a lock (the stage cache's, omforge/file_lock.py) is built once."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stage cache the SmolLM2 fixtures compile into, shared by the run's workers (two compiles sharing a cache
    build each stage once); ``OMFORGE_TEST_CACHE`` may name a persistent one so local runs skip the export."""
    given = os.environ.get("OMFORGE_TEST_CACHE")
    return Path(given) if given else shared_dir(tmp_path_factory, "omforge-cache")


@pytest.fixture(scope="session")
def smollm2_export(smollm2_cache: Path) -> Path:
    """The SmolLM2 export (made once per session, in the stage cache the bundle fixture reuses);
    ``OMFORGE_TEST_SMOLLM2_EXPORT`` may name an existing export directory instead."""
    from omforge.export.onnx_export import cached_export
    from omforge.recipe import load_recipe

    given = os.environ.get("OMFORGE_TEST_SMOLLM2_EXPORT")
    if given and (Path(given) / "export.json").is_file():
        return Path(given)
    return cached_export(load_recipe(SMOLLM2_RECIPE), smollm2_cache / "exports", quiet=True)


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_cache: Path, smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 ort bundle, compiled once per session (the export stage comes from ``smollm2_export``)."""
    return compile_bundle(SMOLLM2_RECIPE, tmp_path_factory.mktemp("smollm2-bundle") / "bundle", smollm2_cache)


@pytest.fixture(scope="session")
def smollm2_hf():  # noqa: ANN201
    """transformers' own GGUF loader on the same file: an independent dequantization and Q/K un-permutation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omforge.recipe import load_recipe

    gguf = load_recipe(SMOLLM2_RECIPE).weights_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{variant: export directory}`` for every family in ``TINY_HF_CONFIGS`` (2 layers, GQA 4/2 heads).
    ``OMFORGE_TEST_TINY_EXPORTS`` may name a directory to keep them in and reuse across sessions."""
    given = os.environ.get("OMFORGE_TEST_TINY_EXPORTS")
    root = Path(given) if given else shared_dir(tmp_path_factory, "tiny-exports")  # the run's workers share them
    out = {}
    for variant in sorted(TINY_HF_CONFIGS):
        with locked(root / variant):
            done = (root / variant / "export" / "export.json").is_file()
            out[variant] = root / variant / "export" if done else export_tiny(root / variant, variant)
    return out


@pytest.fixture(scope="session")
def tiny_ascend_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The tiny recipe's ascend step graph lowered with every own plugin (the in-place paged attention on the
    float16 step graph, PFA on the full graph), both through the ascend pipeline; the lowering record as a cached
    stage stores it."""
    import json

    import onnx_ir as ir

    from omforge.export.onnx_export import export_recipe
    from omforge.passes.options import AscendLoweringOptions
    from omforge.passes.pipeline import Pipeline
    from omforge.recipe import load_recipe

    root = tmp_path_factory.mktemp("atc-tiny")
    export_recipe(load_recipe(TINY_RECIPE), root / "export", quiet=True)
    step = ir.load(root / "export" / "model.onnx")
    paged = Pipeline("ascend", block_size=16, lowering=AscendLoweringOptions(paged_attention="inplace", num_slots=4096),
                     float16=True).run(step).lowering.result
    ir.save(step, root / "step.onnx", external_data="step.onnx.data")
    full = ir.load(root / "export" / "model.onnx")
    pfa = Pipeline("ascend", lowering=AscendLoweringOptions(attention="pfa")).run(full).lowering.result
    lowering = paged.to_dict()
    lowering["custom_ops"] |= pfa.to_dict()["custom_ops"]
    return json.loads(json.dumps(lowering)), root / "step.onnx"


@pytest.fixture(scope="session")
def pooling_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pooling tests' folder (tests/pooling_setup.py): one tiny Qwen3 and one export for test_embeddings.py and
    test_rerank.py in a session."""
    return tmp_path_factory.mktemp("pooling")
