"""Prefill/decode disaggregation's transfer layer: vLLM's NixlConnector protocol (``kv_transfer_params``,
``--kv-transfer-config``) as data, the side-channel handshake, and KV block reads over NIXL.

Importing this package never imports NIXL (only constructing a :class:`NixlKVAgent` does), so omforge without the
cluster extra imports and serves. ``docs/pd.md`` has the protocol, its sources in vLLM and SMG, and what the engine
integration still owns (pinning prefill blocks until released, decode pre-allocation, release, timeouts).
"""

from omforge.runtime.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config, side_channel_address
from omforge.runtime.kv_transfer.errors import (
    ClusterExtraMissing,
    KVLayoutMismatch,
    KVTransferConfigError,
    KVTransferError,
    KVTransferParamsError,
    KVTransferTimeout,
)
from omforge.runtime.kv_transfer.handshake import AgentMetadata, HandshakeListener, fetch_metadata
from omforge.runtime.kv_transfer.nixl_agent import NixlKVAgent, Peer, PendingRead, TransferStats, load_nixl
from omforge.runtime.kv_transfer.params import (
    HeartbeatNotif,
    KVTransferParams,
    ReleaseNotif,
    check_layout,
    parse_kv_transfer_params,
    parse_notif,
    prefill_response_params,
    prompt_hash,
    release_notif,
)

__all__ = [
    "AgentMetadata", "ClusterExtraMissing", "HandshakeListener", "HeartbeatNotif", "KVLayoutMismatch",
    "KVTransferConfig", "KVTransferConfigError", "KVTransferError", "KVTransferParams", "KVTransferParamsError",
    "KVTransferTimeout", "NixlKVAgent", "PendingRead", "Peer", "ReleaseNotif", "TransferStats", "check_layout",
    "fetch_metadata", "load_nixl", "parse_kv_transfer_config", "parse_kv_transfer_params", "parse_notif",
    "prefill_response_params", "prompt_hash", "release_notif", "side_channel_address",
]
