"""The stage cache: each compile stage's output lives in a folder named by the hash of what determines it.

A stage is done when its folder holds ``stage.json`` (written last, after every file): an interrupted stage
is redone, never half-used. Keys hash the stage's inputs (the previous stage's key, the recipe section it
reads, the omforge and tool versions), so changing a fusion switch redoes the passes and what follows but
not the export. Two compiles sharing a cache build a stage once: each builds a stage under :func:`locked` (an
exclusive lock on ``<folder>.lock``, omforge/file_lock.py), and the second finds it done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    return Path(os.environ.get("OMFORGE_CACHE_DIR", Path.home() / ".cache" / "omforge"))


def stage_key(kind: str, inputs: dict[str, Any]) -> str:
    blob = json.dumps({"kind": kind, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Stage:
    kind: str
    key: str
    root: Path

    @property
    def dir(self) -> Path:
        return self.root / "stages" / f"{self.kind}-{self.key}"

    @property
    def done(self) -> bool:
        return (self.dir / "stage.json").is_file()

    def begin(self) -> Path:
        """A fresh, empty folder for the stage (a leftover from an interrupted run is removed)."""
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        return self.dir

    def finish(self, info: dict[str, Any]) -> None:
        (self.dir / "stage.json").write_text(json.dumps({"kind": self.kind, "key": self.key,
                                                         "finished": time.time(), **info}, indent=2))

    def info(self) -> dict[str, Any]:
        return json.loads((self.dir / "stage.json").read_text())


def copy_into(src: Path, dst: Path) -> None:
    """Copy a cached stage file into a bundle. A copy, not a hard link: editing or corrupting a bundle must
    never reach back into the cache that later compiles reuse."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
