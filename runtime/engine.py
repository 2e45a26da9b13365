"""The engine loop: schedule → copy blocks → execute one step → sample → detokenize → finish, and its statistics.

One ``step()`` runs one execution of the step graph for every scheduled request (prefill chunks and decodes
together). Loading needs no torch: a bundle (manifest + step graph + tokenizer), onnxruntime and numpy. What is not
the loop lives beside it: the drafting policy (:class:`~omforge.runtime.spec_decode.SpeculativeDecoder`), the grammar
masks (:class:`~omforge.runtime.structured.GrammarMasks`) and every logprob (the sampler's ``with_logprobs``).

LoRA (a bundle compiled with ``compile.lora``, docs/lora.md): the engine holds the registered adapters and their
slots (:class:`~omforge.runtime.lora.slots.LoraSlots` over the executor's ``lora_pools``), the scheduler pins them;
adapters come from ``lora_modules`` at load and :meth:`LLMEngine.load_lora` / :meth:`LLMEngine.unload_lora` later
(between steps, on the thread that steps); a request names its adapter (``add_request(..., lora=name)``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.manifest import Manifest, load_manifest
from omforge.errors import OmforgeError
from omforge.runtime.detokenizer import IncrementalDetokenizer
from omforge.runtime.engine_config import EngineConfig, EngineConfigError
from omforge.runtime.executor import Executor, run_plan
from omforge.runtime.hicache.attach import build_tiers, host_tier_slots
from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.kv_connector import KVConnector
from omforge.runtime.kv_transfer.connector import build_connector, request_params
from omforge.runtime.lora.adapter import LoraAdapter, LoraError, load_adapter
from omforge.runtime.lora.slots import LoraSlots
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.outputs import EngineSnapshot, EngineStats, RequestOutput
from omforge.runtime.reasoning import ANSWER, MARKER, REASONING, ReasoningError, ReasoningParser, ReasoningState, steer
from omforge.runtime.request import Request, Status, seq_ids
from omforge.runtime.sampler import LogprobEntry, Sampler, prompt_logprobs
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError
from omforge.runtime.scheduler import Scheduler
from omforge.runtime.spec_decode import SpeculativeConfig, SpeculativeDecoder
from omforge.runtime.step_trace import StepTrace
from omforge.runtime.structured import GrammarMasks, StructuredOutputError, compiled_grammar
from omforge.runtime.tokenizer import TextTokenizer

PD_IDLE_POLL_S = 0.002  # an idle engine with PD blocks held or reads in flight polls NIXL this often


class RequestRejected(OmforgeError):
    """A request that can never run (too long for the context or the KV pool, or prompt token ids outside the
    vocabulary); the message says which limit. ``param``: the request field at fault when it is not a length."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownLora(RequestRejected):
    """A request names a LoRA adapter the engine does not hold (never loaded, or unloaded)."""

    def __init__(self, message: str):
        super().__init__(message, param="model")


class LoraInUse(OmforgeError):
    """An adapter that cannot be unloaded now: requests (running or waiting) still use it."""


