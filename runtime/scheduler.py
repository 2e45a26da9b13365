"""The scheduler: which requests run this step and how many tokens each brings (continuous batching).

Policy only; allocation is the KV cache manager's. Every step:
  1. RUNNING requests, oldest first: a decode brings 1 token, a request still prefilling brings its next chunk;
     all within the step budget ``max_num_batched_tokens``. When blocks run out, the newest running request is
     preempted — swapped to the host tier (``preemption_mode: swap``, if the tier has room) or freed to be
     recomputed later — until the older one fits. Preempted requests keep their output and resume unchanged.
  2. SWAPPED requests come back (oldest first) when no one was preempted this step and blocks allow.
  3. WAITING requests are admitted first-come-first-served, when no one was preempted this step, while the
     budget, ``max_num_seqs`` and the blocks allow; a long prompt takes the budget that is left and continues in
     later steps (chunked prefill, interleaved with the running decodes). Prefix-cache hits skip the cached part
     of the prompt. With tiers below the pool (``tiers``: runtime/hicache), the blocks past the pool's hit that a
     tier holds are loaded instead of computed when the tiers' cost rule says so: the request takes its seat and
     its blocks, waits in ``loading`` while other requests keep stepping, and joins RUNNING (its load's checked
     blocks computed, the rest to prefill) in the first step after its load ends. With a host tier (``host``: a
     pool in device memory, runtime/hicache/host_tier.py) the pool's evictions are written back to host slots by
     the plan (``swap_out``, before anything rewrites the blocks) and a hit is copied back by the same plan that
     admits the request (``swap_in``).
With ``mixed_batches`` (executors that support them, ``ExecutorCapabilities.supports_mixed_batches``: the ORT step
graph's decode group, ``contract.DECODE_GROUP_INPUTS``) every step carries the running decodes and fills the rest of
the budget with prefill chunks, vLLM's chunked prefill: the decodes are attended apart from the chunks and cost
their own work only. A step that carries running decodes is bounded (Sarathi-Serve's stall-free batching), so
that arrivals cannot stall the running streams behind a full-budget chunk: by ``decode_step_token_budget`` — the
step's tokens in all, decodes first, the prefill chunks the rest but never fewer than
``MIN_PREFILL_WITH_DECODES`` (the server's default rule, 128 tokens: benchmarks/RESULTS.md "decode-step token
budget"; for float32 weights the default is a fixed cap instead, runtime/engine_config.py) —
or by ``max_prefill_tokens_with_decodes``, a fixed number of prefill tokens; steps without decodes take the whole
budget. Without mixed batches (graphs that
pad every sequence's queries to the step's longest: the runtime-write ORT graph) a step carries either decodes or
prefill work, and the two kinds alternate while both are pending. Measured: benchmarks/RESULTS.md ("mixed steps";
"the decode-step prefill cap").
Invariants: the scheduled tokens of a step never exceed the budget, nor its prefill tokens the decode-step cap
(with the token budget: the larger of ``MIN_PREFILL_WITH_DECODES`` and the budget less the step's decodes);
at most ``max_num_seqs`` requests are RUNNING, counting the ``n > 1`` followers a running leader will fork; a
request is in exactly one of waiting / running / swapped until it finishes.
The step's lifecycle is the scheduler's (vLLM v1's shape): :meth:`Scheduler.schedule` returns the plan — the work
and the ordered block moves the executor carries out (``executor.run_plan``) — and
:meth:`Scheduler.update_from_output` finishes the step with the sampled tokens: tokens computed, full blocks
committed to the prefix cache, blocks out of a sliding window released, ``n > 1`` followers forked from their
leader, token-level stops (stop token ids, EOS, ``max_tokens``, the context) applied and finished requests freed.
The engine keeps sampling, detokenising (stop strings end a request through :meth:`Scheduler.finish`) and outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.request import Request, Status
from omforge.runtime.step import SeqWork
from omforge.runtime.tier_admission import LOADING, WAIT, HostSlots, RemoteKV, TieredAdmission, TierLoader

PREEMPTION_MODES = ("recompute", "swap")
MIN_PREFILL_WITH_DECODES = 32  # prefill tokens a step with decodes may always carry (the token budget's floor)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and the model facts its stop checks need (resolved once: ``runtime.engine_config``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str = "recompute"
    mixed_batches: bool = False
    max_prefill_tokens_with_decodes: int | None = None  # a fixed cap; wins over the token budget
    decode_step_token_budget: int | None = None  # tokens in all of a step with decodes (mixed batches)
    max_model_len: int | None = None  # a request that reaches it finishes with "length"
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # blocks wholly before the window go back to the pool

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {self.preemption_mode!r} is not one of {PREEMPTION_MODES}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.decode_step_token_budget is not None and self.decode_step_token_budget < 1:
            raise ValueError("decode_step_token_budget must be at least 1")

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
    """One step's plan. The executor performs ``swap_out``, ``swap_in``, ``block_copies`` in that order, then
    runs ``work`` (one item per ``scheduled`` entry, same order); ``sample_rows`` pairs every request that
    samples this step with its logits row (``n > 1`` followers share their leader's row)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), before the step
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


class Scheduler(TieredAdmission):
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, tiers: TierLoader | None = None,
                 host: HostSlots | None = None, remote: RemoteKV | None = None):
        self.kv = kv
        self._init_tiers(tiers, host, remote)
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self._last_was_decode = False

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _join(self, follower: Request, leader: Request) -> None:
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

    def _occupied(self) -> int:
        """Seats taken: the running and loading requests and the followers they will fork (reserved at admission)."""
        return sum(1 + len(r.followers) for r in (*self.running, *self.loading.values()))

    def has_unfinished(self) -> bool:
        """Requests in any queue, or a load still in flight (a cancelled one holds blocks until it ends); PD's
        held prefill blocks are the connector's (``LLMEngine.has_unfinished``)."""
        return bool(self.waiting or self.running or self.swapped or self._load_owner)

    def remove(self, request: Request) -> None:
        """Drop a request from whichever queue holds it and release its blocks (finish or abort). A request whose
        load is in flight keeps its blocks, under a tombstone id, until the loader lets go of them."""
        if self._cancel_load(request):
            return
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        self.kv.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); the KV cache manager records its block moves now."""
        out = SchedulerOutput()
        if self.host is not None:
            self.host.release()  # the previous plan ran: its host slots are free to reuse
        self._free_released()
        self._finish_loads()
        self._fill(out)
        self._write_back(out)
        rows = 0
        for s in out.scheduled:
            req = s.request
            if s.num_draft:  # the last known token and the drafts, a logits row for each
                out.work.append(SeqWork([*req.all_token_ids[s.start:], *req.draft], s.start,
                                        self.kv.block_table(req.request_id), all_logits=True))
                out.spec_rows.append((req, rows, s.num_draft))
                rows += s.num_new_tokens
                continue
            # a chunk that holds prompt positions whose next token is a prompt token: logits for all its rows
            every = req.params.prompt_logprobs is not None and s.start < len(req.prompt_token_ids) - 1
            out.work.append(SeqWork(req.all_token_ids[s.start:s.start + s.num_new_tokens], s.start,
                                    self.kv.block_table(req.request_id), needs_logits=s.samples, all_logits=every))
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
        return sampled

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``request`` (``reason``: "stop", "length", "abort"): FINISHED, out of every queue, blocks freed."""
        request.status, request.finish_reason, request.stop_reason = Status.FINISHED, reason, stop_reason
        if self._hold_for_remote(request, reason):  # a PD prefill leg: its blocks wait for the decode side
            for queue in (self.running, self.waiting, self.swapped):
                if request in queue:
                    queue.remove(request)
            return
        self.remove(request)

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
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        room = self._occupied() < self.max_num_seqs  # waiting/swapped work can only start with a free seat
        prefill_pending = len(decoding) < len(self.running) or (room and bool(self.waiting or self.swapped))
        decode_step = (bool(decoding) and not (prefill_pending and self._last_was_decode)
                       and not self.config.mixed_batches)
        self._last_was_decode = decode_step
        # prefill tokens this step may take: capped when it carries decodes (mixed batches); a swapped request
        # that comes back decoding brings the cap a step without decodes would have with one
        cap = self.config.prefill_cap(max(1, len(decoding)))
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
        """WAITING requests, first come first served, from their prefix-cache hit on."""
        # no admission after a preemption in this step: a request preempted for recompute would come straight back
        while (not out.preempted and self.waiting and self._occupied() < self.max_num_seqs and step.tokens > 0
               and step.prefill > 0):
            req = self.waiting[0]
            if self._occupied() + self._seats(req) > self.max_num_seqs:
                break  # an n > 1 request waits until all its sequences can run
            from_host: str | list[tuple[int, int]] = []
            remote = self._from_remote(req) if req.num_computed_tokens == 0 else None  # a PD decode leg
            if remote == LOADING:
                continue
            if remote == WAIT:
                break
            if req.num_computed_tokens == 0:  # prompt logprobs are computed, never read from the cache
                use_cache = req.params.prompt_logprobs is None
                cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids, use_cache=use_cache)
                req.num_computed_tokens = cached
                if use_cache and self.kv.enable_prefix_caching:
                    from_host = self._from_tiers(req)  # the tiers below the pool (tier_admission.py)
                    if from_host == LOADING:
                        continue
                req.num_cached_tokens = max(req.num_cached_tokens,
                                            min(req.num_computed_tokens, len(req.prompt_token_ids)))
            n = min(req.num_tokens - req.num_computed_tokens, step.tokens, step.prefill)
            copies = None if from_host == WAIT else self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:
                self.kv.free(req.request_id)  # give back the prefix-cache references (and host hits); retry later
                req.num_computed_tokens = 0
                break
            if from_host:  # admitted: its host hits are copied in by this plan, before the step reads them
                self.kv.install_loaded(req.request_id, len(from_host))
                out.swap_in += from_host
            self._record_lookup()
            self.waiting.popleft()
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
        victim.num_computed_tokens = 0
        victim.draft = []
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
