"""The scheduler: which requests run this step and how many tokens each brings (continuous batching).

Policy only; allocation is the KV cache manager's. Each step takes RUNNING requests first (oldest first; when
blocks run out the newest is preempted, by swap or recompute), then SWAPPED ones back, then WAITING ones
first-come-first-served (chunked prefill; prefix-cache and KV-connector hits; LoRA slots), within the step budget.
:meth:`Scheduler.schedule` returns the plan — the work and the ordered block moves the executor carries out — and
:meth:`Scheduler.update_from_output` finishes the step with the sampled tokens. The whole order, LoRA pinning, the
bounds of a step that mixes decodes and prefill, and why: docs/step-lifecycle.md, "The scheduler's step".

Invariants: the scheduled tokens of a step never exceed the budget, nor its prefill tokens the decode-step cap
(with the token budget: the larger of ``MIN_PREFILL_WITH_DECODES`` and the budget less the step's decodes; with the
time rule also its prediction, at least ``MIN_TIMED_PREFILL``);
at most ``max_num_seqs`` requests are RUNNING or loading, counting the ``n > 1`` followers a leader will fork; a
request is in exactly one of waiting / running / swapped / loading until it finishes; blocks are held only under
the id of the request that owns them; every RUNNING, SWAPPED or loading request with an adapter pins it once (so a
step carries at most ``max_loras`` adapters), and no other request does; an adapter a step's work reads is written
into its slot by that step's plan (``lora_loads``) or an earlier one. LoRA fairness: once a waiting request has been
passed over for its adapter (every slot pinned by others) for ``lora_fairness_s``, no request that is not so passed
over is admitted with an adapter (base-model requests still are) until it holds a slot: the pinned slots drain and
the first such request in the queue gets the first one freed, however busy the adapters holding them are.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.kv_connector import ExternalHit, FinishedLoad, KVConnector
from omforge.runtime.request import Request, Status
from omforge.runtime.step import SeqWork
from omforge.runtime.step_cost import StepCost

if TYPE_CHECKING:
    from omforge.runtime.lora.registry import LoraRegistry
    from omforge.runtime.lora.slots import LoraLoad

PREEMPTION_MODES = ("recompute", "swap")
MIN_PREFILL_WITH_DECODES = 32  # prefill tokens a step with decodes may always carry (the token budget's floor)
MIN_TIMED_PREFILL = 16  # the time rule's floor: prefill progresses however slow a token is
LORA_FAIRNESS_S = 2.0
"""Seconds a request may be passed over for its LoRA adapter (every slot pinned by other adapters) before the
adapters holding the slots get no new work (``SchedulerConfig.lora_fairness_s``; engine_config lowers it to a quarter
of a shorter ``max_queue_time_s``): a slot drains within the running requests' lifetimes, well inside the queue
bound, instead of never while those adapters keep receiving requests."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and the model facts its stop checks need (resolved once: ``runtime.engine_config``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str = "recompute"
    mixed_batches: bool = False
    max_prefill_tokens_with_decodes: int | None = None  # a fixed cap; wins over the token budget
    decode_step_token_budget: int | None = None  # tokens in all of a step with decodes (mixed batches)
    # the time rule (runtime/step_cost.py): once the step costs are known, a step with decodes lasts no more than
    # about this many times its decodes alone (within the token rule above, which alone holds until then)
    mixed_step_time_ratio: float | None = None
    max_model_len: int | None = None  # a request that reaches it finishes with "length"
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # blocks wholly before the window go back to the pool
    lora_fairness_s: float | None = LORA_FAIRNESS_S  # see LORA_FAIRNESS_S (None: no fairness rule)

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {self.preemption_mode!r} is not one of {PREEMPTION_MODES}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.decode_step_token_budget is not None and self.decode_step_token_budget < 1:
            raise ValueError("decode_step_token_budget must be at least 1")
        if self.mixed_step_time_ratio is not None and self.mixed_step_time_ratio <= 1:
            raise ValueError("mixed_step_time_ratio must be above 1 (the decodes alone are 1)")
        if self.lora_fairness_s is not None and self.lora_fairness_s < 0:
            raise ValueError("lora_fairness_s must be 0 or more seconds")

    def prefill_cap(self, decodes: int) -> int | None:
        """Prefill tokens a step carrying ``decodes`` decoding sequences may take (None: the budget's rest)."""
        if not self.mixed_batches or not decodes:
            return None
        if self.max_prefill_tokens_with_decodes is not None:
            return self.max_prefill_tokens_with_decodes
        if self.decode_step_token_budget is not None:
            return max(MIN_PREFILL_WITH_DECODES, self.decode_step_token_budget - decodes)
        return None


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    num_draft: int = 0  # speculative decoding: the last of these tokens are request.draft (not yet its own)

    @property
    def samples(self) -> bool:
        """After this step the request has computed all its known tokens: the step yields its next token
        (speculating requests yield theirs through verification instead)."""
        return not self.num_draft and self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan. The executor performs ``swap_out``, ``swap_in``, ``block_copies``, ``lora_loads`` in that
    order, then runs ``work`` (one item per ``scheduled`` entry, same order); ``sample_rows`` pairs every request that
    samples this step with its logits row (``n > 1`` followers share their leader's row)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), before the step
    lora_loads: list[LoraLoad] = field(default_factory=list)  # adapters written into their slots, before the step
    preempted: list[Request] = field(default_factory=list)
    work: list[SeqWork] = field(default_factory=list)
    sample_rows: list[tuple[Request, int]] = field(default_factory=list)
    # prompt logprobs: (request, first logits row, first position, rows), one row per token of the chunk
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # speculative decoding: (request, first logits row, drafted tokens): rows for its last token and each draft
    spec_rows: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decoding sequences: one each, plus a speculating one's drafts (decode work, not prefill)."""
        return sum(1 + s.num_draft for s in self.scheduled if s.start >= len(s.request.prompt_token_ids))


@dataclass
class _StepBudget:
    """What one step still has room for while it is planned: ``tokens`` in all, ``prefill`` of them for prefill
    chunks; ``cap`` bounds the prefill of a step with decodes (mixed batches), ``decodes`` says whether it has one."""

    tokens: int
    prefill: int
    cap: int | None
    decodes: bool


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, connectors: Sequence[KVConnector] = (),
                 lora: LoraRegistry | None = None, clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.clock = clock  # the fairness rule's time (seconds)
        self.lora = lora  # the engine's adapter registry (None: the bundle has no LoRA, every request is the base's)
        self.connectors = list(connectors)
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV (or finished meanwhile): blocks, a seat
        self.held: dict[str, Request] = {}  # finished, its blocks held for a remote reader (a PD prefill leg)
        self.failed: list[Request] = []  # ended without an answer (a failed KV load): the engine reports them
        self.num_preemptions = 0
        self._last_was_decode = False
        self.step_cost = StepCost()  # the time rule's model, fed by observe_step
        self._passed_over: dict[str, float] = {}  # waiting request id → when its adapter first found no slot
        self._starving = False  # this step: someone was passed over past lora_fairness_s (no new pins but theirs)

    def observe_step(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """A finished step's shape and duration (the engine's clock), for the time rule."""
        self.step_cost.observe(prefill_tokens, decode_tokens, seconds)

    def _prefill_cap(self, decodes: int) -> int | None:
        """The prefill tokens a step carrying ``decodes`` decodes may take: the configured token rule's
        (:meth:`SchedulerConfig.prefill_cap`), and once the time rule has costs, no more than its prediction."""
        cap = self.config.prefill_cap(decodes)
        ratio = self.config.mixed_step_time_ratio
        if ratio is not None and self.config.mixed_batches and decodes:
            timed = self.step_cost.prefill_within(ratio, decodes, MIN_TIMED_PREFILL)
            if timed is not None:
                return timed if cap is None else min(cap, timed)
        return cap

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _join(self, follower: Request, leader: Request) -> None:
        """n > 1: ``follower`` starts RUNNING on a fork of ``leader``'s blocks, as far as the leader has computed
        (its prompt). Seats were reserved when the leader was admitted (:meth:`_seats`)."""
        self.kv.fork(leader.request_id, follower.request_id)
        if follower.lora is not None:  # its leader pins the adapter: the slot is resident, nothing to load
            self._pin(follower, None)
        follower.num_computed_tokens = leader.num_computed_tokens
        follower.num_cached_tokens = leader.num_cached_tokens
        follower.status = Status.RUNNING
        self.running.append(follower)

    @staticmethod
    def _seats(request: Request) -> int:
        """Running seats a request takes when admitted: its own and its not yet forked followers'."""
        return 1 + len(request.followers)

    def _occupied(self) -> int:
        """Seats taken: the running and loading requests and the followers they will fork (reserved at admission)."""
        return sum(1 + len(r.followers) for r in (*self.running, *self.loading.values()) if not r.finished)

    # --- LoRA adapter slots (docs/lora.md) -------------------------------------------------------------------

    def _pin(self, req: Request, out: SchedulerOutput | None) -> bool:
        """Pin ``req``'s adapter's slot (resident, or assigned a free or unpinned one: the load that writes it there
        goes into ``out``, the plan); False when every slot is pinned by other adapters. A request without an
        adapter, or already pinning, is True."""
        if req.lora is None:
            return True
        if self.lora is None:
            raise ValueError(f"request {req.request_id!r} names LoRA adapter {req.lora!r} but the scheduler has "
                             "no adapter slots")
        pinned = self.lora.acquire(req.request_id, req.lora)
        if pinned is None:
            return False
        if pinned.load is not None:
            if out is None:
                raise RuntimeError(f"request {req.request_id!r}: adapter {req.lora!r} must be resident here")
            out.lora_loads.append(pinned.load)
        return True

    def _lora_waits(self, req: Request) -> bool:
        """Whether ``req``'s adapter keeps it waiting this step: it could not get a slot now (not resident, every
        slot pinned by other adapters), or the fairness rule holds it back (:meth:`_held_back`)."""
        if req.lora is None or self.lora is None:
            return False
        return self._held_back(req) or self.lora.would_wait(req.lora)

    def _held_back(self, req: Request) -> bool:
        """The fairness rule: while a request passed over for its adapter past ``lora_fairness_s`` waits, a request
        with an adapter that was not is not admitted (it would re-pin the slots that must drain)."""
        return self._starving and req.lora is not None and not self._starved(req)

    def _starved(self, req: Request) -> bool:
        """Whether ``req`` has been passed over for its adapter for ``lora_fairness_s`` or longer."""
        since = self._passed_over.get(req.request_id)
        bound = self.config.lora_fairness_s
        return since is not None and bound is not None and self.clock() - since >= bound

    def _update_starving(self) -> None:
        """Whether the fairness rule holds this step: a request passed over past the bound is still waiting."""
        bound = self.config.lora_fairness_s
        if not self._passed_over or bound is None:
            self._starving = False
            return
        now = self.clock()
        self._starving = any(now - since >= bound for since in self._passed_over.values())

    def _passed(self, req: Request) -> None:
        """``req`` found no slot for its adapter this step (the first time starts its fairness clock)."""
        self._passed_over.setdefault(req.request_id, self.clock())

    def _unpin(self, req: Request) -> None:
        """Release ``req``'s pin on its adapter's slot, if it holds one (idempotent)."""
        if self.lora is not None:
            self.lora.release(req.request_id)

    def lora_slot(self, req: Request) -> int:
        """The slot of ``req``'s adapter (it pins it while it runs); 0 for the base model."""
        if req.lora is None or self.lora is None:
            return 0
        slot = self.lora.slot_of(req.lora)
        if slot is None:
            raise RuntimeError(f"request {req.request_id!r} runs but its adapter {req.lora!r} holds no slot")
        return slot

    def _lora_root(self, req: Request) -> bytes | None:
        """The root of ``req``'s prefix-cache hash chain: its adapter's digest (None: the base model)."""
        if req.lora is None or self.lora is None:
            return None
        return self.lora.get(req.lora).digest

    def lora_pins(self) -> dict[str, str]:
        """Request id → the adapter it pins (RUNNING, SWAPPED or loading requests with an adapter)."""
        return self.lora.pins() if self.lora is not None else {}

    def has_unfinished(self) -> bool:
        """Requests in any queue, a load in flight (an aborted one holds blocks until it ends) or blocks held for a
        remote reader."""
        return bool(self.waiting or self.running or self.swapped or self.loading or self.held)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` still holds blocks here (a finished request's may wait for a load or a reader)."""
        return self.kv.holds(request_id)

    def remove(self, request: Request) -> None:
        """Drop a request from whichever queue holds it and release its blocks (finish or abort). A request whose
        load is in flight keeps its blocks, under its own id, until the load ends (:meth:`_load_ended`)."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        self._unpin(request)
        self._passed_over.pop(request.request_id, None)
        if request.request_id not in self.loading:
            self.kv.free(request.request_id)

    # --- the KV connectors (runtime/kv_connector.py) ------------------------------------------------------------

    def _collect_finished(self, out: SchedulerOutput) -> None:
        """What the connectors finished since the last plan: loads (their requests join RUNNING, fail or go back
        to WAITING), held requests released, retired blocks free again."""
        for connector in self.connectors:
            done = connector.get_finished()
            if done.reinstated:
                self.kv.pool.reinstate(done.reinstated)
            for request_id in done.released:
                if self.held.pop(request_id, None) is not None:
                    self.kv.free(request_id)
            for load in done.loads:
                self._load_ended(load)
        self._pool_events(out)

    def _load_ended(self, load: FinishedLoad) -> None:
        req = self.loading.pop(load.request_id)
        rid = req.request_id
        if req.finished or load.error is not None:  # aborted meanwhile, or the load failed
            self.kv.free(rid, retire=load.retired)
            self._unpin(req)
            if req.finished:
                return
            req.num_computed_tokens = 0
            if load.recompute:  # prefilled here instead (its connector will not load it again)
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                return
            for r in (req, *req.followers):  # n > 1: its unforked followers end with it
                r.error, r.status, r.finish_reason = load.error, Status.FINISHED, "abort"
                self.failed.append(r)
            req.followers = []
            return
        # the leading loaded blocks are computed; the last token is always computed (its logits give the next)
        computed = min(req.num_computed_tokens + load.num_loaded_blocks * self.kv.block_size, req.num_tokens - 1)
        req.num_computed_tokens = computed
        req.num_cached_tokens = max(req.num_cached_tokens, min(computed, len(req.prompt_token_ids)))
        self.kv.commit(rid, req.all_token_ids, computed)
        req.status = Status.RUNNING
        self.running.append(req)

    def _external_hit(self, req: Request, use_cache: bool) -> tuple[ExternalHit | None, KVConnector | None]:
        """The first connector that can supply tokens past ``req``'s local hit, and how many."""
        if not self.connectors:
            return None, None
        hashes = self.kv.next_block_hashes(req.request_id, req.all_token_ids) \
            if use_cache and self.kv.enable_prefix_caching and any(c.uses_block_hashes for c in self.connectors) \
            else []
        for connector in self.connectors:
            hit = connector.get_num_new_matched_tokens(req, req.num_computed_tokens, hashes)
            if hit is not None and hit.num_tokens > 0:
                return hit, connector
        return None, None

    def _allocated(self, req: Request, source: KVConnector | None, blocks: list[int],
                   num_external: int) -> list[tuple[int, int]]:
        """Tell every connector ``req`` was admitted (``source`` fills ``blocks``); the plan's host copies."""
        copies = []
        for connector in self.connectors:
            mine = connector is source
            copies += connector.update_state_after_alloc(req, blocks if mine else [], num_external if mine else 0)
        return copies

    def _pool_events(self, out: SchedulerOutput | None) -> None:
        """The pool's typed events to every connector; write-back copies go first in ``out``."""
        events = self.kv.take_events()
        if not events:
            return
        for connector in self.connectors:
            copies = connector.take_events(events)
            if copies:
                if out is None:
                    raise RuntimeError("a write-back outside a plan (evictions happen only while planning)")
                out.swap_out += copies

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); the KV cache manager records its block moves now."""
        out = SchedulerOutput()
        self._collect_finished(out)
        self._fill(out)
        self._pool_events(out)  # the write-back of this plan's evictions, before anything rewrites the blocks
        rows = 0
        for s in out.scheduled:
            req = s.request
            if s.num_draft:  # the last known token and the drafts, a logits row for each
                out.work.append(SeqWork([*req.all_token_ids[s.start:], *req.draft], s.start,
                                        self.kv.block_table(req.request_id), all_logits=True,
                                        lora_slot=self.lora_slot(req)))
                out.spec_rows.append((req, rows, s.num_draft))
                rows += s.num_new_tokens
                continue
            # a chunk that holds prompt positions whose next token is a prompt token: logits for all its rows
            every = req.params.prompt_logprobs is not None and s.start < len(req.prompt_token_ids) - 1
            out.work.append(SeqWork(req.all_token_ids[s.start:s.start + s.num_new_tokens], s.start,
                                    self.kv.block_table(req.request_id), needs_logits=s.samples, all_logits=every,
                                    lora_slot=self.lora_slot(req)))
            if every:
                out.prompt_rows.append((req, rows, s.start, s.num_new_tokens))
                rows += s.num_new_tokens - 1
            if s.samples:  # n > 1: followers sample from their leader's row once its prompt is computed
                out.sample_rows += [(r, rows) for r in (req, *req.followers)]
            if s.samples or every:
                rows += 1
        return out

    def update_from_output(self, plan: SchedulerOutput, token_ids: Sequence[int],
                           verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Finish the step ``plan`` after it ran: ``token_ids[i]`` was sampled for ``plan.sample_rows[i]``;
        ``verified[request_id]``: a speculating request's accepted drafts plus one token (spec_decode.verify).
        Returns the requests that got tokens, in that order, each with its tokens appended (a speculating one may
        get several; a token-level stop among them drops the rest); those that stopped are FINISHED and no longer
        hold blocks. Only accepted tokens are ever computed, committed or hashed: the KV a rejected draft wrote
        lies beyond ``num_computed_tokens``, is never read, and is overwritten by the next step."""
        if len(token_ids) != len(plan.sample_rows):
            raise ValueError(f"{len(token_ids)} sampled tokens for {len(plan.sample_rows)} sampling requests")
        window = self.config.sliding_window
        verified = verified or {}
        sampled: list[Request] = []

        def take(req: Request, tokens: list[int]) -> None:
            """Append tokens through the token-level stops; a stop drops the tokens after it."""
            for token in tokens:
                req.output_token_ids.append(token)
                reason, stop_reason = self._stop(req, token)
                if reason is not None:
                    self.finish(req, reason, stop_reason)
                    break
            sampled.append(req)

        for s in plan.scheduled:
            req = s.request
            if s.num_draft:
                # it computed its last token and its drafts: the accepted drafts become its own tokens (before the
                # commit hashes them) and count as computed; the verified token after them is new, like a sample
                tokens = verified.get(req.request_id, [])
                req.draft = []
                take(req, tokens)
                req.num_computed_tokens += max(len(tokens), 1)
                if req.finished:
                    continue
            else:
                req.num_computed_tokens += s.num_new_tokens
            self.kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if window:  # blocks no later query can see go back to the pool
                self.kv.release_out_of_window(req.request_id, req.num_computed_tokens, window)
            if s.samples:
                for follower in req.followers:
                    self._join(follower, req)
                req.followers = []
        for (req, _), token in zip(plan.sample_rows, token_ids):
            take(req, [int(token)])
        self._pool_events(None)
        return sampled

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``request`` (``reason``: "stop", "length", "abort"): FINISHED, out of every queue, blocks freed — or
        held for a remote reader when a connector asks (a PD prefill leg), or kept until its load ends. Finishing
        a finished request only changes its reason (a stop string found in a token that already ended it)."""
        if request.finished:
            request.finish_reason, request.stop_reason = reason, stop_reason
            return
        request.status, request.finish_reason, request.stop_reason = Status.FINISHED, reason, stop_reason
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        self._unpin(request)  # it runs no more (blocks held for a load or a reader need no adapter)
        self._passed_over.pop(request.request_id, None)
        rid = request.request_id
        if rid in self.loading:  # its blocks are freed when the load ends
            return
        blocks = self.kv.device_table(rid)
        answers = [a for c in self.connectors if (a := c.request_finished(request, blocks)) is not None]
        if answers:
            request.kv_transfer_out = answers[0]
            self.held[rid] = request
            return
        self.kv.free(rid)

    def _stop(self, req: Request, token: int) -> tuple[str | None, int | None]:
        """Token-level stops (stop token ids, EOS, max_tokens, the context); stop strings are the detokenizer's."""
        p, n_out = req.params, len(req.output_token_ids)
        if n_out >= p.min_tokens and token in p.stop_token_ids:
            return "stop", token
        if n_out >= p.min_tokens and not p.ignore_eos and token in self.config.eos_token_ids:
            return "stop", None
        limit = self.config.max_model_len
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (limit is not None and req.num_tokens >= limit):
            return "length", None
        return None, None

    def _fill(self, out: SchedulerOutput) -> None:
        self._update_starving()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        room = self._occupied() < self.max_num_seqs  # waiting/swapped work can only start with a free seat
        # a waiting request whose adapter cannot get a slot now is no prefill this step can start
        waiting = bool(self.waiting) if self.lora is None else any(not self._lora_waits(r) for r in self.waiting)
        prefill_pending = len(decoding) < len(self.running) or (room and (waiting or bool(self.swapped)))
        decode_step = (bool(decoding) and not (prefill_pending and self._last_was_decode)
                       and not self.config.mixed_batches)
        self._last_was_decode = decode_step
        # prefill tokens this step may take: capped when it carries decodes (mixed batches); a swapped request
        # that comes back decoding brings the cap a step without decodes would have with one
        cap = self._prefill_cap(max(1, len(decoding)))
        step = _StepBudget(self.budget, cap if cap and decoding else self.budget, cap, bool(decoding))
        self._fill_running(out, step, decode_step)
        if decode_step:
            return
        self._fill_swapped(out, step)
        self._fill_waiting(out, step)

    def _admit(self, out: SchedulerOutput, step: _StepBudget, req: Request, n: int, copies: list[tuple[int, int]],
               prefill: bool, drafted: int = 0) -> None:
        """Put ``n`` tokens of ``req`` (their slots allocated, ``copies`` the copy-on-write to run first) in this
        step, and take them from its budget (and from its prefill share when they are a prefill chunk)."""
        out.block_copies += copies
        out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, drafted))
        step.tokens -= n
        step.prefill -= n if prefill else 0

    def _fill_running(self, out: SchedulerOutput, step: _StepBudget, decode_step: bool) -> None:
        """RUNNING requests, oldest first; the newest are preempted while blocks run out."""
        i = 0
        while i < len(self.running) and step.tokens > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if not self.config.mixed_batches and (left == 1) != decode_step:
                i += 1  # not this step's kind: it runs in the next step
                continue
            if left > 1 and step.prefill <= 0:
                i += 1  # a prefill chunk, and this step's prefill share is spent
                continue
            n = min(left, step.tokens, step.prefill) if left > 1 else 1
            # drafts only for a sequence past its prompt with no followers to fork: a 1-token last prefill chunk
            # must sample (and fork n > 1 followers) from its own row
            drafted = len(req.draft) if (left == 1 and req.output_token_ids and not req.followers
                                         and len(req.draft) < step.tokens) else 0
            if left == 1 and not drafted:
                req.draft = []  # no room in this step's budget for its drafts
            n += drafted
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:  # the request itself was preempted
                req.draft = []
                continue
            self._admit(out, step, req, n, copies, prefill=left > 1, drafted=drafted)
            i += 1

    def _fill_swapped(self, out: SchedulerOutput, step: _StepBudget) -> None:
        """SWAPPED requests back in, oldest first, when no one was preempted this step."""
        while not out.preempted and self.swapped and step.tokens > 0:
            req = self.swapped[0]
            if self._occupied() + self._seats(req) > self.max_num_seqs:
                break  # a leader swapped out before its prefill completed still brings its followers' seats
            left = req.num_tokens - req.num_computed_tokens
            if left > 1 and step.prefill <= 0:
                break
            if left == 1 and step.cap and not step.decodes:  # the step's first decode: the cap holds from here on
                spent = self.budget - step.prefill  # no decode yet: prefill started at the whole budget
                if spent > step.cap:
                    break  # the step already carries more prefill than a step with decodes may
                step.prefill, step.decodes = min(step.prefill, step.cap - spent), True
            pairs = self.kv.swap_in(req.request_id)
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in += pairs
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(left, step.tokens, step.prefill) if left > 1 else 1
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:  # back in, but no room for its next token this step
                continue
            self._admit(out, step, req, n, copies, prefill=left > 1)

    def _fill_waiting(self, out: SchedulerOutput, step: _StepBudget) -> None:
        """WAITING requests, first come first served, from their prefix-cache hit on, then what a connector can
        supply past it (one admission path for every source of KV: runtime/kv_connector.py). A request whose LoRA
        adapter cannot get a slot is passed over: it keeps its place and the requests behind it may go first."""
        # no admission after a preemption in this step: a request preempted for recompute would come straight back
        bs = self.kv.block_size
        i = 0  # the first request not passed over for its adapter
        while (not out.preempted and i < len(self.waiting) and self._occupied() < self.max_num_seqs
               and step.tokens > 0 and step.prefill > 0):
            req = self.waiting[i]
            rid = req.request_id
            if self._occupied() + self._seats(req) > self.max_num_seqs:
                break  # an n > 1 request waits until all its sequences can run
            if self._held_back(req):
                i += 1  # the fairness rule: a request passed over longer goes first; the ones behind may go
                continue
            if not self._pin(req, out):
                self._passed(req)
                i += 1  # every adapter slot is pinned by other adapters: it waits, the ones behind it may go
                continue
            hit, source = None, None
            if req.num_computed_tokens == 0:  # prompt logprobs are computed, never read from the cache
                use_cache = req.params.prompt_logprobs is None
                req.num_computed_tokens = self.kv.get_computed_blocks(rid, req.all_token_ids, use_cache=use_cache,
                                                                      root=self._lora_root(req))
                hit, source = self._external_hit(req, use_cache)
            cached = req.num_computed_tokens
            external = hit.num_tokens if hit is not None else 0
            if hit is not None and hit.load_async:  # it waits for its load, holding its seat and blocks
                if self.kv.allocate_slots(rid, cached, external) is None:
                    self.kv.free(rid)  # give back the prefix-cache references; retried next step
                    self._unpin(req)
                    req.num_computed_tokens = 0
                    break
                self._allocated(req, source, self.kv.block_table(rid)[cached // bs:], external)
                del self.waiting[i]
                self._passed_over.pop(rid, None)
                req.status = Status.WAITING_FOR_REMOTE_KV
                self.loading[rid] = req
                continue
            n = min(req.num_tokens - cached - external, step.tokens, step.prefill)
            copies = self.kv.allocate_slots(rid, cached, external + n)
            if copies is None:
                self.kv.free(rid)  # give back the prefix-cache references; retry later
                self._unpin(req)
                req.num_computed_tokens = 0
                break
            # a synchronous hit: its blocks are copied in by this plan, before the step reads them
            loaded = self.kv.block_table(rid)[cached // bs:(cached + external) // bs]
            out.swap_in += self._allocated(req, source, loaded, external)
            if external:
                req.num_computed_tokens += external
                self.kv.commit(rid, req.all_token_ids, req.num_computed_tokens)
            req.num_cached_tokens = max(req.num_cached_tokens,
                                        min(req.num_computed_tokens, len(req.prompt_token_ids)))
            del self.waiting[i]
            self._passed_over.pop(rid, None)
            req.status = Status.RUNNING
            self.running.append(req)
            self._admit(out, step, req, n, copies, prefill=True)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        if self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(victim.request_id)
            if pairs is not None:
                out.swap_out += pairs
                victim.status = Status.SWAPPED
                self.swapped.append(victim)
                return
        self.kv.free(victim.request_id)  # recompute: its tokens are prefilled again when it is readmitted
        self._unpin(victim)  # its adapter is acquired again with its readmission
        victim.num_computed_tokens = 0
        victim.draft = []
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
