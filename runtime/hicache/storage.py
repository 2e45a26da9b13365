"""The storage tier (L3): KV blocks as files in a directory, within a byte budget, least recently used first out.

Files live in ``DIR/<identity>/<block hash>.kv`` (identity: :class:`~omforge.runtime.hicache.identity.BundleIdentity`,
format: :mod:`~omforge.runtime.hicache.block_file`), so one directory can hold several bundles' blocks and each
bundle only ever opens its own. The budget applies to one bundle's subdirectory. Recency is the file's mtime,
bumped on every hit, so replicas sharing the directory (one machine or a shared filesystem) share one LRU order;
before evicting, a writer rescans the subdirectory to count the other replicas' files too. Replicas that share a
directory should be given the same budget; writers racing at the limit may overshoot it by the blocks they have in
flight (one each). A file that turns out truncated or corrupt is deleted (it would only miss again); nothing here
ever returns bytes that did not pass :func:`~omforge.runtime.hicache.block_file.read_block`'s checks.

Thread-safe: the engine thread asks :meth:`FileTier.contains`, the loader reads and the writer writes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from omforge.runtime.hicache.block_file import BadBlock, read_block, write_block
from omforge.runtime.hicache.identity import BundleIdentity

SUFFIX = ".kv"
RESCAN_EVERY = 64  # writes between rescans of the directory (other replicas' files count against the budget)


class FileTier:
    """Blocks of one bundle under ``root`` within ``capacity_bytes``."""

    name = "storage"

    def __init__(self, root: Path, identity: BundleIdentity, capacity_bytes: int):
        if capacity_bytes < identity.layout.block_bytes:
            raise ValueError(f"the storage budget ({capacity_bytes} bytes) holds no {identity.layout.block_bytes}-"
                             f"byte block")
        self.identity, self.capacity = identity, capacity_bytes
        self.dir = Path(root) / identity.hex[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._writes = 0
        self.rescan()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def rescan(self) -> None:
        """Count the files now in the directory (every replica's) against the budget."""
        sizes = {}
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    try:
                        sizes[entry.name] = entry.stat().st_size
                    except FileNotFoundError:
                        pass  # evicted by another replica meanwhile
        with self._lock:
            self._sizes = sizes

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file for the block exists now (it may still fail its checks when read)."""
        return self.path(block_hash).exists()

    def read(self, block_hash: bytes, views: Sequence[memoryview]) -> int:
        """Read the block into ``views``; returns the bytes read. FileNotFoundError if absent; :class:`BadBlock`
        (after deleting a truncated or corrupt file) if it fails its checks — ``views`` then hold garbage."""
        path = self.path(block_hash)
        try:
            n = read_block(path, self.identity, block_hash, views)
        except BadBlock as bad:
            if bad.reason in ("truncated", "corrupt"):
                self._forget(path)
            raise
        try:
            os.utime(path)  # recency, seen by every replica
        except FileNotFoundError:
            pass
        return n

    def write(self, block_hash: bytes, views: Sequence[memoryview]) -> int:
        """Store the block unless a file for it exists (then only its recency is bumped); returns the bytes
        written (0 when it was there already)."""
        path = self.path(block_hash)
        if path.exists():
            try:
                os.utime(path)
                return 0
            except FileNotFoundError:
                pass  # evicted between the two calls: write it
        need = self.identity.layout.block_bytes + 4096
        self._make_room(need)
        size = write_block(path, self.identity, block_hash, views)
        with self._lock:
            self._sizes[path.name] = size
            self._writes += 1
        return size

    def _make_room(self, need: int) -> None:
        with self._lock:
            stale = self._writes % RESCAN_EVERY == 0
            full = sum(self._sizes.values()) + need > self.capacity
        if not (stale or full):
            return
        self.rescan()
        with self._lock:
            total = sum(self._sizes.values())
        if total + need <= self.capacity:
            return
        with self._lock:
            sizes = dict(self._sizes)
        aged = []
        for name, size in sizes.items():
            try:
                aged.append(((self.dir / name).stat().st_mtime_ns, name, size))
            except FileNotFoundError:
                total -= size  # another replica evicted it
        for _, name, size in sorted(aged):  # least recently used first
            if total + need <= self.capacity:
                break
            total -= size
            self._forget(self.dir / name)

    def _forget(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self._sizes.pop(path.name, None)
