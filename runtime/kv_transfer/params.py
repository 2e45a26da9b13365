"""vLLM's ``kv_transfer_params`` protocol as data: what a request carries, what a prefill replica answers, the
layout both replicas must share, and the notifications a decode replica sends the prefill replica over NIXL.

The flow (vLLM's NixlConnector in pull mode, driven by any proxy written for it — vLLM's toy proxy
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` ``send_request_to_service``, SMG's
``NIXL_PREFILL_KV_PARAMS`` in ``model_gateway/src/routers/grpc/common/stages/request_execution.rs`` line 53):

1. The proxy sends the *prefill leg* with ``{"do_remote_decode": true}`` (vLLM's proxy adds
   ``"do_remote_prefill": false`` and the ``remote_*`` fields as null), ``max_tokens: 1``, ``stream: false``.
2. The prefill replica computes the prompt, keeps the request's blocks pinned, and answers (in the response body's
   top-level ``kv_transfer_params``) :func:`prefill_response_params`: ``do_remote_prefill: true``, its engine id,
   side-channel host/port, the block ids and the request id (vLLM 0.33.0 ``nixl/pull_scheduler.py`` lines 278-293;
   vLLM 0.11.0 ``nixl_connector.py`` lines 448-455).
3. The proxy copies that dict into the *decode leg*. The decode replica handshakes with the side channel (once per
   engine), pulls the blocks with a NIXL READ whose completion notification is :func:`release_notif` (the prefill
   side frees the blocks on it), and decodes. Without the notification the prefill side frees them when its lease
   (``kv_lease_duration``, 30 s) runs out.

The decode leg needs ``remote_engine_id``, ``remote_request_id``, ``remote_host`` and ``remote_port`` whenever
``remote_block_ids`` is non-empty (vLLM ``nixl/pull_scheduler.py`` lines 135-184; vLLM logs and skips the transfer,
omforge refuses with one line); with no block ids it prefills locally. Field reads follow vLLM's
``nixl/metadata.py`` lines 291-346 (``tp_size`` defaults to 1). Keys omforge does not read (``dcp_size``,
``transfer_mode``, vLLM's private ``_p_side_truncated`` …) are kept in ``extra`` and round-trip unchanged.

A decode leg's blocks are the KV of the prompt its prefill leg computed, so a decode replica reads them only for
that prompt (:meth:`KVTransferParams.prompt_mismatch`): ``remote_num_tokens`` must be its length and omforge's own
optional ``omforge_prompt_hash`` (:func:`prompt_hash`; vLLM's params have no such field) its token ids' hash.
``remote_blocks_expiry_time`` is the prefill side's lease end, wall-clock epoch seconds (``time.time()``, as vLLM
writes it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omforge.contract import PagedLayout, cdiv
from omforge.runtime.kv_transfer.errors import KVLayoutMismatch, KVTransferParamsError

WHERE = "kv_transfer_params"
_KNOWN = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host",
          "remote_port", "remote_block_ids", "tp_size", "remote_num_tokens", "remote_blocks_expiry_time",
          "remote_block_size", "omforge_prompt_hash")
_DECODE_NEEDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class KVTransferParams:
    """One request's ``kv_transfer_params``, validated. Invariant: not both ``do_remote_decode`` and
    ``do_remote_prefill``; a decode leg with block ids has every field of ``_DECODE_NEEDS``."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: tuple[int, ...] = ()
    tp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    remote_block_size: int | None = None
    omforge_prompt_hash: str | None = None  # omforge's own: :func:`prompt_hash` of the prompt the blocks hold
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_prefill_leg(self) -> bool:
        """This replica prefills and keeps the blocks for a remote decode (vLLM: ``do_remote_decode``)."""
        return self.do_remote_decode

    @property
    def is_decode_leg(self) -> bool:
        """This replica pulls the prompt's blocks from a remote prefill (vLLM: ``do_remote_prefill``)."""
        return self.do_remote_prefill

    @property
    def pulls_blocks(self) -> bool:
        """A decode leg with blocks to read (an empty list: the prefill side had none; prefill locally)."""
        return self.do_remote_prefill and bool(self.remote_block_ids)

    def prompt_mismatch(self, prompt_token_ids: Sequence[int], block_size: int) -> str | None:
        """Why this decode leg's blocks cannot hold ``prompt_token_ids``'s KV (one line naming the field), or None
        when they can: ``remote_num_tokens`` is not the prompt's length, ``omforge_prompt_hash`` not its hash, or
        ``remote_block_ids`` too few for it. Fields that are absent are not checked."""
        n = len(prompt_token_ids)
        if self.remote_num_tokens is not None and self.remote_num_tokens != n:
            return (f"remote_num_tokens is {self.remote_num_tokens} but this prompt has {n} tokens: a decode leg "
                    "carries the prompt its prefill leg computed")
        if self.omforge_prompt_hash is not None and self.omforge_prompt_hash != prompt_hash(prompt_token_ids):
            return ("omforge_prompt_hash does not match this prompt's tokens: a decode leg carries the prompt its "
                    "prefill leg computed")
        if len(self.remote_block_ids) < cdiv(n, block_size):
            return (f"remote_block_ids has {len(self.remote_block_ids)} blocks but this prompt's {n} tokens fill "
                    f"{cdiv(n, block_size)}")
        return None

    def to_dict(self) -> dict[str, Any]:
        """The wire form (block ids as a flat list, vLLM 0.11's shape; :func:`parse_kv_transfer_params` also
        reads vLLM 0.33's one-group ``[[...]]``), unknown keys included."""
        out: dict[str, Any] = dict(self.extra)
        for name in _KNOWN:
            value = getattr(self, name)
            out[name] = list(value) if name == "remote_block_ids" else value
        return out


