"""The incremental detokenizer on SmolLM2's real byte-level BPE tokenizer: streamed deltas equal one decode,
no half characters, stop strings held back across tokens, special tokens skipped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from omforge.contract.manifest import TokenizerMeta
from omforge.runtime.detokenizer import IncrementalDetokenizer
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.tokenizer import TextTokenizer

PIECES = ["the", "quick", "fox", "café", "naïve", "Ünïcödé", "façade", "ß", "ǅ", "x²", "Ω≈ç√", "—", "“quoted”",
          "日本語", "テキスト", "中文字符", "한국어", "😀", "🚀🔥", "👩‍👩‍👧", "🇫🇷", "🙂?", "\n", "  ", "\t", "123"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_export: Path) -> TextTokenizer:
    meta = TokenizerMeta.from_dict(json.loads((smollm2_export / "export.json").read_text())["tokenizer"])
    return TextTokenizer(smollm2_export / meta.file, meta)


@pytest.fixture(scope="module")
def prompt(tokenizer: TextTokenizer) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    return tokenizer.encode(chat, add_special_tokens=False)


def stream(tokenizer: TextTokenizer, prompt: list[int], ids: list[int],
           params: SamplingParams) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas = [detok.append(i) for i in ids]
    return detok, deltas


def test_streamed_deltas_equal_one_decode(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    rng = random.Random(0)
    split_characters = 0
    for _ in range(40):
        text = "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        split_characters += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        detok, deltas = stream(tokenizer, prompt, ids, SamplingParams())
        assert not any("\ufffd" in d for d in deltas), (text, deltas)
        tail = detok.flush()
        assert "".join(deltas) + tail == tokenizer.decode(ids) == text
        assert detok.text == text and detok.stopped is None
    assert split_characters > 50  # the texts really put characters across several byte tokens


def test_flush_releases_an_unfinished_character(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte token never came
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams())
    assert "".join(deltas) == "ok"
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)


def test_stop_string_across_tokens_is_never_emitted(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    stop = "\n\nUser:"
    ids = tokenizer.encode("The answer is 42.\n\nUser: and then more", add_special_tokens=False)
    assert sum(tokenizer.decode([i]) in stop for i in ids) >= 2  # the stop string spans several tokens
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams(stop=["never", stop]))
    assert "".join(deltas) == detok.text == "The answer is 42."
    assert not any("\n" in d for d in deltas)
    assert detok.stopped == stop
    assert detok.append(ids[0]) == "" and detok.flush() == ""


def test_earliest_stop_string_wins(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    ids = tokenizer.encode("Say: Hello world!", add_special_tokens=False)
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams(stop=["world", "Hello world"]))
    assert detok.stopped == "Hello world" and detok.text == "".join(deltas) == "Say: "


def test_prompt_context_keeps_the_first_space(tmp_path: Path) -> None:
    """A SentencePiece-style decoder drops the space of a text's first word; the output continues the prompt,
    so its first token is decoded after the prompt's last ones (as vLLM does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spm = Tokenizer(models.WordLevel(vocab={"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm.save(str(tmp_path / "tokenizer.json"))
    tokenizer = TextTokenizer(tmp_path / "tokenizer.json", TokenizerMeta())
    assert tokenizer.decode([1]) == "world"
    assert IncrementalDetokenizer(tokenizer, [0], SamplingParams()).append(1) == " world"


def test_failed_partial_stop_match_is_released(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    text = "Line one.\n\nUsers are great, Use it."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams(stop=["\n\nUser:"]))
    streamed = ["".join(deltas[:n + 1]) for n in range(len(ids))]
    decoded = [tokenizer.decode(ids[:n + 1]) for n in range(len(ids))]
    assert any(s != d for s, d in zip(streamed, decoded))  # something was held back on the way
    assert all(d.startswith(s) for s, d in zip(streamed, decoded))
    assert detok.stopped is None and "".join(deltas) + detok.flush() == text == detok.text


def test_flush_releases_a_trailing_partial_stop(tokenizer: TextTokenizer, prompt: list[int]) -> None:
    ids = tokenizer.encode("Done.\n\nUs", add_special_tokens=False)
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams(stop=["\n\nUser:"]))
    assert "".join(deltas) == "Done."
    assert detok.flush() == "\n\nUs"
    assert detok.text == "Done.\n\nUs" and detok.stopped is None


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: TextTokenizer, prompt: list[int], skip: bool) -> None:
    im_end = tokenizer.token_id("<|im_end|>")
    ids = tokenizer.encode("Hello there", add_special_tokens=False) + [im_end]
    detok, deltas = stream(tokenizer, prompt, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) + detok.flush() == ("Hello there" if skip else "Hello there<|im_end|>")
