"""The engine loop on its own thread, and the asyncio face the HTTP handlers use.

The HTTP event loop never runs the model: ``LLMEngine.step()`` runs on one engine thread (onnxruntime and numpy
release the GIL while they compute, so the event loop keeps answering). Handlers talk to that thread through a
command queue of typed messages (:class:`AddRequest`, :class:`Abort`, :class:`Shutdown`, matched by type) and get
each request's outputs back on an ``asyncio.Queue``, fed once per step with ``loop.call_soon_threadsafe``.

Invariants:
- Only the engine thread touches the ``LLMEngine`` after :meth:`AsyncEngine.start`, but for its intake
  (``check_request``, which reads limits fixed at load) and its LoRA registry (thread-safe); only the event loop
  touches the streams and the in-flight count. A request enters the engine twice: checked once on a worker thread
  (a :class:`~omforge.runtime.input_processor.CheckedRequest`), added once on the engine thread.
- ``num_in_flight`` counts sequences submitted and not yet finished or aborted, each with its
  :class:`~omforge.serve.admission.SeqBound` (prompt, ``max_tokens``, tokens generated so far); a submission the
  :class:`~omforge.serve.admission.QueueBudget` refuses (its sequences are not predicted to start within the
  queue-time bound, or past the configured depth) is refused with :class:`Overloaded` (429), never queued
  without bound. The engine thread feeds the budget every step (its time and tokens, its finishes, the engine's
  running and waiting counts and free KV blocks after it).
- A stream whose consumer stops early (client gone) aborts its request; the engine thread frees its blocks
  before its next step.
- No request waits longer than ``max_queue_time_s`` (checked before every step): one that has not started by then
  is aborted and its group ends with :class:`QueueTimeout`, counted as ``request_rejected{queue_timeout}``.
- LoRA adapters (docs/lora.md): the engine's registry (``model.lora``) is what the server serves; an adapter is
  parsed on a worker thread and registered in it. A request holds its adapter from parsing to submission
  (:meth:`AsyncEngine.holding`: ``LoraRegistry.use``, the one check that it is served, ``UnknownLora``); its
  submission counts its sequences as the adapter's users (``LoraRegistry.join``), which the engine thread ends with
  each sequence (or a refused add). An adapter with users is never unregistered (``LoraInUse``), so no request
  reaches the engine for an adapter it no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from omforge.contract.manifest import PoolingSection
from omforge.errors import OmforgeError
from omforge.runtime.engine import LLMEngine, RequestOutput, UnknownLora
from omforge.runtime.input_processor import CheckedRequest
from omforge.runtime.lora.adapter import LoraError, LoraNameTaken
from omforge.runtime.lora.registry import LoraRegistry
from omforge.runtime.reasoning import ReasoningParser
from omforge.runtime.request import seq_ids
from omforge.runtime.tokenizer import TextTokenizer
from omforge.serve.admission import QueueBudget, SeqBound
from omforge.serve.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("omforge.serve")

FILL_WAIT_CAP = 25
"""The batch-fill wait lasts at most this many ``max_queue_delay`` gaps (50 ms at the default 2 ms)."""
_ARRIVING: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("omforge_arriving", default=None)
"""The handler's own :meth:`AsyncEngine.arriving` count, ``[True]`` until its request is submitted."""


class Overloaded(OmforgeError):
    """The queue is full: the request was not accepted (answer 429 with Retry-After)."""


class EngineUnavailable(OmforgeError):
    """The engine is shutting down or has failed (answer 503)."""


class QueueTimeout(EngineUnavailable):
    """The request waited longer than ``max_queue_time_s`` without starting (answer a retryable 503)."""


class KVTransferFailed(EngineUnavailable):
    """A PD decode leg whose KV could not be read from its prefill replica (answer 503)."""


@dataclass(frozen=True)
class AddRequest:
    """Add one checked prompt (``n`` sequences) to the engine; its adapter's users are counted (submission)."""

    checked: CheckedRequest
    request_id: str
    arrival_time: float


