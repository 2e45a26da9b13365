"""A lock between processes over a folder that is built once and shared (a stage of the compile cache, an export).

``locked(folder)`` holds an exclusive ``flock`` on the file ``<folder>.lock`` beside it while the caller checks
whether the folder is done and builds it if not: a second process waits, then finds it done. The kernel releases
the lock when its holder exits or dies, so a killed build leaves no stale lock (its half-built folder is redone:
the folder's own done-marker decides).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``folder`` (created with its parents if missing) until the block exits."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
