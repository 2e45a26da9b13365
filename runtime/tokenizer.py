"""The serving-side tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, and the chat template.

No torch, no transformers: the chat template is rendered with jinja2 the way Hugging Face renders it
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from omforge.contract.manifest import TokenizerMeta
from omforge.errors import OmforgeError


class ChatTemplateError(OmforgeError):
    """The chat template rejected the messages (``raise_exception`` in the template) or is missing."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TextTokenizer:
    """Encode/decode text and render chat prompts for one model.

    ``meta`` is the bundle manifest's ``tokenizer`` section (export.json's has the same form): the chat template and
    the special tokens it renders.
    """

    def __init__(self, path: Path, meta: TokenizerMeta):
        self.tokenizer = Tokenizer.from_file(str(path))
        self.chat_template = meta.chat_template
        self.bos_token = meta.bos_token
        self.eos_token = meta.eos_token

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain completion prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{role, content}, …]) into the prompt text the model was trained on."""
        # the request's template variables may override the special tokens (transformers and vLLM let them)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **variables)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary entry spells (added tokens included): a text of ``c``
        characters encodes to at least ``c / max_token_chars`` tokens. The entries' own spellings are at least as
        long as the text they stand for (byte-level BPE spells a byte as one character, SentencePiece a space as
        ``▁``, byte fallback ``<0x0A>``), so the bound never refuses a text that fits."""
        return max(1, max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) map to their ids.

        ``add_special_tokens`` lets the tokenizer's post-processor add BOS (Llama 3 does, SmolLM2 does not);
        pass False for a rendered chat prompt, whose template writes BOS itself (as transformers does).
        Through ``encode_batch``, which releases the GIL (``encode`` holds it: a long prompt stalled every other
        thread, the server's event loop included).
        """
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str | None) -> int | None:
        return self.tokenizer.token_to_id(token) if token else None
