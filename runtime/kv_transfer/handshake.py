"""The side channel a decode replica asks a prefill replica's NIXL agent metadata and pool layout on.

vLLM's shape (``nixl/base_scheduler.py`` 0.33.0 lines 342-383, ``nixl/base_worker.py`` lines 1102-1256): the
prefill replica listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`` (a ZMQ ROUTER socket); the decode replica, the
first time it meets an engine id in a request's ``kv_transfer_params``, connects (ZMQ REQ), sends
``GET_META_MSG`` with the rank it wants, waits at most 5 s (``RCVTIMEO``), receives the engine's
``NixlAgentMetadata`` (engine id, NIXL agent metadata bytes, the pools' base addresses, block count, bytes per
block, layout, block size) behind a compatibility hash, checks that the engine id is the one the request named,
then loads the agent metadata with ``add_remote_agent``.

omforge does the same exchange without ZMQ and msgpack, which are not among its dependencies (nor installed
with the cluster extra): a TCP socket, one request and one reply, each frame a 4-byte big-endian length then the
bytes. Request: the JSON object ``{"msg": "get_meta_msg", "version": 1, "tp_rank": 0}``. Reply: a JSON header
(:meth:`AgentMetadata.header`, or ``{"ok": false, "error": ...}``), then the agent metadata bytes as they are.
A thread per connection, a timeout on every socket operation on both sides and a bound on frame sizes keep a slow
or hostile peer from holding either side. It is not a vLLM wire-compatible endpoint: only omforge replicas
handshake with each other (the gateway only relays ``kv_transfer_params``).
"""

from __future__ import annotations

import errno
import json
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from omforge.contract import PagedLayout
from omforge.errors import one_line
from omforge.runtime.kv_transfer.errors import KVTransferConfigError, KVTransferError, KVTransferTimeout

HANDSHAKE_VERSION = 1
GET_META_MSG = "get_meta_msg"  # vLLM's GET_META_MSG (``nixl/metadata.py`` 0.33.0 line 21)
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0  # vLLM's RCVTIMEO for the handshake (``nixl/base_worker.py`` line 1161)
MAX_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class AgentMetadata:
    """What a peer needs to read our blocks (vLLM's ``NixlAgentMetadata``): pools are ``base_addrs`` in a fixed
    order (the same on both sides), each ``num_blocks`` blocks of ``block_len`` bytes laid end to end."""

    engine_id: str
    agent_metadata: bytes
    base_addrs: tuple[int, ...]
    num_blocks: int
    block_len: int
    layout: PagedLayout
    model_fingerprint: str = ""

    def header(self) -> dict[str, Any]:
        """The JSON-able part of the reply (everything but the agent metadata bytes)."""
        lay = self.layout
        return {"ok": True, "version": HANDSHAKE_VERSION, "engine_id": self.engine_id,
                "base_addrs": list(self.base_addrs), "num_blocks": self.num_blocks, "block_len": self.block_len,
                "layout": {"num_layers": lay.num_layers, "kv_heads": lay.kv_heads, "head_dim": lay.head_dim,
                           "block_size": lay.block_size, "kv_dtype": lay.kv_dtype, "row_elems": lay.row_elems},
                "model_fingerprint": self.model_fingerprint, "agent_metadata_len": len(self.agent_metadata)}

    @classmethod
    def from_wire(cls, header: dict[str, Any], blob: bytes) -> AgentMetadata:
        """The metadata a listener sent; raises KeyError/TypeError/ValueError on a malformed header."""
        lay = header["layout"]
        layout = PagedLayout(int(lay["num_layers"]), int(lay["kv_heads"]), int(lay["head_dim"]),
                             int(lay["block_size"]), str(lay["kv_dtype"]))
        if layout.row_elems != int(lay["row_elems"]):
            raise ValueError(f"row_elems {lay['row_elems']} disagrees with its layout's {layout.row_elems}")
        if len(blob) != int(header["agent_metadata_len"]):
            raise ValueError("agent metadata length disagrees with the header")
        return cls(str(header["engine_id"]), blob, tuple(int(a) for a in header["base_addrs"]),
                   int(header["num_blocks"]), int(header["block_len"]), layout, str(header["model_fingerprint"]))


