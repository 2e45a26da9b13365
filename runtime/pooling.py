"""The engine of a pooling bundle (task embed | score): prefill-only requests in continuous batching, no KV pool.

Each request is one whole sequence; each step takes the oldest waiting requests while their padded batch (the
longest × the count) fits the step's token budget and ``max_num_seqs``, runs them in one execution of the pooling
graph (contract/pooling.py) and finishes them all in that step with their result: no decode state, no KV blocks,
nothing kept after. A sequence is never chunked — the graph has no cache to carry a chunk's keys to the next —, so
the token budget is at least ``max_model_len`` (as vLLM's pooling runner disables chunked prefill) and an input
longer than ``max_model_len`` is refused at admission in one line.

The result (:attr:`RequestOutput.pooled`): embed — the last token's final-norm hidden state, truncated to the
request's ``dimensions`` (matryoshka bundles only), L2-normalized when the bundle says so; score — ``P(yes)``, the
softmax of the last position's ``[no, yes]`` logits, as a one-element vector.

:class:`PoolingEngine` has the surface the server's engine thread drives (serve/async_engine.py): ``add_request``,
``check_request`` (into a ``CheckedRequest``), ``add``, ``abort``, ``expire_waiting``, ``has_unfinished``, ``step``,
``snapshot``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.manifest import PoolingSection, load_manifest
from omforge.errors import OmforgeError
from omforge.runtime.engine import LLMEngine, RequestRejected
from omforge.runtime.engine_config import EngineConfig
from omforge.runtime.input_processor import CheckedRequest
from omforge.runtime.kv_cache_manager import KVCacheStats
from omforge.runtime.outputs import EngineSnapshot, EngineStats, RequestOutput
from omforge.runtime.pooling_prompts import instruction_of, pair_ids, query_text
from omforge.runtime.sampling_params import SamplingParamsError
from omforge.runtime.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options: ``dimensions``, the embedding's length (matryoshka truncation, then
    normalization; None: the model's). ``n`` is always 1 (the server counts sequences by it)."""

    dimensions: int | None = None
    n: int = field(default=1, init=False)


@dataclass
class PoolingRequest:
    """One input waiting for its step: its whole token ids (never chunked) and options; ``arrival_time``: when its
    request reached the server (latency), ``queued_at``: when it entered this queue (the queue-time bound)."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)


def pack(batch: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """The pooling graph's inputs for whole sequences ``batch``: right-padded ids (pad id 0), positions
    ``0 .. Q - 1`` and each sequence's last token as a row-major index ``b * Q + len_b - 1``."""
    lens = np.array([len(s) for s in batch], dtype=np.int64)
    if not len(batch) or (lens < 1).any():
        raise ValueError("a pooling step needs sequences of at least one token")
    q = int(lens.max())
    ids = np.zeros((len(batch), q), dtype=np.int64)
    for b, seq in enumerate(batch):
        ids[b, :len(seq)] = seq
    return {"input_ids": ids, "position_ids": np.broadcast_to(np.arange(q, dtype=np.int64), ids.shape).copy(),
            "pool_index": np.arange(len(batch), dtype=np.int64) * q + lens - 1}


def finish(rows: np.ndarray, pooling: PoolingSection, dimensions: Sequence[int | None]) -> list[np.ndarray]:
    """The graph's output rows as results (module docstring): embeddings truncated and normalized, or P(yes)."""
    if pooling.task == "score":
        no, yes = rows[:, 0].astype(np.float64), rows[:, 1].astype(np.float64)
        return [np.array([p], dtype=np.float32) for p in 1.0 / (1.0 + np.exp(no - yes))]
    out = []
    for row, dims in zip(rows, dimensions):
        v = row[:dims] if dims is not None else row
        if pooling.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        out.append(np.asarray(v, dtype=np.float32))
    return out


def encode_text(tokenizer: TextTokenizer, pooling: PoolingSection, text: str) -> list[int]:
    """A text input's token ids: the tokenizer's, ended with the bundle's ``append_token_id`` unless they end with
    it already (Qwen3-Embedding's own tokenizer adds ``<|endoftext|>`` itself)."""
    ids = tokenizer.encode(text)
    end = pooling.append_token_id
    return ids + [end] if end is not None and (not ids or ids[-1] != end) else ids


