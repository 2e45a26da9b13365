"""The one place LoRA state lives at run time (docs/lora.md, "The runtime"): which adapters are served, which slot
each resident one holds, who pins a slot, and how many sequences use each adapter.

Owned by the engine (:meth:`LoraRegistry.open`); the scheduler pins and releases slots through it, the server reads it
(the adapters served, ``/v1/models``), reads adapters (:meth:`LoraRegistry.read`) and registers or unregisters them.
It never touches the executor's pools: acquiring a slot for an adapter that is not resident returns the
:class:`~omforge.runtime.lora.slots.LoraLoad` the scheduler puts in its plan (``SchedulerOutput.lora_loads``), which
:func:`~omforge.runtime.executor.run_plan` carries out before the work.

Invariants: an adapter is in at most one slot and a slot holds at most one adapter, among slots ``1 … max_loras``
(slot 0 is the base model's); a pinned adapter's slot is never reassigned; an adapter with users (sequences
submitted and not yet ended, and the server's requests from parsing to submission: :meth:`use`, :meth:`join`,
:meth:`done`) or pins is never unregistered, so a request admitted with an adapter finds it registered until its
sequences end — the adapter's existence is checked once per request, by :meth:`use`; at most ``max_adapters``
adapters are registered at once (``max_cpu_loras``), each under a valid name (:func:`.access.check_name`).
Thread-safe (one lock): the engine thread pins and releases, the server registers, unregisters and counts users.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from omforge.contract.manifest import LoraSection, ModelConfig
from omforge.errors import OmforgeError
from omforge.runtime.lora.access import check_name
from omforge.runtime.lora.adapter import LoraAdapter, LoraError, LoraNameTaken, load_adapter, validate
from omforge.runtime.lora.slots import LoraLoad
from omforge.runtime.request import Request, RequestRejected


class UnknownLora(RequestRejected):
    """A request names a LoRA adapter the engine does not hold (never loaded, or unloaded)."""

    def __init__(self, message: str):
        super().__init__(message, param="model")


class LoraInUse(OmforgeError):
    """An adapter that cannot be unloaded now: requests (running or waiting) still use it."""


class LoraUnreadable(LoraError):
    """An adapter file or directory that could not be read as one (the message names the path: for the caller who
    named it, or a server's log)."""


class LoraLimit(LoraError):
    """As many adapters are registered as the registry holds (``max_cpu_loras``): unload one first."""


@dataclass(frozen=True)
class Pinned:
    """A pin granted by :meth:`LoraRegistry.acquire`: the adapter's ``slot``, and the ``load`` that writes it there
    first (None: it is resident already)."""

    slot: int
    load: LoraLoad | None


@dataclass(frozen=True)
class LoraState:
    """The adapters after a step (``EngineSnapshot.lora``, ``/metrics``): the adapters of the running requests
    (RUNNING, SWAPPED, loading: they pin a slot) and of the waiting ones, sorted, without repeats (vLLM's
    ``lora_requests_info``); the slots resident at once; adapters written into a slot so far, and how many of those
    replaced another."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    loads: int
    evictions: int


class LoraRegistry:
    """The served adapters (host memory, parsed once) and the ``max_loras`` slots they are loaded into on demand,
    least-recently-used replacement of an unpinned one; pins per request id; users per adapter."""

    def __init__(self, spec: LoraSection, config: ModelConfig, max_loras: int | None = None,
                 max_adapters: int | None = None):
        max_loras = spec.max_loras if max_loras is None else max_loras
        if not 1 <= max_loras <= spec.max_loras:
            raise LoraError(f"--max-loras {max_loras}: the bundle has {spec.max_loras} adapter slots "
                            "(compile.lora.max_loras); use 1 … that")
        self.spec, self.config, self.max_loras = spec, config, max_loras
        self.max_adapters = max_adapters  # adapters registered at once (None: no cap)
        self._adapters: dict[str, LoraAdapter] = {}
        self._users: dict[str, int] = {}  # adapter → sequences submitted and not yet ended
        self._holder: dict[int, str | None] = dict.fromkeys(range(1, max_loras + 1))
        self._slot: dict[str, int] = {}
        self._pins: dict[str, str] = {}  # request id → the adapter whose slot it pins
        self._used: dict[int, int] = dict.fromkeys(range(1, max_loras + 1), 0)  # slot → last acquire tick
        self._tick = 0
        self._lock = threading.RLock()
        self.loads = 0
        """Adapters written into a slot so far."""
        self.evictions = 0
        """Loads that replaced a resident (unpinned) adapter."""
        self.num_checks = 0
        """Checks that an adapter is served (:meth:`use`, ``in``) so far: one per request (tests count it)."""

    @classmethod
    def open(cls, spec: LoraSection | None, config: ModelConfig, max_loras: int | None,
             modules: Mapping[str, str | Path] | None, max_adapters: int | None = None) -> LoraRegistry | None:
        """The engine's registry with ``modules`` (``lora_modules``: name → path) read, checked and registered (a
        bad one: a :class:`LoraError` naming it), holding at most ``max_adapters``; None for a bundle without
        ``lora``."""
        if spec is None:
            return None  # lora_modules / max_loras on such a bundle were refused by EngineConfig.resolve
        registry = cls(spec, config, max_loras, max_adapters)
        for name, path in (modules or {}).items():
            registry.register(load_adapter(name, path, config))
        return registry

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Adapter ``name`` read from ``path``, a PEFT directory or a GGUF LoRA file: whatever stops the reading is
        a :class:`LoraUnreadable` naming the adapter and the path (an invalid name: a ``LoraNameInvalid``); whether
        it fits the bundle is checked by :meth:`register`. Pure apart from reading the file: the server calls it on
        a worker thread."""
        check_name(name)
        try:
            return load_adapter(name, path, self.config)
        except LoraError as exc:
            raise LoraUnreadable(str(exc)) from exc
        except Exception as exc:  # a parser meeting bytes it does not expect, a permission, …: still one line
            raise LoraUnreadable(f"adapter '{name}': {path} cannot be read ({type(exc).__name__}: {exc})") from exc

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """:meth:`read` then :meth:`register` (offline, between steps): :class:`LoraError` naming the adapter when it
        cannot be read, does not fit the bundle or its name is taken."""
        adapter = self.read(name, path)
        self.register(adapter)
        return adapter

    # --- adapters served ----------------------------------------------------------------------------------

    def register(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (its name valid, validated against the bundle; written into a slot only when a request
        pins it); a name already served is a :class:`LoraNameTaken`, one past ``max_adapters`` a
        :class:`LoraLimit`."""
        check_name(adapter.name)
        validate(adapter, self.spec, self.config)
        with self._lock:
            if adapter.name in self._adapters:
                raise LoraNameTaken(f"adapter '{adapter.name}' is already loaded; unload it first to replace it")
            self.check_room()
            self._adapters[adapter.name] = adapter
            self._users[adapter.name] = 0

    def unregister(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its slot: :class:`UnknownLora` if it is not served,
        :class:`LoraInUse` while sequences use it."""
        with self._lock:
            if name not in self._adapters:
                raise UnknownLora(f"the LoRA adapter '{name}' is not loaded")
            users = self._users[name] or sum(n == name for n in self._pins.values())
            if users:
                raise LoraInUse(f"the LoRA adapter '{name}' is in use by {users} sequence(s); unload it once they "
                                "end")
            slot = self._slot.pop(name, None)
            if slot is not None:
                self._holder[slot] = None  # its weights stay until the next load there clears the slot
            del self._adapters[name], self._users[name]

    def check_room(self) -> None:
        """:class:`LoraLimit` when ``max_adapters`` adapters are registered (a load would be refused)."""
        with self._lock:
            if self.max_adapters is not None and len(self._adapters) >= self.max_adapters:
                raise LoraLimit(f"{len(self._adapters)} LoRA adapters are loaded, the most this server holds "
                                f"(--max-cpu-loras {self.max_adapters}); unload one first")

    def names(self) -> tuple[str, ...]:
        """The served adapters, in registration order."""
        with self._lock:
            return tuple(self._adapters)

    def served(self) -> dict[str, str]:
        """Adapter name → the path it was read from, in registration order (``/v1/models``)."""
        with self._lock:
            return {name: str(a.path) for name, a in self._adapters.items()}

    def __contains__(self, name: object) -> bool:
        with self._lock:
            self.num_checks += 1
            return name in self._adapters

    def get(self, name: str) -> LoraAdapter:
        """Adapter ``name``, served (an adapter with users or pins is: no second check)."""
        with self._lock:
            return self._adapters[name]

    # --- users: sequences submitted with an adapter, until they end ----------------------------------------

    def use(self, name: str, sequences: int) -> LoraAdapter:
        """Count ``sequences`` more users of adapter ``name`` (a request submitted with it): the one check that it
        is served (:class:`UnknownLora` otherwise). Each use needs a :meth:`done` per sequence when it ends."""
        with self._lock:
            self.num_checks += 1
            if name not in self._adapters:
                loaded = ", ".join(self._adapters) or "none"
                raise UnknownLora(f"the LoRA adapter '{name}' is not loaded (loaded: {loaded})")
            self._users[name] += sequences
            return self._adapters[name]

    def join(self, name: str, sequences: int) -> None:
        """Count ``sequences`` more users of adapter ``name`` without checking it again: the caller holds a
        :meth:`use` of it (the server's, from parsing to submission), so it is served."""
        with self._lock:
            self._users[name] += sequences

    def done(self, name: str, sequences: int = 1) -> None:
        """``sequences`` users of adapter ``name`` ended (finished, aborted, or never added)."""
        with self._lock:
            self._users[name] -= sequences

    def users(self, name: str) -> int:
        with self._lock:
            return self._users.get(name, 0)

    def state(self, running: Iterable[Request], waiting: Iterable[Request]) -> LoraState:
        """:class:`LoraState` of the requests ``running`` (those not finished pin a slot) and ``waiting``."""
        run = {r.lora for r in running if r.lora is not None and not r.finished}
        wait = {r.lora for r in waiting if r.lora is not None}
        return LoraState(tuple(sorted(run)), tuple(sorted(wait)), self.max_loras, self.loads, self.evictions)

    # --- slots: pinned by the requests that run --------------------------------------------------------------

    def acquire(self, request_id: str, name: str) -> Pinned | None:
        """Pin adapter ``name``'s slot for ``request_id`` (once: a request already pinning gets its slot again):
        where it already is, else a free slot or the least recently acquired unpinned adapter's, with the load that
        writes it there; None (nothing changed) when every slot is pinned by other adapters."""
        with self._lock:
            if self._pins.get(request_id) == name:
                return Pinned(self._slot[name], None)
            adapter = self._adapters[name]  # a user's adapter is served (use)
            slot, load = self._slot.get(name), None
            if slot is None:
                pinned = set(self._pins.values())
                free = [s for s, held in self._holder.items() if held is None]
                idle = [s for s, held in self._holder.items() if held is not None and held not in pinned]
                if free:
                    slot = free[0]
                elif idle:
                    slot = min(idle, key=self._used.__getitem__)
                    del self._slot[self._holder[slot]]  # type: ignore[index]
                    self.evictions += 1
                else:
                    return None
                load = LoraLoad(slot, adapter, self.spec)
                self.loads += 1
                self._holder[slot], self._slot[name] = name, slot
            self._tick += 1
            self._used[slot] = self._tick
            self._pins[request_id] = name
            return Pinned(slot, load)

    def release(self, request_id: str) -> None:
        """Drop ``request_id``'s pin, if it holds one (idempotent); the adapter stays resident until replaced."""
        with self._lock:
            self._pins.pop(request_id, None)

    def would_wait(self, name: str) -> bool:
        """Whether adapter ``name`` could not get a slot now: not resident, and every slot holds a pinned one."""
        with self._lock:
            if name in self._slot:
                return False
            pinned = set(self._pins.values())
            return all(held is not None and held in pinned for held in self._holder.values())

    def slot_of(self, name: str) -> int | None:
        """The slot adapter ``name`` is in, None when not resident."""
        with self._lock:
            return self._slot.get(name)

    def pinned(self, name: str) -> int:
        """How many requests pin adapter ``name``'s slot."""
        with self._lock:
            return sum(n == name for n in self._pins.values())

    def pins(self) -> dict[str, str]:
        """Request id → the adapter whose slot it pins."""
        with self._lock:
            return dict(self._pins)