def parse_kv_transfer_params(raw: Any, where: str = WHERE) -> KVTransferParams | None:
    """The request's params (None or ``{}``: the request takes no part in PD). Raises
    :class:`KVTransferParamsError` with one line naming the field."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, Mapping):
        raise KVTransferParamsError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    decode, prefill = _flag(raw, "do_remote_decode", where), _flag(raw, "do_remote_prefill", where)
    if decode and prefill:
        raise KVTransferParamsError(f"{where}: do_remote_decode and do_remote_prefill are both true; a request is "
                                    "either the prefill leg or the decode leg")
    params = KVTransferParams(
        do_remote_decode=decode, do_remote_prefill=prefill,
        remote_engine_id=_opt_str(raw, "remote_engine_id", where),
        remote_request_id=_opt_str(raw, "remote_request_id", where),
        remote_host=_opt_str(raw, "remote_host", where),
        remote_port=_opt_int(raw, "remote_port", where, 1, 65535),
        remote_block_ids=_block_ids(raw.get("remote_block_ids"), where),
        tp_size=_opt_int(raw, "tp_size", where, 1) or 1,
        remote_num_tokens=_opt_int(raw, "remote_num_tokens", where, 0),
        remote_blocks_expiry_time=_opt_float(raw, "remote_blocks_expiry_time", where),
        remote_block_size=_opt_int(raw, "remote_block_size", where, 1),
        omforge_prompt_hash=_opt_str(raw, "omforge_prompt_hash", where),
        extra={k: v for k, v in raw.items() if k not in _KNOWN})
    if params.is_decode_leg:
        _check_decode_leg(params, where)
    return params


def _check_decode_leg(params: KVTransferParams, where: str) -> None:
    if params.tp_size != 1:
        raise KVTransferParamsError(f"{where}: tp_size {params.tp_size}: omforge pulls from a prefill engine of one "
                                    "rank (tp_size 1)")
    if params.remote_block_ids:
        for name in _DECODE_NEEDS:
            if getattr(params, name) is None:
                raise KVTransferParamsError(f"{where}: do_remote_prefill with remote_block_ids needs {name}")


def prefill_response_params(*, engine_id: str, request_id: str, block_ids: Sequence[int], host: str, port: int,
                            num_tokens: int, block_size: int, expiry_time: float | None = None,
                            prompt_digest: str | None = None) -> dict[str, Any]:
    """What a prefill replica answers for a finished prefill leg: the decode leg's ``kv_transfer_params``.

    vLLM 0.33's keys (``nixl/pull_scheduler.py`` lines 278-293) with omforge's values: one rank (``tp_size``,
    ``dcp_size``, ``pp_size`` 1), pull mode, ``remote_blocks_expiry_time`` the held blocks' lease end
    (``expiry_time``, wall-clock epoch seconds), plus ``remote_block_size`` so a decode replica of another block
    size refuses before it handshakes and ``omforge_prompt_hash`` (``prompt_digest``: :func:`prompt_hash` of the
    prompt) so it reads the blocks for that prompt only."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [int(b) for b in block_ids],
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": int(port), "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": int(num_tokens),
            "remote_blocks_expiry_time": expiry_time, "remote_registration_generation": 0, "transfer_mode": "pull",
            "remote_block_size": int(block_size), "omforge_prompt_hash": prompt_digest}


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A prompt's identity in ``omforge_prompt_hash``: BLAKE2b-128 of its token ids as little-endian int64, hex."""
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def check_layout(local: PagedLayout, remote: PagedLayout, remote_engine_id: str = "the peer") -> None:
    """Refuse a peer whose pool blocks are not byte-compatible with ours (vLLM refuses a different block size,
    ``nixl_connector.py`` 0.11.0 line 1005, and hashes the model's dtype, KV heads, head size and layer count into
    its handshake, ``nixl/metadata.py`` 0.33.0 lines 146-216). One line naming the first field that differs."""
    for name, ours, theirs in (("block_size", local.block_size, remote.block_size),
                               ("kv_dtype", local.kv_dtype, remote.kv_dtype),
                               ("num_layers", local.num_layers, remote.num_layers),
                               ("kv_heads", local.kv_heads, remote.kv_heads),
                               ("head_dim", local.head_dim, remote.head_dim),
                               ("row_elems", local.row_elems, remote.row_elems)):
        if ours != theirs:
            raise KVLayoutMismatch(f"KV layout mismatch with {remote_engine_id}: {name} {theirs!r} there, {ours!r} "
                                   "here (block size, KV dtype and head layout must match for a KV transfer)")


