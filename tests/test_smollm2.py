"""SmolLM2-135M (the real test model): export parity with transformers, tokenizer, chat template, greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omforge.runtime.full_recompute import ExportedModel

TOL = 1e-4
PARAGRAPH = ("Large language models are trained on vast amounts of text. They learn to predict the next token, "
             "and in doing so they pick up grammar, facts and some reasoning. Serving them efficiently means "
             "keeping the key-value cache in fixed-size blocks, batching requests continuously, and fusing the "
             "small operations of each layer into a few large kernels.")
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in one sentence.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def exported(smollm2_export: Path) -> ExportedModel:
    return ExportedModel(smollm2_export)


def test_prompt_logits_match_transformers(exported: ExportedModel, smollm2_hf) -> None:  # noqa: ANN001
    hf, _ = smollm2_hf
    ids = exported.tokenizer.encode(PARAGRAPH)
    assert len(ids) >= 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    out = exported.logits(np.array([ids]))
    diff = float(np.abs(out - ref).max())
    assert diff <= TOL, f"max abs diff {diff:.3g} over {len(ids)} tokens"


def test_tokenizer_matches_transformers(exported: ExportedModel, smollm2_hf) -> None:  # noqa: ANN001
    _, hf_tok = smollm2_hf
    for text in [PARAGRAPH, "héllo wörld — ünïcode ✓ 漢字 🙂", "  leading spaces\n\ttabs",
                 "<|im_start|>user\nhi<|im_end|>"]:
        ids = exported.tokenizer.encode(text)
        assert ids == hf_tok(text, add_special_tokens=True)["input_ids"]
        assert exported.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


def test_chat_template_matches_transformers(exported: ExportedModel, smollm2_hf) -> None:  # noqa: ANN001
    _, hf_tok = smollm2_hf
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}],
    ]
    for messages in conversations:
        ours = exported.tokenizer.apply_chat_template(messages)
        theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_tokens_match_transformers(exported: ExportedModel, smollm2_hf, prompt: str) -> None:  # noqa: ANN001
    hf, hf_tok = smollm2_hf
    messages = [{"role": "user", "content": prompt}]
    text = exported.tokenizer.apply_chat_template(messages)
    ids = exported.tokenizer.encode(text, add_special_tokens=False)
    hf_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    assert ids == list(hf_ids)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
    ref_new = ref[0, len(ids):].tolist()
    gen = exported.greedy(ids, 32)
    assert gen.token_ids == ref_new, f"{prompt!r}: ours {gen.text!r} vs reference {hf_tok.decode(ref_new)!r}"
    assert gen.finish_reason == ("stop" if ref_new[-1] == 2 else "length")


def test_export_metadata(smollm2_export: Path) -> None:
    import json

    meta = json.loads((smollm2_export / "export.json").read_text())
    cfg = meta["config"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["tie_word_embeddings"] and cfg["eos_token_ids"] == [2]
    assert meta["tokenizer"]["chat_template"].startswith("{% for message in messages %}")
    # fp32 weights stored once: 134.5 M parameters ≈ 538 MB (the tied lm_head is not a second copy)
    size = (smollm2_export / "model.onnx.data").stat().st_size
    assert 530e6 < size < 545e6, size