def score_inputs(tokenizer: TextTokenizer, pooling: PoolingSection, query: str, documents: Sequence[str],
                 instruction: str | None = None) -> list[list[int]]:
    """The sequences that score ``query`` against each document (:func:`scores_of` reads their results): a score
    bundle — one sequence per pair in its prompt format; an embed bundle — the query (in its format), then each
    document, embedded (the score is then their cosine, as vLLM scores with an embedding model)."""
    fmt = pooling.prompt_format
    instruction = instruction_of(fmt, instruction, pooling.instruction)
    if pooling.task == "score":
        def plain(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return [pair_ids(fmt, plain, query, d, instruction) for d in documents]
    return [encode_text(tokenizer, pooling, t) for t in (query_text(fmt, query, instruction), *documents)]


def scores_of(pooling: PoolingSection, results: Sequence[np.ndarray]) -> list[float]:
    """The scores from the results of :func:`score_inputs`' sequences, in document order."""
    if pooling.task == "score":
        return [float(r[0]) for r in results]
    query, *docs = (r / max(float(np.linalg.norm(r)), 1e-12) for r in results)
    return [float(np.dot(query, d)) for d in docs]


class PoolingEngine:
    """One pooling bundle loaded; ``config`` (default: resolved from the bundle) or keyword ``overrides`` of its
    serve settings (``max_num_seqs``, ``max_num_batched_tokens``, ``threads``, …)."""

    reasoning = None  # what the server asks of every engine: pooling reasons about nothing
    block_size = 1  # no KV blocks: /v1/loads counts tokens

    def __init__(self, bundle: str | Path, config: EngineConfig | None = None, *, acl_module: object = None,
                 **overrides: Any):
        bundle = Path(bundle)
        self.manifest = m = load_manifest(bundle)
        if m.pooling is None:
            raise OmforgeError(f"{bundle}: a generate bundle (task generate); load it with LLMEngine")
        self.pooling: PoolingSection = m.pooling
        self.engine_config = cfg = config or EngineConfig.resolve(m, **overrides)
        self.config = m.model.config
        self.max_model_len = cfg.max_model_len
        # whole sequences only: a step must hold the longest admitted one
        self.token_budget = max(cfg.max_num_batched_tokens, cfg.max_model_len)
        self.executor = self._executor(bundle, m, cfg, acl_module)
        self.tokenizer = TextTokenizer(bundle / m.tokenizer.file, m.tokenizer) if m.tokenizer.file else None
        self.waiting: deque[PoolingRequest] = deque()
        self.stats = EngineStats()
        self.closed = False
        self._ids = itertools.count()

    @staticmethod
    def _executor(bundle: Path, m: Any, cfg: EngineConfig, acl_module: object) -> Any:
        """The OM through AscendCL for an ascend bundle (``acl_module``: a pyACL stand-in, tests), else ORT."""
        if m.target == "ascend":
            from omforge.runtime.ascend.acl_pooling import AclPoolingExecutor

            return AclPoolingExecutor(bundle, m, acl=acl_module)
        from omforge.runtime.ort import kernels
        from omforge.runtime.ort.pooling_executor import PoolingExecutor

        kernels.check_bundle(bundle, m.kernels, m.passes.op_histogram)  # its MatMulF32 needs the library here
        return PoolingExecutor(bundle / m.graphs.step, m.pooling.output, threads=cfg.threads)

    @property
    def task(self) -> str:
        return self.pooling.task

    lora = None  # a pooling bundle has no LoRA slots (compile.lora is refused for task embed | score)

    # --- requests -----------------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: PoolingParams,
                      lora: str | None = None) -> CheckedRequest:
        """The admission check, pure: :class:`RequestRejected` naming the limit (an empty or too long input, ids
        outside the vocabulary, a LoRA adapter: a pooling bundle has none), :class:`SamplingParamsError` for
        ``dimensions``; returns the checked request."""
        if lora is not None:
            raise RequestRejected(f"this pooling model serves no LoRA adapter ('{lora}')", param="model")
        if not prompt_token_ids:
            raise RequestRejected("the input is empty", param="input")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"input token ids must be in [0, {vocab})", param="input")
        if len(prompt_token_ids) > self.max_model_len:
            raise RequestRejected(f"the input ({len(prompt_token_ids)} tokens) is longer than this model's maximum "
                                  f"of {self.max_model_len} tokens (a pooling request is one whole sequence)")
        d = params.dimensions
        if d is not None:
            if not self.pooling.matryoshka:
                raise SamplingParamsError("dimensions", f"this model ({self.manifest.model.name}) does not support "
                                          "dimensions: its embeddings are not matryoshka-trained (recipe "
                                          "pooling.matryoshka)")
            if not 1 <= d <= self.pooling.size:
                raise SamplingParamsError("dimensions", f"dimensions must be in [1, {self.pooling.size}], got {d}")
        return CheckedRequest(tuple(prompt_token_ids), params)

    def add_request(self, prompt: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    lora: str | None = None) -> list[PoolingRequest]:
        """Queue one input (text, tokenized with the bundle's tokenizer and ended with its ``append_token_id``,
        or token ids as given; ``lora`` must be None). Raises :class:`RequestRejected` /
        :class:`SamplingParamsError`."""
        params = params or PoolingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.add(self.check_request(ids, params, lora), request_id, arrival_time)

    def add(self, checked: CheckedRequest, request_id: str | None = None,
            arrival_time: float | None = None) -> list[PoolingRequest]:
        """Queue a checked input (:meth:`check_request`); :class:`RequestRejected` for a request id in use."""
        ids, params = list(checked.prompt_token_ids), checked.params
        rid = request_id or f"pool-{next(self._ids)}"
        if any(r.request_id == rid for r in self.waiting):
            raise RequestRejected(f"request id '{rid}' is already in use")
        req = PoolingRequest(rid, ids, params)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.waiting.append(req)
        return [req]

    def encode(self, text: str) -> list[int]:
        """A text input's token ids (:func:`encode_text`)."""
        if self.tokenizer is None:
            raise RequestRejected("this bundle has no tokenizer: give input token ids")
        return encode_text(self.tokenizer, self.pooling, text)

    def abort(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        return False

    def expire_waiting(self, max_wait_s: float, now: float | None = None) -> list[str]:
        """Abort the requests waiting in this queue longer than ``max_wait_s``; returns their ids. Queue time
        only: a server request of many inputs tokenizes them all, then queues them in parts, each when the one
        before is done — neither counts against its later inputs."""
        now = time.monotonic() if now is None else now
        expired = [r.request_id for r in self.waiting if now - r.queued_at > max_wait_s]
        for rid in expired:
            self.abort(rid)
        return expired

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def close(self) -> None:
        if not self.closed and hasattr(self.executor, "close"):  # the ACL executor holds the device
            self.executor.close()
        self.closed = True

    def reset_prefix_cache(self) -> bool:
        return not self.waiting  # nothing cached

    def snapshot(self, pending_adds: int = 0) -> EngineSnapshot:
        """The engine's gauges (``/metrics``): the queue, the running totals, an empty KV cache."""
        st = self.stats
        kv = KVCacheStats(0, 0, 0, 0, 0.0, 0, 0, 0.0, 0, 0)
        return EngineSnapshot(
            num_running=0, num_waiting=len(self.waiting) + pending_adds, num_swapped=0, kv=kv, steps=st.steps,
            last_step_time=st.step_times[-1] if st.step_times else None, prompt_tokens=st.prompt_tokens,
            prefill_tokens=st.prefill_tokens, generation_tokens=0, preemptions=0, spec_drafts=0,
            spec_draft_tokens=0, spec_accepted_tokens=0, spec_accepted_per_position={})

    # --- the step -----------------------------------------------------------------------------------------

    def schedule(self) -> list[PoolingRequest]:
        """The oldest waiting requests whose padded batch fits the token budget and ``max_num_seqs`` (at least
        one: every admitted input fits the budget alone)."""
        batch: list[PoolingRequest] = []
        longest = 0
        for req in self.waiting:
            n = len(req.prompt_token_ids)
            if batch and (len(batch) == self.engine_config.max_num_seqs
                          or max(longest, n) * (len(batch) + 1) > self.token_budget):
                break
            batch.append(req)
            longest = max(longest, n)
        for _ in batch:
            self.waiting.popleft()
        return batch

    def step(self) -> list[RequestOutput]:
        """One execution over the scheduled requests; each comes back finished with its result."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        batch = self.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        rows = self.executor.run(pack([r.prompt_token_ids for r in batch]))
        results = finish(rows, self.pooling, [r.params.dimensions for r in batch])
        now = time.monotonic()
        st = self.stats
        tokens = sum(len(r.prompt_token_ids) for r in batch)
        st.steps += 1
        st.prefill_tokens += tokens
        st.prompt_tokens += tokens
        st.last_prefill_tokens, st.last_decode_tokens = tokens, 0
        st.finished += len(batch)
        st.step_times.append(time.perf_counter() - t0)
        return [RequestOutput(r.request_id, 0, r.prompt_token_ids, "", [], "", [], True, "stop", None, 0, (),
                              r.arrival_time, now, [now], pooled=v) for r, v in zip(batch, results)]

    def run(self, prompts: Sequence[str | Sequence[int]], params: PoolingParams | None = None) -> list[np.ndarray]:
        """Every input through the engine, batched; results in input order (the offline API's)."""
        ids = [self.add_request(p, params)[0].request_id for p in prompts]
        done: dict[str, np.ndarray] = {}
        while self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out.pooled
        return [done[i] for i in ids]


def open_engine(bundle: str | Path, **options: Any) -> LLMEngine | PoolingEngine:
    """The engine a bundle is for: :class:`PoolingEngine` for a pooling bundle, else :class:`LLMEngine` (each
    verifies the bundle's files as it loads)."""
    pooling = load_manifest(Path(bundle), verify=False).pooling is not None
    return (PoolingEngine if pooling else LLMEngine)(bundle, **options)
