"""``--kv-transfer-config``: vLLM's ``KVTransferConfig`` JSON, validated, with one-line errors naming the field.

The field names and their rules are vLLM's (``vllm/config/kv_transfer.py``, vLLM 0.33.0, lines 56-124): ``kv_role``
is one of ``kv_producer``, ``kv_consumer``, ``kv_both`` and is required once ``kv_connector`` is set; ``engine_id``
defaults to a fresh UUID (line 111-112). vLLM 0.33 deprecates ``kv_both`` for NixlConnector in favour of
``kv_producer`` on prefill and ``kv_consumer`` on decode replicas (``nixl/connector.py`` lines 97-103); omforge
accepts all three, as vLLM still does. NixlConnector's own knobs live in ``kv_connector_extra_config``:
``backends`` (default ``["UCX"]``, ``nixl/base_worker.py`` line 625), ``num_threads`` and ``kv_lease_duration``
(seconds a prefill replica keeps finished blocks for a decode replica to read, default 30,
``nixl/base_scheduler.py`` lines 82-86). Other extra keys are kept and ignored, as vLLM ignores the keys a
connector does not read.

The side channel a decode replica handshakes with is not in this config but in vLLM's environment variables
``VLLM_NIXL_SIDE_CHANNEL_HOST`` (default ``localhost``) and ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (default 5600)
(``vllm/envs.py`` lines 232-233, 1721-1727); :func:`side_channel_address` reads them the same way.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omforge.runtime.kv_transfer.errors import KVTransferConfigError

NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector")
"""The connector names omforge speaks: vLLM's NixlConnector, a backward-compatible alias of NixlPullConnector
(READ-based pull by the decode side) in vLLM 0.33 (``nixl/connector.py`` lines 12, 350)."""
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_BUFFER_DEVICES = ("cpu",)
"""omforge registers its host (numpy) pools with NIXL, so the transfer buffer is host memory: vLLM's ``cpu``."""
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_KV_PORT = 14579
DEFAULT_LEASE_S = 30.0
DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600
FLAG = "--kv-transfer-config"


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated ``--kv-transfer-config``. Invariant: ``kv_connector`` is a NIXL connector and ``kv_role`` one
    of :data:`KV_ROLES`; ``backends`` is a non-empty tuple of NIXL backend names; ``lease_s`` > 0."""

    kv_connector: str
    kv_role: str
    engine_id: str
    kv_buffer_device: str = "cpu"
    kv_port: int = DEFAULT_KV_PORT
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    @property
    def is_kv_producer(self) -> bool:
        """This replica may serve prefill legs (``do_remote_decode``) and keep their blocks for a peer."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """This replica may serve decode legs (``do_remote_prefill``) and pull blocks from a peer."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.kv_connector_extra_config.get("backends", ("UCX",)))

    @property
    def num_threads(self) -> int:
        return int(self.kv_connector_extra_config.get("num_threads", 0))

    @property
    def lease_s(self) -> float:
        """How long a prefill replica keeps a finished request's blocks pinned waiting for the decode side."""
        return float(self.kv_connector_extra_config.get("kv_lease_duration", DEFAULT_LEASE_S))


