"""The scheduler: which requests run this step and how many tokens each brings (continuous batching).

Policy only; allocation is the KV cache manager's. Every step:
  1. RUNNING requests, oldest first: a decode brings 1 token, a request still prefilling brings its next chunk;
     all within the step budget ``max_num_batched_tokens``. When blocks run out, the newest running request is
     preempted — swapped to the host tier (``preemption_mode: swap``, if the tier has room) or freed to be
     recomputed later — until the older one fits. Preempted requests keep their output and resume unchanged.
  2. SWAPPED requests come back (oldest first) when no one was preempted this step and blocks allow.
  3. WAITING requests are admitted first-come-first-served, when no one was preempted this step, while the
     budget, ``max_num_seqs`` and the blocks allow; a long prompt takes the budget that is left and continues in
     later steps (chunked prefill, interleaved with the running decodes). Prefix-cache hits skip the cached part of the prompt.
With ``mixed_steps`` (executors whose graph has a decode group: the ORT step graph, ``contract.DECODE_GROUP_INPUTS``)
every step carries the running decodes and fills the rest of the budget with prefill chunks, vLLM's chunked
prefill: the decodes are attended apart from the chunks, so they cost their own work only (measured against the
alternation below: benchmarks/RESULTS.md, "mixed steps"). A burst of arrivals then stalls the running decodes for
its prefill steps instead of alternating with them.
``max_prefill_tokens_with_decodes`` (mixed steps only) bounds the prefill tokens of a step that carries running
decodes, so that a burst of arrivals cannot stall the decodes behind a full-budget prefill (Sarathi-Serve's
stall-free batching): a decode step that carries a full-budget chunk costs a full-budget prefill. Steps without
decodes still take the whole budget.
Without mixed steps (graphs that pad every sequence's queries to the step's longest: the runtime-write ORT graph) a step
carries either decodes or prefill work, and the two kinds alternate while both are pending: a 512-token chunk in a
step with 16 decodes would cost 17 × 512 query rows of attention.
Invariants: the scheduled tokens of a step never exceed the budget, nor its prefill tokens the decode-step cap;
at most ``max_num_seqs`` requests are RUNNING; a request is in exactly one of waiting / running / swapped until it finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.request import Request, Status


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step

    @property
    def samples(self) -> bool:
        """After this step the request has computed all its known tokens: the step yields its next token."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), before the step
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", mixed_steps: bool = False,
                 max_prefill_tokens_with_decodes: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self._last_was_decode = False
        self.mixed_steps = mixed_steps
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def join(self, follower: Request, leader: Request) -> None:
        """n > 1: ``follower`` starts RUNNING on a fork of ``leader``'s blocks, as far as the leader has computed
        (its prompt). Seats were reserved when the leader was admitted (:meth:`_seats`)."""
        self.kv.fork(leader.request_id, follower.request_id)
        follower.num_computed_tokens = leader.num_computed_tokens
        follower.num_cached_tokens = leader.num_cached_tokens
        follower.status = Status.RUNNING
        self.running.append(follower)

    @staticmethod
    def _seats(request: Request) -> int:
        """Running seats a request takes when admitted: its own and its not yet forked followers'."""
        return 1 + len(request.followers)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, request: Request) -> None:
        """Drop a request from whichever queue holds it and release its blocks (finish or abort)."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        self.kv.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        room = len(self.running) < self.max_num_seqs  # waiting/swapped work can only start with a free seat
        prefill_pending = len(decoding) < len(self.running) or (room and bool(self.waiting or self.swapped))
        decode_step = bool(decoding) and not (prefill_pending and self._last_was_decode) and not self.mixed_steps
        self._last_was_decode = decode_step
        # prefill tokens this step may take: capped when it carries decodes (mixed steps)
        prefill = budget
        if self.mixed_steps and decoding and self.max_prefill_tokens_with_decodes:
            prefill = self.max_prefill_tokens_with_decodes
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if not self.mixed_steps and (left == 1) != decode_step:
                i += 1  # not this step's kind: it runs in the next step
                continue
            if left > 1 and prefill <= 0:
                i += 1  # a prefill chunk, and this step's prefill share is spent
                continue
            n = min(left, budget, prefill) if left > 1 else 1
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:  # the request itself was preempted
                continue
            out.block_copies += copies
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
            prefill -= n if left > 1 else 0
            i += 1
        if decode_step:
            return out

        while (not out.preempted and self.swapped and len(self.running) < self.max_num_seqs and budget > 0
               and prefill > 0):
            req = self.swapped[0]
            pairs = self.kv.swap_in(req.request_id)
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in += pairs
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget, prefill)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:  # back in, but no room for its next token this step
                continue
            out.block_copies += copies
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
            prefill -= n

        # no admission after a preemption in this step: a request preempted for recompute would come straight back
        while (not out.preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0
               and prefill > 0):
            req = self.waiting[0]
            if len(self.running) + self._seats(req) > self.max_num_seqs:
                break  # an n > 1 request waits until all its sequences can run
            if req.num_computed_tokens == 0:
                cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
                req.num_computed_tokens = cached
                req.num_cached_tokens = max(req.num_cached_tokens, min(cached, len(req.prompt_token_ids)))
            n = min(req.num_tokens - req.num_computed_tokens, budget, prefill)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:
                self.kv.free(req.request_id)  # give back the prefix-cache references; retry next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.block_copies += copies
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
            prefill -= n
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        if self.preemption_mode == "swap":
            pairs = self.kv.swap_out(victim.request_id)
            if pairs is not None:
                out.swap_out += pairs
                victim.status = Status.SWAPPED
                self.swapped.append(victim)
                return
        self.kv.free(victim.request_id)  # recompute: its tokens are prefilled again when it is readmitted
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
