"""Prometheus metrics at ``/metrics``, named as vLLM names them (``vllm:`` → ``omforge:``), so existing
dashboards and alerts carry over by changing the prefix. :meth:`ServerMetrics.loads` is the same state as
``GET /v1/loads``, which a gateway in front of several replicas polls (SMG; docs/cluster.md).

All updates come from the engine thread after each step (prometheus_client's metrics are thread-safe), from an
:class:`EngineSnapshot` the engine thread takes; gauges describe the state after the latest step. Counters that
mirror the engine's running totals are advanced by the difference since the previous step, so they never go
backwards.
"""

from __future__ import annotations

import datetime
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from omforge.runtime.engine import RequestOutput
from omforge.runtime.hicache.controller import HiCacheStats
from omforge.runtime.kv_transfer.connector import PDStats
from omforge.runtime.lora.registry import LoraState
from omforge.runtime.outputs import EngineSnapshot

PREFIX = "omforge:"
# vLLM's buckets (seconds), so the quantiles read the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)


# the tiers' counters: (metric name, TierStats field, help)
_TIER_COUNTERS = (
    ("hicache_lookup_blocks", "lookups", "Blocks looked up in the tier (past the pool's hit; a lookup stops at "
                                         "the first miss)."),
    ("hicache_hit_blocks", "hits", "Blocks the tier held when looked up."),
    ("hicache_loaded_blocks", "loaded_blocks", "Blocks loaded from the tier into the pool (checked)."),
    ("hicache_loaded_bytes", "loaded_bytes", "Bytes loaded from the tier."),
    ("hicache_load_seconds", "load_seconds", "Seconds the loader spent loading from the tier."),
    ("hicache_written_blocks", "written_blocks", "Blocks written to the tier."),
    ("hicache_written_bytes", "written_bytes", "Bytes written to the tier."),
    ("hicache_write_seconds", "write_seconds", "Seconds the writer spent writing to the tier."),
    ("hicache_write_queue_drops", "queue_drops", "Blocks not written because the write queue was full."),
)
_TIER_GAUGES = (("hicache_tier_blocks", "blocks", "Blocks the tier holds now."),
                ("hicache_tier_bytes", "bytes", "Bytes the tier holds now."),
                ("hicache_tier_capacity_bytes", "capacity_bytes", "The tier's byte budget."))


class HiCacheMetrics:
    """``omforge:hicache_*``: per tier (label ``tier``: ``storage``; ``host`` for a host tier) the counters of
    :class:`~omforge.runtime.hicache.controller.TierStats`, its occupancy, bad block files by reason, and the
    cost rule's decisions (``hicache_loads{decision=taken|skipped}``: hits loaded, hits recomputed instead)."""

    def __init__(self, registry: CollectorRegistry, model: str):
        self.model = model
        labels = ["model_name", "tier"]
        self.counters = {f: Counter(PREFIX + n, h, labels, registry=registry) for n, f, h in _TIER_COUNTERS}
        self.gauges = {f: Gauge(PREFIX + n, h, labels, registry=registry) for n, f, h in _TIER_GAUGES}
        self.bad = Counter(PREFIX + "hicache_bad_blocks", "Block files found truncated, corrupt or foreign (each a "
                           "miss).", labels + ["reason"], registry=registry)
        self.loads = Counter(PREFIX + "hicache_loads", "Tier hits by the cost rule's decision.",
                             ["model_name", "decision"], registry=registry)
        self._last: dict[tuple, float] = {}

    def update(self, st: HiCacheStats) -> None:
        def advance(metric: Counter, labels: tuple, value: float, name: str = "") -> None:
            key = (name, *labels)
            if value > self._last.get(key, 0):
                metric.labels(*labels).inc(value - self._last.get(key, 0))
                self._last[key] = value

        for tier, ts in st.tiers.items():
            for field_name, metric in self.counters.items():
                advance(metric, (self.model, tier), getattr(ts, field_name), field_name)
            for reason, count in ts.bad_blocks.items():
                advance(self.bad, (self.model, tier, reason), count, "bad")
            for field_name, metric in self.gauges.items():
                metric.labels(self.model, tier).set(getattr(ts, field_name))
        advance(self.loads, (self.model, "taken"), st.loads_taken, "loads")
        advance(self.loads, (self.model, "skipped"), st.loads_skipped, "loads")


