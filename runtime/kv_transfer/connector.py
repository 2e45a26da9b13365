"""The engine's side of prefill/decode disaggregation over NIXL: vLLM's NixlConnector lifecycle (docs/pd.md), as
one :class:`~omforge.runtime.kv_connector.KVConnector` under the scheduler.

Engine thread only (NIXL calls go through the agent's lock; the handshake listener answers from its own thread).

- **Prefill replica** (``kv_producer``): a prefill leg (``do_remote_decode``) that finishes normally keeps its
  blocks, under its own request id in the scheduler's ``held`` (:meth:`PDConnector.request_finished` answers the
  decode leg's ``kv_transfer_params``). They are freed when the decode side's release notification arrives (it is
  sent with the READ and delivered once the data has moved: vLLM's ``"<request id>:1"``) or when the lease
  (``kv_lease_duration``, default 30 s) runs out, so a decode replica that died mid-transfer costs the blocks for
  the lease at most; a decode side's heartbeat (vLLM 0.33's ``HB:id,…``) renews the leases of the ids it names.
  Only an n > 1 leg's first sequence is held (its followers forked its prompt blocks): one hand-off, one hold. The
  hand-off names the prompt (``remote_num_tokens``, ``omforge_prompt_hash``) and the lease's end
  (``remote_blocks_expiry_time``, wall-clock epoch seconds).
- **Decode replica** (``kv_consumer``): a decode leg with blocks (``do_remote_prefill``) is offered as an
  asynchronous hit of the rest of its prompt past its local prefix hit; the scheduler allocates the blocks and
  :meth:`PDConnector.update_state_after_alloc` pulls the prefill's blocks into them (handshake once per engine id,
  bounded). Only a leg whose prompt is the one its prefill leg computed is offered (length, hash, block count:
  ``KVTransferParams.prompt_mismatch``), and none that asks for prompt logprobs (they need the prompt's logits).
  The leg is read once: a leg preempted for recompute later is prefilled here (the first read's notification let
  the prefill side free its blocks). The prefill side frees held blocks when its lease ends, whether a READ of them
  is in flight or not: so a leg is not read past that end (``remote_blocks_expiry_time``; without it, the lease
  from the leg's arrival here, which the prefill side's started before) less ``STALE_MARGIN_S``, and a read seen
  finished after that point is refused too (it may have copied freed blocks). A read past its deadline (the lease)
  is cancelled; if NIXL cannot cancel it, its blocks are retired (the request's own, not its prefix hits) and come
  back when a later try releases the handle. A failed read drops nothing but itself: the peer is forgotten (to
  handshake again: a restarted prefill replica has new addresses) only after a transfer error, and only once no
  other read from it is in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from omforge.contract import PagedLayout, cdiv
from omforge.errors import OmforgeError, one_line
from omforge.runtime.executor import ExecutorCapabilities
from omforge.runtime.kv_connector import ExternalHit, Finished, FinishedLoad, KVConnector
from omforge.runtime.kv_transfer.config import KVTransferConfig, side_channel_address
from omforge.runtime.kv_transfer.errors import KVTransferConfigError, KVTransferError, KVTransferParamsError
from omforge.runtime.kv_transfer.handshake import HandshakeListener, fetch_metadata, listen
from omforge.runtime.kv_transfer.nixl_agent import NixlKVAgent, PendingRead
from omforge.runtime.kv_transfer.params import (
    HeartbeatNotif,
    KVTransferParams,
    ReleaseNotif,
    parse_notif,
    prefill_response_params,
    prompt_hash,
    release_notif,
)
from omforge.runtime.request import Request

log = logging.getLogger("omforge.kv_transfer")
HANDSHAKE_TIMEOUT_S = 5.0
STALE_MARGIN_S = 2.0  # a decode leg is not read later than its lease's end less this (its blocks may be gone)


def wall_offset() -> float:
    """Wall-clock epoch seconds less ``time.monotonic()`` now: converts a lease's end between the two clocks."""
    return time.time() - time.monotonic()


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
    retired_blocks: int = 0  # blocks of reads NIXL could not cancel, now