@dataclass(frozen=True)
class ReleaseNotif:
    """"The decode side has read (or no longer needs) request ``request_id``'s blocks": free them once
    ``consumers`` such notifications came (one per reading rank; 1 for omforge)."""

    request_id: str
    consumers: int


@dataclass(frozen=True)
class HeartbeatNotif:
    """vLLM 0.33's lease renewal from a decode side still waiting to read: extend these requests' leases."""

    request_ids: tuple[str, ...]


def release_notif(request_id: str, consumers: int = 1) -> bytes:
    """The notification a READ carries (or a standalone one, when nothing is read): vLLM's
    ``f"{remote_request_id}:{expected_consumers}"`` (``nixl/pull_worker.py`` 0.33.0 lines 448-450)."""
    return f"{request_id}:{consumers}".encode()


def parse_notif(message: bytes) -> ReleaseNotif | HeartbeatNotif | None:
    """A notification from a decode side, or None if it is neither form (``nixl/pull_worker.py`` 0.33.0 lines
    650-701: ``HB:req1,req2`` is a heartbeat, ``base_worker.py`` line 3540; otherwise ``request_id:count``)."""
    text = message.decode("utf-8", "replace")
    if text.startswith("HB:"):
        return HeartbeatNotif(tuple(r for r in text[3:].split(",") if r))
    request_id, sep, count = text.rpartition(":")
    if not sep or not request_id or not count.isdigit():
        return None
    return ReleaseNotif(request_id, int(count))


def _flag(raw: Mapping[str, Any], name: str, where: str) -> bool:
    value = raw.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KVTransferParamsError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _opt_str(raw: Mapping[str, Any], name: str, where: str) -> str | None:
    value = raw.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise KVTransferParamsError(f"{where}: {name} must be a non-empty string, got {value!r}")
    return value


def _opt_int(raw: Mapping[str, Any], name: str, where: str, low: int, high: int | None = None) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"{low}-{high}" if high is not None else f">= {low}"
        raise KVTransferParamsError(f"{where}: {name} must be a whole number {span}, got {value!r}")
    return value


def _opt_float(raw: Mapping[str, Any], name: str, where: str) -> float | None:
    value = raw.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise KVTransferParamsError(f"{where}: {name} must be a number, got {value!r}")
    return None if value is None else float(value)


def _block_ids(value: Any, where: str) -> tuple[int, ...]:
    """A flat list of block ids (vLLM 0.11), or one KV cache group's list in a list (vLLM 0.33's ``BlockIds``,
    ``kv_connector/utils.py`` line 35); omforge has one group, so several are refused."""
    if value is None:
        return ()
    if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
        if len(value) != 1:
            raise KVTransferParamsError(f"{where}: remote_block_ids has {len(value)} KV cache groups; omforge has one")
        value = value[0]
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                              for b in value):
        raise KVTransferParamsError(f"{where}: remote_block_ids must be a list of block ids (whole numbers >= 0)")
    if len(set(value)) != len(value):
        raise KVTransferParamsError(f"{where}: remote_block_ids repeats a block id")
    return tuple(value)
