"""A thin wrapper over NIXL's Python API: register the KV pools once, describe them to peers, READ whole blocks.

What it does is what vLLM's NixlConnector worker does with the same API:

- registration (``nixl/base_worker.py`` 0.33.0 ``register_kv_caches``, lines 1481-1936): each pool is one region
  (``get_reg_descs`` of ``(addr, len, device, "")``, ``register_memory``), K and V apart ("K and V are now in
  different regions", ``nixl_connector.py`` 0.11.0 lines 758-763);
- descriptors: one strided descriptor per pool, ``(base, block_len, device, stride=block_len, count=num_blocks)``
  (``_block_strided_descs``, lines 2134-2164; "NIXL >= 1.5 prepares this layout directly", line 2128), prepared
  once with ``prep_xfer_dlist`` — locally under ``NIXL_INIT_AGENT`` (``register_local_xfer_handler``, lines
  2250-2336), for a peer under its agent name once its metadata is loaded (``add_remote_agent``, lines 2542-2689);
  block ``b`` of pool ``p`` is descriptor ``p * num_blocks + b`` (``_compute_desc_ids``, lines 140-278);
- a read is ``make_prepped_xfer("READ", local, local_ids, remote, remote_ids, notif_msg)`` then ``transfer``,
  polled with ``check_xfer_state`` until ``DONE``/``ERR`` (``nixl/pull_worker.py`` lines 554-584,
  ``base_worker.py`` lines 3402-3451); the notification reaches the peer when the data has moved, and tells it to
  free the blocks (:func:`~omforge.runtime.kv_transfer.params.release_notif`);
- progress: NIXL's own progress thread is off — in nixl-cu12 1.5.1 its UCX thread spins a whole core even with
  nothing to do (measured: 1.0 CPU-s/s idle, 0.0 without it), which on a CPU replica is a core taken from the
  model. Ours calls ``get_new_notifs`` (it progresses the UCX workers) under the agent's lock: every
  ``PROGRESS_ACTIVE_S`` while the connector has blocks held or reads in flight (a peer reading our blocks over TCP
  needs our side to progress), every ``PROGRESS_IDLE_S`` otherwise; notifications it collects wait in an inbox
  for :meth:`NixlKVAgent.poll_notifs`;
- a handle is released on every path; if NIXL cannot cancel an in-flight one, release raises and the handle (and
  so the destination blocks) is kept (``_try_release_xfer_handle``, lines 3454-3467): the error says so.

NIXL is imported on first use only: omforge without the cluster extra imports and serves without it.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from omforge.contract import KV_ITEMSIZE, PagedLayout
from omforge.errors import one_line
from omforge.runtime.kv_transfer.errors import (
    ClusterExtraMissing,
    KVLayoutMismatch,
    KVTransferConfigError,
    KVTransferError,
    KVTransferTimeout,
)
from omforge.runtime.kv_transfer.handshake import AgentMetadata
from omforge.runtime.kv_transfer.params import check_layout

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
"""Where NIXL's API lives: the ``nixl`` meta-package, or the CUDA-variant wheels it picks between (``nixl-cu12``
1.5.1 installs the module ``nixl_cu12``; its core and UCX plugin need no CUDA)."""
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3
PROGRESS_ACTIVE_S = 0.5e-3  # our progress thread's period while transfers may be under way
PROGRESS_IDLE_S = 0.05  # ... and otherwise (UCX connection requests still get answered)


def load_nixl() -> ModuleType:
    """NIXL's API module (the one with ``nixl_agent``), its chatty INFO logging (to stdout) turned down to
    warnings unless ``NIXL_LOG_LEVEL`` asks otherwise. Raises :class:`ClusterExtraMissing` if none imports."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        api = module if hasattr(module, "nixl_agent") else getattr(module, "_api", None)
        if api is not None and hasattr(api, "nixl_agent"):
            if not os.environ.get("NIXL_LOG_LEVEL"):
                logging.getLogger("nixl").setLevel(logging.WARNING)
            return api
    raise ClusterExtraMissing("PD disaggregation moves KV blocks with NIXL, which is not installed: "
                              "pip install .[cluster]")


@dataclass(frozen=True)
class Peer:
    """A peer whose metadata is loaded: reads from it use ``dlist`` (its pools' descriptors)."""

    engine_id: str
    agent_name: str
    num_blocks: int
    dlist: Any


@dataclass(frozen=True)
class TransferStats:
    """One finished read: whole blocks of every pool."""

    num_blocks: int
    bytes: int
    seconds: float


