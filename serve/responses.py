"""Response bodies in OpenAI's shapes: completions and chat completions, whole or as stream chunks, usage and
logprobs. Pure functions of the engine's :class:`RequestOutput` objects; no I/O. The one place the runtime's
:class:`~omforge.runtime.sampler.LogprobEntry` values become JSON: the legacy completions form, the chat form
and vLLM's ``prompt_logprobs`` field.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from omforge.runtime.engine import RequestOutput
from omforge.runtime.sampler import LogprobEntry
from omforge.serve.tools import StreamSplitter, ToolPlan

TokenText = Callable[[int], str]


def token_text_fn(tokenizer: Any) -> TokenText:
    """``token_id → its text`` as OpenAI's logprobs show it (the token decoded alone, special tokens kept)."""

    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens`` (a reasoning parser's count, part of the completion tokens) as OpenAI's
    ``completion_tokens_details.reasoning_tokens``."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def _top(e: LogprobEntry, token_text: TokenText) -> dict[str, float]:
    """An entry's alternatives in the legacy form, ``{token: logprob}``."""
    return {token_text(i): lp for i, lp in e.top}


def completion_logprobs(entries: Sequence[LogprobEntry], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions form: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token: logprob}`` per position) and ``text_offset`` (each token's start in the choice's text)."""
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        s = token_text(e.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top(e, token_text) for e in entries], "text_offset": offsets}


def prompt_completion_logprobs(prompt_ids: Sequence[int], entries: Sequence[LogprobEntry | None],
                               token_text: TokenText) -> dict[str, Any]:
    """Echo + logprobs: the prompt's tokens in the legacy form, the first with ``null`` logprob and top (as
    OpenAI returned them), offsets from 0 into the echoed text."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])]
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _top(e, token_text) for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(entries: Sequence[LogprobEntry | None], token_text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt position ``None`` or ``{token_id: {logprob, rank,
    decoded_token}}`` holding the prompt's token and the top alternatives."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(e.token_id)}}
        for rank, (i, lp) in enumerate(e.top, 1):
            d.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": token_text(i)})
        out.append(d)
    return out


def _merge(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy logprobs blocks one after the other (the echoed prompt's, then the completion's)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: Sequence[LogprobEntry], token_text: TokenText) -> dict[str, Any]:
    """The chat form: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = token_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries]}


class ResponseBuilder:
    """Builds one response's bodies; ``kind`` is ``"completion"`` or ``"chat"``."""

    def __init__(self, kind: str, request_id: str, model: str, token_text: TokenText, want_logprobs: bool,
                 tools: ToolPlan | None = None):
        self.kind, self.id, self.model = kind, request_id, model
        self.tools = tools
        self._streams: dict[int, StreamSplitter | None] = {}  # tools: per choice, the held-back text
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

    def logprobs(self, index: int, entries: Sequence[LogprobEntry]) -> dict | None:
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

    def _echo_logprobs(self, index: int, o: RequestOutput) -> dict | None:
        """Echo + logprobs: the prompt's part; the completion's offsets then count from the echoed text."""
        if not self.want_logprobs or o.prompt_logprobs is None:
            return None
        lp = prompt_completion_logprobs(o.prompt_token_ids, o.prompt_logprobs, self.token_text)
        self._offsets[index] = sum(len(t) for t in lp["tokens"])
        return lp

    def echo_chunk(self, index: int, text: str, o: RequestOutput) -> str:
        """Streaming echo + logprobs: the prompt text with its logprobs, once they are known."""
        lp = self._echo_logprobs(index, o)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
        return sse(self._envelope("text_completion", [choice], None))

    def full(self, choices: list[tuple[int, str, RequestOutput]], usage_: dict, echo: bool = False,
             scoring_only: bool = False) -> dict[str, Any]:
        """``choices``: (index, text, final output) in index order. ``echo``: the texts start with the prompt
        (and the logprobs with the prompt's); ``scoring_only``: no completion tokens (echo + max_tokens 0)."""
        out = []
        for index, text, o in choices:
            prompt_lp = self._echo_logprobs(index, o) if echo else None
            lp = None if scoring_only else self.logprobs(index, o.logprobs)
            lp = _merge(prompt_lp, lp)
            if scoring_only:
                o = replace(o, finish_reason="length", stop_reason=None)
            if self.kind == "chat":  # with a reasoning parser, text is the answer and the thinking is apart
                thinking = o.reasoning_text is not None
                message: dict[str, Any] = {"role": "assistant", "content": (text or None) if thinking else text}
                finish = o.finish_reason
                if self.tools is not None:
                    content, calls = self.tools.split(text)
                    if calls:
                        message = {"role": "assistant", "content": content or None,
                                   "tool_calls": [c.to_openai() for c in calls]}
                        finish = "tool_calls" if finish == "stop" else finish
                if thinking:
                    message["reasoning_content"] = o.reasoning_text or None
                out.append({"index": index, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                out.append({"index": index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason})
            if o.prompt_logprobs is not None:  # vLLM's field, for its prompt_logprobs parameter
                out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(o.prompt_logprobs, self.token_text)
        return self._envelope("chat.completion" if self.kind == "chat" else "text_completion", out, usage_)

    # --- stream chunks ------------------------------------------------------------------------------------

    def chunk(self, index: int, text: str, new_logprobs: Sequence[LogprobEntry] | None, finish_reason: str | None,
              role: bool = False, reasoning: str | None = None) -> str:
        """One choice's chunk: ``text`` (chat: ``delta.content``), or with ``reasoning`` a chat chunk of the
        thinking alone (``delta.reasoning_content``, vLLM's field)."""
        lp = self.logprobs(index, new_logprobs) if new_logprobs is not None else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
            if reasoning is not None:
                delta = {"reasoning_content": reasoning}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice], None))
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return sse(self._envelope("text_completion", [choice], None))

    def tool_stream(self, index: int, out: RequestOutput, new_logprobs: Sequence[LogprobEntry] | None) -> list[str]:
        """Chat with tools, streaming: content as it becomes safe to send, then at the end the calls as one
        ``delta.tool_calls`` chunk and the finish reason (``tool_calls`` when there are calls)."""
        assert self.tools is not None
        if index not in self._streams:
            self._streams[index] = self.tools.streamer()
        splitter = self._streams[index]
        chunks = []
        text = splitter.feed(out.new_text) if splitter is not None else ""
        if text or new_logprobs:
            chunks.append(self.chunk(index, text, new_logprobs, None))
        if out.finished:
            if splitter is not None:
                rest, calls = splitter.finish()
            else:
                rest, calls = self.tools.split(out.text)
            if rest:
                chunks.append(self.chunk(index, rest, None, None))
            if calls:
                delta = {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                chunks.append(sse(self._envelope("chat.completion.chunk", [choice], None)))
            finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            chunks.append(self.chunk(index, "", None, finish))
        return chunks

    def usage_chunk(self, usage_: dict) -> str:
        return sse(self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [], usage_))


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
