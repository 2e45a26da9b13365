"""The storage tier (L3): KV blocks as files in a directory, within a byte budget, least recently used first out.

Files live in ``DIR/<identity>/<block hash>.kv`` (identity: :class:`~omforge.runtime.hicache.identity.BundleIdentity`,
format: :mod:`~omforge.runtime.hicache.block_file`), so one directory can hold several bundles' blocks and each
bundle only ever opens its own. The budget applies to one bundle's subdirectory. Recency is the file's mtime,
bumped on every hit, so replicas sharing the directory (one machine or a shared filesystem) share one LRU order.

Replicas that share a directory share its books too: every change to its set of files — a block published (a
private staging file renamed over its final name), evicted or deleted as bad — happens under an exclusive
``flock`` on ``.lock`` in the subdirectory and updates the byte count in ``.usage`` there, so the bytes on disk
never exceed the budget (issue 45: counted per replica, two replicas overshot by their rescan interval each,
1.96x a 40-block budget). A rescan every ``RESCAN_EVERY`` writes resets the count to the files really there
(files removed by hand). Replicas that share a directory should be given the same budget. A file that turns
out truncated or corrupt is deleted (it would only miss again) — that file only, identified by its inode: a good
file another replica renamed over the name meanwhile stays. Nothing here ever returns bytes that did not pass
:func:`~omforge.runtime.hicache.block_file.read_block`'s checks.

Thread-safe: the engine thread asks :meth:`FileTier.contains`, the loader reads and the writer writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from omforge.runtime.hicache.block_file import BadBlock, read_block, write_block
from omforge.runtime.hicache.identity import BundleIdentity

SUFFIX = ".kv"
RESCAN_EVERY = 64  # writes between recounts of the directory's files (the shared count is exact between)


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
        self._lock = threading.RLock()  # with the directory's flock: one writer of the books at a time
        self._sizes: dict[str, int] = {}
        self._writes = 0
        self.rescan()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    @contextlib.contextmanager
    def _books(self) -> Iterator[list[int]]:
        """The directory's byte count under its lock (every replica's); the caller changes ``[0]`` in place."""
        with self._lock, open(self.dir / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                raw = (self.dir / ".usage").read_bytes() if (self.dir / ".usage").exists() else b""
                books = [int(raw) if raw.strip().isdigit() else self._scan()]
                before = books[0]
                yield books
                if books[0] != before or not raw:
                    tmp = self.dir / f".usage.{os.getpid()}.{threading.get_ident()}"
                    tmp.write_bytes(str(max(books[0], 0)).encode())
                    os.replace(tmp, self.dir / ".usage")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _scan(self) -> int:
        """Count the files now in the directory (every replica's); the caller holds the lock."""
        sizes = {}
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    try:
                        sizes[entry.name] = entry.stat().st_size
                    except FileNotFoundError:
                        pass  # evicted by another replica meanwhile
        self._sizes = sizes
        return sum(sizes.values())

    def rescan(self) -> None:
        """Count the files now in the directory (every replica's) against the budget."""
        with self._books() as books:
            books[0] = self._scan()

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    @property
    def num_bytes(self) -> int:
        """Bytes in the directory now, every replica's files."""
        with self._books() as books:
            return books[0]

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
                self._forget(path, bad.inode)
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
        staged = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.staged")
        try:
            size = write_block(staged, self.identity, block_hash, views)
            with self._books() as books:
                if self._writes % RESCAN_EVERY == 0:
                    books[0] = self._scan()
                self._writes += 1
                if path.exists():  # another replica published it meanwhile
                    return 0
                self._make_room(books, size)
                os.replace(staged, path)
                books[0] += size
                self._sizes[path.name] = size
        finally:
            staged.unlink(missing_ok=True)
        return size

    def _make_room(self, books: list[int], need: int) -> None:
        """Evict least recently used files until ``need`` more bytes fit (the caller holds the books)."""
        if books[0] + need <= self.capacity:
            return
        aged = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    aged.append((st.st_mtime_ns, entry.name, st.st_size))
        books[0] = sum(size for _, _, size in aged)
        for _, name, size in sorted(aged):  # least recently used first
            if books[0] + need <= self.capacity:
                break
            (self.dir / name).unlink(missing_ok=True)
            self._sizes.pop(name, None)
            books[0] -= size

    def _forget(self, path: Path, inode: tuple[int, int] | None) -> None:
        """Delete the bad file at ``path`` if it is still the one read (``inode``), never its replacement."""
        with self._books() as books:
            try:
                st = path.stat()
            except FileNotFoundError:
                return
            if (st.st_dev, st.st_ino) == inode:
                path.unlink()
                books[0] -= st.st_size
                self._sizes.pop(path.name, None)
