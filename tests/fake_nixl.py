"""FAKE NIXL for PD tests in one process: agents on one :class:`Fabric` read each other's numpy pools.

It stands in for :class:`~omforge.runtime.kv_transfer.nixl_agent.NixlKVAgent` under the PD connector, with the
failure modes real NIXL showed (tests/test_kv_transfer.py runs the real one where the cluster extra is installed):
a READ completes when the fabric's clock reaches its ``done_at`` (set by the test, or ``delay`` after it started),
then copies the peer's blocks and posts the release notification to the peer's inbox; a read whose peer was
removed fails ``NIXL_ERR_NOT_FOUND`` (what real NIXL answers for the other in-flight reads of a removed peer); a
read may be made uncancellable (``stuck``: release refused until the test lets go); local block ids out of range
raise ValueError as the real agent's checks do. The handshake is implicit: every agent on the fabric is a peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omforge.contract import PagedLayout
from omforge.runtime.kv_transfer.errors import KVTransferError
from omforge.runtime.kv_transfer.nixl_agent import Peer


@dataclass
class Fabric:
    """The agents of one test and their shared clock (seconds, advanced by the test)."""

    now: float = 0.0
    delay: float = 0.0  # a read's duration unless the test sets done_at
    agents: dict[str, FakeAgent] = field(default_factory=dict)
    reads: list[FakeRead] = field(default_factory=list)

    def clock(self) -> float:
        return self.now


class FakeRead:
    """A posted READ (the :class:`~omforge.runtime.kv_transfer.nixl_agent.PendingRead` surface)."""

    def __init__(self, agent: FakeAgent, peer: Peer, remote: list[int], local: list[int], notif: bytes):
        self.agent, self.peer, self.remote, self.local, self.notif = agent, peer, remote, local, notif
        self.started = agent.fabric.now
        self.done_at = self.started + agent.fabric.delay
        self.num_blocks = len(local)
        self.done = False
        self.stuck = False  # NIXL refuses to release it while True
        self.fail: str | None = None  # the state NIXL reports instead of DONE

    def poll(self) -> bool:
        if self.done:
            return True
        if self.peer.engine_id in self.agent.removed and self.fail is None:
            self.fail = "NIXL_ERR_NOT_FOUND"
        if self.fail is None and self.agent.fabric.now < self.done_at:
            return False
        self.done = True
        if self.fail is not None:
            raise KVTransferError(f"KV read from {self.peer.engine_id} failed (NIXL state ERR: {self.fail})")
        source = self.agent.fabric.agents[self.peer.engine_id]
        for mine, theirs in zip(self.agent.pools, source.pools):
            mine[self.local] = theirs[self.remote]
        source.inbox.append((self.agent.engine_id, self.notif))
        return True

    def cancel(self) -> bool:
        if self.stuck:
            return False
        self.done = True
        return True

    def retry_release(self) -> bool:
        """Try again to release an uncancellable read (True once NIXL lets go of it)."""
        return not self.stuck


class FakeAgent:
    def __init__(self, fabric: Fabric, engine_id: str, layout: PagedLayout, pools: Sequence[np.ndarray]):
        self.fabric, self.engine_id, self.layout, self.pools = fabric, engine_id, layout, list(pools)
        self.num_blocks = self.pools[0].shape[0]
        self.block_len = self.pools[0][0].nbytes
        self.inbox: list[tuple[str, bytes]] = []
        self.removed: set[str] = set()
        self.handshakes = 0
        self.active = False
        fabric.agents[engine_id] = self

    def peer(self, engine_id: str) -> Peer | None:
        if engine_id not in self.fabric.agents:
            raise KVTransferError(f"KV transfer handshake with {engine_id}: connection refused")
        self.removed.discard(engine_id)
        self.handshakes += 1
        return Peer(engine_id, engine_id, self.fabric.agents[engine_id].num_blocks, None)

    def add_peer(self, meta: object) -> Peer:
        raise AssertionError("the fake fabric's peers need no handshake")

    def remove_peer(self, engine_id: str) -> None:
        self.removed.add(engine_id)

    def start_read(self, peer: Peer, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                   notif_msg: bytes = b"") -> FakeRead:
        if len(remote_block_ids) != len(local_block_ids) or not local_block_ids:
            raise ValueError("a read needs as many local as remote block ids, at least one")
        if max(remote_block_ids) >= peer.num_blocks or min(remote_block_ids) < 0:
            raise ValueError(f"remote block ids must lie in [0, {peer.num_blocks}) ({peer.engine_id}'s pool)")
        if max(local_block_ids) >= self.num_blocks:
            raise ValueError(f"local block ids must lie in [0, {self.num_blocks})")
        read = FakeRead(self, peer, list(remote_block_ids), list(local_block_ids), notif_msg)
        self.fabric.reads.append(read)
        return read

    def set_active(self, active: bool) -> None:
        self.active = active

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        pass
