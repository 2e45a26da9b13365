"""What the engine reports: :class:`RequestOutput` (one request's result so far, its own copies),
:class:`EngineStats` (the engine's running totals) and :class:`EngineSnapshot` (everything ``/metrics`` and the
server read of the engine at one moment, typed: serve reads no scheduler, KV manager, tier or connector state)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from omforge.runtime.hicache.controller import HiCacheStats
from omforge.runtime.kv_cache_manager import KVCacheStats
from omforge.runtime.kv_transfer.connector import PDStats
from omforge.runtime.lora.registry import LoraState
from omforge.runtime.sampler import LogprobEntry
from omforge.runtime.spec_decode import Verified


@dataclass
class EngineStats:
    steps: int = 0
    step_times: deque = field(default_factory=lambda: deque(maxlen=1000))  # seconds, the last 1000 steps
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    # speculative decoding (vLLM's spec_decode counters): drafts made, tokens drafted / accepted, and accepted
    # tokens per draft position (0 = the first drafted token)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: dict[int, int] = field(default_factory=dict)

    def count_verified(self, v: Verified) -> None:
        """Count one sequence's verified draft."""
        self.spec_drafts += 1
        self.spec_draft_tokens += v.num_drafted
        self.spec_accepted_tokens += v.num_accepted
        for i in range(v.num_accepted):
            self.spec_accepted_per_position[i] = self.spec_accepted_per_position.get(i, 0) + 1


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine after a step (:meth:`LLMEngine.snapshot <omforge.runtime.engine.LLMEngine.snapshot>`): the
    scheduler's queue lengths (``num_waiting`` counts requests waiting for their KV to load, and the requests
    submitted but not yet handed to the engine), the KV cache, the running totals of :class:`EngineStats`
    (``last_step_time``: seconds of the latest step, None before the first), the tier below the pool, PD's
    counters and the LoRA adapters (None when off)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv: KVCacheStats
    steps: int
    last_step_time: float | None
    prompt_tokens: int
    prefill_tokens: int
    generation_tokens: int
    preemptions: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_position: dict[int, int]
    hicache: HiCacheStats | None = None  # the tier below the pool (runtime/hicache), None when off
    pd: PDStats | None = None  # prefill/decode disaggregation (runtime/kv_transfer), None when off
    lora: LoraState | None = None  # the adapters running and waiting (runtime/lora), None without LoRA


@dataclass
class RequestOutput:
    """One request's result so far (``new_text`` / ``new_token_ids``: what this step added). Its token ids, times
    and logprob entries are its own copies, taken when it was made (the request's lists grow on)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    logprobs: tuple[LogprobEntry, ...]
    arrival_time: float
    first_token_time: float | None
    token_times: list[float]
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None  # SamplingParams.prompt_logprobs: (None, …)
    kv_transfer_params: dict | None = None  # a finished PD prefill leg: what the decode leg needs (vLLM's field)
    error: str | None = None  # it ended without an answer (a failed KV transfer): the server answers an error
    # SamplingParams.reasoning: the thinking's text so far (``text`` is then the answer's), what this step added,
    # and its tokens (the markers not counted); None / "" / 0 without it
    reasoning_text: str | None = None
    new_reasoning_text: str = ""
    num_reasoning_tokens: int = 0
    pooled: np.ndarray | None = None  # a pooling bundle's result (runtime/pooling.py): an embedding, or [P(yes)]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
