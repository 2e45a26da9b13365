"""The engine's side of HiCache: the tier an engine configuration asks for, built as the scheduler's KV connector
(connectors.py).

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
from pathlib import Path

from omforge.contract.manifest import Manifest
from omforge.errors import OmforgeError
from omforge.runtime.executor import ExecutorCapabilities
from omforge.runtime.hicache.connectors import HostTierConnector, StorageConnector
from omforge.runtime.hicache.controller import HiCache
from omforge.runtime.hicache.host_tier import HostTier
from omforge.runtime.hicache.identity import BundleIdentity
from omforge.runtime.hicache.storage import FileTier
from omforge.runtime.kv_cache_manager import KVCacheManager

log = logging.getLogger("omforge.hicache")
DEVICE_POOL_TARGETS = ("ascend",)  # executors whose KV pool is device memory


class HiCacheConfigError(OmforgeError):
    """A hierarchical-cache option that cannot hold here (the message names it)."""


def host_tier_slots(cfg: object, manifest: Manifest) -> int:
    """Host-tier slots the executor must allocate after its swap tier (0 unless the pool is device memory)."""
    if not (cfg.enable_hierarchical_cache and cfg.hicache_size_gb and manifest.target in DEVICE_POOL_TARGETS):
        return 0
    return int(cfg.hicache_size_gb * (1 << 30)) // (manifest.kv.bytes_per_token * manifest.kv.block_size)


def build_tiers(cfg: object, manifest: Manifest, caps: ExecutorCapabilities,
                kv: KVCacheManager) -> StorageConnector | HostTierConnector | None:
    """The engine's tier below the pool for ``cfg`` (an EngineConfig) as a KV connector, or None when the
    hierarchical cache is off. ``kv`` must record the pool's events (``record_events``)."""
    if not cfg.enable_hierarchical_cache:
        return None
    if not kv.pool.record_events:
        raise ValueError("the tiers below the pool need a KV cache manager that records the pool's events")
    if manifest.target in DEVICE_POOL_TARGETS or caps.host_kv is None:
        return HostTierConnector(_host_tier(cfg, manifest, kv), kv.block_size)
    if cfg.hicache_size_gb:
        log.warning("hicache: the host tier (hicache_size %.3g GB) is off: this bundle's pool (%s) is host "
                    "memory already; raise kv_cache_space_gb for the same memory without copies",
                    cfg.hicache_size_gb, manifest.target)
    return StorageConnector(_storage(cfg, manifest, caps.host_kv.block_views, kv), kv)


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
