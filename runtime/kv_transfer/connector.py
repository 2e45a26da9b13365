"""The engine's side of prefill/decode disaggregation over NIXL: vLLM's NixlConnector lifecycle (docs/pd.md).

Engine thread only (NIXL calls go through the agent's lock; the handshake listener answers from its own thread).

- **Prefill replica** (``kv_producer``): a prefill leg (``do_remote_decode``) that finishes normally keeps its
  blocks — the scheduler moves its table under a held id — and :meth:`PDConnector.hold` answers the decode leg's
  ``kv_transfer_params``. The blocks are freed when the decode side's release notification arrives (it is sent
  with the READ and delivered once the data has moved: vLLM's ``"<request id>:1"``) or when the lease
  (``kv_lease_duration``, default 30 s) runs out, so a decode replica that died mid-transfer costs the blocks for
  the lease at most; a decode side's heartbeat (vLLM 0.33's ``HB:id,…``) renews the leases of the ids it names.
  Nothing is freed while a READ may still be reading it: the notification comes after.
- **Decode replica** (``kv_consumer``): a decode leg with blocks (``do_remote_prefill``) takes its prefix-cache
  hits and fresh blocks, reserved and unregistered, for the rest of its prompt, and :meth:`PDConnector.start_read`
  pulls the prefill's blocks into them (handshake once per engine id, bounded). A decode leg that waited here
  longer than the lease less ``STALE_MARGIN_S`` is not read at all: the prefill side may have freed (and reused)
  those blocks, and a read would copy whatever is there now (this side sends no heartbeats; both sides are
  assumed to share the lease). :meth:`PDConnector.finished_loads` reports reads that ended — all blocks, or none
  with the error — the scheduler's ``LoadedJob`` shape; a read past its deadline (the lease) is cancelled. If
  NIXL cannot cancel it, the job says so (``keep_blocks``) and the blocks are never reused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omforge.contract import PagedLayout
from omforge.errors import OmforgeError, one_line
from omforge.runtime.kv_transfer.config import KVTransferConfig, side_channel_address
from omforge.runtime.kv_transfer.errors import KVTransferConfigError, KVTransferError, KVTransferParamsError
from omforge.runtime.kv_transfer.handshake import HandshakeListener, fetch_metadata
from omforge.runtime.kv_transfer.nixl_agent import NixlKVAgent, PendingRead
from omforge.runtime.kv_transfer.params import (
    HeartbeatNotif,
    KVTransferParams,
    ReleaseNotif,
    parse_notif,
    prefill_response_params,
    release_notif,
)

log = logging.getLogger("omforge.kv_transfer")
HANDSHAKE_TIMEOUT_S = 5.0
STALE_MARGIN_S = 2.0  # a decode leg older than the lease less this is not read (its blocks may be gone)


@dataclass
class PDStats:
    """Counters since start (decode side: reads; prefill side: held requests) and the held blocks now."""

    read_requests: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    read_failures: int = 0
    held_requests: int = 0
    released_notified: int = 0
    released_expired: int = 0
    heartbeats: int = 0  # leases renewed by a decode side's ``HB:`` notification
    held_blocks: int = 0


@dataclass
class RemoteJob:
    """One decode leg's read: ``loaded`` is all of ``blocks`` once it succeeded, 0 otherwise (``error`` says why)."""

    key: str
    blocks: list[int]
    deadline: float
    pending: PendingRead | None = None
    loaded: int = 0
    error: str | None = None
    keep_blocks: bool = False  # NIXL could not cancel the read: the blocks may still be written, never reuse them


@dataclass
class _Held:
    kv_id: str
    deadline: float
    num_blocks: int


