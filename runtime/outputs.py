"""What the engine reports: :class:`RequestOutput` (one request's result so far, its own copies) and
:class:`EngineStats` (the engine's running totals, read by ``/metrics``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