@dataclass
class RemoteJob:
    """One decode leg's read of ``blocks``. ``stale_at``: when the prefill side may free them (the leg's arrival
    plus the lease less the margin); ``deadline``: when the read is given up."""

    request_id: str
    engine_id: str
    blocks: list[int]
    deadline: float
    stale_at: float
    pending: PendingRead | None = None
    loaded: bool = False
    error: str | None = None
    keep_blocks: bool = False  # NIXL could not cancel the read: the blocks may still be written, retired


@dataclass
class _Held:
    deadline: float
    num_blocks: int


@dataclass
class PDConnector(KVConnector):
    config: KVTransferConfig
    agent: NixlKVAgent
    block_size: int
    host: str
    port: int
    listener: HandshakeListener | None = None
    clock: Callable[[], float] = time.monotonic
    stats: PDStats = field(default_factory=PDStats)
    _held: dict[str, _Held] = field(default_factory=dict)
    _jobs: list[RemoteJob] = field(default_factory=list)
    _stuck: list[RemoteJob] = field(default_factory=list)
    _suspect: set[str] = field(default_factory=set)

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
                listener = listen(agent.metadata(), host, port)
                host, port = listener.address
        except BaseException:
            agent.close()
            raise
        return cls(config, agent, layout.block_size, host, port, listener)

    # --- decode side ----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   next_hashes: Sequence[bytes]) -> ExternalHit | None:
        """A decode leg with blocks to pull: the rest of its prompt past its local hit (vLLM's decode side reads
        only past its local hit too); None for any other request — its n > 1 followers and a leg preempted for
        recompute included — or a leg whose blocks are not its prompt's, or that asks for prompt logprobs (it is
        prefilled here; the intake refuses both with a 400)."""
        params = request.kv_transfer
        if params is None or not params.pulls_blocks or request.parent is not None or request.output_token_ids:
            return None  # an n > 1 follower forks its leader's blocks; a request with outputs is recomputed here
        if request.params.prompt_logprobs is not None:
            return None
        mismatch = params.prompt_mismatch(request.prompt_token_ids, self.block_size)
        if mismatch is not None:
            log.warning("kv transfer: %s not read (%s); prefilled here", request.request_id, mismatch)
            return None
        return ExternalHit(len(request.prompt_token_ids) - num_computed_tokens, load_async=True)

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int],
                                 num_external_tokens: int) -> list[tuple[int, int]]:
        """Start the read of the prompt's blocks past the local hit into ``blocks``; its end (or failure: one too
        old to read safely, one that cannot start) is reported by :meth:`get_finished`."""
        if not num_external_tokens:
            return []
        params: KVTransferParams = request.kv_transfer
        request.kv_transfer = None  # read once: a leg preempted for recompute later is prefilled here
        first = cdiv(len(request.prompt_token_ids), self.block_size) - len(blocks)
        now = self.clock()
        lease_end = request.arrival_time + self.config.lease_s if params.remote_blocks_expiry_time is None \
            else params.remote_blocks_expiry_time - wall_offset()  # the prefill side's word, in our clock
        job = RemoteJob(request.request_id, params.remote_engine_id, list(blocks), now + self.config.lease_s,
                        lease_end - STALE_MARGIN_S)
        self._jobs.append(job)
        self.stats.read_requests += 1
        if now > job.stale_at:
            why = "remote_blocks_expiry_time" if params.remote_blocks_expiry_time is not None else \
                f"a {self.config.lease_s:g} s lease from the request's arrival here"
            self._failed(job, KVTransferError(f"{lease_end - now:.1f} s were left of the prefill side's lease on "
                                              f"its blocks ({why}), less than {STALE_MARGIN_S:g} s: they may be "
                                              "freed; not read"))
        else:
            try:
                peer = self.agent.peer(params.remote_engine_id) or self.agent.add_peer(fetch_metadata(
                    params.remote_host, params.remote_port, timeout_s=HANDSHAKE_TIMEOUT_S,
                    expected_engine_id=params.remote_engine_id))
                job.pending = self.agent.start_read(peer, params.remote_block_ids[first:first + len(blocks)],
                                                    blocks, notif_msg=release_notif(params.remote_request_id))
            except (KVTransferError, OmforgeError, OSError) as exc:  # OmforgeError: a layout mismatch
                self._failed(job, exc, drop_peer=isinstance(exc, KVTransferError))
            except ValueError as exc:  # this leg's block ids: nothing wrong with the peer
                self._failed(job, exc)
        self.agent.set_active(self.busy())
        return []

    def get_finished(self) -> Finished:
        """Reads that ended (succeeded, failed, timed out, or seen finished past their stale point), held
        requests released (notified or past their lease), and retired blocks NIXL finally let go of."""
        done, now = Finished(), self.clock()
        for job in self._jobs:
            if job.error is None and job.pending is not None:
                try:
                    if job.pending.poll():
                        self._read_done(job, now)
                    elif now > job.deadline:
                        job.keep_blocks = not job.pending.cancel()
                        self._failed(job, KVTransferError(f"the KV read did not finish within "
                                                          f"{self.config.lease_s:g} s"))
                except KVTransferError as exc:
                    self._failed(job, exc, drop_peer=True)
        ended = [j for j in self._jobs if j.loaded or j.error is not None]
        self._jobs = [j for j in self._jobs if j not in ended]
        for job in ended:
            retired = tuple(job.blocks) if job.keep_blocks else ()
            done.loads.append(FinishedLoad(job.request_id, len(job.blocks) if job.loaded else 0, job.error,
                                           self.config.kv_load_failure_policy == "recompute", retired))
            if retired:
                self._stuck.append(job)
        for job in list(self._stuck):  # a later try may release what NIXL refused to cancel
            if job.pending is None or job.pending.retry_release():
                self._stuck.remove(job)
                done.reinstated += job.blocks
        self.stats.retired_blocks = sum(len(j.blocks) for j in self._stuck)
        for engine_id in list(self._suspect):  # forget a failed peer once no read from it is in flight
            if not any(j.engine_id == engine_id for j in self._jobs):
                self._suspect.discard(engine_id)
                self.agent.remove_peer(engine_id)
        done.released = self._releases(now)
        self.agent.set_active(self.busy())
        return done

    def _read_done(self, job: RemoteJob, now: float) -> None:
        if now > job.stale_at:
            self._failed(job, KVTransferError(f"the read ended {now - job.stale_at + STALE_MARGIN_S:.1f} s before "
                                              f"the prefill side's {self.config.lease_s:g} s lease could end at the "
                                              "latest (less the margin): its blocks may have been freed meanwhile; "
                                              "refused"))
            return
        job.loaded = True
        self.stats.read_blocks += len(job.blocks)
        self.stats.read_bytes += len(job.blocks) * self.agent.block_len * 2 * self.agent.layout.num_layers
        self.stats.read_seconds += now - job.pending.started

    def _failed(self, job: RemoteJob, exc: Exception, drop_peer: bool = False) -> None:
        """``drop_peer``: a transfer or handshake error (the peer may have restarted with new addresses); a bad
        leg (ValueError), a timeout or a stale leg says nothing about the peer."""
        job.error = f"KV transfer from prefill engine {job.engine_id} failed: {one_line(exc)}"
        job.keep_blocks = job.keep_blocks or getattr(exc, "handle_released", True) is False
        self.stats.read_failures += 1
        if drop_peer and job.engine_id is not None:
            self._suspect.add(job.engine_id)
        log.warning("%s", job.error)

    # --- prefill side ---------------------------------------------------------------------------------------

    def request_finished(self, request: Request, blocks: Sequence[int]) -> dict | None:
        """A prefill leg that finished normally: its prompt's blocks are held; the decode leg's
        ``kv_transfer_params``. None for any other request — an n > 1 leg's followers included (the leader holds
        the prompt's blocks they forked, and its hand-off is the one answered)."""
        params = request.kv_transfer
        if params is None or not params.is_prefill_leg or request.finish_reason not in ("stop", "length") \
                or request.parent is not None:
            return None
        prompt = blocks[:cdiv(len(request.prompt_token_ids), self.block_size)]
        deadline = self.clock() + self.config.lease_s
        self._held[request.request_id] = _Held(deadline, len(prompt))
        self.stats.held_requests += 1
        self.stats.held_blocks += len(prompt)
        self.agent.set_active(True)
        return prefill_response_params(engine_id=self.config.engine_id, request_id=request.request_id,
                                       block_ids=prompt, host=self.host, port=self.port,
                                       num_tokens=len(request.prompt_token_ids), block_size=self.block_size,
                                       expiry_time=deadline + wall_offset(),
                                       prompt_digest=prompt_hash(request.prompt_token_ids))

    def _releases(self, now: float) -> list[str]:
        """The held requests to free now: released by their decode side, or past their lease."""
        free = []
        for _, message in self.agent.poll_notifs():
            notif = parse_notif(message)
            if isinstance(notif, ReleaseNotif) and notif.request_id in self._held:
                del self._held[notif.request_id]
                free.append(notif.request_id)
                self.stats.released_notified += 1
            elif isinstance(notif, HeartbeatNotif):  # a decode side still waiting to read: a new lease
                for request_id in notif.request_ids:
                    if request_id in self._held:
                        self._held[request_id].deadline = now + self.config.lease_s
                        self.stats.heartbeats += 1
        for request_id in [r for r, h in self._held.items() if now > h.deadline]:
            del self._held[request_id]
            free.append(request_id)
            self.stats.released_expired += 1
            log.warning("kv transfer: the blocks of %s were not read within the %g s lease; freed", request_id,
                        self.config.lease_s)
        self.stats.held_blocks = sum(h.num_blocks for h in self._held.values())
        return free

    def busy(self) -> bool:
        """Blocks held for a decode side, reads in flight or retired: the engine keeps polling."""
        return bool(self._held or self._jobs or self._stuck)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.agent.close()