@dataclass(frozen=True)
class LoraState:
    """The engine's adapters after a step (``/metrics``): the adapters of the running requests (RUNNING, SWAPPED,
    loading: they pin a slot) and of the waiting ones, sorted, without repeats (vLLM's ``lora_requests_info``); the
    slots resident at once; adapters written into a slot so far, and how many of those replaced another."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    loads: int
    evictions: int


class LLMEngine:
    """One bundle loaded for generation. ``config`` (default: resolved from the bundle) or keyword ``overrides`` of
    its serve settings (``num_kv_blocks``, ``max_num_seqs``, …: :class:`EngineConfig`); ``acl_module``: a pyACL
    stand-in for ascend bundles (tests)."""

    def __init__(self, bundle: str | Path, config: EngineConfig | None = None, *, acl_module: object = None,
                 **overrides: Any):
        bundle = Path(bundle)
        self.manifest = m = load_manifest(bundle)  # its target is ort or ascend (the manifest checks it)
        if m.pooling is not None:  # no KV pool, nothing to sample: runtime/pooling.py runs it
            raise OmforgeError(f"{bundle}: a pooling bundle (task {m.task}); load it with PoolingEngine, or "
                               "LLM(bundle).embed / .score")
        cfg = config or EngineConfig.resolve(m, **overrides)
        self.tokenizer = TextTokenizer(bundle / m.tokenizer.file, m.tokenizer) if m.tokenizer.file else None
        try:  # the thinking apart from the answer (runtime/reasoning.py); a tokenizer without the markers: one line
            self.reasoning = ReasoningParser(cfg.reasoning_parser, self.tokenizer, cfg.reasoning_budget) \
                if cfg.reasoning_parser else None
        except ReasoningError as exc:
            raise EngineConfigError(str(exc)) from None
        self.config = m.model.config
        self.layout = m.kv.paged_layout
        self.block_size = self.layout.block_size
        self.executor: Executor = self._executor(bundle, m, cfg, acl_module)
        caps = self.executor.capabilities
        if caps.num_blocks is not None:
            try:
                cfg = cfg.with_num_kv_blocks(caps.num_blocks)
            except EngineConfigError:
                self.executor.close()
                raise
        self.engine_config = cfg
        self.max_model_len = cfg.max_model_len
        self.max_prompt_len = caps.max_prompt_len
        self.kv = KVCacheManager(cfg.num_kv_blocks, self.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                                 num_host_blocks=cfg.num_host_blocks, record_events=cfg.enable_hierarchical_cache)
        self.hicache = self.pd = None
        try:
            self.hicache = build_tiers(cfg, m, caps, self.kv)  # the tier below the pool, or None
            self.pd = build_connector(cfg.kv_transfer_config, m, caps)  # PD over NIXL, or None
        except OmforgeError:
            if self.hicache is not None:
                self.hicache.close()
            self.executor.close()
            raise
        # the KV connectors under the scheduler, asked in this order: a PD decode leg's read comes first
        self.connectors: list[KVConnector] = [c for c in (self.pd, self.hicache) if c is not None]
        try:
            self.lora = self._lora_slots(m, cfg)  # the adapter slots (None: no LoRA), lora_modules registered
        except OmforgeError:
            self._close_parts()
            raise
        self.scheduler = Scheduler(self.kv, cfg.scheduler_config(self.config, caps.supports_mixed_batches),
                                   connectors=self.connectors, lora=self.lora)
        self.sampler = Sampler(eos_token_ids=self.config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.closed = False
        self.stats = EngineStats()
        self._trace = StepTrace.from_env()  # OMFORGE_STEP_TRACE: one line per model step
        self._ids = itertools.count()
        self.speculative = SpeculativeConfig.from_dict(cfg.speculative_config)
        if self.speculative is not None and not caps.supports_prompt_logits:
            raise EngineConfigError("speculative decoding needs a logits row per drafted token; this bundle's "
                                    "executor (the ascend OM models) returns one per sequence")
        self._spec = SpeculativeDecoder(self.speculative, self.sampler, self.max_model_len) \
            if self.speculative is not None else None
        self._grammars = GrammarMasks(lambda: self.tokenizer.tokenizer.to_str() if self.tokenizer is not None else "",
                                      self.config.vocab_size, self.config.eos_token_ids)

    def _close_parts(self) -> None:
        """Release what ``__init__`` built so far (a start-up error after the executor was made)."""
        for connector in self.connectors:
            connector.close()
        self.executor.close()

    def _lora_slots(self, m: Manifest, cfg: EngineConfig) -> LoraSlots | None:
        """The adapter slots over the executor's pools, with ``lora_modules`` loaded and checked (a bad one: a
        :class:`LoraError` naming it); None for a bundle without ``lora``."""
        if m.lora is None:
            return None  # lora_modules / max_loras on such a bundle were refused by EngineConfig.resolve
        pools = getattr(self.executor, "lora_pools", None)
        if not pools:
            raise EngineConfigError(f"this bundle has LoRA slots (compile.lora) but its executor "
                                    f"({type(self.executor).__name__}) binds no adapter pools")
        slots = LoraSlots(m.lora, self.config, pools, cfg.max_loras)
        for name, path in (cfg.lora_modules or {}).items():
            slots.register(self._read_lora(name, path))
        return slots

    def _read_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Adapter ``name`` read from ``path`` (:class:`LoraError` naming it; whether it fits the bundle is checked
        when it is registered, :meth:`LoraSlots.register`). Pure apart from reading the file: any thread may call
        it."""
        if self.manifest.lora is None:
            raise LoraError(f"adapter '{name}': this bundle was compiled without compile.lora (no adapter slots)")
        return load_adapter(name, path, self.config)

    def read_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """:meth:`_read_lora` for callers that parse an adapter off the engine's thread (the server) and register
        it with :meth:`add_lora` on it; also refuses an empty name."""
        if not name or not name.strip():
            raise LoraError("the adapter needs a name (lora_name)")
        return self._read_lora(name, path)

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Register a read adapter under its name (between steps), checked against the bundle. One that does not
        fit, a bundle without LoRA, or a name already registered (:class:`LoraNameTaken`) is a :class:`LoraError`."""
        if self.lora is None:
            raise LoraError(f"adapter '{adapter.name}': this bundle was compiled without compile.lora (no adapter "
                            "slots)")
        self.lora.register(adapter)

    def load_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Read, check and register adapter ``name`` from ``path`` (a PEFT directory or a GGUF LoRA file); call
        between steps, on the thread that steps. :class:`LoraError` naming the adapter when it cannot be read,
        does not fit the bundle or its name is taken."""
        adapter = self.read_lora(name, path)
        self.add_lora(adapter)
        return adapter

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (between steps). :class:`UnknownLora` if it is not loaded, :class:`LoraInUse`
        while a request in flight (running or waiting) names it."""
        if self.lora is None or name not in self.lora.names():
            raise UnknownLora(f"the LoRA adapter '{name}' is not loaded")
        users = sum(1 for r in self.requests.values() if r.lora == name and not r.finished)
        if users:
            raise LoraInUse(f"the LoRA adapter '{name}' is in use by {users} sequence(s); unload it once they end")
        self.lora.unregister(name)

    def lora_names(self) -> list[str]:
        """The registered adapters' names, in registration order (empty without LoRA)."""
        return list(self.lora.names()) if self.lora is not None else []

    def _executor(self, bundle: Path, m: Manifest, cfg: EngineConfig, acl_module: object) -> Executor:
        if m.target == "ascend":
            from omforge.runtime.ascend.acl_executor import AclExecutor

            return AclExecutor(bundle, m, acl=acl_module,  # the swap tier, then the host tier's slots
                               num_host_blocks=cfg.num_host_blocks + host_tier_slots(cfg, m))
        return OrtExecutor.for_bundle(bundle, m, num_blocks=cfg.num_kv_blocks, threads=cfg.threads,
                                      num_host_blocks=cfg.num_host_blocks, prefault=cfg.prefault_kv)

    # --- requests -----------------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      lora: str | None = None) -> SamplingParams:
        """The admission check, pure (reads only limits fixed at load, so the server may call it from any thread):
        raises :class:`RequestRejected` naming the limit, or :class:`SamplingParamsError` naming the parameter;
        returns ``params`` with ``max_tokens`` resolved (None → the room left in the context). ``lora``: the
        adapter the request names (whether it is loaded is :meth:`add_request`'s to say: adapters come and go)."""
        params.validate()
        if lora is not None and self.manifest.lora is None:
            raise UnknownLora(f"the LoRA adapter '{lora}' does not exist: this bundle was compiled without "
                              "compile.lora")
        if lora is not None and params.kv_transfer_params is not None:
            raise SamplingParamsError("kv_transfer_params", "LoRA adapters are not supported with "
                                      "kv_transfer_params")
        ids = prompt_token_ids
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if any(t >= vocab for t in params.logit_bias):
            raise SamplingParamsError("logit_bias",
                                      f"logit_bias keys must be token ids below the vocabulary size {vocab}")
        if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
            raise RequestRejected(f"the prompt ({len(ids)} tokens) is longer than this ascend bundle's gears admit "
                                  f"({self.max_prompt_len} tokens: a padded prefill chunk must end inside the context)")
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise RequestRejected(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                  f"context of {self.max_model_len} tokens")
        if params.structured is not None:
            if self.tokenizer is None:
                raise SamplingParamsError(params.structured.param, "structured output needs the model's tokenizer")
            try:
                compiled_grammar(params.structured)
            except StructuredOutputError as exc:
                raise SamplingParamsError(exc.param, str(exc)) from None
        if params.reasoning is not None and any(not 0 <= t < vocab for t in (params.reasoning.start_token_id,
                                                                             params.reasoning.end_token_id)):
            raise SamplingParamsError("reasoning", f"reasoning marker token ids must be in [0, {vocab})")
        if params.prompt_logprobs is not None and not self.executor.capabilities.supports_prompt_logits:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs: this bundle's executor returns one logits "
                                      "row per sequence (the ascend OM models); use an ort bundle")
        if params.n > self.scheduler.max_num_seqs:  # its sequences are admitted together
            raise SamplingParamsError("n", f"n must be at most max_num_seqs ({self.scheduler.max_num_seqs}), "
                                           f"got {params.n}")
        try:  # a PD leg this replica's role, protocol or layout cannot serve
            request_params(self.pd, params.kv_transfer_params, self.block_size)
        except ValueError as exc:
            raise SamplingParamsError("kv_transfer_params", str(exc)) from None
        need = -(-(len(ids) + max_tokens) // self.block_size)
        usable = self.kv.pool.num_usable()  # less the blocks a transfer NIXL could not cancel may still write
        if need > usable:
            raise RequestRejected(f"prompt + max_tokens needs {need} KV blocks but the pool has {usable} "
                                  f"(of {self.kv.pool.num_blocks}) it can use; it could never run")
        return replace(params, max_tokens=max_tokens)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    lora: str | None = None) -> list[Request]:
        """Queue a request (``n`` sequences for ``params.n > 1``, ids ``{request_id}-{i}``). Raises
        :class:`RequestRejected` when it can never run (:class:`UnknownLora` for an adapter not loaded),
        :class:`SamplingParamsError` for bad parameters. ``arrival_time`` (``time.monotonic()``) is when the request
        reached the server, for TTFT; default now. ``lora``: the adapter's name (None: the base model)."""
        params = params or SamplingParams()
        # an adapter of a bundle without LoRA slots: check_request below says the bundle has none
        if lora is not None and self.lora is not None and lora not in self.lora.names():
            loaded = ", ".join(self.lora_names()) or "none"
            raise UnknownLora(f"the LoRA adapter '{lora}' is not loaded (loaded: {loaded})")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this bundle has no tokenizer: give prompt token ids")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        params = self.check_request(ids, params, lora)
        kv_transfer = request_params(self.pd, params.kv_transfer_params, self.block_size)  # checked just now
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests or any(self.scheduler.holds(sid) for sid in seq_ids(rid, params.n)):
            raise RequestRejected(f"request id '{rid}' is already in use")
        reqs = []
        for i, sid in enumerate(seq_ids(rid, params.n)):
            req = Request(sid, ids, params, prompt=text, index=i, generator=params.make_generator(i),
                          kv_transfer=kv_transfer, lora=lora)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            if self.tokenizer is not None:
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
            if params.reasoning is not None:  # stop strings apply to the answer alone
                req.reasoning = ReasoningState(params.reasoning)
                if self.tokenizer is not None:
                    req.reasoning_detokenizer = IncrementalDetokenizer(self.tokenizer, ids, replace(params, stop=[]))
            reqs.append(req)
        # n > 1: the prompt is computed once, by the first sequence; the others fork its blocks (copy-on-write)
        # when its prefill completes, and sample their first tokens from the same logits row
        if params.structured is not None:
            for req in reqs:
                req.matcher = self._grammars.matcher(params.structured)
        leader = reqs[0]
        if params.prompt_logprobs is not None:
            leader.prompt_logprobs.append(None)  # the first token has no context (OpenAI: null)
        for req in reqs[1:]:
            req.parent = leader
            leader.followers.append(req)
            req.prompt_logprobs = leader.prompt_logprobs  # one prompt, one list
        for req in reqs:
            self.requests[req.request_id] = req
        self.scheduler.add(leader)
        return reqs

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks (a client that went away); False if it was not in flight."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        if req.parent is not None and req in req.parent.followers:  # not forked yet: it holds nothing
            req.parent.followers.remove(req)
        self.scheduler.remove(req)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        # a leader aborted before its prefill completed takes its followers along (a copy: each abort removes its
        # follower from req.followers)
        for follower in list(req.followers):
            self.abort(follower.request_id)
        return True

    def expire_waiting(self, max_wait_s: float, now: float | None = None) -> list[str]:
        """Abort every request that has waited longer than ``max_wait_s`` since its arrival without ever running
        (the server's queue time bound); returns the sequence ids aborted (a leader's followers included). A
        request that ran and went back to the queue (preempted for recompute) has been served and stays."""
        now = time.monotonic() if now is None else now
        expired = [r for r in self.scheduler.waiting
                   if r.num_preemptions == 0 and r.first_token_time is None and now - r.arrival_time > max_wait_s]
        ids = []
        for req in expired:
            ids += [req.request_id, *(f.request_id for f in req.followers)]
            self.abort(req.request_id)
        return ids

    def close(self) -> None:
        """Release the executor's resources (the AscendCL device, streams and buffers; nothing by hand for ORT).
        Idempotent; the engine cannot step afterwards."""
        if not self.closed:
            self.closed = True
            for connector in self.connectors:  # workers stop and NIXL lets go before the pools go
                connector.close()
            self.executor.close()
            self._grammars.close()
            if self._trace is not None:
                self._trace.close()

    def has_unfinished(self) -> bool:
        """Requests in flight (or their blocks held), or connector I/O that holds blocks or must be polled."""
        return self.scheduler.has_unfinished() or any(c.busy() for c in self.connectors)

    def snapshot(self, pending_adds: int = 0) -> EngineSnapshot:
        """The engine's gauges and running totals now, typed (``/metrics``, the server's start-up line). Call it on
        the engine thread; ``pending_adds`` requests submitted but not yet added count as waiting."""
        sched, st = self.scheduler, self.stats
        loading = sum(not r.finished for r in sched.loading.values())
        return EngineSnapshot(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + loading + pending_adds,
            num_swapped=len(sched.swapped), kv=self.kv.stats(), steps=st.steps,
            last_step_time=st.step_times[-1] if st.step_times else None, prompt_tokens=st.prompt_tokens,
            prefill_tokens=st.prefill_tokens, generation_tokens=st.generation_tokens, preemptions=st.preemptions,
            spec_drafts=st.spec_drafts, spec_draft_tokens=st.spec_draft_tokens,
            spec_accepted_tokens=st.spec_accepted_tokens,
            spec_accepted_per_position=dict(st.spec_accepted_per_position),
            hicache=self.hicache.stats() if self.hicache is not None else None,
            pd=replace(self.pd.stats) if self.pd is not None else None)

    def lora_state(self) -> LoraState | None:
        """The adapters now (:class:`LoraState`); None without LoRA. Call it on the engine thread."""
        if self.lora is None:
            return None
        sched = self.scheduler
        running = {r.lora for r in (*sched.running, *sched.swapped, *sched.loading.values())
                   if r.lora is not None and not r.finished}
        waiting = {r.lora for r in sched.waiting if r.lora is not None}
        return LoraState(tuple(sorted(running)), tuple(sorted(waiting)), self.lora.max_loras, self.lora.loads,
                         self.lora.evictions)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; returns False (nothing done) while requests are in flight."""
        if self.has_unfinished():
            return False
        self.kv.reset_prefix_cache()  # blocks a transfer may still write stay retired
        return True

    # --- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: the scheduler's plan, run by the executor, sampled, finished by the scheduler, detokenised."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        t0 = time.perf_counter()
        if self._spec is not None:
            self._spec.draft(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        masks = self._grammars.start([r.matcher if r.reasoning is None or r.reasoning.constrained else None
                                      for r, _ in plan.sample_rows])  # beside the model step; none in the thinking
        t_model = time.perf_counter()
        logits = run_plan(self.executor, plan)
        model_s = time.perf_counter() - t_model
        failed = [self._failed(req) for req in self.scheduler.failed]  # ended without an answer (a KV read)
        self.scheduler.failed.clear()
        if logits is None:
            for connector in self.connectors:
                connector.after_step(0, 0.0, idle=True)
            if self.pd is not None and not failed and self.pd.busy():
                time.sleep(PD_IDLE_POLL_S)  # held blocks or reads in flight: poll again soon, not at once
            return failed
        now = time.monotonic()
        for req, row, start, count in plan.prompt_rows:
            self._prompt_logprobs(req, logits[row:row + count], start)
        entries: dict[str, list[LogprobEntry]] = {}  # logprob entries of each request's new tokens, when it asks
        verified: dict[str, list[int]] = {}
        for req, row, k in plan.spec_rows:
            v = self._spec.verify(req, logits[row:row + k + 1])
            self.stats.count_verified(v)
            verified[req.request_id] = v.tokens
            if v.logprobs is not None:
                entries[req.request_id] = v.logprobs
        reqs = [r for r, _ in plan.sample_rows]
        if reqs:
            rows = [row for _, row in plan.sample_rows]
            chosen = logits[rows] if rows != list(range(len(logits))) else logits  # n > 1: followers share a row
            allowed = masks.result() if masks is not None else None
            if any(r.reasoning is not None for r in reqs):  # a spent thinking budget forces the end marker
                allowed = steer([r.reasoning for r in reqs], allowed, chosen.shape[1])
            result = self.sampler.sample(chosen, [r.params for r in reqs], [r.generator for r in reqs],
                                         [r.output_token_ids for r in reqs], [r.prompt_token_ids for r in reqs],
                                         allowed=allowed)
            asking = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            if asking:
                built = result.entries([reqs[i].params.logprobs for i in asking], asking)
                entries.update((reqs[i].request_id, [e]) for i, e in zip(asking, built))
            tokens = result.token_ids.tolist()
        else:
            tokens = []
        before = {r.request_id: len(r.output_token_ids) for r in [*reqs, *(r for r, _, _ in plan.spec_rows)]}
        sampled = self.scheduler.update_from_output(plan, tokens, verified)
        channels = {req.request_id: [req.reasoning.observe(t) for t in req.output_token_ids[before[req.request_id]:]]
                    for req in sampled if req.reasoning is not None}  # each new token: reasoning, answer or marker
        if masks is not None:
            self._advance_grammars(sampled, channels)
        outputs = failed + [self._emit(req, req.output_token_ids[before[req.request_id]:], entries.get(req.request_id),
                                       now, channels.get(req.request_id)) for req in sampled]
        decode = plan.num_decode_tokens
        st = self.stats
        st.steps += 1
        st.last_decode_tokens = decode
        st.last_prefill_tokens = plan.num_tokens - decode
        st.decode_tokens += decode
        st.prefill_tokens += plan.num_tokens - decode
        st.step_times.append(time.perf_counter() - t0)
        self.scheduler.observe_step(st.last_prefill_tokens, decode, st.step_times[-1])
        if self._trace is not None:
            self._trace.record(time.monotonic() - st.step_times[-1], st.step_times[-1], model_s,
                               st.last_prefill_tokens, decode, len(self.scheduler.running), len(self.scheduler.waiting))
        for connector in self.connectors:
            connector.after_step(st.last_prefill_tokens, st.step_times[-1], idle=False)
        return outputs

    # --- after the model step ------------------------------------------------------------------------------

    def _advance_grammars(self, sampled: list[Request], channels: dict[str, list[str]]) -> None:
        """Each structured sequence's matcher takes its new token, if it is one of the answer's (``channels``: a
        reasoning sequence's). A complete grammar allows only EOS, which ends the request as usual; with
        ``ignore_eos`` the consumed EOS ends it here."""
        eos = self.config.eos_token_ids
        for req in sampled:
            if req.matcher is None or req.finished or channels.get(req.request_id, [""])[-1] in (REASONING, MARKER):
                continue
            token = req.output_token_ids[-1]
            if not req.matcher.consume_token(token):
                self.scheduler.finish(req, "stop", "grammar error: " + (req.matcher.get_error() or "token refused"))
            elif req.matcher.is_stopped() and token in eos:
                self.scheduler.finish(req, "stop")

    @staticmethod
    def _prompt_logprobs(req: Request, logits: np.ndarray, start: int) -> None:
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
                    self.scheduler.finish(req, "stop", req.detokenizer.stopped)
                    del req.output_token_ids[len(req.output_token_ids) - (len(new) - i - 1):]  # nothing after it
                    break
        if req.finished and req.detokenizer is not None:
            new_text += req.detokenizer.flush()  # held-back text that can no longer become a stop string
            if req.reasoning_detokenizer is not None:
                new_reasoning += req.reasoning_detokenizer.flush()
        if req.finished:
            self.requests.pop(req.request_id, None)  # a long-running server must not keep finished requests
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

    def _failed(self, req: Request) -> RequestOutput:  # ended by the scheduler without an answer (req.error)
        self.requests.pop(req.request_id, None)
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
