"""Response bodies in OpenAI's shapes: completions and chat completions, whole or as stream chunks, usage and
logprobs. Pure functions of the engine's :class:`RequestOutput` objects; no I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from omforge.runtime.engine import RequestOutput

TokenText = Callable[[int], str]


def token_text_fn(tokenizer: Any) -> TokenText:
    """``token_id → its text`` as OpenAI's logprobs show it (the token decoded alone, special tokens kept)."""

    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[dict], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions form: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token: logprob}`` per position) and ``text_offset`` (each token's start in the choice's text)."""
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        s = token_text(e["token_id"])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(i): lp for i, lp in e.get("top", [])} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[dict], token_text: TokenText) -> dict[str, Any]:
    """The chat form: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = token_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(e["token_id"], e["logprob"]),
                         "top_logprobs": [one(i, lp) for i, lp in e.get("top", [])]} for e in entries]}


class ResponseBuilder:
    """Builds one response's bodies; ``kind`` is ``"completion"`` or ``"chat"``."""

    def __init__(self, kind: str, request_id: str, model: str, token_text: TokenText, want_logprobs: bool):
        self.kind, self.id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self._offsets: dict[int, int] = {}  # completions: text offset of the next token, per choice

    def _envelope(self, obj: str, choices: list[dict], usage_: dict | None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": None}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def logprobs(self, index: int, entries: list[dict]) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.token_text)
        start = self._offsets.get(index, 0)
        lp = completion_logprobs(entries, self.token_text, start)
        self._offsets[index] = start + sum(len(t) for t in lp["tokens"])
        return lp

    def start_offset(self, index: int, offset: int) -> None:
        """Completions with ``echo``: token offsets count from after the echoed prompt."""
        self._offsets[index] = offset

    # --- whole responses ----------------------------------------------------------------------------------

    def full(self, choices: list[tuple[int, str, RequestOutput]], usage_: dict) -> dict[str, Any]:
        """``choices``: (index, text, final output) in index order."""
        out = []
        for index, text, o in choices:
            lp = self.logprobs(index, o.logprobs)
            if self.kind == "chat":
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": o.finish_reason})
            else:
                out.append({"index": index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason})
        return self._envelope("chat.completion" if self.kind == "chat" else "text_completion", out, usage_)

    # --- stream chunks ------------------------------------------------------------------------------------

    def chunk(self, index: int, text: str, new_logprobs: list[dict] | None, finish_reason: str | None,
              role: bool = False) -> str:
        lp = self.logprobs(index, new_logprobs) if new_logprobs is not None else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice], None))
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return sse(self._envelope("text_completion", [choice], None))

    def usage_chunk(self, usage_: dict) -> str:
        return sse(self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [], usage_))


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
