"""The engine loop: schedule → copy blocks → execute one step → sample → detokenize → finish, and its statistics.

One ``step()`` runs one execution of the step graph for every scheduled request (prefill chunks and decodes
together). Loading needs no torch: a bundle (manifest + step graph + tokenizer), onnxruntime and numpy. What is not
the loop lives beside it: the drafting policy (:class:`~omforge.runtime.spec_decode.SpeculativeDecoder`), the grammar
masks (:class:`~omforge.runtime.structured.GrammarMasks`) and every logprob (the sampler's ``with_logprobs``).

LoRA (a bundle compiled with ``compile.lora``, docs/lora.md): the engine owns the one adapter registry, ``lora``
(:class:`~omforge.runtime.lora.registry.LoraRegistry`: adapters, users, slots, pins), the scheduler pins slots in it
and its plan's ``lora_loads`` write adapters into the executor's ``lora_pools``; adapters come from ``lora_modules``
at load and ``engine.lora.load`` / ``engine.lora.unregister`` later; a request names its adapter
(``add_request(..., lora=name)``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.manifest import Manifest, load_manifest
from omforge.errors import OmforgeError
from omforge.runtime.engine_config import EngineConfig, EngineConfigError
from omforge.runtime.executor import Executor, run_plan
from omforge.runtime.hicache.attach import build_tiers, host_tier_slots
from omforge.runtime.input_processor import CheckedRequest, InputProcessor, IntakeLimits
from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.kv_connector import KVConnector
from omforge.runtime.kv_transfer.connector import build_connector
from omforge.runtime.lora.registry import LoraInUse, LoraRegistry, UnknownLora
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.output_processor import OutputProcessor
from omforge.runtime.outputs import EngineSnapshot, EngineStats, RequestOutput
from omforge.runtime.reasoning import ReasoningError, ReasoningParser, steer
from omforge.runtime.request import Request, RequestRejected, Status, seq_ids
from omforge.runtime.sampler import LogprobEntry, Sampler
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler, SchedulerOutput
from omforge.runtime.spec_decode import SpeculativeConfig, SpeculativeDecoder
from omforge.runtime.step_trace import StepTrace
from omforge.runtime.structured import GrammarMasks
from omforge.runtime.tokenizer import TextTokenizer

PD_IDLE_POLL_S = 0.002  # an idle engine with PD blocks held or reads in flight polls NIXL this often


__all__ = ["LLMEngine", "LoraInUse", "RequestOutput", "RequestRejected", "UnknownLora"]


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
            # the adapters (None: no LoRA), lora_modules registered; their slots: the executor's lora_pools
            if m.lora is not None and caps.lora_pools is None:
                raise EngineConfigError(f"this bundle has LoRA slots (compile.lora) but its executor "
                                        f"({type(self.executor).__name__}) binds no adapter pools")
            self.lora = LoraRegistry.open(m.lora, self.config, cfg.max_loras, cfg.lora_modules, cfg.max_cpu_loras)
        except OmforgeError:  # release what was built so far
            for connector in (self.pd, self.hicache):
                if connector is not None:
                    connector.close()
            self.executor.close()
            raise
        # the KV connectors under the scheduler, asked in this order: a PD decode leg's read comes first
        self.connectors: list[KVConnector] = [c for c in (self.pd, self.hicache) if c is not None]
        self.scheduler = Scheduler(self.kv, cfg.scheduler_config(self.config, caps.supports_mixed_batches),
                                   connectors=self.connectors, lora=self.lora)
        self.intake = InputProcessor(IntakeLimits(
            self.config, self.max_model_len, self.block_size, self.scheduler.max_num_seqs, m.lora is not None,
            caps.max_prompt_len, caps.supports_prompt_logits, self.tokenizer is not None),
            self.tokenizer, self.kv.pool.num_usable, self.kv.pool.num_blocks, self.pd)
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
        self.output = OutputProcessor(self.tokenizer, self.config.eos_token_ids, self._grammars, self.stats,
                                      self.scheduler.finish, self._forget)

    def prepare_structured_output(self) -> None:
        """Build the grammar engine's tokenizer now (it holds the GIL while it builds; a server calls this before
        it listens). Nothing to do without a tokenizer."""
        if self.tokenizer is not None:
            self._grammars.prepare()

    def _executor(self, bundle: Path, m: Manifest, cfg: EngineConfig, acl_module: object) -> Executor:
        if m.target == "ascend":
            from omforge.runtime.ascend.acl_executor import AclExecutor

            return AclExecutor(bundle, m, acl=acl_module,  # the swap tier, then the host tier's slots
                               num_host_blocks=cfg.num_host_blocks + host_tier_slots(cfg, m))
        return OrtExecutor.for_bundle(bundle, m, num_blocks=cfg.num_kv_blocks, threads=cfg.threads,
                                      num_host_blocks=cfg.num_host_blocks, prefault=cfg.prefault_kv)

    # --- requests -----------------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      lora: str | None = None) -> CheckedRequest:
        """The admission check (:meth:`InputProcessor.check`, pure: any thread may call it)."""
        return self.intake.check(prompt_token_ids, params, lora)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    lora: str | None = None) -> list[Request]:
        """Check and queue a request (``n`` sequences for ``params.n > 1``, ids ``{request_id}-{i}``). Raises
        :class:`RequestRejected` when it can never run (:class:`UnknownLora` for an adapter not loaded),
        :class:`SamplingParamsError` for bad parameters. ``arrival_time`` (``time.monotonic()``) is when the request
        reached the server, for TTFT; default now. ``lora``: the adapter's name (None: the base model)."""
        checked = self.intake.process(prompt, params or SamplingParams(), lora)
        if checked.lora is not None:
            self.lora.use(checked.lora, checked.n)  # type: ignore[union-attr]  # its sequences use it until they end
        try:
            return self.add(checked, request_id, arrival_time)
        except BaseException:
            if checked.lora is not None:
                self.lora.done(checked.lora, checked.n)  # type: ignore[union-attr]
            raise

    def add(self, checked: CheckedRequest, request_id: str | None = None,
            arrival_time: float | None = None) -> list[Request]:
        """Queue a checked request, its adapter's users already counted (``LoraRegistry.use`` or ``join``, one per
        sequence; ended by the engine when each sequence ends). :class:`RequestRejected` for a request id in use."""
        params, ids, text = checked.params, list(checked.prompt_token_ids), checked.prompt
        lora, kv_transfer = checked.lora, checked.kv_transfer
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests or any(self.scheduler.holds(sid) for sid in seq_ids(rid, params.n)):
            raise RequestRejected(f"request id '{rid}' is already in use")
        reqs = []
        for i, sid in enumerate(seq_ids(rid, params.n)):
            req = Request(sid, ids, params, prompt=text, index=i, generator=params.make_generator(i),
                          kv_transfer=kv_transfer, lora=lora)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            self.output.add(req)
            reqs.append(req)
        # n > 1: the prompt is computed once, by the first sequence; the others fork its blocks (copy-on-write)
        # when its prefill completes, and sample their first tokens from the same logits row
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

    def _forget(self, req: Request) -> None:
        """``req`` ended (finished, failed or aborted): out of the request table, its adapter's use ended."""
        if self.requests.pop(req.request_id, None) is not None and req.lora is not None and self.lora is not None:
            self.lora.done(req.lora)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks (a client that went away); False if it was not in flight."""
        req = self.requests.get(request_id)
        if req is not None:
            self._forget(req)
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
            pd=replace(self.pd.stats) if self.pd is not None else None,
            lora=self.lora.state([*sched.running, *sched.swapped, *sched.loading.values()], sched.waiting)
            if self.lora is not None else None)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; returns False (nothing done) while requests are in flight."""
        if self.has_unfinished():
            return False
        self.kv.reset_prefix_cache()  # blocks a transfer may still write stay retired
        return True

    # --- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: the scheduler's plan, run by the executor, sampled, finished by the scheduler, then the output
        processor's (detokenised, stop strings, grammars)."""
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
        failed = [self.output.failed(req) for req in self.scheduler.failed]  # ended without an answer (a KV read)
        self.scheduler.failed.clear()
        if logits is None:
            return self._idle(failed)
        now = time.monotonic()
        for req, row, start, count in plan.prompt_rows:
            self.output.prompt_logprobs(req, logits[row:row + count], start)
        tokens, verified, entries = self._sample(plan, logits, masks)
        before = {r.request_id: len(r.output_token_ids) for r in [*(r for r, _ in plan.sample_rows),
                                                                  *(r for r, _, _ in plan.spec_rows)]}
        sampled = self.scheduler.update_from_output(plan, tokens, verified)
        outputs = failed + self.output.process(sampled, before, entries, now, masks is not None)
        self._account(plan, time.perf_counter() - t0, model_s)
        return outputs

    def _idle(self, failed: list[RequestOutput]) -> list[RequestOutput]:
        """A step that ran no work: the connectors' idle turn (a PD replica with held blocks or reads in flight
        polls again soon, not at once)."""
        for connector in self.connectors:
            connector.after_step(0, 0.0, idle=True)
        if self.pd is not None and not failed and self.pd.busy():
            time.sleep(PD_IDLE_POLL_S)
        return failed

    def _sample(self, plan: SchedulerOutput, logits: np.ndarray,
                masks: Any) -> tuple[list[int], dict[str, list[int]], dict[str, list[LogprobEntry]]]:
        """The step's tokens: a speculating request's verified run (``verified``), one sampled token per sample row
        (grammar masks and thinking budgets applied), and the logprob entries of the requests that ask for them."""
        entries: dict[str, list[LogprobEntry]] = {}
        verified: dict[str, list[int]] = {}
        for req, row, k in plan.spec_rows:
            v = self._spec.verify(req, logits[row:row + k + 1])  # type: ignore[union-attr]
            self.stats.count_verified(v)
            verified[req.request_id] = v.tokens
            if v.logprobs is not None:
                entries[req.request_id] = v.logprobs
        reqs = [r for r, _ in plan.sample_rows]
        if not reqs:
            return [], verified, entries
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
        return result.token_ids.tolist(), verified, entries

    def _account(self, plan: SchedulerOutput, seconds: float, model_s: float) -> None:
        """A finished step's totals, the scheduler's time rule, the step trace and the connectors' turn."""
        decode = plan.num_decode_tokens
        st = self.stats
        st.steps += 1
        st.last_decode_tokens = decode
        st.last_prefill_tokens = plan.num_tokens - decode
        st.decode_tokens += decode
        st.prefill_tokens += plan.num_tokens - decode
        st.step_times.append(seconds)
        self.scheduler.observe_step(st.last_prefill_tokens, decode, seconds)
        if self._trace is not None:
            self._trace.record(time.monotonic() - seconds, seconds, model_s, st.last_prefill_tokens, decode,
                               len(self.scheduler.running), len(self.scheduler.waiting))
        for connector in self.connectors:
            connector.after_step(st.last_prefill_tokens, seconds, idle=False)
