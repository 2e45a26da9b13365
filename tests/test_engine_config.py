"""The engine configuration resolved once from a manifest's serve section and the caller's overrides."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omforge.contract import PagedLayout
from omforge.contract.buckets import BucketPlan
from omforge.contract.manifest import (
    Graphs,
    KvSection,
    Limits,
    Manifest,
    ModelConfig,
    ModelSection,
    PassCounts,
    StepAbi,
    TokenizerMeta,
    Weights,
)
from omforge.runtime.engine_config import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_QUEUE_TIME_S,
    MIXED_STEP_TIME_RATIO,
    QUEUE_BATCHES,
    EngineConfig,
    EngineConfigError,
)

SERVE = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_prefill_tokens_with_decodes": None,
         "max_model_len": None, "enable_prefix_caching": True, "max_queue_delay_us": 2000,
         "preemption_mode": "recompute", "swap_space_gb": 1.0, "num_kv_blocks": None, "max_waiting_requests": 256}


MODEL = ModelConfig("llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=128, eos_token_ids=(2,))


def manifest(**serve: object) -> Manifest:
    """A bundle's manifest with the ``serve`` section given: a 512-token context, blocks of 16 tokens, 1 KiB of KV
    per token (one layer, one KV head of 128, float32)."""
    return Manifest(omforge_version="test", model=ModelSection("m", MODEL), tokenizer=TokenizerMeta(), target="ort",
                    abi=StepAbi((), ()), kv=KvSection.of(PagedLayout(1, 1, 128, 16), write="in place"),
                    limits=Limits(512, 8, 256), serve={**SERVE, **serve},
                    buckets=BucketPlan("ort", 16, 8, 512, 256, ()), passes=PassCounts({}, 0, {}),
                    graphs=Graphs("ort/step.onnx"), toolchain={}, timings={}, files={})


def test_the_bundle_values_when_nothing_is_overridden() -> None:
    cfg = EngineConfig.resolve(manifest())
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (512, 8, 256)
    assert cfg.num_kv_blocks == 8 * 512 // 16  # max_num_seqs full contexts
    assert cfg.num_host_blocks == 0 and not cfg.explicit_kv_blocks
    assert (cfg.max_waiting_requests, cfg.max_queue_delay_us, cfg.threads) == (256, 2000, None)


def test_overrides_win_and_none_means_the_bundle() -> None:
    cfg = EngineConfig.resolve(manifest(num_kv_blocks=40), max_num_seqs=2, max_model_len=256, num_kv_blocks=None,
                               enable_prefix_caching=False, preemption_mode="swap", swap_space_gb=0.5, threads=1)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.num_kv_blocks) == (2, 256, 40)
    assert not cfg.enable_prefix_caching and cfg.threads == 1 and not cfg.explicit_kv_blocks
    assert cfg.num_host_blocks == (1 << 29) // (16 * 1024)
    huge = EngineConfig.resolve(manifest(max_num_seqs=4096))
    assert huge.num_kv_blocks == DEFAULT_KV_CACHE_BYTES // (16 * 1024)  # at most the default byte budget


def test_unknown_or_impossible_options_are_named() -> None:
    with pytest.raises(EngineConfigError, match="unknown engine option.*max_num_seq\\b"):
        EngineConfig.resolve(manifest(), max_num_seq=4)
    with pytest.raises(EngineConfigError, match="preemption_mode 'evict'"):
        EngineConfig.resolve(manifest(), preemption_mode="evict")
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens must be at least 1"):
        EngineConfig.resolve(manifest(), max_num_batched_tokens=-1)
    for outside in (4096, 0, -5):  # above the build was silently capped, 0 silently "unset", -5 refused everything
        with pytest.raises(EngineConfigError, match=f"max_model_len must be 1 … 512 .*got {outside}"):
            EngineConfig.resolve(manifest(), max_model_len=outside)


def test_a_pool_fixed_by_the_executor() -> None:
    """An ascend bundle compiles its pool into the OM models: the engine takes that size, and an explicit
    different ``num_kv_blocks`` is refused with what to do instead."""
    assert EngineConfig.resolve(manifest(num_kv_blocks=40)).with_num_kv_blocks(64).num_kv_blocks == 64
    with pytest.raises(EngineConfigError, match="compiled into the OM models \\(64 blocks\\).*num_kv_blocks: 40"):
        EngineConfig.resolve(manifest(), num_kv_blocks=40).with_num_kv_blocks(64)


def test_scheduler_config_carries_the_model_facts() -> None:
    cfg = EngineConfig.resolve(manifest(max_prefill_tokens_with_decodes=64))
    sc = cfg.scheduler_config(replace(MODEL, eos_token_ids=(2, 7), sliding_window=24), mixed_batches=True)
    assert (sc.eos_token_ids, sc.sliding_window, sc.max_model_len, sc.mixed_batches) == ((2, 7), 24, 512, True)
    assert sc.max_prefill_tokens_with_decodes == 64


def test_the_decode_step_cap_is_a_number_the_token_budget_or_none() -> None:
    """``auto`` (the recipe's default) is, when serving, the scheduler's token budget for steps with decodes — for
    float32 weights the time rule, a fixed 64 prefill tokens until steps are timed — (offline the step budget: no
    inter-token gap is seen there); a number is a fixed
    prefill cap; null — or a caller's ``none`` over a bundle's value — bounds nothing; anything else is refused."""
    def caps(cfg: EngineConfig, serving: bool = True) -> tuple[int | None, int | None, float | None]:
        cfg = replace(cfg, serving=serving)
        sc = cfg.scheduler_config(MODEL, mixed_batches=True)
        return sc.max_prefill_tokens_with_decodes, sc.decode_step_token_budget, sc.mixed_step_time_ratio

    int4 = replace(manifest(max_prefill_tokens_with_decodes="auto"), weights=Weights("int4", {}))
    assert caps(EngineConfig.resolve(int4)) == (None, 128, None)
    assert caps(EngineConfig.resolve(int4), serving=False) == (None, None, None)
    assert caps(EngineConfig.resolve(int4, max_prefill_tokens_with_decodes=32)) == (32, None, None)
    # float32 weights: the time rule over a fixed cap (their steps are slower), when serving only; a number still wins
    auto = manifest(max_prefill_tokens_with_decodes="auto")
    assert caps(EngineConfig.resolve(auto)) == (64, None, MIXED_STEP_TIME_RATIO)
    assert caps(EngineConfig.resolve(auto), serving=False) == (None, None, None)
    assert caps(EngineConfig.resolve(manifest(max_prefill_tokens_with_decodes=96))) == (96, None, None)
    assert EngineConfig.resolve(manifest(), serving=True).serving  # omforge serve's engine
    assert caps(EngineConfig.resolve(manifest())) == (None, None, None)  # a bundle that recorded null
    assert caps(EngineConfig.resolve(manifest(max_prefill_tokens_with_decodes="auto"),
                                     max_prefill_tokens_with_decodes="none")) == (None, None, None)
    assert caps(EngineConfig.resolve(replace(manifest(), weights=Weights("bfloat16", {})),
                                     max_prefill_tokens_with_decodes="auto")) == (None, 128, None)
    with pytest.raises(EngineConfigError, match="unknown engine option"):
        EngineConfig.resolve(manifest(), float32_weights=False)  # read from the bundle, not an option
    with pytest.raises(EngineConfigError, match="max_prefill_tokens_with_decodes must be a positive number, 'auto'"):
        EngineConfig.resolve(manifest(), max_prefill_tokens_with_decodes="fast")


def test_the_time_rule_ratio_comes_from_the_recipe_or_the_caller() -> None:
    """``mixed_step_time_ratio`` is the time rule's bound where ``auto`` applies it (float32 weights, serving): the
    bundle's value, a caller's over it; anything not above 1 is refused (the decodes alone are 1)."""
    def ratio(cfg: EngineConfig) -> float | None:
        return replace(cfg, serving=True).scheduler_config(MODEL, mixed_batches=True).mixed_step_time_ratio

    auto = manifest(max_prefill_tokens_with_decodes="auto", mixed_step_time_ratio=2.0)
    assert ratio(EngineConfig.resolve(auto)) == 2.0
    assert ratio(EngineConfig.resolve(auto, mixed_step_time_ratio=1.5)) == 1.5
    assert ratio(EngineConfig.resolve(replace(auto, weights=Weights("int4", {})))) is None  # the token budget there
    for bad in (1, 0.5, "fast", True):
        with pytest.raises(EngineConfigError, match="mixed_step_time_ratio must be a number above 1"):
            EngineConfig.resolve(manifest(), mixed_step_time_ratio=bad)


def test_the_pool_is_sized_from_the_kv_cache_space_budget() -> None:
    big = manifest(max_num_seqs=4096)
    cfg = EngineConfig.resolve(big, kv_cache_space_gb=0.25)
    assert cfg.num_kv_blocks == (1 << 28) // (16 * 1024) and cfg.kv_cache_space_gb == 0.25
    assert EngineConfig.resolve(manifest(max_num_seqs=4096, kv_cache_space_gb=0.5)).num_kv_blocks == \
        (1 << 29) // (16 * 1024)  # the recipe's budget
    given = EngineConfig.resolve(big, kv_cache_space_gb=0.25, num_kv_blocks=10)
    assert given.num_kv_blocks == 10 and given.kv_cache_space_gb is None  # a block count wins over a budget


def test_the_queue_is_bounded_in_time_and_its_default_depth_follows_max_num_seqs() -> None:
    """issue 24, defect 10: a default depth in full batches (it was a fixed 256 whatever the batch; one batch until
    the server measures its rate, issue 46), and a queue time bound (default 60 s; a bundle's null: none; an
    override wins)."""
    cfg = EngineConfig.resolve(manifest(max_waiting_requests=None))
    assert cfg.max_waiting_requests == QUEUE_BATCHES * 8 == 8 and not cfg.explicit_waiting
    assert cfg.max_queue_time_s == DEFAULT_MAX_QUEUE_TIME_S == 60.0  # a bundle compiled before the key existed
    assert EngineConfig.resolve(manifest(max_queue_time_s=None)).max_queue_time_s is None
    assert EngineConfig.resolve(manifest(max_queue_time_s=None), max_queue_time_s=2).max_queue_time_s == 2.0
    assert EngineConfig.resolve(manifest(max_waiting_requests=5)).max_waiting_requests == 5
    assert EngineConfig.resolve(manifest(max_waiting_requests=5)).explicit_waiting
    with pytest.raises(EngineConfigError, match="max_queue_time_s"):
        EngineConfig.resolve(manifest(), max_queue_time_s=-1)
