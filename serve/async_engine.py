"""The engine loop on its own thread, and the asyncio face the HTTP handlers use.

The HTTP event loop never runs the model: ``LLMEngine.step()`` runs on one engine thread (onnxruntime and numpy
release the GIL while they compute, so the event loop keeps answering). Handlers talk to that thread through a
command queue of typed messages (:class:`AddRequest`, :class:`Abort`, :class:`Shutdown`, matched by type) and get
each request's outputs back on an ``asyncio.Queue``, fed once per step with ``loop.call_soon_threadsafe``.

Invariants:
- Only the engine thread touches the ``LLMEngine`` after :meth:`AsyncEngine.start` (``check_request`` aside,
  which reads limits fixed at load); only the event loop touches the streams and the in-flight count.
- ``num_in_flight`` counts sequences submitted and not yet finished or aborted; a submission the
  :class:`~omforge.serve.admission.QueueBudget` refuses (more waiting than the measured service rate starts
  within the queue-time bound, or past the configured depth) is refused with :class:`Overloaded` (429), never
  queued without bound.
- A stream whose consumer stops early (client gone) aborts its request; the engine thread frees its blocks
  before its next step.
- No request waits longer than ``max_queue_time_s`` (checked before every step): one that has not started by then
  is aborted and its group ends with :class:`QueueTimeout`, counted as ``request_rejected{queue_timeout}``.
- LoRA adapters (docs/lora.md): ``loras`` (name → path, event loop only) is what the server serves; an adapter is
  parsed on a worker thread and registered (:class:`AddLora`) or forgotten (:class:`RemoveLora`) on the engine
  thread between steps. An adapter with sequences in flight is never unloaded (``LoraInUse``), and one being
  unloaded takes no new request (``UnknownLora`` at submission), so no request reaches the engine for an adapter
  it no longer holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from omforge.contract.manifest import PoolingSection
from omforge.errors import OmforgeError
from omforge.runtime.engine import LLMEngine, LoraInUse, RequestOutput, UnknownLora
from omforge.runtime.lora.adapter import LoraAdapter, LoraNameTaken
from omforge.runtime.reasoning import ReasoningParser
from omforge.runtime.request import seq_ids
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.tokenizer import TextTokenizer
from omforge.serve.admission import QueueBudget, ServiceRate
from omforge.serve.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("omforge.serve")

FILL_WAIT_CAP = 25
"""The batch-fill wait lasts at most this many ``max_queue_delay`` gaps (50 ms at the default 2 ms)."""


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
    """Add one checked prompt (``n`` sequences) to the engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    arrival_time: float
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@dataclass(frozen=True)
class AddLora:
    """Register a read and checked adapter (``LLMEngine.add_lora``); ``done`` gets None or the error."""

    adapter: LoraAdapter
    done: concurrent.futures.Future


