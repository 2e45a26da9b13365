"""The engine's configuration, resolved once: the bundle's ``serve`` section overridden by the caller's options.

Every consumer (engine, scheduler, KV cache manager, server loop) reads this one object; nothing downstream
re-reads the manifest's ``serve`` section. The options are contract/serve_options.py's (the recipe's ``serve`` keys
and ``omforge serve``'s flags are the same declaration), plus what the caller is (:data:`CALLER_OPTIONS`). An
override of None means "the bundle's value", and a key the bundle lacks the declared default; an unknown override
name is an error naming it. ``num_kv_blocks`` resolves to a number here (default: enough blocks for
``max_num_seqs`` full contexts, at most :data:`DEFAULT_KV_CACHE_BYTES`), except that an executor which fixes its
pool (an ascend bundle: the block count is compiled into the OM models) replaces it at load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from omforge.contract import cdiv
from omforge.contract.manifest import Manifest, ModelConfig
from omforge.contract.serve_options import SERVE_OPTIONS
from omforge.errors import OmforgeError
from omforge.runtime.scheduler import LORA_FAIRNESS_S, PREEMPTION_MODES, SchedulerConfig

SERVE_DEFAULTS = {o.name: o.default for o in SERVE_OPTIONS}
CALLER_OPTIONS = ("prefault_kv", "serving")
"""Options that say what the caller is rather than tune the engine (``omforge serve`` sets both)."""
DEFAULT_KV_CACHE_BYTES = 2 << 30  # the pool size when neither the recipe nor the caller gives num_kv_blocks
DEFAULT_MAX_QUEUE_TIME_S = SERVE_DEFAULTS["max_queue_time_s"]  # a request waiting this long ends with a 503
# serve.max_prefill_tokens_with_decodes: "auto" (the recipe's default): when serving, a step with decodes carries
# this many tokens in all (runtime/scheduler.py), chosen from serving at concurrency 32; offline the step budget
# applies (no inter-token gap is seen there). The measurements: benchmarks/RESULTS.md, 2026-12-02 "the decode-step
# token budget"
DECODE_STEP_TOKEN_BUDGET = 128
# ... except for float32 weights, whose steps are longer: when serving, "auto" is then a fixed 64 prefill tokens
# beside decodes, and once the engine has fitted its step costs no more than the time rule allows (runtime/
# step_cost.py: a step with decodes lasts at most ~MIXED_STEP_TIME_RATIO times its decodes alone; at 135M the 64
# tokens are within it, at 1B beside a few decodes they are not); quantized and bfloat16 bundles keep the budget,
# which a smaller prefill share would cost throughput. The measurements: benchmarks/RESULTS.md, 2026-12-05 "The
# decode-step budget, again" (the fixed 64 at 135M) and 2026-12-06 "the time rule" (1B: a fixed 64 fp32 tokens made
# 700 ms mixed steps beside 130 ms decode-only ones)
FLOAT32_PREFILL_WITH_DECODES = 64
MIXED_STEP_TIME_RATIO = SERVE_DEFAULTS["mixed_step_time_ratio"]  # serve.mixed_step_time_ratio
DEFAULT_HICACHE_STORAGE_GB = 16.0  # the storage tier's budget when none is given
DEFAULT_MAX_CPU_LORAS = 16
"""``max_cpu_loras`` when none is given: the larger of this, ``max_loras`` and the ``lora_modules`` count (adapters
live in host memory once registered: each is its A and B in float32)."""
HICACHE_STORAGE_BACKENDS = ("file",)
QUEUE_BATCHES = 1
"""The default ``max_waiting_requests`` depth (``QUEUE_BATCHES * max_num_seqs``) where the server has no queue-time
bound, or for one request on an idle server whose steps are not timed yet; otherwise serve/admission.py predicts
each request's start from the measured pace or the queued requests' ``max_tokens`` and the engine's step times. A
waiting request starts when a running one finishes, so a queue of ``k`` batches drains in about ``k`` request
lifetimes. Issue 46 measured one batch of 64 SmolLM2 requests at ~38 s on the 2-core VM: two lifetimes passed
``DEFAULT_MAX_QUEUE_TIME_S`` and 21 of 150 requests heard a 503 after waiting 60 s instead of a 429 at once."""


class EngineConfigError(OmforgeError):
    """An engine option that does not exist or cannot hold (the message names it)."""


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    num_host_blocks: int  # the swap tier, in blocks (0 unless preemption_mode is "swap")
    enable_prefix_caching: bool
    preemption_mode: str
    swap_space_gb: float
    max_prefill_tokens_with_decodes: int | str | None  # a number, "auto" (the token budget) or None (no bound)
    max_waiting_requests: int  # the server's queue beyond max_num_seqs (past it: 429); default QUEUE_BATCHES batches
    max_queue_time_s: float | None  # a request waiting longer ends with a retryable 503 (None: no bound)
    max_queue_delay_us: int  # the server's wait for companions before a first step
    threads: int | None  # ORT intra-op threads (None: ORT's default)
    explicit_kv_blocks: bool = False  # num_kv_blocks came from the caller, not the recipe or the default
    explicit_waiting: bool = False  # max_waiting_requests came from the recipe or the caller: a hard cap
    kv_cache_space_gb: float | None = None  # the budget the pool was sized from (None: num_kv_blocks was given)
    speculative_config: dict | None = None  # runtime/spec_decode.SpeculativeConfig's fields (vLLM's spelling)
    prefault_kv: bool = False  # write the KV pool at start-up (omforge serve: RSS known up front)
    serving: bool = False  # outputs are streamed as they come (omforge serve): "auto" bounds decode-step prefill
    float32_weights: bool = False  # the bundle's weights are float32: "auto" takes FLOAT32_PREFILL_WITH_DECODES
    mixed_step_time_ratio: float = MIXED_STEP_TIME_RATIO  # the time rule's bound on float32 weights (step_cost.py)
    # tiers below the pool (runtime/hicache; SGLang's option names): L2 host memory, L3 storage
    enable_hierarchical_cache: bool = False
    hicache_size_gb: float | None = None  # the host tier (for pools in device memory)
    hicache_storage_backend: str | None = None  # "file"
    hicache_storage_dir: str | None = None
    hicache_storage_size_gb: float = DEFAULT_HICACHE_STORAGE_GB
    kv_transfer_config: str | dict | None = None  # vLLM's --kv-transfer-config (PD over NIXL; runtime/kv_transfer)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser (runtime/reasoning.py PARSERS)
    reasoning_budget: int | None = None  # the thinking budget of a request that sets none (None: no cap)
    lora_modules: dict[str, str] | None = None  # LoRA adapters loaded at start: name → path (docs/lora.md)
    max_loras: int | None = None  # adapters resident at once (a LoRA bundle: 1 … compile.lora.max_loras; else None)
    max_cpu_loras: int | None = None  # adapters registered at once (a LoRA bundle: resolved; else None)
    enable_runtime_lora: bool = False  # the server's load/unload routes answer (docs/lora.md, "Runtime loading")
    lora_dirs: tuple[str, ...] | None = None  # where those may read adapters: real paths of existing directories

    @classmethod
    def resolve(cls, manifest: Manifest, **overrides: Any) -> EngineConfig:
        """The configuration for a bundle's ``manifest`` with the caller's ``overrides`` (None: the bundle's)."""
        known = {*SERVE_DEFAULTS, *CALLER_OPTIONS}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise EngineConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        serve = manifest.serve

        def pick(name: str) -> Any:
            value = overrides.get(name)
            return serve.get(name, SERVE_DEFAULTS[name]) if value is None else value

        context = manifest.limits.max_seq_len
        asked = pick("max_model_len")
        if asked is not None and not 1 <= asked <= context:  # 0 was "unset", above the build was capped: both silent
            raise EngineConfigError(f"max_model_len must be 1 … {context} (the bundle's compile.max_seq_len; a longer "
                                    f"context needs a recompile), got {asked}")
        max_model_len = asked or context
        max_num_seqs, max_batched = pick("max_num_seqs"), pick("max_num_batched_tokens")
        kv = manifest.kv  # None: a pooling bundle, no KV pool (its block options resolve to 0)
        block_size = kv.block_size if kv is not None else 1
        bytes_per_block = kv.bytes_per_token * block_size if kv is not None else 1
        # the pool: num_kv_blocks as given, else as many blocks as the KV budget holds (vLLM's KV cache space),
        # but no more than max_num_seqs full-context sequences need
        space = pick("kv_cache_space_gb")
        budget = int(space * (1 << 30)) if space is not None else DEFAULT_KV_CACHE_BYTES
        blocks = pick("num_kv_blocks") or max(2, min(budget // bytes_per_block,
                                                     max_num_seqs * cdiv(max_model_len, block_size)))
        blocks = blocks if kv is not None else 0
        mode = pick("preemption_mode")
        if mode not in PREEMPTION_MODES:
            raise EngineConfigError(f"preemption_mode {mode!r} is not one of {PREEMPTION_MODES}")
        swap_gb = float(pick("swap_space_gb"))
        cap = pick("max_prefill_tokens_with_decodes")
        cap = None if cap == "none" else cap  # a caller's "no bound" (None there means "the bundle's")
        if not (cap is None or cap == "auto" or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1)):
            raise EngineConfigError(f"max_prefill_tokens_with_decodes must be a positive number, 'auto' or none, "
                                    f"got {cap!r}")
        ratio = pick("mixed_step_time_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 1:
            raise EngineConfigError(f"mixed_step_time_ratio must be a number above 1 (the decodes alone are 1), "
                                    f"got {ratio!r}")
        tiers = _hicache(pick)
        for name, value in (("max_num_seqs", max_num_seqs), ("num_kv_blocks", blocks),
                            ("max_num_batched_tokens", max_batched)):
            if value < 1 and (kv is not None or name != "num_kv_blocks"):
                raise EngineConfigError(f"{name} must be at least 1, got {value}")
        return cls(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_batched, num_kv_blocks=blocks,
                   num_host_blocks=int(swap_gb * (1 << 30) // bytes_per_block) if mode == "swap" and kv else 0,
                   enable_prefix_caching=bool(pick("enable_prefix_caching")), preemption_mode=mode,
                   swap_space_gb=swap_gb, max_prefill_tokens_with_decodes=cap,
                   max_waiting_requests=pick("max_waiting_requests") or QUEUE_BATCHES * max_num_seqs,
                   max_queue_time_s=_queue_time(pick("max_queue_time_s")),
                   max_queue_delay_us=pick("max_queue_delay_us"),
                   threads=pick("threads"), explicit_kv_blocks=overrides.get("num_kv_blocks") is not None,
                   explicit_waiting=pick("max_waiting_requests") is not None,
                   kv_cache_space_gb=None if pick("num_kv_blocks") else budget / (1 << 30),
                   speculative_config=pick("speculative_config"), prefault_kv=bool(overrides.get("prefault_kv")),
                   serving=bool(overrides.get("serving")), kv_transfer_config=pick("kv_transfer_config"),
                   reasoning_parser=pick("reasoning_parser"), reasoning_budget=pick("reasoning_budget"),
                   float32_weights=manifest.weights.precision == "float32", mixed_step_time_ratio=float(ratio),
                   **_lora(manifest, pick), **tiers)

    def with_num_kv_blocks(self, num_blocks: int) -> EngineConfig:
        """The same configuration on a pool the executor fixed (``ExecutorCapabilities.num_blocks``)."""
        if self.explicit_kv_blocks and num_blocks != self.num_kv_blocks:
            raise EngineConfigError(f"num_kv_blocks is compiled into the OM models ({num_blocks} blocks); recompile "
                                    f"with serve.num_kv_blocks: {self.num_kv_blocks} to change it")
        return replace(self, num_kv_blocks=num_blocks)

    def scheduler_config(self, model: ModelConfig, mixed_batches: bool) -> SchedulerConfig:
        """The scheduler's limits: these options with the model's EOS ids and sliding window."""
        # "auto": when serving the token budget (float32 weights: the time rule); offline (whole outputs
        # returned at once, nobody sees an inter-token gap) the step budget, for throughput
        auto = self.max_prefill_tokens_with_decodes == "auto"
        cap = None if auto else self.max_prefill_tokens_with_decodes
        budget = DECODE_STEP_TOKEN_BUDGET if auto and self.serving else None
        ratio = None
        if budget is not None and self.float32_weights:
            cap, budget, ratio = FLOAT32_PREFILL_WITH_DECODES, None, self.mixed_step_time_ratio
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               preemption_mode=self.preemption_mode, mixed_batches=mixed_batches,
                               max_prefill_tokens_with_decodes=cap, decode_step_token_budget=budget,
                               mixed_step_time_ratio=ratio,
                               max_model_len=self.max_model_len,
                               eos_token_ids=model.eos_token_ids, sliding_window=model.sliding_window,
                               lora_fairness_s=self.lora_fairness_s)

    @property
    def lora_fairness_s(self) -> float:
        """Seconds a request is passed over for its adapter before the fairness rule holds (runtime/scheduler.py
        ``LORA_FAIRNESS_S``), at most a quarter of ``max_queue_time_s``: it starts well before the queue bound."""
        if self.max_queue_time_s is None:
            return LORA_FAIRNESS_S
        return min(LORA_FAIRNESS_S, self.max_queue_time_s / 4)


def _hicache(pick: Any) -> dict[str, Any]:
    """The hierarchical-cache options, checked against each other (one line naming the one at fault)."""
    on = bool(pick("enable_hierarchical_cache"))
    backend, where = pick("hicache_storage_backend"), pick("hicache_storage_dir")
    size = pick("hicache_storage_size_gb")
    size = DEFAULT_HICACHE_STORAGE_GB if size is None else float(size)
    host = pick("hicache_size_gb")
    if backend is not None and backend not in HICACHE_STORAGE_BACKENDS:
        raise EngineConfigError(f"hicache_storage_backend {backend!r} is not one of {HICACHE_STORAGE_BACKENDS}")
    if on and backend == "file" and not where:
        raise EngineConfigError("hicache_storage_backend file needs hicache_storage_dir (the directory of the blocks)")
    if on and not pick("enable_prefix_caching"):
        raise EngineConfigError("enable_hierarchical_cache needs enable_prefix_caching (the tiers hold cached "
                                "prefixes)")
    if size <= 0 or (host is not None and host < 0):
        raise EngineConfigError(f"hicache_storage_size_gb must be positive and hicache_size_gb not negative, got "
                                f"{size} and {host}")
    return {"enable_hierarchical_cache": on, "hicache_size_gb": host, "hicache_storage_backend": backend,
            "hicache_storage_dir": None if where is None else str(where), "hicache_storage_size_gb": size}


def _lora(manifest: Manifest, pick: Any) -> dict[str, Any]:
    """The LoRA options — ``lora_modules`` (name → path), ``max_loras`` (default: the bundle's slots),
    ``max_cpu_loras`` (default: :data:`DEFAULT_MAX_CPU_LORAS` or more), ``enable_runtime_lora`` (needs ``lora_dirs``)
    and ``lora_dirs`` (existing directories, kept as real paths) — checked against each other and the bundle's
    ``lora`` section (one line naming the option at fault)."""
    spec = manifest.lora
    modules, max_loras, cap = pick("lora_modules"), pick("max_loras"), pick("max_cpu_loras")
    runtime, dirs = bool(pick("enable_runtime_lora")), pick("lora_dirs")
    if spec is None:  # enable_runtime_lora alone is a permission with nothing to permit (it may come from the env)
        for name, value in (("lora_modules", modules), ("max_loras", max_loras), ("max_cpu_loras", cap),
                            ("lora_dirs", dirs)):
            if value:
                raise EngineConfigError(f"{name}: this bundle was compiled without compile.lora (no adapter slots); "
                                        "recompile it with compile.lora to serve LoRA adapters")
        return {"lora_modules": None, "max_loras": None, "max_cpu_loras": None, "enable_runtime_lora": False,
                "lora_dirs": None}
    if modules is not None and (not isinstance(modules, dict)
                                or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                           for k, v in modules.items())):
        raise EngineConfigError(f"lora_modules must map adapter names to paths, got {modules!r}")
    if max_loras is None:
        max_loras = spec.max_loras
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or not 1 <= max_loras <= spec.max_loras:
        raise EngineConfigError(f"max_loras must be 1 … {spec.max_loras} (the bundle's compile.lora.max_loras), "
                                f"got {max_loras}")
    count = len(modules or {})
    if cap is None:
        cap = max(DEFAULT_MAX_CPU_LORAS, max_loras, count)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < max(1, max_loras, count):
        raise EngineConfigError(f"max_cpu_loras must be a whole number at least max_loras ({max_loras}) and the "
                                f"lora_modules given ({count}), got {cap!r}")
    if runtime and not dirs:
        raise EngineConfigError("enable_runtime_lora needs lora_dirs (--lora-dirs DIR …: the directories adapters "
                                "may be loaded from at run time)")
    return {"lora_modules": dict(modules) if modules else None, "max_loras": max_loras, "max_cpu_loras": cap,
            "enable_runtime_lora": runtime, "lora_dirs": _lora_dirs(dirs)}


def _lora_dirs(dirs: Any) -> tuple[str, ...] | None:
    """``lora_dirs`` as the real paths of existing directories (None: not given); a word that is not one is an
    error naming it."""
    if not dirs:
        return None
    if isinstance(dirs, str) or not all(isinstance(d, str) and d for d in dirs):
        raise EngineConfigError(f"lora_dirs must be a list of directories, got {dirs!r}")
    real = []
    for d in dirs:
        if not os.path.isdir(d):
            raise EngineConfigError(f"lora_dirs: {d} is not a directory")
        real.append(os.path.realpath(d))
    return tuple(dict.fromkeys(real))


def _queue_time(value: float | None) -> float | None:
    """``max_queue_time_s`` as picked: the caller's, else the bundle's (null there: no bound), else the default."""
    if value is not None and value <= 0:
        raise EngineConfigError(f"max_queue_time_s must be positive, got {value}")
    return None if value is None else float(value)
