"""The cache controller: moves KV blocks between the pool and the tiers below it, off the engine's step.

The engine thread talks to it; two worker threads do the I/O (a writer and a loader, so a load never waits
behind write-back). Contract with the engine thread, which alone touches the KV cache manager:

- **Write-through** (:meth:`HiCache.offer_writes`): a block newly committed to the prefix cache is offered once;
  if the tier lacks it and the bounded queue has room, the caller pins the block (a reference, so it cannot be
  evicted or rewritten) and the writer copies it out; when the queue is full the block is dropped (counted), never
  the step delayed. :meth:`HiCache.finished_writes` returns the blocks to unpin. Writing at commit rather than at
  eviction (SGLang's ``write_through`` policy): on a pool in host memory an evicted block is rewritten by the very
  step that evicted it, so writing it then would put the copy on that step's path; a pin costs nothing.
- **Load on hit** (:meth:`HiCache.match`, :meth:`HiCache.worth_loading`, :meth:`HiCache.start_load`): admission
  asks how many of a request's next block hashes the tier holds and whether loading them beats recomputing
  (the rule below); the loader reads them into pool blocks the request holds but nobody reads, and
  :meth:`HiCache.finished_loads` reports how many leading blocks passed their checks (the rest are misses).
- **The cost rule**: load iff ``blocks x block_bytes / read_bandwidth < blocks x block_size / prefill_rate``,
  both measured (exponential averages: the loader's bytes per second over its jobs, the engine's prefill tokens
  per second over steps that prefill — a step's decodes count against it, which favours loading); before the
  first measurement of either, load. ``omforge:hicache_loads_total{decision}`` counts hits taken and skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from omforge.runtime.hicache.block_file import BadBlock
from omforge.runtime.hicache.storage import FileTier

log = logging.getLogger("omforge.hicache")

EMA = 0.2  # weight of the newest measurement in the bandwidth and prefill-rate averages
CLOSE_TIMEOUT_S = 30.0  # queued writes get this long to finish when the engine closes
IDLE_WAIT_S = 0.05  # a step with no work but tier I/O in flight waits this long for it
BlockViews = Callable[[int], Sequence[memoryview]]


@dataclass
class TierStats:
    """Counters of one tier since start (blocks and bytes), and its occupancy now."""

    lookups: int = 0
    hits: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    written_blocks: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0
    queue_drops: int = 0
    bad_blocks: dict[str, int] = field(default_factory=dict)  # by reason: truncated, corrupt, foreign, unreadable
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


@dataclass(frozen=True)
class HiCacheStats:
    tiers: dict[str, TierStats]
    loads_taken: int
    loads_skipped: int
    pending_writes: int
    pending_loads: int


@dataclass
class LoadJob:
    key: str  # the request id whose blocks it fills
    hashes: list[bytes]
    blocks: list[int]
    loaded: int = 0  # leading blocks read and checked
    cancelled: bool = False


class HiCache:
    """The tiers below one engine's pool (today: the storage tier) and the threads that fill them."""

    def __init__(self, storage: FileTier, block_views: BlockViews, block_size: int, write_queue_blocks: int = 256):
        self.storage, self.block_views, self.block_size = storage, block_views, block_size
        self.block_bytes = storage.identity.layout.block_bytes
        self._stats = TierStats(capacity_bytes=storage.capacity)
        self._lock = threading.Lock()  # guards _stats and the averages (worker threads update them)
        self._writes: queue.Queue = queue.Queue(maxsize=write_queue_blocks)
        self._loads: queue.Queue = queue.Queue()
        self._written: queue.Queue = queue.Queue()
        self._loaded: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._pending_writes = self._pending_loads = 0  # engine thread only
        self._read_bw: float | None = None  # bytes / s
        self._prefill_rate: float | None = None  # tokens / s
        self.loads_taken = self.loads_skipped = 0
        self._logged: set[str] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True),
                         threading.Thread(target=self._load_loop, name="hicache-loader", daemon=True)]
        for thread in self._threads:
            thread.start()

    # --- engine thread ----------------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Writes or loads in flight (their blocks are pinned or reserved until they come back)."""
        return bool(self._pending_writes or self._pending_loads)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the tier holds now (each still checked when loaded); counts nothing."""
        n = 0
        for block_hash in hashes:
            if not self.storage.contains(block_hash):
                break
            n += 1
        return n

    def record(self, lookups: int, hits: int, decision: str | None) -> None:
        """Count one admitted request's lookup: blocks looked up, found, and the cost rule's decision on them."""
        with self._lock:
            self._stats.lookups += lookups
            self._stats.hits += hits
        self.loads_taken += decision == "taken"
        self.loads_skipped += decision == "skipped"

    def worth_loading(self, num_blocks: int) -> bool:
        """The cost rule (module docstring)."""
        bw, rate = self._read_bw, self._prefill_rate
        return bw is None or rate is None or num_blocks * self.block_bytes / bw < num_blocks * self.block_size / rate

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One step's prefill tokens and its duration (the engine's prefill speed, for the cost rule)."""
        if tokens > 0 and seconds > 0:
            self._prefill_rate = _ema(self._prefill_rate, tokens / seconds)

    def start_load(self, key: str, hashes: Sequence[bytes], blocks: Sequence[int]) -> LoadJob:
        """Read ``hashes`` into pool ``blocks`` (reserved by the caller, read by nobody until reported done)."""
        job = LoadJob(key, list(hashes), list(blocks))
        self._pending_loads += 1
        self._loads.put(job)
        return job

    def finished_loads(self) -> list[LoadJob]:
        """Jobs done since the last call; each job's first ``loaded`` blocks hold their KV, the rest garbage."""
        done = _drain(self._loaded)
        self._pending_loads -= len(done)
        return done

    def offer_writes(self, committed: Sequence[tuple[int, bytes]]) -> list[int]:
        """Queue newly committed ``(block, hash)`` pairs the tier lacks; returns the blocks queued, which the
        caller must pin until :meth:`finished_writes` returns them. A full queue drops the rest (counted)."""
        queued = []
        for block, block_hash in committed:
            if self._closed or self.storage.contains(block_hash):
                continue
            if self._writes.qsize() >= self._writes.maxsize:
                with self._lock:
                    self._stats.queue_drops += 1
                continue
            self._writes.put_nowait((block, block_hash))
            queued.append(block)
        self._pending_writes += len(queued)
        return queued

    def finished_writes(self) -> list[int]:
        """Blocks written (or given up) since the last call: unpin them."""
        done = _drain(self._written)
        self._pending_writes -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        """Sleep until a worker finishes something, or ``timeout`` seconds."""
        self._wake.wait(timeout)
        self._wake.clear()

    def stats(self) -> HiCacheStats:
        with self._lock:
            tier = replace(self._stats, bad_blocks=dict(self._stats.bad_blocks),
                           blocks=self.storage.num_blocks, bytes=self.storage.num_bytes)
        return HiCacheStats({"storage": tier}, self.loads_taken, self.loads_skipped, self._pending_writes,
                            self._pending_loads)

    def close(self) -> None:
        """Stop the workers after the queued writes (at most ``CLOSE_TIMEOUT_S``); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._loads.put(None)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # --- worker threads -----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            block, block_hash = item
            t0 = time.perf_counter()
            try:
                n = self.storage.write(block_hash, self.block_views(block))
            except OSError as exc:
                self._bad("unwritable", f"writing a block to {self.storage.dir}: {exc}")
                n = 0
            with self._lock:
                if n:
                    self._stats.written_blocks += 1
                    self._stats.written_bytes += n
                self._stats.write_seconds += time.perf_counter() - t0
            self._written.put(block)
            self._wake.set()

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            t0, nbytes = time.perf_counter(), 0
            for block_hash, block in zip(job.hashes, job.blocks):
                if job.cancelled:
                    break
                try:
                    nbytes += self.storage.read(block_hash, self.block_views(block))
                except FileNotFoundError:
                    break  # evicted since the match: a miss
                except BadBlock as bad:
                    self._bad(bad.reason, str(bad))
                    break
                except OSError as exc:
                    self._bad("unreadable", f"{self.storage.path(block_hash).name}: {exc}")
                    break
                job.loaded += 1
            seconds = time.perf_counter() - t0
            with self._lock:
                self._stats.loaded_blocks += job.loaded
                self._stats.loaded_bytes += nbytes
                self._stats.load_seconds += seconds
                if nbytes and seconds > 0:
                    self._read_bw = _ema(self._read_bw, nbytes / seconds)
            self._loaded.put(job)
            self._wake.set()

    def _bad(self, reason: str, detail: str) -> None:
        """A block that cannot be used: counted, and logged the first time its reason occurs."""
        with self._lock:
            self._stats.bad_blocks[reason] = self._stats.bad_blocks.get(reason, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("hicache: %s block file treated as a miss (logged once per reason): %s", reason, detail)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