@dataclass
class PDConnector:
    config: KVTransferConfig
    agent: NixlKVAgent
    block_size: int
    host: str
    port: int
    listener: HandshakeListener | None = None
    stats: PDStats = field(default_factory=PDStats)
    _held: dict[str, _Held] = field(default_factory=dict)
    _jobs: list[RemoteJob] = field(default_factory=list)

    @classmethod
    def start(cls, config: KVTransferConfig, layout: PagedLayout, pools: Sequence[np.ndarray],
              model_fingerprint: str) -> PDConnector:
        """Register the pools with NIXL and, on a producer, listen for handshakes on vLLM's side channel address
        (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``)."""
        agent = NixlKVAgent(config.engine_id, layout, pools, backends=config.backends,
                            num_threads=config.num_threads, model_fingerprint=model_fingerprint)
        host, port = side_channel_address()
        listener = None
        try:
            if config.is_kv_producer:
                listener = HandshakeListener(agent.metadata(), host, port)
                host, port = listener.address
        except BaseException:
            agent.close()
            raise
        return cls(config, agent, layout.block_size, host, port, listener)

    # --- decode side ----------------------------------------------------------------------------------------

    def start_read(self, key: str, params: KVTransferParams, blocks: Sequence[int], first: int = 0,
                   arrival: float | None = None) -> RemoteJob:
        """Pull ``params.remote_block_ids[first:first + len(blocks)]`` into ``blocks`` (reserved by the caller,
        read by nobody until reported done; ``first``: the prompt's blocks this side already holds, its prefix
        hit; ``arrival``: when the decode leg arrived, ``time.monotonic()``); a failure to start, or a leg too old
        to read safely, is reported like any other, by :meth:`finished_loads`."""
        job = RemoteJob(key, list(blocks), time.monotonic() + self.config.lease_s)
        self._jobs.append(job)
        self.stats.read_requests += 1
        waited = None if arrival is None else time.monotonic() - arrival
        if waited is not None and waited > self.config.lease_s - STALE_MARGIN_S:
            self._failed(job, KVTransferError(f"the request waited {waited:.1f} s here, past the prefill side's "
                                              f"{self.config.lease_s:g} s lease less {STALE_MARGIN_S:g} s: its "
                                              "blocks may be freed; not read"),
                         params.remote_engine_id, drop_peer=False)
        else:
            try:
                peer = self.agent.peer(params.remote_engine_id) or self.agent.add_peer(fetch_metadata(
                    params.remote_host, params.remote_port, timeout_s=HANDSHAKE_TIMEOUT_S,
                    expected_engine_id=params.remote_engine_id))
                job.pending = self.agent.start_read(peer, params.remote_block_ids[first:first + len(blocks)],
                                                    blocks, notif_msg=release_notif(params.remote_request_id))
            except (KVTransferError, OmforgeError, OSError, ValueError) as exc:  # OmforgeError: a layout mismatch
                self._failed(job, exc, params.remote_engine_id)
        self.agent.set_active(self.busy())
        return job

    def finished_loads(self) -> list[RemoteJob]:
        """Reads that ended since the last call (succeeded, failed or timed out)."""
        done, now = [], time.monotonic()
        for job in self._jobs:
            if job.error is None and job.pending is not None:
                try:
                    if job.pending.poll():
                        job.loaded = len(job.blocks)
                        self.stats.read_blocks += job.loaded
                        self.stats.read_bytes += job.loaded * self.agent.block_len * 2 * self.agent.layout.num_layers
                        self.stats.read_seconds += now - job.pending.started
                    elif now > job.deadline:
                        job.keep_blocks = not job.pending.cancel()
                        self._failed(job, KVTransferError(f"the KV read did not finish within "
                                                          f"{self.config.lease_s:g} s"), job.pending.peer.engine_id)
                except KVTransferError as exc:
                    self._failed(job, exc, job.pending.peer.engine_id)
            if job.loaded or job.error is not None:
                done.append(job)
        self._jobs = [j for j in self._jobs if j not in done]
        self.agent.set_active(self.busy())
        return done

    def _failed(self, job: RemoteJob, exc: Exception, engine_id: str | None, drop_peer: bool = True) -> None:
        job.error = f"KV transfer from prefill engine {engine_id} failed: {one_line(exc)}"
        job.keep_blocks = job.keep_blocks or getattr(exc, "handle_released", True) is False
        self.stats.read_failures += 1
        if engine_id is not None and drop_peer:
            self.agent.remove_peer(engine_id)  # a restarted prefill replica has new addresses: handshake again
        log.warning("%s", job.error)

    # --- prefill side ---------------------------------------------------------------------------------------

    def hold(self, request_id: str, kv_id: str, blocks: Sequence[int], num_tokens: int) -> dict:
        """A finished prefill leg's blocks, now held under ``kv_id``: the decode leg's ``kv_transfer_params``."""
        self._held[request_id] = _Held(kv_id, time.monotonic() + self.config.lease_s, len(blocks))
        self.stats.held_requests += 1
        self.stats.held_blocks += len(blocks)
        self.agent.set_active(True)
        return prefill_response_params(engine_id=self.config.engine_id, request_id=request_id, block_ids=blocks,
                                       host=self.host, port=self.port, num_tokens=num_tokens,
                                       block_size=self.block_size)

    def releases(self) -> list[str]:
        """The held ids to free now: released by their decode side, or past their lease."""
        free = []
        now = time.monotonic()
        for _, message in self.agent.poll_notifs():
            notif = parse_notif(message)
            if isinstance(notif, ReleaseNotif) and notif.request_id in self._held:
                free.append(self._held.pop(notif.request_id).kv_id)
                self.stats.released_notified += 1
            elif isinstance(notif, HeartbeatNotif):  # a decode side still waiting to read: a new lease
                for request_id in notif.request_ids:
                    if request_id in self._held:
                        self._held[request_id].deadline = now + self.config.lease_s
                        self.stats.heartbeats += 1
        for request_id in [r for r, h in self._held.items() if now > h.deadline]:
            free.append(self._held.pop(request_id).kv_id)
            self.stats.released_expired += 1
            log.warning("kv transfer: the blocks of %s were not read within the %g s lease; freed", request_id,
                        self.config.lease_s)
        self.stats.held_blocks = sum(h.num_blocks for h in self._held.values())
        self.agent.set_active(self.busy())
        return free

    def busy(self) -> bool:
        """Blocks held for a decode side or reads in flight: the engine keeps polling."""
        return bool(self._held or self._jobs)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.agent.close()


