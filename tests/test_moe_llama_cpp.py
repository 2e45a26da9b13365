"""Mixtures of experts through llama.cpp's own converter (issue 62 acceptance): a tiny random Qwen3-MoE
(``norm_topk_prob`` on, as Qwen3-30B-A3B: llama.cpp's qwen3moe graph always renormalizes) and a tiny Mixtral, saved by
transformers with the test model's tokenizer files (the converter recognizes its pre-tokenizer), converted by
``convert_hf_to_gguf.py`` of llama-cpp-python's sources (scripts/setup.sh fetches them) to F32 and Q8_0. The F32
file's bundle generates transformers' greedy tokens; every weight the Q8_0 file holds is the F32 file's, or its
Q8_0 rounding by ``gguf``'s own quantizer, as omforge reads both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from moe_setup import make_moe_hf_dir

from helpers import SMOLLM2_RECIPE, compile_bundle, hf_reference, write_recipe
from omforge.export.weights import load_gguf
from omforge.recipe import load_recipe
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams

CONVERTER = Path(__file__).resolve().parent.parent / ".venv" / "llama.cpp-convert" / "0.3.36"
NEW = 8
VOCAB = 49_152  # the test model's tokenizer
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, VOCAB, n)] for n in (5, 13, 22)]

pytestmark = pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
                                reason=f"llama.cpp's converter is not at {CONVERTER} (bash scripts/setup.sh)")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per family: the HF directory, transformers' greedy tokens and the converter's F32 and Q8_0 files."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama-cpp")
    gguf_path = load_recipe(SMOLLM2_RECIPE).weights_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    out = {}
    for family, extra in (("qwen3_moe", {"norm_topk_prob": True}), ("mixtral", {})):
        hf_dir = make_moe_hf_dir(root / family, family, vocab_size=VOCAB, **extra)
        tokenizer.save_pretrained(hf_dir)
        hf = hf_reference(hf_dir)
        with torch.no_grad():
            tokens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        files = {}
        for outtype in ("f32", "q8_0"):
            files[outtype] = root / f"{family}-{outtype}.gguf"
            run = subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype",
                                  outtype, "--outfile", str(files[outtype])], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(CONVERTER / "gguf-py")}, timeout=600)
            assert run.returncode == 0, run.stderr[-3000:]
        out[family] = {"hf_dir": hf_dir, "tokens": tokens, **files}
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_converters_f32_file_generates_transformers_tokens(converted: dict, family: str,
                                                                tmp_path: Path) -> None:
    c = converted[family]
    recipe = write_recipe(tmp_path / "r.yaml", {"name": f"llama-cpp-{family}", "source": "gguf", "path": str(c["f32"])},
                          compile={"kv_block_size": 4, "max_seq_len": 64})
    bundle = compile_bundle(recipe, tmp_path / "bundle", tmp_path / "cache")
    with LLM(bundle) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                         ignore_eos=True), use_tqdm=False)]
    assert got == c["tokens"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_converters_q8_0_file_holds_the_f32_weights_rounded(converted: dict, family: str) -> None:
    f32, q8 = load_gguf(converted[family]["f32"]), load_gguf(converted[family]["q8_0"])
    assert f32.config == q8.config and f32.config.is_moe and set(f32.tensors) == set(q8.tensors)
    rounded = 0
    for name, w in f32.tensors.items():
        got = np.asarray(q8.tensors[name])
        w = np.asarray(w, np.float32)
        if not np.array_equal(got, w):
            q = gguf.GGMLQuantizationType.Q8_0
            assert np.array_equal(got, gguf.quants.dequantize(gguf.quants.quantize(w, q), q).reshape(w.shape)), name
            rounded += 1
    experts = [n for n in f32.tensors if ".experts." in n]
    assert experts and rounded >= len(experts)  # every expert matrix (and more) was stored as Q8_0