class HandshakeListener:
    """Serves ``metadata`` to every peer that asks, on ``host:port`` (port 0: a free one, see :attr:`address`),
    from a daemon thread, until :meth:`close`. Each connection gets its own thread and ``timeout_s`` per socket
    operation."""

    def __init__(self, metadata: AgentMetadata, host: str, port: int,
                 timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S):
        reply = (json.dumps(metadata.header()).encode(), metadata.agent_metadata)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(timeout_s)
                try:
                    ask = json.loads(_recv_frame(self.request))
                    if not isinstance(ask, dict) or ask.get("msg") != GET_META_MSG:
                        _send_frames(self.request, json.dumps({"ok": False, "error": "expected get_meta_msg"}).encode())
                        return
                    _send_frames(self.request, *reply)
                except (OSError, ValueError):
                    return  # a peer that went away or spoke nonsense: nothing to answer

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kv-transfer-handshake", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop listening (idempotent); returns once the accept loop has ended."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()

    def __enter__(self) -> HandshakeListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listen(metadata: AgentMetadata, host: str, port: int) -> HandshakeListener:
    """The prefill replica's side channel on ``host:port``; a port another process holds (two ``kv_both`` or
    ``kv_producer`` replicas on one host, both on vLLM's default 5600) is one line naming the variable to change."""
    try:
        return HandshakeListener(metadata, host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise KVTransferConfigError(f"VLLM_NIXL_SIDE_CHANNEL_PORT: port {port} on {host} is in use (another replica "
                                    "on this host?); give each replica its own side-channel port") from None


def fetch_metadata(host: str, port: int, *, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
                   expected_engine_id: str | None = None) -> AgentMetadata:
    """Ask the listener at ``host:port`` for its metadata, all within ``timeout_s``. Raises
    :class:`KVTransferTimeout` past it and :class:`KVTransferError` (one line) on a refused connection, a
    malformed or refused reply, another protocol version, or an engine id other than ``expected_engine_id``
    (vLLM's check, ``nixl/base_worker.py`` lines 1228-1234)."""
    where = f"KV transfer handshake with {host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            ask = {"msg": GET_META_MSG, "version": HANDSHAKE_VERSION, "tp_rank": 0}
            _send_frames(sock, json.dumps(ask).encode(), deadline=deadline)
            header = json.loads(_recv_frame(sock, deadline=deadline))
            if not isinstance(header, dict) or not header.get("ok"):
                error = header.get("error") if isinstance(header, dict) else header
                raise KVTransferError(f"{where}: refused ({error})")
            if header.get("version") != HANDSHAKE_VERSION:
                raise KVTransferError(f"{where}: the peer speaks handshake version {header.get('version')!r}, this "
                                      f"replica {HANDSHAKE_VERSION}")
            meta = AgentMetadata.from_wire(header, _recv_frame(sock, deadline=deadline))
    except TimeoutError:
        raise KVTransferTimeout(f"{where}: no answer within {timeout_s:g} s") from None
    except OSError as e:
        raise KVTransferError(f"{where}: {one_line(e)}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise KVTransferError(f"{where}: malformed reply ({one_line(e)})") from None
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise KVTransferError(f"{where}: engine id mismatch: the request names {expected_engine_id!r}, the peer is "
                              f"{meta.engine_id!r}")
    return meta


def _send_frames(sock: socket.socket, *frames: bytes, deadline: float | None = None) -> None:
    for frame in frames:
        _settle(sock, deadline)
        sock.sendall(struct.pack(">I", len(frame)) + frame)


def _recv_frame(sock: socket.socket, deadline: float | None = None) -> bytes:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return _recv_exact(sock, size, deadline)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < size:
        _settle(sock, deadline)
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _settle(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next socket operation by what is left of ``deadline`` (None: the socket's own timeout)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