def build_connector(kv_transfer_config: object, manifest: object, executor: object) -> PDConnector | None:
    """The engine's connector for ``--kv-transfer-config`` (None: the replica takes no part in PD). Its pools
    are the executor's host pools in vLLM's order (K0, V0, K1, …); its model fingerprint the bundle identity
    (runtime/hicache/identity.py), so replicas of two models, or two precisions, never exchange KV."""
    if kv_transfer_config is None:
        return None
    from omforge.runtime.hicache.identity import BundleIdentity
    from omforge.runtime.kv_transfer.config import parse_kv_transfer_config

    config = parse_kv_transfer_config(kv_transfer_config)
    keys, values = getattr(executor, "key_pools", None), getattr(executor, "value_pools", None)
    if keys is None or values is None:
        raise KVTransferConfigError(f"--kv-transfer-config: the {manifest.target} executor's KV pool is device "
                                    "memory; PD over NIXL is built for host pools (ort) only")
    pools = [pool for layer in zip(keys, values) for pool in layer]
    return PDConnector.start(config, manifest.kv.paged_layout, pools, BundleIdentity.of(manifest).hex)


def request_params(connector: PDConnector | None, raw: object, block_size: int) -> KVTransferParams | None:
    """A request's ``kv_transfer_params`` checked against this replica's role and layout; raises ValueError with
    one line (the server answers 400, param ``kv_transfer_params``). On a ``kv_producer`` replica a request
    without them is a prefill leg."""
    from omforge.runtime.kv_transfer.params import parse_kv_transfer_params

    try:
        params = parse_kv_transfer_params(raw)
    except KVTransferParamsError as exc:
        raise ValueError(str(exc)) from None
    if params is None:  # a replica that only prefills treats every request as a prefill leg: SMG 1.13's HTTP PD
        # router sends the prefill leg with max_tokens 1 but without do_remote_decode (seen on 127.0.0.1)
        return KVTransferParams(do_remote_decode=True) if connector and connector.config.kv_role == "kv_producer" \
            else None
    if connector is None:
        raise ValueError("kv_transfer_params: this replica takes no part in prefill/decode disaggregation (start it "
                         "with --kv-transfer-config)")
    role = connector.config.kv_role
    if params.is_prefill_leg and not connector.config.is_kv_producer:
        raise ValueError(f"kv_transfer_params: do_remote_decode (a prefill leg) on a {role} replica")
    if params.is_decode_leg and not connector.config.is_kv_consumer:
        raise ValueError(f"kv_transfer_params: do_remote_prefill (a decode leg) on a {role} replica")
    if params.pulls_blocks and params.remote_block_size not in (None, block_size):
        raise ValueError(f"kv_transfer_params: KV layout mismatch with {params.remote_engine_id}: block_size "
                         f"{params.remote_block_size} there, {block_size} here")
    return params