def build_connector(kv_transfer_config: object, manifest: object, caps: ExecutorCapabilities) -> PDConnector | None:
    """The engine's connector for ``--kv-transfer-config`` (None: the replica takes no part in PD). Its pools
    are the executor's host pools in vLLM's order (K0, V0, K1, …: ``ExecutorCapabilities.host_kv``); its model
    fingerprint the bundle identity (runtime/hicache/identity.py), so replicas of two models, or two precisions,
    never exchange KV."""
    if kv_transfer_config is None:
        return None
    from omforge.runtime.hicache.identity import BundleIdentity
    from omforge.runtime.kv_transfer.config import parse_kv_transfer_config

    config = parse_kv_transfer_config(kv_transfer_config)
    if caps.host_kv is None:
        raise KVTransferConfigError(f"--kv-transfer-config: the {manifest.target} executor's KV pool is device "
                                    "memory; PD over NIXL is built for host pools (ort) only")
    return PDConnector.start(config, manifest.kv.paged_layout, caps.host_kv.pools, BundleIdentity.of(manifest).hex)


def request_params(connector: PDConnector | None, raw: object, block_size: int,
                   prompt_token_ids: Sequence[int]) -> KVTransferParams | None:
    """A request's ``kv_transfer_params`` checked against this replica's role and layout, and a decode leg's
    against its prompt (:meth:`KVTransferParams.prompt_mismatch`); raises ValueError with one line (the server
    answers 400, param ``kv_transfer_params``). On a ``kv_producer`` replica a request without them is a prefill
    leg."""
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
    mismatch = params.prompt_mismatch(prompt_token_ids, block_size) if params.pulls_blocks else None
    if mismatch is not None:
        raise ValueError(f"kv_transfer_params: {mismatch}")
    return params
