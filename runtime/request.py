"""A request's state as the engine sees it: tokens, progress through the KV cache, status, timings.

Invariants: ``num_computed_tokens <= len(all_token_ids)``; a RUNNING or SWAPPED request holds blocks in the
KV cache manager, a WAITING one holds none; a WAITING_FOR_REMOTE_KV one holds the blocks a KV connector is
loading into (runtime/kv_connector.py: a tier below the pool or a prefill replica) and is in the scheduler's
``loading``; a finished one holds none, unless its blocks wait for a load that cannot be stopped to end (still in
``loading``) or for a remote reader (a PD prefill leg, in the scheduler's ``held``) — always under its own id.
A request with a LoRA adapter (``lora``, docs/lora.md) pins its adapter's slot while it is RUNNING, SWAPPED or
WAITING_FOR_REMOTE_KV (the engine's ``LoraRegistry``); a WAITING or finished one pins none.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omforge.errors import OmforgeError
from omforge.runtime.sampler import LogprobEntry
from omforge.runtime.sampling_params import SamplingParams


class RequestRejected(OmforgeError):
    """A request that can never run (too long for the context or the KV pool, or prompt token ids outside the
    vocabulary); the message says which limit. ``param``: the request field at fault when it is not a length."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    generator: np.random.Generator | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer, set by the engine
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt position filled so far ([None] for the first token); n > 1:
    # the leader's list, shared by its followers (one prompt)
    prompt_logprobs: list[LogprobEntry | None] = field(default_factory=list)
    matcher: Any = None  # params.structured: this sequence's llguidance matcher (its place in the grammar)
    reasoning: Any = None  # params.reasoning: this sequence's ReasoningState (runtime/reasoning.py)
    reasoning_detokenizer: object | None = None  # params.reasoning: the thinking's text (``detokenizer``: the answer's)
    draft: list[int] = field(default_factory=list)  # speculative decoding: this step's drafted tokens
    spec_acceptance: float = 1.0  # its drafts' accepted fraction, averaged (spec_decode.ACCEPTANCE_WEIGHT)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    parent: Request | None = None  # n > 1: the leader whose prompt KV this follower shares (forked, COW)
    followers: list[Request] = field(default_factory=list)  # n > 1, on the leader: not yet forked from it
    index: int = 0  # n > 1: which of the n completions
    kv_transfer: Any = None  # runtime/kv_transfer's KVTransferParams of a PD leg, None otherwise
    kv_transfer_out: dict | None = None  # a finished prefill leg: the decode leg's kv_transfer_params
    error: str | None = None  # why it ended without an answer (a failed KV transfer)
    lora: str | None = None  # the LoRA adapter's name (docs/lora.md); None: the base model. n > 1: the leader's

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def seq_ids(request_id: str, n: int) -> list[str]:
    """The ids of the ``n`` sequences of a request: ``{request_id}-{i}``, or the request id itself when n is 1."""
    return [f"{request_id}-{i}" for i in range(n)] if n > 1 else [request_id]

