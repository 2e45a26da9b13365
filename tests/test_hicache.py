"""HiCache on the real SmolLM2 bundle: the storage tier below the KV pool, end to end.

Conversations whose second turn re-sends the first (prompt + answer + more) on a pool too small to keep them:
greedy outputs identical with the tier on and off (KV from the tier is bit-exact), fewer prefill tokens with it,
a restarted engine and a second replica hitting the same directory, damaged files as misses (outputs unchanged),
the budget held, and no block left pinned, reserved or referenced after the run.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from omforge.contract.manifest import load_manifest
from omforge.runtime.engine import LLMEngine
from omforge.runtime.engine_config import EngineConfig, EngineConfigError
from omforge.runtime.hicache.block_file import write_block
from omforge.runtime.hicache.identity import BundleIdentity
from omforge.runtime.sampling_params import SamplingParams
from server_process import ServerProcess

POOL = dict(num_kv_blocks=8, max_num_seqs=2)  # 512 tokens: one conversation's turns evict the others'
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
rng = np.random.default_rng(7)
FIRST = [rng.integers(200, 40000, 200).tolist() for _ in range(3)]
MORE = [rng.integers(200, 40000, 90).tolist() for _ in range(3)]


def tiered(bundle: Path, where: Path, **extra: object) -> LLMEngine:
    return LLMEngine(bundle, **POOL, enable_hierarchical_cache=True, hicache_storage_backend="file",
                     hicache_storage_dir=str(where), **extra)


def generate(engine: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    engine.add_request(prompt, GREEDY, request_id=rid)
    out = None
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out = o.token_ids if o.finished else out
        engine.kv.check_invariants()
    assert not engine.has_unfinished() and out is not None
    return out


def converse(engine: LLMEngine, tag: str) -> list[list[int]]:
    """Two turns of three conversations, one request at a time (each turn evicts the others' blocks)."""
    answers = [generate(engine, p, f"{tag}-a{i}") for i, p in enumerate(FIRST)]
    return answers + [generate(engine, [*p, *a, *m], f"{tag}-b{i}")
                      for i, (p, a, m) in enumerate(zip(FIRST, answers, MORE))]


def assert_idle(engine: LLMEngine) -> None:
    """Nothing pinned, reserved, referenced or queued: every block free, every write and load returned."""
    assert not engine.has_unfinished()
    assert engine.kv.stats().num_free == engine.kv.pool.num_blocks
    if engine.hicache is not None:
        st = engine.hicache.stats()
        assert st.pending_writes == st.pending_loads == 0


@pytest.fixture(scope="module")
def reference(smollm2_bundle: Path) -> tuple[list[list[int]], int]:
    """The answers of a pool that never evicts (every second turn's prefix a pool hit: the same chunks and bytes
    a tier must reproduce), and the prefill tokens the small pool computes without tiers."""
    roomy = LLMEngine(smollm2_bundle, num_kv_blocks=64, max_num_seqs=2)
    answers = converse(roomy, "ref")
    assert_idle(roomy)
    small = LLMEngine(smollm2_bundle, **POOL)
    converse(small, "small")
    assert small.stats.prefill_tokens > roomy.stats.prefill_tokens  # the small pool did evict and recompute
    return answers, small.stats.prefill_tokens


def test_the_storage_tier_loads_evicted_prefixes_bit_exact_and_survives_a_restart(
        smollm2_bundle: Path, reference: tuple[list[list[int]], int], tmp_path: Path) -> None:
    answers, off_prefill = reference
    engine = tiered(smollm2_bundle, tmp_path)
    assert converse(engine, "on") == answers
    st = engine.hicache.stats()
    tier = st.tiers["storage"]
    assert tier.loaded_blocks >= 6 and st.loads_taken >= 3 and tier.written_blocks >= tier.blocks > 0
    assert engine.stats.prefill_tokens <= off_prefill - tier.loaded_blocks * 64
    assert_idle(engine)
    engine.close()
    restarted = tiered(smollm2_bundle, tmp_path)  # nothing carried over but the directory
    assert converse(restarted, "warm") == answers
    warm = restarted.hicache.stats().tiers["storage"]
    assert warm.loaded_blocks > tier.loaded_blocks  # the first turns hit too now
    assert restarted.stats.prefill_tokens < engine.stats.prefill_tokens
    assert_idle(restarted)
    restarted.close()


def test_damaged_or_foreign_block_files_are_misses_and_outputs_do_not_change(
        smollm2_bundle: Path, reference: tuple[list[list[int]], int], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    answers, _ = reference
    writer = tiered(smollm2_bundle, tmp_path)
    converse(writer, "w")
    writer.close()
    files = sorted(writer.hicache.storage.dir.glob("*.kv"))
    assert len(files) >= 6
    files[0].write_bytes(files[0].read_bytes()[:-100])  # truncated
    data = bytearray(files[1].read_bytes())
    data[-5] ^= 0x40
    files[1].write_bytes(bytes(data))  # one flipped bit
    other = dataclasses.replace(writer.hicache.storage.identity, digest=b"\x01" * 32, model="another-model")
    block = writer.hicache.storage.identity.layout
    junk = [memoryview(bytearray(block.pool_block_bytes)) for _ in range(block.num_pools)]
    write_block(files[2], other, bytes.fromhex(files[2].stem), junk)  # another bundle's block at our name
    with caplog.at_level(logging.WARNING, logger="omforge.hicache"):
        reader = tiered(smollm2_bundle, tmp_path)
        assert converse(reader, "r") == answers
    bad = reader.hicache.stats().tiers["storage"].bad_blocks
    assert bad.get("truncated", 0) + bad.get("corrupt", 0) + bad.get("foreign", 0) >= 1
    warned = [r.getMessage() for r in caplog.records if "treated as a miss" in r.getMessage()]
    assert len(warned) == len(bad)  # once per reason
    assert_idle(reader)
    reader.close()


def test_the_storage_budget_holds(smollm2_bundle: Path, reference: tuple[list[list[int]], int],
                                  tmp_path: Path) -> None:
    answers, _ = reference
    layout = BundleIdentity.of(load_manifest(smollm2_bundle)).layout
    engine = tiered(smollm2_bundle, tmp_path, hicache_storage_size_gb=4.5 * layout.block_bytes / (1 << 30))
    assert converse(engine, "small") == answers
    tier = engine.hicache.stats().tiers["storage"]
    on_disk = sum(p.stat().st_size for p in engine.hicache.storage.dir.glob("*.kv"))
    assert tier.written_blocks > 4 and on_disk <= tier.capacity_bytes and tier.blocks <= 4
    assert_idle(engine)
    engine.close()


def test_the_identity_names_the_bundles_kv(smollm2_bundle: Path) -> None:
    m = load_manifest(smollm2_bundle)
    ident = BundleIdentity.of(m)
    assert BundleIdentity.of(m) == ident
    requantized = dataclasses.replace(m, files={**m.files, "step.onnx.data": dataclasses.replace(
        next(iter(m.files.values())), sha256="0" * 64)})
    assert BundleIdentity.of(requantized).digest != ident.digest
    int8 = dataclasses.replace(m, kv=dataclasses.replace(m.kv, dtype="int8", bytes_per_token=m.kv.bytes_per_token
                                                         * 68 // 256))
    assert BundleIdentity.of(int8).digest != ident.digest and BundleIdentity.of(int8).layout != ident.layout


def test_options_that_cannot_hold_are_refused_in_one_line(smollm2_bundle: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    m = load_manifest(smollm2_bundle)
    with pytest.raises(EngineConfigError, match="needs hicache_storage_dir"):
        EngineConfig.resolve(m, enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(EngineConfigError, match="needs enable_prefix_caching"):
        EngineConfig.resolve(m, enable_hierarchical_cache=True, enable_prefix_caching=False,
                             hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with pytest.raises(EngineConfigError, match="not one of"):
        EngineConfig.resolve(m, hicache_storage_backend="s3")
    with pytest.raises(Exception, match="nothing below the pool"):
        LLMEngine(smollm2_bundle, num_kv_blocks=8, enable_hierarchical_cache=True, hicache_size_gb=1.0)
    with caplog.at_level(logging.WARNING, logger="omforge.hicache"):
        tiered(smollm2_bundle, tmp_path, hicache_size_gb=1.0).close()
    assert any("host tier" in r.getMessage() and "is off" in r.getMessage() for r in caplog.records)


def test_a_second_replica_sharing_the_directory_hits_the_first_replicas_prefixes(
        smollm2_bundle: Path, tmp_path: Path) -> None:
    """Two servers at once on one storage directory: the second answers the first's prompt from its blocks
    (official openai client, 127.0.0.1) with the same greedy text."""
    args = ("--num-kv-blocks", "8", "--threads", "1", "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path))
    a, b = ServerProcess(smollm2_bundle, *args), ServerProcess(smollm2_bundle, *args)
    try:
        prompt = " ".join(["the river ran past the old mill and the town"] * 40)
        first = a.client().completions.create(model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0)
        a.wait_for_metric('omforge:hicache_written_blocks_total{tier=storage}', lambda v: v >= 5)
        second = b.client().completions.create(model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0)
        assert second.choices[0].text == first.choices[0].text
        got = b.metrics()
        assert got['omforge:hicache_loaded_blocks_total{tier=storage}'] >= 5
        assert got['omforge:hicache_loads_total{decision=taken}'] == 1
        assert second.usage.prompt_tokens_details.cached_tokens >= 5 * 64
    finally:
        a.stop()
        b.stop()
