"""Reasoning output: which output tokens are a reasoning model's thinking (``<think> … </think>``) and which its
answer, told on token ids; and the thinking budget that ends the thinking after a number of tokens.

The parsers are vLLM's, by name (``--reasoning-parser``):

  qwen3        Qwen3: the model opens its thinking with ``<think>`` (Qwen3's own template leaves that to it); an
               output that does not start with it is all answer.
  deepseek_r1  DeepSeek-R1: the output starts inside the thinking (its template, or the model's habit, opened it);
               an output without ``</think>`` is all reasoning.

Both read the prompt's end first: a ``<think>`` or ``</think>`` the chat template wrote at the end of the prompt
(only whitespace after it) says where the output starts — in the thinking (``<think>\\n``: Qwen3.5, Qwen3's
thinking-only models, DeepSeek-R1-0528) or in the answer (``<think>\\n\\n</think>\\n\\n``: Qwen3's
``enable_thinking: false``). The markers must be single tokens of the tokenizer; split on ids, the result holds
whether the tokenizer calls them special (dropped from decoded text) or not (Qwen3's).

Per sequence, :class:`ReasoningState` puts each output token in one channel — reasoning, answer, or a marker
(the markers are text of neither) — and its phase only moves forward: undecided → thinking → answer, or
undecided → answer. A budget caps the reasoning tokens: once it is spent, the end marker is the only token the
sequence may take (:func:`steer`), and the answer follows. Structured output applies to the answer alone: a
grammar starts after ``</think>`` (the engine asks :attr:`ReasoningState.constrained`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omforge.errors import OmforgeError

if TYPE_CHECKING:
    from omforge.runtime.tokenizer import TextTokenizer


class ReasoningError(OmforgeError):
    """A reasoning parser this model's tokenizer cannot serve (the message names the option and the token)."""


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # the next token may open the thinking (qwen3; nothing in the prompt said)
    THINKING = "thinking"
    ANSWER = "answer"


REASONING, ANSWER, MARKER = "reasoning", "answer", "marker"
"""The channel of one output token (:meth:`ReasoningState.observe`)."""


@dataclass(frozen=True)
class ParserRule:
    """A parser: its markers and the phase an output starts in when the prompt's end names none."""

    start: str
    end: str
    default: Phase


PARSERS = {
    "qwen3": ParserRule("<think>", "</think>", Phase.UNDECIDED),
    "deepseek_r1": ParserRule("<think>", "</think>", Phase.THINKING),
}

TEMPLATE_TAIL = 4
"""A marker among the prompt's last ``TEMPLATE_TAIL + 1`` tokens with only whitespace after it is the template's
(``<think>\\n``, ``</think>\\n\\n``); one further back belongs to an earlier turn."""


@dataclass(frozen=True)
class ReasoningSpec:
    """One request's reasoning (``SamplingParams.reasoning``): the marker token ids, the phase its output starts
    in, and its thinking budget (None: no cap; 0: the end marker at once)."""

    start_token_id: int
    end_token_id: int
    phase: Phase
    budget: int | None = None


class ReasoningParser:
    """A parser (:data:`PARSERS`) over one tokenizer; ``default_budget`` is the server's ``reasoning_budget``.
    Raises :class:`ReasoningError` when the tokenizer lacks a marker as a single token."""

    def __init__(self, name: str, tokenizer: TextTokenizer | None, default_budget: int | None = None):
        if name not in PARSERS:
            raise ReasoningError(f"reasoning_parser: {name!r} is not one of {', '.join(PARSERS)}")
        if tokenizer is None:
            raise ReasoningError(f"reasoning_parser {name}: this bundle has no tokenizer")
        self.name, self.rule, self.tokenizer, self.default_budget = name, PARSERS[name], tokenizer, default_budget
        ids = []
        for token in (self.rule.start, self.rule.end):
            token_id = tokenizer.token_id(token)
            if token_id is None:
                raise ReasoningError(f"reasoning_parser {name}: the tokenizer has no single token {token!r} (the "
                                     "parser splits the output on it)")
            ids.append(token_id)
        self.start_token_id, self.end_token_id = ids

    def spec(self, prompt_ids: Sequence[int], budget: int | None = None) -> ReasoningSpec:
        """The reasoning of a request with this prompt (a chat template's rendering); ``budget`` None: the
        server's default."""
        phase = self.rule.default
        tail = list(prompt_ids[-(TEMPLATE_TAIL + 1):])
        markers = (self.start_token_id, self.end_token_id)
        last = max((i for i, t in enumerate(tail) if t in markers), default=None)
        if last is not None and not self.tokenizer.decode(tail[last + 1:], skip_special_tokens=False).strip():
            phase = Phase.THINKING if tail[last] == self.start_token_id else Phase.ANSWER
        return ReasoningSpec(self.start_token_id, self.end_token_id, phase,
                             self.default_budget if budget is None else budget)


class ReasoningState:
    """One sequence's place in its reasoning. Invariants: ``phase`` only moves forward; ``num_tokens`` counts the
    tokens observed in the thinking (markers excluded) and never passes the budget."""

    def __init__(self, spec: ReasoningSpec):
        self.spec = spec
        self.phase = spec.phase
        self.num_tokens = 0

    @property
    def must_end(self) -> bool:
        """The budget is spent: the next token must be the end marker."""
        budget = self.spec.budget
        return self.phase is Phase.THINKING and budget is not None and self.num_tokens >= budget

    @property
    def constrained(self) -> bool:
        """A grammar applies to the next token (not inside the thinking; undecided, beside the start marker)."""
        return self.phase is not Phase.THINKING

    @property
    def steers(self) -> bool:
        """Its tokens may yet be forced (a budget, and the answer not reached): each must be sampled in turn."""
        return self.spec.budget is not None and self.phase is not Phase.ANSWER

    def observe(self, token_id: int) -> str:
        """The channel of the next output token (:data:`REASONING`, :data:`ANSWER` or :data:`MARKER`)."""
        if self.phase is Phase.UNDECIDED:
            if token_id == self.spec.start_token_id:
                self.phase = Phase.THINKING
                return MARKER
            self.phase = Phase.ANSWER
        elif self.phase is Phase.THINKING:
            if token_id == self.spec.end_token_id:
                self.phase = Phase.ANSWER
                return MARKER
            self.num_tokens += 1
            return REASONING
        return ANSWER


def steer(states: Sequence[ReasoningState | None], allowed: tuple[np.ndarray, np.ndarray] | None,
          vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The sampler's ``allowed`` (rows, 0/1 ``[len(rows), vocab_size]``: the grammar's tokens) with reasoning
    applied: row ``i`` whose budget is spent may take only its end marker; an undecided row with a grammar may also
    take the start marker. A row with a grammar is never one inside the thinking (the engine gives those none)."""
    forced = [i for i, s in enumerate(states) if s is not None and s.must_end]
    rows, mask = allowed if allowed is not None else (np.empty(0, np.int64), np.empty((0, vocab_size), np.uint8))
    opening = [(k, states[r]) for k, r in enumerate(rows.tolist())
               if states[r] is not None and states[r].phase is Phase.UNDECIDED]  # type: ignore[union-attr]
    if not forced and not opening:
        return allowed
    mask = mask.copy()
    for k, state in opening:
        mask[k, state.spec.start_token_id] = 1
    extra = np.zeros((len(forced), mask.shape[1]), mask.dtype)
    for k, i in enumerate(forced):
        extra[k, states[i].spec.end_token_id] = 1  # type: ignore[union-attr]
    return np.concatenate([rows, np.asarray(forced, np.int64)]), np.concatenate([mask, extra])
