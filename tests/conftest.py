"""Session fixtures: the SmolLM2 export (made once per test session: it takes about a minute) and its
transformers reference; the tiny export of every family for the fusion tests (about 8 s each, made once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import SMOLLM2_RECIPE, TINY_HF_CONFIGS, export_tiny


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 export; ``OMFORGE_TEST_SMOLLM2_EXPORT`` may name an existing one to skip the minute."""
    from omforge.export.onnx_export import export_recipe
    from omforge.recipe import load_recipe

    given = os.environ.get("OMFORGE_TEST_SMOLLM2_EXPORT")
    if given and (Path(given) / "export.json").is_file():
        return Path(given)
    out = tmp_path_factory.mktemp("smollm2-export")
    export_recipe(load_recipe(SMOLLM2_RECIPE), out, quiet=True)
    return out


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
    root = Path(given) if given else tmp_path_factory.mktemp("tiny-exports")
    return {variant: root / variant / "export" if (root / variant / "export" / "export.json").is_file()
            else export_tiny(root / variant, variant) for variant in sorted(TINY_HF_CONFIGS)}
