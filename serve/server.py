"""``omforge serve BUNDLE``: load the bundle, start the engine thread, run uvicorn on one bound socket.

Startup prints one line with the URL and what was loaded (tests and scripts read the URL from it, so
``--port 0`` works). SIGTERM / Ctrl-C: the listening socket closes, ``/health`` turns 503, running requests
finish within ``drain_timeout`` seconds (then they are cancelled, which aborts them), the engine thread stops.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from omforge.errors import OmforgeError
from omforge.runtime.engine import LLMEngine
from omforge.runtime.pooling import open_engine
from omforge.serve.api import build_app
from omforge.serve.async_engine import AsyncEngine
from omforge.serve.http_protocol import DEFAULT_HEADER_TIMEOUT_S, with_header_timeout
from omforge.serve.metrics import ServerMetrics
from omforge.serve.state import ServerState
from omforge.serve.tools import detect_format

log = logging.getLogger("omforge.serve")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    log_level: str = "warning"
    tool_call_parser: str = "auto"  # auto: from the chat template (serve/tools.py); or hermes, llama3_json, mistral
    body_timeout: float = 30.0  # seconds to receive a request body (a half-sent body then gets a 408)
    max_request_body_bytes: int = 8 << 20  # a larger request body gets a 413
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # seconds to receive a request's headers (then: closed)


def _log_to_stderr(level: str) -> None:
    """The server's own log (``omforge.serve``) on stderr at ``--log-level``, as uvicorn's is."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("omforge serve: %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())


class _Server(uvicorn.Server):
    """uvicorn's server that marks the engine draining as soon as the signal arrives (``/health`` → 503) and
    exits 0 after a SIGTERM drain."""

    engine: AsyncEngine
    drain_timeout: float = 30.0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.engine.draining:
            self.engine.draining = True
            print(f"omforge serve: shutting down, draining {self.engine.num_in_flight} sequence(s) "
                  f"(at most {self.drain_timeout:g}s)", file=sys.stderr, flush=True)
            self.engine.drain_deadline(self.drain_timeout)
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()  # a drained shutdown exits 0; uvicorn would re-raise SIGTERM and die by it


