"""The engine's side of HiCache: build the tiers an engine configuration asks for, and the per-step bookkeeping.

Tiers per executor: the storage tier (``hicache_storage_backend: file``) below any pool held in host memory (the
ORT executor's; the loader and writer read and write pool blocks in place). The host tier (``hicache_size_gb``,
L2) is for pools in device memory; an ORT pool already is host memory, so there it is off (a warning says so: a
bigger pool, ``kv_cache_space_gb``, is the same memory without the copies). Ascend pools (device memory, behind
AscendCL) have no block I/O here yet, so an ascend bundle refuses the hierarchical cache in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from omforge.contract.manifest import Manifest
from omforge.errors import OmforgeError
from omforge.runtime.hicache.controller import HiCache
from omforge.runtime.hicache.identity import BundleIdentity
from omforge.runtime.hicache.storage import FileTier
from omforge.runtime.kv_cache_manager import KVCacheManager

log = logging.getLogger("omforge.hicache")
IDLE_WAIT_S = 0.05  # a step with no work but tier I/O in flight waits this long for it


class HiCacheConfigError(OmforgeError):
    """A hierarchical-cache option that cannot hold here (the message names it)."""


def build_hicache(cfg: object, manifest: Manifest, executor: object, kv: KVCacheManager) -> HiCache | None:
    """The engine's tiers for ``cfg`` (an EngineConfig), or None when the hierarchical cache is off."""
    if not cfg.enable_hierarchical_cache:
        return None
    views: Callable[[int], Sequence[memoryview]] | None = getattr(executor, "host_block_views", None)
    if views is None:
        raise HiCacheConfigError(f"enable_hierarchical_cache: the {manifest.target} executor's KV pool is device "
                                 "memory without block I/O in omforge yet (never built for ascend); serve without it")
    if cfg.hicache_size_gb:
        log.warning("hicache: the host tier (hicache_size %.3g GB) is off: this bundle's pool (%s) is host memory "
                    "already; raise kv_cache_space_gb for the same memory without copies", cfg.hicache_size_gb,
                    manifest.target)
    if cfg.hicache_storage_backend != "file":
        raise HiCacheConfigError("enable_hierarchical_cache: nothing below the pool — on a host-memory pool the "
                                 "tier is storage: give hicache_storage_backend file and hicache_storage_dir DIR")
    identity = BundleIdentity.of(manifest)
    budget = int(cfg.hicache_storage_size_gb * (1 << 30))
    try:
        storage = FileTier(Path(cfg.hicache_storage_dir), identity, budget)
    except ValueError as exc:
        raise HiCacheConfigError(f"hicache_storage_size_gb: {exc}") from None
    except OSError as exc:
        raise HiCacheConfigError(f"hicache_storage_dir {cfg.hicache_storage_dir}: {exc}") from None
    kv.collect_committed = True
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