def parse_kv_transfer_config(value: str | Mapping[str, Any], source: str = FLAG) -> KVTransferConfig:
    """The config in ``value`` (the flag's JSON text, or an already decoded mapping).

    Raises :class:`KVTransferConfigError` with one line ``"<source>: <field>: <what is wrong>"``."""
    raw = _decode(value, source)
    known = {"kv_connector", "kv_role", "engine_id", "kv_buffer_device", "kv_port", "kv_connector_extra_config",
             "kv_load_failure_policy", "enable_permute_local_kv", "kv_connector_module_path"}
    for name in raw:
        if name not in known:
            raise KVTransferConfigError(f"{source}: unknown field {name!r} (vLLM's KVTransferConfig fields omforge "
                                        f"reads: {', '.join(sorted(known))})")

    def bad(name: str, why: str) -> KVTransferConfigError:
        return KVTransferConfigError(f"{source}: {name}: {why}")

    connector = raw.get("kv_connector")
    if connector is None:
        raise bad("kv_connector", f"missing; omforge speaks {' or '.join(NIXL_CONNECTORS)}")
    if connector not in NIXL_CONNECTORS:
        raise bad("kv_connector", f"{connector!r} is not supported; omforge speaks {' or '.join(NIXL_CONNECTORS)}")
    role = raw.get("kv_role")
    if role is None:
        raise bad("kv_role", f"required when kv_connector is set; one of {', '.join(KV_ROLES)}")
    _one_of(role, KV_ROLES, bad("kv_role", f"{role!r} is not one of {', '.join(KV_ROLES)}"))
    engine_id = raw.get("engine_id")
    if engine_id is None:
        engine_id = str(uuid.uuid4())
    elif not isinstance(engine_id, str) or not engine_id:
        raise bad("engine_id", f"must be a non-empty string, got {engine_id!r}")
    device = raw.get("kv_buffer_device", "cpu")
    _one_of(device, KV_BUFFER_DEVICES, bad("kv_buffer_device", f"{device!r}: omforge registers host pools, so only "
                                           "'cpu' is supported"))
    port = raw.get("kv_port", DEFAULT_KV_PORT)
    if not _is_int(port) or not 1 <= port <= 65535:
        raise bad("kv_port", f"must be a port number 1-65535, got {port!r}")
    policy = raw.get("kv_load_failure_policy", "fail")
    _one_of(policy, KV_LOAD_FAILURE_POLICIES, bad("kv_load_failure_policy", f"{policy!r} is not one of "
                                                  f"{', '.join(KV_LOAD_FAILURE_POLICIES)}"))
    if raw.get("enable_permute_local_kv", False) is not False:
        raise bad("enable_permute_local_kv", "omforge's pools have one layout on both sides; only false is supported")
    if raw.get("kv_connector_module_path") is not None:
        raise bad("kv_connector_module_path", "omforge loads no connector modules; leave it unset")
    extra = _extra(raw.get("kv_connector_extra_config", {}), source)
    return KVTransferConfig(connector, role, engine_id, device, port, extra, policy)


def _extra(extra: Any, source: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` with the NIXL keys omforge reads checked (the rest kept as given)."""
    where = f"{source}: kv_connector_extra_config"
    if not isinstance(extra, Mapping):
        raise KVTransferConfigError(f"{where}: must be a JSON object, got {extra!r}")
    backends = extra.get("backends", ["UCX"])
    if not isinstance(backends, list | tuple) or not backends or not all(isinstance(b, str) and b for b in backends):
        raise KVTransferConfigError(f"{where}.backends: must be a non-empty list of NIXL backend names, got "
                                    f"{backends!r}")
    threads = extra.get("num_threads", 0)
    if not _is_int(threads) or threads < 0:
        raise KVTransferConfigError(f"{where}.num_threads: must be a whole number >= 0, got {threads!r}")
    lease = extra.get("kv_lease_duration", DEFAULT_LEASE_S)
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
        raise KVTransferConfigError(f"{where}.kv_lease_duration: must be a positive number of seconds, got {lease!r}")
    return {**extra, "backends": list(backends)}


def side_channel_address(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The host and port this replica's handshake listener binds and advertises as ``remote_host`` /
    ``remote_port``: vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``."""
    env = os.environ if env is None else env
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", DEFAULT_SIDE_CHANNEL_HOST)
    text = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", str(DEFAULT_SIDE_CHANNEL_PORT))
    if not host:
        raise KVTransferConfigError("VLLM_NIXL_SIDE_CHANNEL_HOST: must not be empty")
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise KVTransferConfigError(f"VLLM_NIXL_SIDE_CHANNEL_PORT: must be a port number 1-65535, got {text!r}")
    return host, int(text)


def _decode(value: str | Mapping[str, Any], source: str) -> Mapping[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise KVTransferConfigError(f"{source}: not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise KVTransferConfigError(f"{source}: must be a JSON object, got {value!r}")
    return value


def _one_of(value: Any, allowed: tuple[str, ...], error: KVTransferConfigError) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise error


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