class ServeStartError(OmforgeError):
    """The server cannot start where it was told to (the port, the host): one line naming the flag."""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket on ``host:port``, bound before anything is loaded (as vLLM does): a port in use, a
    host that does not resolve or a port outside 0…65535 is a :class:`ServeStartError` at once, not after the
    bundle's load and the KV pool's allocation."""
    if not 0 <= port <= 65535:
        raise ServeStartError(f"--port: {port} is not a TCP port (0 … 65535; 0 picks a free one)")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = min(found, key=lambda a: a[0] != socket.AF_INET)  # IPv4 first
    except (socket.gaierror, UnicodeError) as exc:
        raise ServeStartError(f"--host: {host!r} does not resolve to an address on this machine "
                              f"({exc.args[-1] if exc.args else exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeStartError(f"--port: {port} on {host} is already in use (another server?); pick another "
                                  "port, or --port 0 for a free one") from None
        raise ServeStartError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(bundle: str | Path, options: ServeOptions, **engine_options: Any) -> int:
    t0 = time.perf_counter()
    _log_to_stderr(options.log_level)
    sock = bind(options.host, options.port)
    try:
        return _serve(bundle, options, sock, t0, **engine_options)
    finally:
        sock.close()


def _serve(bundle: str | Path, options: ServeOptions, sock: socket.socket, t0: float, **engine_options: Any) -> int:
    # the pool's memory resident from the start; streamed outputs: the decode-step token budget applies
    engine = open_engine(bundle, prefault_kv=True, serving=True, **engine_options)
    cfg = engine.engine_config
    name = options.served_model_name or engine.manifest.model.name
    if engine.lora is not None and name in engine.lora.names():
        engine.close()
        raise ServeStartError(f"--lora-modules: the adapter name '{name}' is the base model's (its served name); "
                              "pick another")
    if isinstance(engine, LLMEngine):  # not at the first grammar, stalling every thread of a running server
        engine.prepare_structured_output()
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, max_waiting_requests=cfg.max_waiting_requests,
                               max_queue_delay_s=cfg.max_queue_delay_us / 1e6, metrics=metrics,
                               max_queue_time_s=cfg.max_queue_time_s, explicit_waiting=cfg.explicit_waiting)
    metrics.after_step(async_engine.snapshot(), [])  # the pool's size and an empty engine, before any request
    template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
    tool_format = detect_format(template) if options.tool_call_parser == "auto" else options.tool_call_parser
    state = ServerState(async_engine, metrics, name, options.api_key, engine.max_model_len, int(time.time()),
                        tool_format, options.body_timeout, options.max_request_body_bytes,
                        cfg.lora_dirs if cfg.enable_runtime_lora else None)
    app = build_app(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.draining = True
        async_engine.stop()

    app.router.lifespan_context = lifespan
    sock.listen(2048)  # before the URL is printed: a client that connects at once waits in the backlog
    host, port = sock.getsockname()[:2]
    st = engine.snapshot()
    kv = st.kv
    if engine.manifest.pooling is None:
        kv_gib = kv.num_blocks * engine.block_size * engine.layout.bytes_per_token / (1 << 30)
        pool = f"{kv.num_blocks} KV blocks of {engine.block_size} tokens ({kv_gib:.2f} GiB, allocated)"
    else:
        pool = f"task {engine.manifest.task}, no KV pool"
    print(f"omforge serve: {name} ({engine.manifest.target}, {engine.config.num_hidden_layers} layers) from "
          f"{bundle}, {pool}, max_num_seqs "
          f"{engine.engine_config.max_num_seqs}, context {engine.max_model_len}, loaded in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    if engine.lora is not None:
        adapters = ", ".join(engine.lora.names()) or "none yet"
        runtime = f"runtime loads from {', '.join(cfg.lora_dirs or ())}" if cfg.enable_runtime_lora else \
            "runtime loading off (--enable-runtime-lora)"
        print(f"omforge serve: LoRA: {cfg.max_loras} of {engine.manifest.lora.max_loras} adapter slot(s) resident "
              f"at once, rank <= {engine.manifest.lora.max_rank}; adapters: {adapters} (at most {cfg.max_cpu_loras}; "
              f"{runtime})", flush=True)
        if cfg.enable_runtime_lora and not options.api_key:
            log.warning("runtime LoRA loading is on without --api-key: any client may load adapters from %s",
                        ", ".join(cfg.lora_dirs or ()))
    if st.hicache is not None:
        for name, tier in st.hicache.tiers.items():
            where = f" {engine.engine_config.hicache_storage_dir}" if name == "storage" else ""
            print(f"omforge serve: hierarchical cache: {name} tier{where} ({tier.blocks} blocks, "
                  f"{tier.bytes / (1 << 30):.2f} of {tier.capacity_bytes / (1 << 30):.2f} GiB)", flush=True)
    print(f"omforge serve: listening on http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
          f"{' (API key required)' if options.api_key else ''}", flush=True)
    # uvicorn's own graceful timeout is longer than the drain: at the drain timeout the engine ends what is left
    # with an error event (AsyncEngine.end_all), and those responses are written before connections close
    config = uvicorn.Config(app, log_level=options.log_level, timeout_graceful_shutdown=options.drain_timeout + 5,
                            access_log=False, lifespan="on", timeout_keep_alive=30,
                            http=with_header_timeout(options.header_timeout))
    server = _Server(config)
    server.engine, server.drain_timeout = async_engine, options.drain_timeout
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:  # the engine thread has stopped (lifespan exit): release the executor (AscendCL: device and buffers)
        released = not async_engine.running
        if released:
            engine.close()
    print(f"omforge serve: stopped ({engine.stats.finished} sequences finished, "
          f"{engine.stats.generation_tokens} tokens generated; executor "
          f"{'released' if released else 'NOT released: the engine thread did not stop'})", flush=True)
    return 0

