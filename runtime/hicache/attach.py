"""The engine's side of HiCache: the tiers an engine configuration asks for, and the per-step bookkeeping.

Tiers per executor:
- a pool in **host memory** (the ORT executor's): the storage tier (``hicache_storage_backend: file``), whose
  loader and writer read and write pool blocks in place. A host tier would be the pool's own memory with copies
  added, so ``hicache_size_gb`` is off there (a warning says so: give the pool more, ``kv_cache_space_gb``).
- a pool in **device memory** (ascend; never run on an NPU): the host tier (``hicache_size_gb``), slots of the
  executor's host block memory after its swap tier, written back on eviction and loaded by the step plans'
  copies (host_tier.py). Storage below the host tier is not built yet: an ascend bundle refuses it in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omforge.contract.manifest import Manifest
from omforge.errors import OmforgeError
from omforge.runtime.hicache.controller import HiCache, HiCacheStats, TierStats
from omforge.runtime.hicache.host_tier import HostTier
from omforge.runtime.hicache.identity import BundleIdentity
from omforge.runtime.hicache.storage import FileTier
from omforge.runtime.kv_cache_manager import KVCacheManager

log = logging.getLogger("omforge.hicache")
IDLE_WAIT_S = 0.05  # a step with no work but tier I/O in flight waits this long for it
DEVICE_POOL_TARGETS = ("ascend",)  # executors whose KV pool is device memory


class HiCacheConfigError(OmforgeError):
    """A hierarchical-cache option that cannot hold here (the message names it)."""


@dataclass
class Tiers:
    """The tiers below one engine's pool: ``controller`` (the storage tier and its threads) and/or ``host``."""

    controller: HiCache | None = None
    host: HostTier | None = None

    @property
    def storage(self) -> FileTier | None:
        return self.controller.storage if self.controller is not None else None

    def prepare(self, kv: KVCacheManager) -> None:
        """Make ``kv`` record what the tiers need: commits (write-through) and evictions (write-back)."""
        kv.collect_committed = self.controller is not None
        if self.host is not None:
            kv.pool.evicted = []

    def busy(self) -> bool:
        return self.controller is not None and self.controller.busy()

    def after_step(self, kv: KVCacheManager, prefill_tokens: int, seconds: float, idle: bool) -> None:
        if self.controller is not None:
            after_step(self.controller, kv, prefill_tokens, seconds, idle)

    def stats(self) -> HiCacheStats:
        st = self.controller.stats() if self.controller is not None else HiCacheStats({}, 0, 0, 0, 0)
        if self.host is not None:
            h = self.host.stats
            st.tiers["host"] = TierStats(lookups=h.lookups, hits=h.hits, loaded_blocks=h.hits,
                                         loaded_bytes=h.hits * self.host.block_bytes, written_blocks=h.stored,
                                         written_bytes=h.stored * self.host.block_bytes, queue_drops=h.dropped,
                                         blocks=len(self.host), bytes=len(self.host) * self.host.block_bytes,
                                         capacity_bytes=self.host.num_slots * self.host.block_bytes)
        return st

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()


def host_tier_slots(cfg: object, manifest: Manifest) -> int:
    """Host-tier slots the executor must allocate after its swap tier (0 unless the pool is device memory)."""
    if not (cfg.enable_hierarchical_cache and cfg.hicache_size_gb and manifest.target in DEVICE_POOL_TARGETS):
        return 0
    return int(cfg.hicache_size_gb * (1 << 30)) // (manifest.kv.bytes_per_token * manifest.kv.block_size)


def build_tiers(cfg: object, manifest: Manifest, executor: object, kv: KVCacheManager) -> Tiers | None:
    """The engine's tiers for ``cfg`` (an EngineConfig), or None when the hierarchical cache is off."""
    if not cfg.enable_hierarchical_cache:
        return None
    views: Callable[[int], Sequence[memoryview]] | None = getattr(executor, "host_block_views", None)
    if manifest.target in DEVICE_POOL_TARGETS or views is None:
        tiers = Tiers(host=_host_tier(cfg, manifest, kv))
    else:
        if cfg.hicache_size_gb:
            log.warning("hicache: the host tier (hicache_size %.3g GB) is off: this bundle's pool (%s) is host "
                        "memory already; raise kv_cache_space_gb for the same memory without copies",
                        cfg.hicache_size_gb, manifest.target)
        tiers = Tiers(controller=_storage(cfg, manifest, views, kv))
    tiers.prepare(kv)
    return tiers


def _host_tier(cfg: object, manifest: Manifest, kv: KVCacheManager) -> HostTier:
    if cfg.hicache_storage_backend is not None:
        raise HiCacheConfigError(f"hicache_storage_backend: a storage tier below a {manifest.target} pool (device "
                                 "memory) is not built yet; use the host tier, hicache_size_gb")
    slots = host_tier_slots(cfg, manifest)
    if slots < 1:
        raise HiCacheConfigError(f"enable_hierarchical_cache: the {manifest.target} pool is device memory; give the "
                                 f"host tier a size of at least one block, hicache_size_gb (got {cfg.hicache_size_gb})")
    block_bytes = manifest.kv.bytes_per_token * manifest.kv.block_size
    return HostTier(base=kv.num_host_blocks, num_slots=slots, block_bytes=block_bytes)


def _storage(cfg: object, manifest: Manifest, views: Callable[[int], Sequence[memoryview]],
             kv: KVCacheManager) -> HiCache:
    if cfg.hicache_storage_backend != "file":
        raise HiCacheConfigError("enable_hierarchical_cache: nothing below the pool — on a host-memory pool the "
                                 "tier is storage: give hicache_storage_backend file and hicache_storage_dir DIR")
    budget = int(cfg.hicache_storage_size_gb * (1 << 30))
    try:
        storage = FileTier(Path(cfg.hicache_storage_dir), BundleIdentity.of(manifest), budget)
    except ValueError as exc:
        raise HiCacheConfigError(f"hicache_storage_size_gb: {exc}") from None
    except OSError as exc:
        raise HiCacheConfigError(f"hicache_storage_dir {cfg.hicache_storage_dir}: {exc}") from None
    return HiCache(storage, views, kv.block_size)


def after_step(hicache: HiCache, kv: KVCacheManager, prefill_tokens: int, seconds: float, idle: bool) -> None:
    """After each engine step (``idle``: it ran no work): unpin written blocks, queue the newly committed ones
    (pinned while queued), feed the prefill speed to the cost rule; an idle step waits a little for the workers."""
    if idle and hicache.busy():
        hicache.wait(IDLE_WAIT_S)
    kv.unpin(hicache.finished_writes())
    kv.pin(hicache.offer_writes(kv.take_committed()))
    if not idle:
        hicache.observe_prefill(prefill_tokens, seconds)