@dataclass(frozen=True)
class RemoveLora:
    """Forget an adapter (``LLMEngine.unload_lora``); ``done`` gets None or the error."""

    name: str
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Abort:
    """Abort these sequences (unknown or finished ids are ignored); the engine frees their blocks at once."""

    seq_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine thread before its next step; whatever is still running is dropped."""


Command = AddRequest | Abort | Shutdown | AddLora | RemoveLora


@dataclass
class RequestGroup:
    """One HTTP request: one engine request per prompt (``n`` sequences each), all feeding one queue.

    ``prompt_of`` maps each sequence id to the index of its prompt; ``unfinished`` holds the sequence ids that
    have not finished yet (the group is done when it is empty)."""

    prompt_of: dict[str, int]
    unfinished: set[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    lora: str | None = None  # the adapter every sequence of the group runs with


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
        self.max_queue_time_s = max_queue_time_s
        self.service_rate = ServiceRate()
        self.budget = QueueBudget(engine.engine_config.max_num_seqs, max_waiting_requests, explicit_waiting,
                                  max_queue_time_s, self.service_rate)
        self.capacity = self.budget.capacity
        self.max_queue_delay_s = max_queue_delay_s
        self.metrics = metrics  # updated from the engine thread
        self.num_in_flight = 0
        self.num_arriving = 0  # requests being parsed / tokenized (event loop writes, engine thread reads)
        self.failure: BaseException | None = None
        self.draining = False
        self._groups: dict[str, RequestGroup] = {}  # unfinished sequence id → its group (event loop only)
        self._cmds: deque[Command] = deque()
        self._cv = threading.Condition()
        self._stopped = False  # a Shutdown was applied (engine thread only)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # LoRA adapters served (name → path) and sequences in flight per adapter (event loop only)
        self.loras: dict[str, str] = {n: str(engine.lora.get(n).path) for n in engine.lora_names()}
        self._lora_users: Counter[str] = Counter()

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

    # --- what the server reads of the engine (fixed at load, so safe from the event loop) ------------------

    @property
    def tokenizer(self) -> TextTokenizer | None:
        """The bundle's tokenizer, or None when the bundle ships none (token ids only)."""
        return self._engine.tokenizer

    @property
    def reasoning(self) -> ReasoningParser | None:
        """The server's reasoning parser (``--reasoning-parser``), or None."""
        return self._engine.reasoning

    @property
    def pooling(self) -> PoolingSection | None:
        """A pooling bundle's settings (task embed | score: runtime/pooling.py's engine); None for generate."""
        return self._engine.manifest.pooling

    @property
    def vocab_size(self) -> int:
        return self._engine.config.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the server admits."""
        return self._engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._engine.engine_config.max_num_seqs

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._engine.block_size

    def snapshot(self, pending_adds: int = 0) -> EngineSnapshot:
        """The engine's gauges and running totals now, for ``/metrics`` (``LLMEngine.snapshot``). Call it on the
        engine thread, or before :meth:`start`; ``pending_adds`` requests submitted but not yet applied count as
        waiting."""
        return self._engine.snapshot(pending_adds)

    # --- requests (event loop) ----------------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams,
              lora: str | None = None) -> SamplingParams:
        """The engine's admission check (raises RequestRejected / SamplingParamsError); see LLMEngine."""
        return self._engine.check_request(prompt_token_ids, params, lora)

    @property
    def max_loras(self) -> int | None:
        """Adapters resident at once (None: the bundle has no LoRA slots)."""
        return self._engine.engine_config.max_loras

    def submit(self, prompts: list[tuple[list[int], SamplingParams]], request_id: str,
               arrival_time: float | None = None, lora: str | None = None) -> RequestGroup:
        """Queue one request per (prompt token ids, checked params) as a group, all or none, with adapter ``lora``
        (None: the base model). Raises :class:`UnknownLora` for an adapter not served (or being unloaded),
        :class:`Overloaded` when the group would exceed the capacity, :class:`EngineUnavailable` when draining or
        failed. Consume the group with :meth:`outputs` (which aborts what is left if the consumer stops)."""
        self._require_running()
        if lora is not None and lora not in self.loras:
            raise UnknownLora(f"the LoRA adapter '{lora}' is not loaded")
        num_seqs = sum(p.n for _, p in prompts)
        refused = self.budget.refusal(self.num_in_flight, num_seqs)
        if refused is not None:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            raise Overloaded(f"the server is at capacity ({refused}); retry later")
        group = RequestGroup({}, set(), lora=lora)
        arrival = arrival_time or time.monotonic()
        for i, (ids, params) in enumerate(prompts):
            rid = f"{request_id}-p{i}" if len(prompts) > 1 else request_id
            for sid in seq_ids(rid, params.n):
                group.prompt_of[sid] = i
                group.unfinished.add(sid)
                self._groups[sid] = group
            self._send(AddRequest(ids, params, rid, arrival, lora))
        self.num_in_flight += num_seqs
        if lora is not None:
            self._lora_users[lora] += num_seqs
        if self.metrics is not None:
            self.metrics.lora_request(lora, len(prompts))
        return group

    # --- LoRA adapters (event loop) -----------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> None:
        """Read and check adapter ``name`` from ``path`` on a worker thread, then register it on the engine thread
        (between steps). Raises ``LoraError`` (unreadable, does not fit the bundle, name taken),
        :class:`EngineUnavailable` when the engine is not running."""
        self._require_running()
        if name in self.loras:
            raise LoraNameTaken(f"adapter '{name}' is already loaded; unload it first to replace it")
        adapter = await asyncio.to_thread(self._engine.read_lora, name, path)
        await self._on_engine_thread(AddLora(adapter, concurrent.futures.Future()))
        self.loras[name] = str(path)

    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (on the engine thread, between steps). Raises :class:`UnknownLora` if it is not
        served, :class:`LoraInUse` while sequences of it are in flight."""
        self._require_running()
        if name not in self.loras:
            raise UnknownLora(f"the LoRA adapter '{name}' is not loaded")
        if self._lora_users[name]:
            raise LoraInUse(f"the LoRA adapter '{name}' is in use by {self._lora_users[name]} sequence(s); unload "
                            "it once they end")
        path = self.loras.pop(name)  # no new request for it from now on
        try:
            await self._on_engine_thread(RemoveLora(name, concurrent.futures.Future()))
        except BaseException:
            self.loras[name] = path
            raise

    def _require_running(self) -> None:
        """:class:`EngineUnavailable` unless the engine thread runs and the server is not draining."""
        if self.failure is not None or not self.healthy:
            raise EngineUnavailable(f"the engine is not running: {self.failure or 'stopped'}")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")

    async def _on_engine_thread(self, cmd: AddLora | RemoveLora) -> None:
        """Send ``cmd`` to the engine thread and wait for it to be applied (its error raised here)."""
        self._send(cmd)
        await asyncio.wrap_future(cmd.done)

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
            group = self._groups.pop(sid, None)
            if group is not None:
                self.num_in_flight -= 1
                group.unfinished.discard(sid)
                if group.lora is not None:
                    self._lora_users[group.lora] -= 1
                    if not self._lora_users[group.lora]:
                        del self._lora_users[group.lora]

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
                case AddRequest(prompt_token_ids=ids, params=params, request_id=rid, arrival_time=arrival, lora=lora):
                    try:
                        self._engine.add_request(ids, params, rid, arrival_time=arrival, lora=lora)
                        added = True
                    except Exception as exc:
                        self._call_soon(self._fail, seq_ids(rid, params.n), exc)
                case AddLora(adapter=adapter, done=done):
                    self._settle(done, self._engine.add_lora, adapter)
                case RemoveLora(name=name, done=done):
                    self._settle(done, self._engine.unload_lora, name)
                case Shutdown():
                    self._stopped = True
                    for later in cmds[cmds.index(cmd) + 1:]:  # a LoRA command's waiter must not wait forever
                        if isinstance(later, AddLora | RemoveLora):
                            later.done.set_exception(EngineUnavailable("the server is shutting down"))
                    return added
        return added

    @staticmethod
    def _settle(done: concurrent.futures.Future, fn, *args) -> None:  # noqa: ANN001
        """Run ``fn(*args)`` (engine thread) and put its outcome in ``done`` (awaited on the event loop)."""
        try:
            fn(*args)
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _call_soon(self, fn, *args) -> None:  # noqa: ANN001
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed under us (shutdown)
            pass

    def _run(self) -> None:
        engine = self._engine
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
                saturated = self.num_in_flight >= self.max_num_seqs  # a waiting sequence gets the next free slot
                started = time.perf_counter()
                outputs = engine.step() if engine.has_unfinished() else []
                self.service_rate.step(time.perf_counter() - started, sum(o.finished for o in outputs), saturated)
                if self.metrics is not None:  # before delivery: a client that has its answer sees it counted
                    pending = sum(isinstance(c, AddRequest) for c in list(self._cmds))
                    self.metrics.after_step(self.snapshot(pending), outputs)
                    if engine.lora is not None:
                        self.metrics.lora_state(engine.lora_state())
                if outputs:
                    self._call_soon(self._deliver, outputs)
        except BaseException as exc:
            self.failure = exc
            log.error("engine thread failed:\n%s", traceback.format_exc())
            for cmd in self._take_commands(block=False):  # a LoRA command's waiter must not wait forever
                if isinstance(cmd, AddLora | RemoveLora) and not cmd.done.done():
                    cmd.done.set_exception(EngineUnavailable(f"the engine failed: {type(exc).__name__}: {exc}"))
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
        """Wrap a request's parsing and tokenization (event loop), so the batch-fill wait knows it is coming."""
        self.num_arriving += 1
        try:
            yield
        finally:
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