class PDMetrics:
    """``omforge:kv_transfer_*``: a decode replica's reads (requests, blocks, bytes, seconds, failures) and a
    prefill replica's held blocks and how they were released (``reason``: ``notified`` by the decode side,
    ``expired`` at the lease's end)."""

    COUNTERS = (("kv_transfer_read_requests", "read_requests", "PD decode legs whose KV was read from a prefill "
                 "replica (started)."),
                ("kv_transfer_read_blocks", "read_blocks", "KV blocks read from prefill replicas."),
                ("kv_transfer_read_bytes", "read_bytes", "KV bytes read from prefill replicas."),
                ("kv_transfer_read_seconds", "read_seconds", "Seconds from posting a KV read to its end."),
                ("kv_transfer_read_failures", "read_failures", "KV reads that failed or timed out."),
                ("kv_transfer_held_requests", "held_requests", "PD prefill legs whose blocks were held for a "
                 "decode replica."),
                ("kv_transfer_heartbeats", "heartbeats", "Held requests' leases renewed by a decode side's "
                 "heartbeat."))

    def __init__(self, registry: CollectorRegistry, model: str):
        self.model = model
        self.counters = {f: Counter(PREFIX + n, h, ["model_name"], registry=registry) for n, f, h in self.COUNTERS}
        self.released = Counter(PREFIX + "kv_transfer_released", "Held prefill blocks' requests released, by how.",
                                ["model_name", "reason"], registry=registry)
        self.held = Gauge(PREFIX + "kv_transfer_held_blocks", "KV blocks held now for decode replicas.",
                          ["model_name"], registry=registry)
        self._last: dict[str, float] = {}

    def update(self, st: PDStats) -> None:
        values = {f: getattr(st, f) for f in self.counters}
        for f, metric in self.counters.items():
            if values[f] > self._last.get(f, 0):
                metric.labels(self.model).inc(values[f] - self._last.get(f, 0))
                self._last[f] = values[f]
        for reason, value in (("notified", st.released_notified), ("expired", st.released_expired)):
            if value > self._last.get(reason, 0):
                self.released.labels(self.model, reason).inc(value - self._last.get(reason, 0))
                self._last[reason] = value
        self.held.labels(self.model).set(st.held_blocks)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(PREFIX + name, doc, labels + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.latest: tuple[float, EngineSnapshot] | None = None  # (time.time(), the latest snapshot): /v1/loads
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be admitted.")
        self.swapped = gauge("num_requests_swapped", "Sequences preempted to the host swap tier.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV blocks held by requests (refcount > 0).")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "KV blocks in the pool.")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (blocks), since start.")
        self.prefix_queries = counter("prefix_cache_queries", "Blocks looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Blocks found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (swap or recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        # the engine's own accounting of prefill work: beside prompt_tokens (counted at a first token) it shows
        # prompt work spent on requests that never produced one (aborted mid-prefill, recomputed after preemption)
        self.prefill_tokens = counter("prefill_tokens", "Prompt tokens computed by prefill steps (prefix-cache hits "
                                      "excluded, recomputation counted again), whether or not a token followed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests (sequences) by finish reason.",
                               ("finished_reason",))
        self.failures = counter("request_rejected", "Requests refused before running, by reason.", ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_generation = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.step_seconds = histogram("step_duration_seconds", "One engine step (schedule + execute + sample).",
                                      ITL_BUCKETS)
        # speculative decoding, vLLM's names
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft proposals verified (one per sequence and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.")
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted drafted tokens by position in the draft (0 = first).", ("position",))
        self._last = dict.fromkeys(("prompt", "prefill", "gen", "pre", "q", "h", "steps", "sd", "sdt", "sa"), 0)
        self._last_pos: dict[int, int] = {}
        self.hicache = HiCacheMetrics(r, model_name)
        self.pd = PDMetrics(r, model_name)
        # LoRA (docs/lora.md): requests per adapter, and vLLM's lora_requests_info (the adapters running and
        # waiting as labels, the time of the latest change as its value)
        self.lora_requests = counter("lora_requests", "Requests (prompts) submitted per LoRA adapter (lora_name; "
                                     "the base model's requests are not counted).", ("lora_name",))
        self.lora_info = Gauge(PREFIX + "lora_requests_info", "The LoRA adapters of the running and the waiting "
                               "requests (comma-separated labels) and the adapters resident at once; the value is "
                               "when they last changed (unix seconds).",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._lora_labels: tuple[str, str, str] | None = None
        self.lora_loads = counter("lora_slot_loads", "LoRA adapters written into an adapter slot (on demand).")
        self.lora_evictions = counter("lora_slot_evictions", "LoRA adapter slot loads that replaced a resident, "
                                      "unpinned adapter (least recently used).")

    def after_step(self, st: EngineSnapshot, outputs: list[RequestOutput]) -> None:
        kv = st.kv
        self.latest = (time.time(), st)  # one store: the event loop reads the pair whole
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.swapped.set(st.num_swapped)
        self.kv_usage.set(kv.usage)
        self.kv_used_blocks.set(kv.num_used)
        self.kv_total_blocks.set(kv.num_blocks)
        self.hit_rate.set(kv.hit_rate)
        last = self._last
        for key, value, metric in (("prompt", st.prompt_tokens, self.prompt_tokens),
                                   ("prefill", st.prefill_tokens, self.prefill_tokens),
                                   ("gen", st.generation_tokens, self.generation_tokens),
                                   ("pre", st.preemptions, self.preemptions),
                                   ("q", kv.prefix_queries, self.prefix_queries),
                                   ("h", kv.prefix_hits, self.prefix_hits),
                                   ("sd", st.spec_drafts, self.spec_drafts),
                                   ("sdt", st.spec_draft_tokens, self.spec_draft_tokens),
                                   ("sa", st.spec_accepted_tokens, self.spec_accepted)):
            if value > last[key]:
                metric.inc(value - last[key])
            last[key] = value  # the KV manager is replaced by reset_prefix_cache: restart from its count
        for pos, count in st.spec_accepted_per_position.items():
            if count > self._last_pos.get(pos, 0):
                self.spec_per_pos.labels(self.model, str(pos)).inc(count - self._last_pos.get(pos, 0))
                self._last_pos[pos] = count
        if st.hicache is not None:
            self.hicache.update(st.hicache)
        if st.pd is not None:
            self.pd.update(st.pd)
        if st.steps > last["steps"] and st.last_step_time is not None:
            self.step_seconds.observe(st.last_step_time)
            last["steps"] = st.steps
        for out in outputs:
            if out.finished:
                self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        self.success.labels(self.model, out.finish_reason or "stop").inc()
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        for gap in out.inter_token_latencies:
            self.itl.observe(gap)
        if out.token_times:
            self.e2e.observe(out.token_times[-1] - out.arrival_time)
        self.req_prompt.observe(len(out.prompt_token_ids))
        self.req_generation.observe(len(out.token_ids))

    def loads(self, block_size: int, max_running_requests: int) -> dict:
        """``GET /v1/loads``: the latest snapshot in the shape SMG reads from a worker (one data-parallel rank;
        crates/protocols/src/worker.rs ``WorkerLoadResponse``). Tokens are counted in whole KV blocks, as the
        pool allocates them: ``num_used_tokens`` is the room of the blocks requests hold, so ``token_usage`` ==
        ``num_used_tokens / max_total_num_tokens`` == ``kv_cache_usage_perc``. Waiting includes swapped out."""
        taken, st = self.latest or (time.time(), None)
        rank = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_reqs": 0,
                "num_used_tokens": 0, "max_total_num_tokens": 0, "token_usage": 0.0, "cache_hit_rate": 0.0,
                "max_running_requests": max_running_requests}
        if st is not None:
            waiting = st.num_waiting + st.num_swapped
            rank |= {"num_running_reqs": st.num_running, "num_waiting_reqs": waiting,
                     "num_total_reqs": st.num_running + waiting, "num_used_tokens": st.kv.num_used * block_size,
                     "max_total_num_tokens": st.kv.num_blocks * block_size, "token_usage": st.kv.usage,
                     "cache_hit_rate": st.kv.hit_rate}
        stamp = datetime.datetime.fromtimestamp(taken, datetime.UTC).isoformat(timespec="milliseconds")
        return {"timestamp": stamp, "dp_rank_count": 1, "loads": [rank]}

    def lora_request(self, lora: str | None, num_prompts: int) -> None:
        """A request of ``num_prompts`` prompts was submitted with adapter ``lora`` (None: the base model)."""
        if lora is not None:
            self.lora_requests.labels(self.model, lora).inc(num_prompts)

    def lora_state(self, state: LoraState | None) -> None:
        """The adapters after a step (``EngineSnapshot.lora``; None: no LoRA): one series of
        ``lora_requests_info``, replaced when the adapters running or waiting change; the slot counters."""
        if state is None:
            return
        labels = (str(state.max_loras), ",".join(state.waiting), ",".join(state.running))
        if labels != self._lora_labels:
            self.lora_info.clear()
            self.lora_info.labels(*labels).set(time.time())
            self._lora_labels = labels
        last = self._last
        for key, value, metric in (("lora_loads", state.loads, self.lora_loads),
                                   ("lora_evictions", state.evictions, self.lora_evictions)):
            if value > last.get(key, 0):
                metric.inc(value - last.get(key, 0))
            last[key] = value

    def aborted(self, num_seqs: int) -> None:
        self.success.labels(self.model, "abort").inc(num_seqs)

    def rejected(self, reason: str) -> None:
        self.failures.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