@dataclass(frozen=True)
class Abort:
    """Abort these sequences (unknown or finished ids are ignored); the engine frees their blocks at once."""

    seq_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine thread before its next step; whatever is still running is dropped."""


Command = AddRequest | Abort | Shutdown


@dataclass
class RequestGroup:
    """One HTTP request: one engine request per prompt (``n`` sequences each), all feeding one queue.

    ``prompt_of`` maps each sequence id to the index of its prompt; ``unfinished`` holds the sequence ids that
    have not finished yet (the group is done when it is empty)."""

    prompt_of: dict[str, int]
    unfinished: set[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    lora: str | None = None  # the adapter every sequence of the group runs with


@dataclass(frozen=True)
class ServedModel:
    """What the server reads of the engine, fixed at load (safe from the event loop): the tokenizer (None: token
    ids only), the reasoning parser (``--reasoning-parser``), a pooling bundle's settings (None: generate), the
    limits (``token_budget``: tokens one step carries; ``num_kv_blocks``: 0 without a KV pool), and the LoRA
    registry (None: no adapter slots; ``max_loras`` resident at once)."""

    tokenizer: TextTokenizer | None
    reasoning: ReasoningParser | None
    pooling: PoolingSection | None
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int  # tokens per KV block
    lora: LoraRegistry | None
    max_loras: int | None
    token_budget: int = 512
    num_kv_blocks: int = 0

    @classmethod
    def of(cls, engine: Any) -> ServedModel:
        """The facts of an ``LLMEngine`` or a ``PoolingEngine``."""
        cfg = engine.engine_config
        pooling = engine.manifest.pooling
        return cls(engine.tokenizer, engine.reasoning, pooling, engine.config.vocab_size,
                   engine.max_model_len, cfg.max_num_seqs, engine.block_size, engine.lora, cfg.max_loras,
                   getattr(engine, "token_budget", cfg.max_num_batched_tokens),  # a pooling step holds a whole input
                   cfg.num_kv_blocks if pooling is None else 0)


class AsyncEngine:
    """``group = engine.submit(...)``; ``async for outputs in engine.outputs(group): …`` — one list of
    :class:`RequestOutput` per step.

    ``max_queue_delay_s``: when the engine is idle and a request arrives, wait this long for more before the
    first step, so requests sent together are prefilled together (the recipe's ``max_queue_delay_us``).
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int, max_queue_delay_s: float = 0.002,
                 metrics: ServerMetrics | None = None, max_queue_time_s: float | None = None,
                 explicit_waiting: bool = True):
        self._engine = engine
        self.model = ServedModel.of(engine)
        self.max_queue_time_s = max_queue_time_s
        m = self.model
        self.budget = QueueBudget(m.max_num_seqs, max_waiting_requests, explicit_waiting, max_queue_time_s,
                                  m.token_budget, m.num_kv_blocks, m.block_size,
                                  m.max_loras or 0 if m.lora is not None else 0)
        self.capacity = self.budget.capacity
        self.max_queue_delay_s = max_queue_delay_s
        self.metrics = metrics  # updated from the engine thread
        self.num_in_flight = 0
        self.num_arriving = 0  # requests being parsed / tokenized (event loop writes, engine thread reads)
        self.failure: BaseException | None = None
        self.draining = False
        self._groups: dict[str, RequestGroup] = {}  # unfinished sequence id → its group (event loop only)
        self._bounds: dict[str, SeqBound] = {}  # unfinished sequence id → what admission reads of it (event loop)
        self._cmds: deque[Command] = deque()
        self._cv = threading.Condition()
        self._stopped = False  # a Shutdown was applied (engine thread only)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="omforge-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after the HTTP server drained); anything still running is dropped."""
        self._send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """The engine thread is alive (started and not yet stopped)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def snapshot(self, pending_adds: int = 0) -> EngineSnapshot:
        """The engine's gauges and running totals now, for ``/metrics`` (``LLMEngine.snapshot``). Call it on the
        engine thread, or before :meth:`start`; ``pending_adds`` requests submitted but not yet applied count as
        waiting."""
        return self._engine.snapshot(pending_adds)

    # --- requests (event loop) ----------------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def check(self, prompt_token_ids: Sequence[int], params: Any, lora: str | None = None) -> CheckedRequest:
        """The engine's admission check, once per prompt (raises RequestRejected / SamplingParamsError); see
        ``InputProcessor.check``. Any thread."""
        return self._engine.check_request(prompt_token_ids, params, lora)

    def submit(self, prompts: Sequence[CheckedRequest], request_id: str, arrival_time: float | None = None,
               continuing: bool = False) -> RequestGroup:
        """Queue one request per checked prompt as a group, all or none, with their adapter (one for the group;
        None: the base model), which the caller holds (:meth:`holding`). Raises :class:`Overloaded` when the
        budget refuses the group (``continuing``: the next part of a request already admitted, refused only past
        the capacity), :class:`EngineUnavailable` when draining or failed. Consume the group with :meth:`outputs`
        (which aborts what is left if the consumer stops)."""
        self._require_running()
        lora = prompts[0].lora
        num_seqs = sum(p.n for p in prompts)
        bounds = [self._bound(p) for p in prompts for _ in range(p.n)]
        refused = self.budget.refusal(list(self._bounds.values()), bounds, time.monotonic(), continuing)
        if refused is not None:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            raise Overloaded(f"the server is at capacity ({refused}); retry later")
        if lora is not None:  # its users until each sequence ends (the engine thread); held: served
            self.model.lora.join(lora, num_seqs)  # type: ignore[union-attr]
        group = RequestGroup({}, set(), lora=lora)
        arrival = arrival_time or time.monotonic()
        fresh = iter(bounds)
        for i, checked in enumerate(prompts):
            rid = f"{request_id}-p{i}" if len(prompts) > 1 else request_id
            for sid in seq_ids(rid, checked.n):
                group.prompt_of[sid] = i
                group.unfinished.add(sid)
                self._groups[sid] = group
                self._bounds[sid] = next(fresh)
            self._send(AddRequest(checked, rid, arrival))
        self._arrived()
        self.num_in_flight += num_seqs
        if self.metrics is not None:
            self.metrics.lora_request(lora, len(prompts))
        return group

    def _bound(self, checked: CheckedRequest) -> SeqBound:
        """One of ``checked``'s sequences as admission sees it: a generation runs to ``max_tokens`` at the latest
        (none given: to the end of the context), a pooling input is its prefill alone."""
        prompt = len(checked.prompt_token_ids)
        if self.model.pooling is not None:
            return SeqBound(prompt, 0)
        max_new = checked.params.max_tokens
        return SeqBound(prompt, max_new if max_new is not None else max(1, self.model.max_model_len - prompt),
                        lora=checked.lora)

    # --- LoRA adapters (event loop) -----------------------------------------------------------------------

    @contextlib.contextmanager
    def holding(self, lora: str | None) -> Iterator[None]:
        """Hold adapter ``lora`` (None: the base model, nothing to hold) while a request is parsed, tokenized,
        checked and submitted: the one check that it is served (:class:`UnknownLora`), and it stays served (an
        unload meanwhile is a ``LoraInUse``) until the sequences :meth:`submit` counts end."""
        if lora is None:
            yield
            return
        if self.model.lora is None:
            raise UnknownLora(f"the LoRA adapter '{lora}' is not loaded")
        self.model.lora.use(lora, 1)
        try:
            yield
        finally:
            self.model.lora.done(lora, 1)

    async def load_lora(self, name: str, path: str) -> None:
        """Read and check adapter ``name`` from ``path`` on a worker thread, then register it (the registry is
        thread-safe; a step in flight is unaffected). Raises ``LoraError`` (unreadable, does not fit the bundle,
        name taken), :class:`EngineUnavailable` when the engine is not running."""
        self._require_running()
        registry = self.model.lora
        if registry is None:
            raise LoraError(f"adapter '{name}': this bundle was compiled without compile.lora (no adapter slots)")
        if name in registry:
            raise LoraNameTaken(f"adapter '{name}' is already loaded; unload it first to replace it")
        registry.register(await asyncio.to_thread(registry.read, name, path))

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``. Raises :class:`UnknownLora` if it is not served, ``LoraInUse`` while sequences
        of it are in flight (submitted and not ended)."""
        self._require_running()
        if self.model.lora is None:
            raise UnknownLora(f"the LoRA adapter '{name}' is not loaded")
        self.model.lora.unregister(name)

    def _require_running(self) -> None:
        """:class:`EngineUnavailable` unless the engine thread runs and the server is not draining."""
        if self.failure is not None or not self.healthy:
            raise EngineUnavailable(f"the engine is not running: {self.failure or 'stopped'}")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")

    async def outputs(self, group: RequestGroup) -> AsyncIterator[list[RequestOutput]]:
        """Yield the group's outputs, one list per engine step, until every sequence finished. Leaving early
        (an exception, a cancelled task: the client disconnected) aborts the unfinished sequences at once."""
        try:
            # an ended group (_fail retires its sequences, then queues the error) still has its error to read
            while group.unfinished or not group.queue.empty():
                item = await group.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel(group)

    def cancel(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sequences (the engine frees their blocks before its next step); a no-op
        once all finished. Safe to call more than once, and for a group whose outputs were never consumed."""
        if group.unfinished:
            self._send(Abort(tuple(group.unfinished)))
            self._retire(list(group.unfinished))

    def _retire(self, ids: list[str]) -> None:
        for sid in ids:
            self._bounds.pop(sid, None)
            group = self._groups.pop(sid, None)
            if group is not None:
                self.num_in_flight -= 1
                group.unfinished.discard(sid)

    def _send(self, cmd: Command) -> None:
        with self._cv:
            self._cmds.append(cmd)
            self._cv.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: route one step's outputs to their groups (one list per group per step)."""
        per_group: dict[int, tuple[RequestGroup, list[RequestOutput]]] = {}
        failed = [o for o in outputs if o.error is not None]
        for out in failed:  # ended without an answer (a PD decode leg's KV read): the group ends with an error
            self._fail([out.request_id], KVTransferFailed(out.error))
        for out in outputs if not failed else [o for o in outputs if o.error is None]:
            group = self._groups.get(out.request_id)
            if group is not None:  # None: aborted meanwhile
                per_group.setdefault(id(group), (group, []))[1].append(out)
                self._bounds[out.request_id].generated = max(1, len(out.token_ids))  # started
        for group, outs in per_group.values():
            self._retire([o.request_id for o in outs if o.finished])
            group.queue.put_nowait(outs)

    def _time_out(self, ids: list[str]) -> None:
        """On the event loop: these sequences waited past ``max_queue_time_s`` (the engine aborted them); end each
        group once with :class:`QueueTimeout`, aborting its other sequences (other prompts of the request)."""
        for sid in ids:
            group = self._groups.get(sid)
            if group is None:
                continue  # its group already ended (another of its sequences, or the client left meanwhile)
            if self.metrics is not None:
                self.metrics.rejected("queue_timeout")
            self._send(Abort(tuple(group.unfinished)))
            self._fail([sid], QueueTimeout(f"the request waited {self.max_queue_time_s:g}s in the queue without "
                                           "starting (max_queue_time_s); the server is overloaded, retry later"))

    def _fail(self, ids: list[str], error: BaseException) -> None:
        """On the event loop: end these sequences' groups with ``error`` (a refused add, a failed engine)."""
        for sid in ids:
            group = self._groups.get(sid)
            if group is not None:
                self._retire(list(group.unfinished))
                group.queue.put_nowait(error)

    # --- the engine thread --------------------------------------------------------------------------------

    def _take_commands(self, block: bool) -> list[Command]:
        with self._cv:
            while block and not self._cmds:
                self._cv.wait()
            cmds = list(self._cmds)
            self._cmds.clear()
            return cmds

    def _apply(self, cmds: list[Command]) -> bool:
        """Apply commands on the engine thread, in order; True when a request was added. A :class:`Shutdown`
        sets ``_stopped`` and drops the commands after it."""
        added = False
        for cmd in cmds:
            match cmd:
                case Abort(seq_ids=ids):
                    aborted = sum(self._engine.abort(sid) for sid in ids)
                    if self.metrics is not None and aborted:
                        self.metrics.aborted(aborted)
                case AddRequest(checked=checked, request_id=rid, arrival_time=arrival):
                    try:
                        self._engine.add(checked, rid, arrival_time=arrival)
                        added = True
                    except Exception as exc:
                        if checked.lora is not None:  # never added: its sequences end here
                            self.model.lora.done(checked.lora, checked.n)  # type: ignore[union-attr]
                        self._call_soon(self._fail, seq_ids(rid, checked.n), exc)
                case Shutdown():
                    self._stopped = True
                    return added
        return added

    def _call_soon(self, fn, *args) -> None:  # noqa: ANN001
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed under us (shutdown)
            pass

    def _run(self) -> None:
        engine = self._engine
        before = self.snapshot()
        try:
            while True:
                cmds = self._take_commands(block=not engine.has_unfinished())
                was_idle = not engine.has_unfinished()
                if self._apply(cmds) and was_idle and self.max_queue_delay_s > 0 and not self._stopped:
                    self._fill_batch()
                if self._stopped:
                    return
                if self.max_queue_time_s is not None and (expired := engine.expire_waiting(self.max_queue_time_s)):
                    self._call_soon(self._time_out, expired)
                started = time.perf_counter()
                outputs = engine.step() if engine.has_unfinished() else []
                seconds = time.perf_counter() - started
                pending = sum(isinstance(c, AddRequest) for c in list(self._cmds))
                snap = self.snapshot(pending)
                self.budget.observe_step(seconds, snap.prefill_tokens - before.prefill_tokens,
                                         snap.generation_tokens - before.generation_tokens,
                                         sum(o.finished for o in outputs), snap.num_running,
                                         snap.num_waiting - pending, snap.kv.num_free, time.monotonic())
                before = snap
                if self.metrics is not None:  # before delivery: a client that has its answer sees it counted
                    self.metrics.after_step(snap, outputs)
                    self.metrics.lora_state(snap.lora)
                if outputs:
                    self._call_soon(self._deliver, outputs)
        except BaseException as exc:
            self.failure = exc
            log.error("engine thread failed:\n%s", traceback.format_exc())
            self._call_soon(self._fail_all, EngineUnavailable(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _fill_batch(self) -> None:
        """The batch-fill wait, on an idle engine that just got work: keep waiting, in gaps of
        ``max_queue_delay_s``, while requests keep coming or the server is still parsing / tokenizing some that
        arrived (``num_arriving``), at most ``FILL_WAIT_CAP`` gaps. A burst sent together — clients whose previous
        requests ended in the same step — is then prefilled together instead of staggered by a prefill step each
        (which would stall the others' decodes for that step, every time)."""
        for _ in range(FILL_WAIT_CAP):
            time.sleep(self.max_queue_delay_s)
            added = self._apply(self._take_commands(block=False))
            if self._stopped or (not added and self.num_arriving == 0):
                return

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Wrap a request's parsing and tokenization (event loop), so the batch-fill wait knows it is coming; it
        counts as arriving until its first :meth:`submit` (not while it waits for its outputs: a lone request would
        hold its own first step for the whole wait)."""
        self.num_arriving += 1
        held = [True]
        token = _ARRIVING.set(held)
        try:
            yield
        finally:
            _ARRIVING.reset(token)
            if held[0]:
                self.num_arriving -= 1

    def _arrived(self) -> None:
        """The calling handler's request is submitted: it no longer counts as arriving."""
        held = _ARRIVING.get()
        if held is not None and held[0]:
            held[0] = False
            self.num_arriving -= 1

    def end_all(self, reason: str) -> None:
        """On the event loop (the drain timeout): abort every sequence still in flight and end its response with
        a 503 — a stream with an error event and ``[DONE]`` — instead of letting the server cut it."""
        ids = list(self._groups)
        if ids:
            self._send(Abort(tuple(ids)))
            self._fail(ids, EngineUnavailable(reason))

    def drain_deadline(self, seconds: float) -> None:
        """From any thread: :meth:`end_all` in ``seconds`` (the server's own graceful timeout is a little longer,
        so the ended responses are written before it closes connections)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(
                lambda: self._loop.call_later(seconds, self.end_all,  # type: ignore[union-attr]
                                              f"the server is shutting down: the {seconds:g}s drain timeout passed"))

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._groups), error)

