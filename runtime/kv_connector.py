"""The one seam between the scheduler and every source of KV outside the pool: the storage tier, the host tier
(runtime/hicache) and a prefill replica over NIXL (runtime/kv_transfer).

Its shape is the one vLLM's v1 ``KVConnectorBase_V1`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``get_finished``, ``request_finished``,
``take_events``) and SGLang's ``HiRadixCache`` (match past the device prefix, load into allocated slots, write
through on insert) share. Per plan the scheduler

1. asks :meth:`KVConnector.get_finished` which loads ended (:class:`FinishedLoad`: blocks in place, or an error
   and the blocks a transfer may still write) and which held requests a remote reader is done with;
2. asks, for a new request after its local prefix-cache hit, :meth:`KVConnector.get_num_new_matched_tokens`:
   how many tokens past it the connector can supply, loaded asynchronously (the request waits in
   ``WAITING_FOR_REMOTE_KV``, holding its seat and blocks) or by this plan's host → device copies;
3. allocates the blocks and tells every connector which, :meth:`KVConnector.update_state_after_alloc`;
4. hands the pool's typed events (block stored / evicted) to :meth:`KVConnector.take_events`, which may answer
   device → host copies the plan makes first (a write-back);
5. tells :meth:`KVConnector.request_finished` when a request ends: a connector may keep its blocks for a remote
   reader (until ``get_finished`` names it) and answer the request's ``kv_transfer_params``.

Blocks always belong to a request: one whose load is in flight keeps them under its own id, aborted or not, until
the load ends. The engine also calls :meth:`KVConnector.after_step` after every step (connector I/O that must not
see a block before the step wrote it), :meth:`KVConnector.busy`, :meth:`KVConnector.stats` and
:meth:`KVConnector.close`. Every method runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omforge.runtime.block_pool import PoolEvent
from omforge.runtime.request import Request


@dataclass(frozen=True)
class ExternalHit:
    """Tokens past the request's local prefix hit that a connector supplies. ``load_async``: loaded while other
    requests step (the request waits for it); else by the admitting plan's host → device copies. When the hit
    reaches the end of the request's tokens, the last token is computed anyway (its logits give the next one)."""

    num_tokens: int
    load_async: bool


@dataclass(frozen=True)
class FinishedLoad:
    """A load that ended. ``num_loaded_blocks``: leading blocks of those allocated for it whose KV is in place (the
    rest are computed); ``error``: it failed as a whole (a PD read) — the request fails, or is prefilled here when
    ``recompute``; ``retired``: blocks a transfer that could not be cancelled may still write (kept out of
    circulation until :attr:`Finished.reinstated` names them)."""

    request_id: str
    num_loaded_blocks: int
    error: str | None = None
    recompute: bool = False
    retired: tuple[int, ...] = ()


@dataclass
class Finished:
    """What :meth:`KVConnector.get_finished` reports: loads that ended, held requests whose blocks may be freed, and
    retired blocks nothing writes any more."""

    loads: list[FinishedLoad] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    reinstated: list[int] = field(default_factory=list)


class KVConnector:
    """The scheduler-side interface (module docstring); every hook does nothing unless a connector overrides it.
    ``uses_block_hashes``: :meth:`get_num_new_matched_tokens` reads ``next_hashes`` (else they are not computed)."""

    uses_block_hashes = False

    def get_finished(self) -> Finished:
        """Once per plan, first: loads that ended, held requests released, retired blocks free again."""
        return Finished()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   next_hashes: Sequence[bytes]) -> ExternalHit | None:
        """Tokens past ``num_computed_tokens`` (the local hit, a whole number of blocks) this connector can supply;
        ``next_hashes``: the chain hashes of the request's next full blocks (empty when the request may not use
        the prefix cache). None: nothing. May be asked again for the same request in a later plan."""
        return None

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int],
                                 num_external_tokens: int) -> list[tuple[int, int]]:
        """``request`` was admitted (``num_external_tokens`` > 0 only for the connector whose hit it took, which
        fills ``blocks``). Returns the ``(host, device)`` copies this plan must make for a synchronous hit."""
        return []

    def take_events(self, events: Sequence[PoolEvent]) -> list[tuple[int, int]]:
        """The pool's events since the last call; returns ``(device, host)`` copies the current plan makes before
        anything else (a write-back of evicted blocks)."""
        return []

    def request_finished(self, request: Request, blocks: Sequence[int]) -> dict | None:
        """``request`` ended (``finish_reason`` set) holding device ``blocks``. A dict: they are held for a remote
        reader until :meth:`get_finished` releases the request, and the dict is its ``kv_transfer_params``
        answer; None: they are freed."""
        return None

    def after_step(self, prefill_tokens: int, seconds: float, idle: bool) -> None:
        """After each engine step (``idle``: it ran no work)."""

    def busy(self) -> bool:
        """I/O in flight that holds blocks or must be polled: the engine keeps stepping."""
        return False

    def close(self) -> None:
        """Stop threads and let go of memory registrations (idempotent)."""
