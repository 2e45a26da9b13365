"""The scheduler's admission from the tiers below the KV pool (runtime/hicache): host-tier hits copied in by the
admitting plan, storage-tier hits loaded while other requests step, the host tier's write-back of evictions.

A mixin of :class:`~omforge.runtime.scheduler.Scheduler` (its queues, KV cache manager and plan): policy only, the
tiers' I/O is theirs. A request loading from storage holds its seat and its reserved blocks in ``loading`` (status
LOADING) until its load ends; one aborted meanwhile keeps its blocks under a tombstone id until then, so the
loader never writes a block that was given to someone else.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omforge.runtime.request import Request, Status

LOADING = "loading"  # _from_tiers: the request's KV is loading
WAIT = "wait"  # _from_tiers: tier hits need more free blocks than the pool has now

if TYPE_CHECKING:
    from omforge.runtime.kv_cache_manager import KVCacheManager
    from omforge.runtime.scheduler import SchedulerOutput


class LoadedJob(Protocol):
    key: str
    loaded: int  # leading blocks whose KV is in place


class HostSlots(Protocol):
    """What the scheduler asks of a host tier (runtime/hicache/host_tier.py, ``HostTier``)."""

    def match(self, hashes: Sequence[bytes]) -> int: ...
    def record(self, lookups: int, hits: int, decision: str | None) -> None: ...
    def take(self, hashes: Sequence[bytes]) -> list[int]: ...
    def store(self, block_hash: bytes) -> int | None: ...
    def release(self) -> None: ...


class TierLoader(Protocol):
    """What the scheduler asks of the tiers below the pool (runtime/hicache/controller.py, ``HiCache``)."""

    def match(self, hashes: Sequence[bytes]) -> int: ...
    def record(self, lookups: int, hits: int, decision: str | None) -> None: ...
    def worth_loading(self, num_blocks: int) -> bool: ...
    def start_load(self, key: str, hashes: Sequence[bytes], blocks: Sequence[int]) -> object: ...
    def finished_loads(self) -> Sequence[LoadedJob]: ...



class RemoteKV(Protocol):
    """What the scheduler asks of prefill/decode disaggregation (runtime/kv_transfer/connector.py)."""

    config: Any

    def start_read(self, key: str, params: Any, blocks: Sequence[int]) -> object: ...
    def finished_loads(self) -> Sequence[LoadedJob]: ...
    def hold(self, request_id: str, kv_id: str, blocks: Sequence[int], num_tokens: int) -> dict: ...
    def releases(self) -> list[str]: ...


class TieredAdmission:
    """The tier side of the scheduler (module docstring); ``kv``, ``waiting`` and ``running`` are the scheduler's."""

    kv: KVCacheManager
    waiting: object
    running: list[Request]

    def _init_tiers(self, tiers: TierLoader | None, host: HostSlots | None, remote: RemoteKV | None = None) -> None:
        self.tiers, self.host, self.remote = tiers, host, remote
        self.failed: list[Request] = []  # ended without an answer (a failed KV read): the engine reports them
        self._remote_keys: set[str] = set()
        self.loading: dict[str, Request] = {}  # load key -> request whose KV is loading (it holds blocks, a seat)
        self._load_owner: dict[str, str] = {}  # load key -> the id its blocks are kept under (a tombstone if aborted)
        self._load_keys = itertools.count()
        self._lookup: tuple | None = None  # (tier, blocks looked up, hits, decision) of the request being admitted

    def _cancel_load(self, request: Request) -> bool:
        """An aborted request whose load is in flight: its blocks stay held, under a tombstone id, until the
        loader lets go of them (:meth:`_finish_loads` frees them). False if it is not loading."""
        for key, req in list(self.loading.items()):
            if req is request:
                del self.loading[key]
                self._load_owner[key] = f"{request.request_id}\0cancelled-load-{key}"
                self.kv.rename(request.request_id, self._load_owner[key])
                return True
        return False

    def _write_back(self, out: SchedulerOutput) -> None:
        """The host tier's write-back, first in the plan: before anything rewrites the blocks evicted by it."""
        if self.host is not None:
            out.swap_out += [(block, slot) for block, block_hash in self.kv.take_evicted()
                             if (slot := self.host.store(block_hash)) is not None]

    def _from_tiers(self, req: Request) -> str | list[tuple[int, int]]:
        """After ``req``'s pool hit: its next blocks from the tiers below. Returns ``LOADING`` (it left the waiting
        queue for ``loading``), ``WAIT`` (the tiers hold blocks worth taking but the pool lacks the free blocks
        for them: the caller gives back its pool hit and retries next step — computing instead would redo work
        a later step can load), or the host tier's ``(slot, block)`` copies for the plan to make if ``req`` is
        admitted (``[]``: nothing below, or not worth loading: it computes). Lookups are counted by
        :meth:`_record_lookup` once ``req`` is admitted, so a retried request counts once."""
        self._lookup = None
        hashes = self.kv.next_block_hashes(req.request_id, req.all_token_ids) if self.host or self.tiers else []
        if not hashes:
            return []
        tier = self.host if self.host is not None else self.tiers
        n = tier.match(hashes)
        worth = n > 0 and (self.host is not None or self.tiers.worth_loading(n))
        self._lookup = (tier, min(n + 1, len(hashes)), n, None if not n else "taken" if worth else "skipped")
        if not worth:
            return []
        blocks = self.kv.reserve_loaded(req.request_id, hashes[:n])
        if blocks is None:
            self._lookup = None
            return WAIT
        if self.host is not None:
            req.num_computed_tokens += n * self.kv.block_size
            return list(zip(self.host.take(hashes[:n]), blocks))
        key = str(next(self._load_keys))
        self.waiting.popleft()
        self.loading[key], self._load_owner[key] = req, req.request_id
        req.status = Status.LOADING
        self.tiers.start_load(key, hashes[:n], blocks)
        self._record_lookup()
        return LOADING

    def _record_lookup(self) -> None:
        """Count the latest :meth:`_from_tiers` lookup in its tier (blocks looked up, hits, the decision)."""
        if self._lookup is not None:
            tier, looked, hits, decision = self._lookup
            tier.record(looked, hits, decision)
            self._lookup = None

    def _from_remote(self, req: Request) -> str | None:
        """A PD decode leg with blocks to pull: its prefix-cache hits here, fresh blocks for the rest of its prompt
        and the read of just those (``LOADING``; vLLM's decode side reads only past its local hit too); ``WAIT``
        while the pool lacks them; None for any other request (or blocks that cannot hold the prompt: it is
        prefilled here). The hit always leaves the prompt's last block to read (:meth:`get_computed_blocks`)."""
        params = req.kv_transfer
        if self.remote is None or params is None or not params.pulls_blocks:
            return None
        bs = self.kv.block_size
        need = -(-len(req.prompt_token_ids) // bs)
        if len(params.remote_block_ids) < need:
            return None
        hit = self.kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                          use_cache=req.params.prompt_logprobs is None) // bs
        blocks = self.kv.reserve_remote(req.request_id, need - hit)
        if blocks is None:
            self.kv.free(req.request_id)  # give back the hits' references; retried next step
            return WAIT
        key = str(next(self._load_keys))
        self.waiting.popleft()
        self.loading[key], self._load_owner[key] = req, req.request_id
        self._remote_keys.add(key)
        req.status = Status.LOADING
        self.remote.start_read(key, params, blocks, first=hit, arrival=req.arrival_time)
        return LOADING

    def _finish_remote(self) -> None:
        """Decode legs whose read ended: with the prompt's KV they join RUNNING to compute the last prompt token
        (its logits give the first output token, vLLM's rule); a failed read fails the request, or prefills it
        here (``kv_load_failure_policy: recompute``). An aborted one's blocks are freed (kept if NIXL could not
        cancel its read)."""
        for job in self.remote.finished_loads():
            owner = self._load_owner.pop(job.key)
            self._remote_keys.discard(job.key)
            req = self.loading.pop(job.key, None)
            ok = bool(job.loaded)
            if job.keep_blocks:  # NIXL may still write them: quarantined for the process's life
                self.kv.quarantine(owner)
            else:
                self.kv.install_remote(owner, ok)
            if req is None:
                if not job.keep_blocks:
                    self.kv.free(owner)
                continue
            if ok:
                req.num_computed_tokens = len(req.prompt_token_ids) - 1
                req.num_cached_tokens = req.num_computed_tokens
                self.kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
                req.status = Status.RUNNING
                self.running.append(req)
                continue
            self.kv.free(req.request_id)
            if self.remote.config.kv_load_failure_policy == "recompute":
                req.kv_transfer, req.status = None, Status.WAITING
                self.waiting.appendleft(req)
            else:
                req.error, req.status, req.finish_reason = job.error, Status.FINISHED, "abort"
                self.failed.append(req)

    def _hold_for_remote(self, request: Request, reason: str) -> bool:
        """A PD prefill leg that finished normally: its blocks are held (under another id, out of every queue)
        for the decode side, and its ``kv_transfer_out`` names them; False for any other request."""
        params = request.kv_transfer
        if self.remote is None or params is None or not params.is_prefill_leg or reason not in ("stop", "length"):
            return False
        held = f"{request.request_id}\0held-for-decode"
        self.kv.rename(request.request_id, held)
        prompt_blocks = -(-len(request.prompt_token_ids) // self.kv.block_size)
        request.kv_transfer_out = self.remote.hold(request.request_id, held,
                                                   self.kv.block_table(held)[:prompt_blocks],
                                                   len(request.prompt_token_ids))
        return True

    def _free_released(self) -> None:
        """Held prefill blocks the decode side released (or whose lease ran out)."""
        if self.remote is not None:
            for kv_id in self.remote.releases():
                self.kv.free(kv_id)

    def _finish_loads(self) -> None:
        """Loads that ended: their requests join RUNNING with the checked blocks computed; an aborted request's
        blocks are freed now that the loader no longer writes them."""
        if self.remote is not None and self._remote_keys:
            self._finish_remote()
        if self.tiers is None or not self._load_owner:
            return
        for job in self.tiers.finished_loads():
            owner = self._load_owner.pop(job.key)
            req = self.loading.pop(job.key, None)
            if req is None:
                self.kv.install_loaded(owner, 0)
                self.kv.free(owner)
                continue
            computed = self.kv.install_loaded(owner, job.loaded)
            req.num_computed_tokens = computed
            req.num_cached_tokens = max(req.num_cached_tokens, min(computed, len(req.prompt_token_ids)))
            req.status = Status.RUNNING
            self.running.append(req)
