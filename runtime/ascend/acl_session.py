"""What both ACL executors (generate: :mod:`.acl_executor`, pooling: :mod:`.acl_pooling`) hold the same way: the
release stack of everything set-up acquired, the device and context they open, and the one-line notes they print.

Invariant: every acquisition pushes its release right after it succeeds; :meth:`AclSession.close` runs them in
reverse order, goes on past a failing one and raises the first failure at the end, and is idempotent."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Self

from omforge.runtime.ascend.acl_api import AclRuntime


class AclSession:
    """The part of an executor's set-up and teardown that does not depend on its model."""

    rt: AclRuntime
    device: int

    def _start_session(self, rt: AclRuntime, device: int) -> None:
        self.rt, self.device = rt, device
        self.notes: list[str] = []
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def _push(self, what: str, release: Callable[[], None]) -> None:
        self._undo.append((what, release))

    def _say(self, line: str) -> None:
        """A one-line note: kept in :attr:`notes` and printed to stderr."""
        self.notes.append(line)
        print(f"omforge: {line}", file=sys.stderr)

    def _open_device(self) -> None:
        """``acl.init``, the device, a context (reference/ascend.md §3.2), each with its release."""
        rt = self.rt
        rt.init()
        self._push("acl.finalize", rt.finalize)
        rt.set_device(self.device)
        self._push("acl.rt.reset_device", lambda: rt.reset_device(self.device))
        self.context = rt.create_context(self.device)
        self._push("acl.rt.destroy_context", lambda: rt.destroy_context(self.context))

    def _open(self) -> None:
        """The executor's set-up (device, model, buffers), each acquisition with its release."""
        raise NotImplementedError

    def _open_or_close(self) -> None:
        """Run :meth:`_open`; on any failure release what it acquired, then re-raise (nothing leaks)."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _malloc(self, size: int) -> int:
        ptr = self.rt.malloc(size)
        self._push("acl.rt.free", lambda: self.rt.free(ptr))
        return ptr

    def close(self) -> None:
        """Release everything in reverse order of acquisition; a failing release does not stop the others (the
        first failure is raised after all ran). Idempotent."""
        first: BaseException | None = None
        while self._undo:
            _, release = self._undo.pop()
            try:
                release()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