class PendingRead:
    """A posted READ. :meth:`poll` until it returns True, or :meth:`cancel`; either way the handle is released
    exactly once. Not thread-safe on its own (the agent's lock guards the NIXL calls)."""

    def __init__(self, agent: NixlKVAgent, handle: Any, state: str, peer: Peer, num_blocks: int, started: float):
        self._agent, self._handle, self._state, self.peer = agent, handle, state, peer
        self.num_blocks, self.started = num_blocks, started  # time.monotonic() before the READ was made
        self.done = False

    def poll(self) -> bool:
        """True once the data is here (the handle then released). Raises :class:`KVTransferError` if NIXL
        reports the transfer failed."""
        if self.done:
            return True
        if self._state == "PROC":
            try:
                self._state = self._agent._call(self._agent._nixl.check_xfer_state, self._handle)
            except Exception as e:  # a peer that went away raises (NIXL_ERR_REMOTE_DISCONNECT), not "ERR"
                self._state = f"ERR: {one_line(e)}"
        if self._state == "PROC":
            return False
        self.done = True
        released = self._agent._release(self._handle)
        if self._state != "DONE":
            raise KVTransferError(f"KV read from {self.peer.engine_id} failed (NIXL state {self._state})",
                                  handle_released=released)
        return True

    def cancel(self) -> bool:
        """Abandon the read; True if NIXL released (cancelled) it, so the destination blocks are safe to reuse."""
        if self.done:
            return True
        self.done = True
        return self._agent._release(self._handle)

    def retry_release(self) -> bool:
        """After NIXL refused to release the handle: try again; True once it let go (the blocks are safe now)."""
        return self._agent._retry_release(self._handle)


