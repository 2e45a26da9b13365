"""The engine's output processor (vLLM v1's OutputProcessor): what becomes of a step's new tokens once the core has
sampled them and the scheduler has appended them — each sequence's detokenizers, its reasoning channels (thinking,
answer, marker), its grammar's advance, the stop strings, and the :class:`RequestOutput` the caller gets.

Invariants: every request the core adds passes through :meth:`OutputProcessor.add` (its detokenizers, reasoning
state and grammar matcher made there, once); every output of a finished request is its last, and the request leaves
the engine's table (``forget``) when it is made; a stop string or a refused grammar token ends the request through
the scheduler (``finish``), and the tokens after a stop string are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from omforge.runtime.detokenizer import IncrementalDetokenizer
from omforge.runtime.outputs import EngineStats, RequestOutput
from omforge.runtime.reasoning import ANSWER, MARKER, REASONING, ReasoningState
from omforge.runtime.request import Request
from omforge.runtime.sampler import LogprobEntry, prompt_logprobs
from omforge.runtime.structured import GrammarMasks
from omforge.runtime.tokenizer import TextTokenizer


class OutputProcessor:
    """Turns sampled tokens into outputs. ``finish(req, reason, stop_reason)``: the scheduler's; ``forget(req)``: the
    engine's (out of its request table, its adapter's use ended); ``stats``: the engine's running totals (prompt and
    generation tokens, finished requests)."""

    def __init__(self, tokenizer: TextTokenizer | None, eos_token_ids: tuple[int, ...], grammars: GrammarMasks,
                 stats: EngineStats, finish: Callable[..., None], forget: Callable[[Request], None]):
        self.tokenizer, self.eos_token_ids, self.grammars = tokenizer, eos_token_ids, grammars
        self.stats, self.finish, self.forget = stats, finish, forget

    def add(self, req: Request) -> None:
        """Make ``req``'s detokenizers (a reasoning request's second one: stop strings apply to the answer alone),
        reasoning state and grammar matcher."""
        params, ids = req.params, req.prompt_token_ids
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        if params.reasoning is not None:
            req.reasoning = ReasoningState(params.reasoning)
            if self.tokenizer is not None:
                req.reasoning_detokenizer = IncrementalDetokenizer(self.tokenizer, ids, replace(params, stop=[]))
        if params.structured is not None:
            req.matcher = self.grammars.matcher(params.structured)

    def process(self, sampled: list[Request], before: dict[str, int], entries: dict[str, list[LogprobEntry]],
                now: float, grammars: bool) -> list[RequestOutput]:
        """The outputs of the requests that got tokens this step (``before``: each one's output length before the
        step; ``grammars``: the step had masks, so the structured sequences' matchers advance)."""
        channels = {req.request_id: [req.reasoning.observe(t) for t in req.output_token_ids[before[req.request_id]:]]
                    for req in sampled if req.reasoning is not None}  # each new token: reasoning, answer or marker
        if grammars:
            self._advance_grammars(sampled, channels)
        return [self._emit(req, req.output_token_ids[before[req.request_id]:], entries.get(req.request_id), now,
                           channels.get(req.request_id)) for req in sampled]


    def _advance_grammars(self, sampled: list[Request], channels: dict[str, list[str]]) -> None:
        """Each structured sequence's matcher takes its new token, if it is one of the answer's (``channels``: a
        reasoning sequence's). A complete grammar allows only EOS, which ends the request as usual; with
        ``ignore_eos`` the consumed EOS ends it here."""
        eos = self.eos_token_ids
        for req in sampled:
            if req.matcher is None or req.finished or channels.get(req.request_id, [""])[-1] in (REASONING, MARKER):
                continue
            token = req.output_token_ids[-1]
            if not req.matcher.consume_token(token):
                self.finish(req, "stop", "grammar error: " + (req.matcher.get_error() or "token refused"))
            elif req.matcher.is_stopped() and token in eos:
                self.finish(req, "stop")

    @staticmethod
    def prompt_logprobs(req: Request, logits: np.ndarray, start: int) -> None:
        """Row ``i`` of ``logits`` predicts position ``start + i + 1``: record the logprob of the prompt's token
        there (and the top ``prompt_logprobs`` alternatives) for the positions not yet filled — a chunk recomputed
        after a preemption adds nothing twice."""
        prompt, filled, k = req.prompt_token_ids, req.prompt_logprobs, req.params.prompt_logprobs
        first = len(filled) - start - 1  # the first row whose position is unfilled
        last = min(len(logits), len(prompt) - start - 1)
        if first < last:
            filled.extend(prompt_logprobs(logits[first:last], prompt[start + first + 1:start + last + 1], k))

    def _emit(self, req: Request, new: list[int], entries: list[LogprobEntry] | None, now: float,
              channels: list[str] | None = None) -> RequestOutput:
        """Record this step's tokens of ``req`` (one, or a speculating request's accepted run) — times, logprobs —
        and detokenise them one by one (``channels``: a reasoning sequence's, each token's: the thinking's text,
        the answer's, or a marker, text of neither); a stop string ends the request there and drops the tokens
        after it (a stop string applies to the answer alone)."""
        if req.first_token_time is None:
            req.first_token_time = now
            if req.parent is None:  # a follower's prompt was its leader's
                self.stats.prompt_tokens += len(req.prompt_token_ids)
        new_text, new_reasoning, kept = "", "", []
        for i, token in enumerate(new):
            kept.append(token)
            req.token_times.append(now)
            self.stats.generation_tokens += 1
            if entries is not None and i < len(entries):
                req.logprobs.append(entries[i])
            if req.detokenizer is not None:
                last = i == len(new) - 1
                ends_on_token = last and req.finish_reason == "stop" and not isinstance(req.stop_reason, str)
                channel = channels[i] if channels is not None else None
                if channel is not None and channel != ANSWER:
                    new_reasoning += self._reasoning_text(req, token, channel, ends_on_token)
                    continue
                new_text += "" if ends_on_token else req.detokenizer.append(token)
                if req.detokenizer.stopped:  # it wins over a length limit or stop token at this or a later token
                    self.finish(req, "stop", req.detokenizer.stopped)
                    del req.output_token_ids[len(req.output_token_ids) - (len(new) - i - 1):]  # nothing after it
                    break
        if req.finished and req.detokenizer is not None:
            new_text += req.detokenizer.flush()  # held-back text that can no longer become a stop string
            if req.reasoning_detokenizer is not None:
                new_reasoning += req.reasoning_detokenizer.flush()
        if req.finished:
            self.forget(req)  # a long-running server must not keep finished requests
            self.stats.finished += 1
        return self._output(req, new_text, kept, new_reasoning)

    @staticmethod
    def _reasoning_text(req: Request, token: int, channel: str, ends_on_token: bool) -> str:
        """The thinking's new text for one of its tokens; a marker is context, never text: the end marker closes
        the thinking's text and is the answer's first context."""
        think = req.reasoning_detokenizer
        if channel == REASONING:
            return "" if ends_on_token else think.append(token)  # type: ignore[union-attr]
        if token == req.reasoning.spec.start_token_id:
            think.context(token)  # type: ignore[union-attr]
            return ""
        out = think.flush()  # type: ignore[union-attr]
        req.detokenizer.context(token)  # type: ignore[union-attr]
        return out

    def failed(self, req: Request) -> RequestOutput:
        """The output of a request the scheduler ended without an answer (``req.error``: a failed KV read)."""
        self.forget(req)
        return self._output(req, "", [])

    def _output(self, req: Request, new_text: str, new_ids: list[int], new_reasoning: str = "") -> RequestOutput:
        text = req.detokenizer.text if req.detokenizer is not None else ""
        think = req.reasoning_detokenizer
        return RequestOutput(req.request_id, req.index, req.prompt_token_ids, text, list(req.output_token_ids),
                             new_text, new_ids, req.finished, req.finish_reason, req.stop_reason,
                             req.num_cached_tokens, tuple(req.logprobs), req.arrival_time, req.first_token_time,
                             list(req.token_times), tuple(req.prompt_logprobs) if req.prompt_logprobs else None,
                             req.kv_transfer_out, req.error, reasoning_text=think.text if think is not None else None,
                             new_reasoning_text=new_reasoning,
                             num_reasoning_tokens=req.reasoning.num_tokens if req.reasoning is not None else 0)
