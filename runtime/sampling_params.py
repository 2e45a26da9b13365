"""Per-request sampling parameters: vLLM's / OpenAI's names, defaults and ranges, so requests carry over unchanged.

A plain dataclass; :meth:`SamplingParams.validate` is the one place the ranges live (the server calls it on
every request and turns :class:`SamplingParamsError` into a 400 naming the parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omforge.errors import OmforgeError
from omforge.runtime.reasoning import ReasoningSpec
from omforge.runtime.structured import StructuredOutput

# Below this a temperature means greedy (vLLM's _SAMPLING_EPS): dividing by it would overflow the logits.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


class SamplingParamsError(OmforgeError):
    """A sampling parameter is out of range; the message names it and the allowed values, ``param`` is its name
    (what an OpenAI error's ``param`` field carries)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token of one request and when to stop.

    ``top_k`` 0 or -1 is off; ``logprobs`` is the number of top alternatives to return per token (0: only the
    chosen token's logprob, None: none); ``prompt_logprobs`` likewise for every prompt token after the first
    (computed, never read from the prefix cache). ``stop`` strings end the output before the match (not included);
    ``stop_token_ids`` end it after the token, like EOS. ``seed`` makes this request's sampling reproducible
    regardless of what else is batched with it (see :meth:`make_generator`). ``logit_bias`` maps token ids to a
    value in [-100, 100] added to their logits before any penalty or truncation (OpenAI's semantics; -100 bans).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens, with this many alternatives
    structured: StructuredOutput | None = None  # the output must match this grammar (runtime/structured.py)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's kv_transfer_params (prefill/decode disaggregation, runtime/kv_transfer): read by the engine
    kv_transfer_params: dict[str, Any] | None = None
    # a reasoning model's thinking apart from its answer, and its budget (runtime/reasoning.py; chat requests)
    reasoning: ReasoningSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts one string or a list
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def make_generator(self, index: int = 0) -> np.random.Generator | None:
        """The random stream of the ``index``-th of the ``n`` sequences: seeded ``seed + index`` as vLLM seeds
        parallel samples, or None when unseeded (the sampler's shared stream is used).

        Any int64 seed is accepted (OpenAI's range); numpy wants a non-negative one, hence the modulo.
        """
        return None if self.seed is None else np.random.default_rng((self.seed + index) % 2**64)

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` for the first parameter outside its OpenAI/vLLM range."""
        _int("n", self.n, 1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens must be at most max_tokens ({self.max_tokens}), "
                                      f"got {self.min_tokens}")
        _real("temperature", self.temperature, 0.0, 2.0)
        _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError("top_k",
                                      f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        _real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise SamplingParamsError("seed", f"seed must be a 64-bit integer or null, got {self.seed!r}")
        _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop",
                                      f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids",
                                      f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.reasoning is not None and self.reasoning.budget is not None:
            _int("thinking_token_budget", self.reasoning.budget, 0)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias",
                                      f"logit_bias must map token ids to values, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
            _real(f"logit_bias[{token}]", bias, -100.0, 100.0)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise SamplingParamsError(name.split("[")[0], f"{name} must be {allowed}, got {value!r}")


def _real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and (
        (low < value if low_open else low <= value) and value <= high)  # NaN fails both comparisons
    if not ok:
        allowed = (f"> {low:g}" if high == math.inf else
                   f"in {'(' if low_open else '['}{low:g}, {high:g}]")
        raise SamplingParamsError(name.split("[")[0], f"{name} must be {allowed}, got {value!r}")