class NixlKVAgent:
    """One NIXL agent owning this replica's registered pools.

    Invariants: the pools are registered from construction to :meth:`close` and referenced here all that time (so
    their memory cannot move or go); ``pools`` are ``2 * num_layers`` arrays ``[num_blocks, block_size, kv_heads,
    row_elems]`` in one order that both sides share (vLLM's K0, V0, K1, V1, ...); a peer is loaded once per engine
    id. Every NIXL call goes through one lock, so engine and transfer threads may share the agent."""

    def __init__(self, engine_id: str, layout: PagedLayout, pools: Sequence[np.ndarray], *,
                 backends: Sequence[str] = ("UCX",), num_threads: int = 0, model_fingerprint: str = ""):
        api = load_nixl()
        self.engine_id, self.layout, self.model_fingerprint = engine_id, layout, model_fingerprint
        self._pools = list(pools)
        self.num_blocks, self.block_len = _check_pools(layout, self._pools)
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._stuck: list[Any] = []
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends), num_threads=num_threads)
        self._nixl = api.nixl_agent(f"{engine_id}-{uuid.uuid4().hex[:8]}", config)
        self._inbox: list[tuple[str, bytes]] = []
        self._active = False
        self._wake = threading.Event()
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            raise KVTransferConfigError(f"kv_connector_extra_config.backends: NIXL backend {missing[0]!r} is not "
                                        f"available here (plugins: {', '.join(self._nixl.get_plugin_list())})")
        regions = [(p.ctypes.data, p.nbytes, 0, "") for p in self._pools]
        self._registered = self._nixl.register_memory(self._nixl.get_reg_descs(regions, "DRAM"))
        self._local_dlist = self._nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _strided([p.ctypes.data for p in self._pools], self.block_len, self.num_blocks), "DRAM")
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, name=f"nixl-progress-{engine_id}", daemon=True)
        self._progress.start()

    def set_active(self, active: bool) -> None:
        """Transfers may be under way (blocks held for a peer, reads in flight): progress often; else rarely."""
        if active != self._active:
            self._active = active
            if active:
                self._wake.set()

    def _progress_loop(self) -> None:
        while True:  # until close() marks the agent closed
            with self._lock:
                if self._closed:
                    return
                self._take_notifs()
            self._wake.wait(PROGRESS_ACTIVE_S if self._active else PROGRESS_IDLE_S)
            self._wake.clear()

    def _take_notifs(self) -> None:
        """Progress the workers and move new notifications to the inbox (caller holds the lock)."""
        try:
            notifs = self._nixl.get_new_notifs()
        except Exception:  # a peer that went away: its notifications are gone with it
            return
        self._inbox.extend((str(agent), msg) for agent, msgs in notifs.items() for msg in msgs)

    def metadata(self) -> AgentMetadata:
        """What a peer needs to read our blocks (served by the handshake listener)."""
        return AgentMetadata(self.engine_id, self._call(self._nixl.get_agent_metadata),
                             tuple(p.ctypes.data for p in self._pools), self.num_blocks, self.block_len, self.layout,
                             self.model_fingerprint)

    def add_peer(self, meta: AgentMetadata) -> Peer:
        """Load a peer's metadata (once per engine id) after checking its layout matches ours."""
        if meta.engine_id in self._peers:
            return self._peers[meta.engine_id]
        check_layout(self.layout, meta.layout, meta.engine_id)
        if meta.model_fingerprint and self.model_fingerprint and meta.model_fingerprint != self.model_fingerprint:
            raise KVLayoutMismatch(f"KV transfer refused: {meta.engine_id} serves model {meta.model_fingerprint!r}, "
                                   f"this replica {self.model_fingerprint!r}")
        if meta.block_len != self.block_len or len(meta.base_addrs) != len(self._pools):
            raise KVLayoutMismatch(f"KV layout mismatch with {meta.engine_id}: {len(meta.base_addrs)} pools of "
                                   f"{meta.block_len} bytes a block there, {len(self._pools)} of {self.block_len} here")
        try:
            name = self._call(self._nixl.add_remote_agent, meta.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            dlist = self._call(self._nixl.prep_xfer_dlist, name,
                               _strided(meta.base_addrs, meta.block_len, meta.num_blocks), "DRAM")
        except Exception as e:  # NIXL's binding errors have no common base class
            raise KVTransferError(f"loading {meta.engine_id}'s NIXL metadata failed: {one_line(e)}") from None
        peer = Peer(meta.engine_id, name, meta.num_blocks, dlist)
        self._peers[meta.engine_id] = peer
        return peer

    def peer(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer (after it died or was replaced): its descriptors are released and its metadata unloaded."""
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            self._quietly(self._nixl.release_dlist_handle, peer.dlist)
            self._quietly(self._nixl.remove_remote_agent, peer.agent_name)

    def start_read(self, peer: Peer, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                   notif_msg: bytes = b"") -> PendingRead:
        """Post a READ of whole blocks ``remote_block_ids`` of every peer pool into ``local_block_ids`` of ours
        (pairwise). ``notif_msg`` reaches the peer when the data has moved. Raises :class:`KVTransferError` if NIXL
        refuses to post it (the handle then released)."""
        local_ids, remote_ids = self._desc_ids(peer, remote_block_ids, local_block_ids)
        handle, started = None, time.monotonic()
        try:
            handle = self._call(self._nixl.make_prepped_xfer, "READ", self._local_dlist, local_ids, peer.dlist,
                                remote_ids, notif_msg)
            state = self._call(self._nixl.transfer, handle)
        except Exception as e:  # NIXL's binding errors have no common base class
            released = handle is None or self._release(handle)
            raise KVTransferError(f"KV read from {peer.engine_id} could not start: {one_line(e)}",
                                  handle_released=released) from None
        return PendingRead(self, handle, state, peer, len(local_block_ids), started)

    def read_blocks(self, peer: Peer, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    timeout_s: float, notif_msg: bytes = b"") -> TransferStats:
        """:meth:`start_read` and wait for it, at most ``timeout_s``. Raises :class:`KVTransferTimeout` past it
        (the read cancelled) and :class:`KVTransferError` on failure; ``handle_released`` False on either means
        the local blocks may still be written and must be kept until :meth:`close`."""
        pending = self.start_read(peer, remote_block_ids, local_block_ids, notif_msg)
        deadline, delay = pending.started + timeout_s, _POLL_MIN_S
        while not pending.poll():
            if time.monotonic() >= deadline:
                released = pending.cancel()
                raise KVTransferTimeout(f"KV read of {pending.num_blocks} blocks from {peer.engine_id} did not finish "
                                        f"within {timeout_s:g} s", handle_released=released)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        elapsed = time.monotonic() - pending.started
        return TransferStats(pending.num_blocks, pending.num_blocks * self.block_len * len(self._pools), elapsed)

    def notify(self, peer: Peer, message: bytes) -> None:
        """A standalone notification (vLLM sends one when there is nothing to read: a full prefix-cache hit)."""
        try:
            self._call(self._nixl.send_notif, peer.agent_name, message)
        except Exception as e:  # NIXL's binding errors have no common base class
            raise KVTransferError(f"notifying {peer.engine_id} failed: {one_line(e)}") from None

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (sender agent name, message)."""
        with self._lock:
            self._take_notifs()
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        """Release every handle and descriptor list, unload the peers and deregister the pools (idempotent)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True  # the progress thread's next pass ends it
        self._wake.set()
        self._progress.join(timeout=5.0)
        for handle in self._stuck:
            self._quietly(self._nixl.release_xfer_handle, handle)
        self._stuck.clear()
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        self._quietly(self._nixl.release_dlist_handle, self._local_dlist)
        self._quietly(self._nixl.deregister_memory, self._registered)

    def _desc_ids(self, peer: Peer, remote: Sequence[int], local: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Descriptor indices for those blocks in every pool, pool-major, after range and length checks."""
        remote_ids, local_ids = np.asarray(remote, dtype=np.int64), np.asarray(local, dtype=np.int64)
        if remote_ids.ndim != 1 or remote_ids.shape != local_ids.shape or remote_ids.size == 0:
            raise ValueError(f"a read needs as many local as remote block ids, at least one (got {len(local)} local, "
                             f"{len(remote)} remote)")
        if remote_ids.min() < 0 or remote_ids.max() >= peer.num_blocks:
            raise ValueError(f"remote block ids must lie in [0, {peer.num_blocks}) ({peer.engine_id}'s pool)")
        if local_ids.min() < 0 or local_ids.max() >= self.num_blocks:
            raise ValueError(f"local block ids must lie in [0, {self.num_blocks})")
        if np.unique(local_ids).size != local_ids.size:
            raise ValueError("local block ids repeat a block (two reads would land in one block)")
        pools = np.arange(len(self._pools), dtype=np.int64)[:, None]
        return ((pools * self.num_blocks + local_ids).ravel().astype(np.int32),
                (pools * peer.num_blocks + remote_ids).ravel().astype(np.int32))

    def _call(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def _release(self, handle: Any) -> bool:
        """Release a transfer handle; False (the handle kept for :meth:`close`) if NIXL could not cancel it."""
        try:
            self._call(self._nixl.release_xfer_handle, handle)
            return True
        except Exception:  # NIXL's binding errors have no common base class
            self._stuck.append(handle)
            return False

    def _retry_release(self, handle: Any) -> bool:
        if handle not in self._stuck:
            return True
        try:
            self._call(self._nixl.release_xfer_handle, handle)
        except Exception:  # NIXL's binding errors have no common base class
            return False
        self._stuck.remove(handle)
        return True

    def _quietly(self, fn: Any, *args: Any) -> None:
        try:
            self._call(fn, *args)
        except Exception:  # teardown of a handle NIXL already dropped: nothing left to free
            pass

    def __enter__(self) -> NixlKVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_pools(layout: PagedLayout, pools: list[np.ndarray]) -> tuple[int, int]:
    """``(num_blocks, bytes per block)`` of pools that fit ``layout``; :class:`KVLayoutMismatch` otherwise."""
    if len(pools) != 2 * layout.num_layers:
        raise KVLayoutMismatch(f"{len(pools)} pools for {layout.num_layers} layers; register K and V of each "
                               f"({2 * layout.num_layers})")
    num_blocks = pools[0].shape[0] if isinstance(pools[0], np.ndarray) and pools[0].ndim == 4 else -1
    want = (num_blocks, layout.block_size, layout.kv_heads, layout.row_elems)
    itemsize = KV_ITEMSIZE[layout.kv_dtype]
    for i, pool in enumerate(pools):
        if not isinstance(pool, np.ndarray) or pool.shape != want or num_blocks < 1:
            raise KVLayoutMismatch(f"pool {i} has shape {getattr(pool, 'shape', None)}, the layout needs "
                                   f"[num_blocks, {', '.join(map(str, want[1:]))}]")
        if pool.dtype.itemsize != itemsize or not pool.flags.c_contiguous or not pool.flags.writeable:
            raise KVLayoutMismatch(f"pool {i} must be a writeable C-contiguous array of {layout.kv_dtype} "
                                   f"({itemsize}-byte elements), got {pool.dtype}")
    return num_blocks, pools[0].nbytes // num_blocks


def _strided(base_addrs: Sequence[int], block_len: int, num_blocks: int) -> np.ndarray:
    """NIXL's Nx5 strided descriptors ``(addr, len, device, stride, count)``: one per pool, one entry a block."""
    return np.array([(a, block_len, 0, block_len, num_blocks) for a in base_addrs], dtype=np.uint64).reshape(-1, 5)
