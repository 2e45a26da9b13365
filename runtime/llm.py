"""The offline API: ``LLM(bundle).generate(prompts, params)`` runs every prompt through the engine, batched; a
pooling bundle's ``LLM(bundle).embed(texts)`` / ``.score(query, documents)`` likewise (runtime/pooling.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from omforge.errors import OmforgeError
from omforge.runtime.engine import RequestOutput
from omforge.runtime.pooling import PoolingEngine, PoolingParams, open_engine, score_inputs, scores_of
from omforge.runtime.sampling_params import SamplingParams


class LLM:
    """``LLM("build/smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=32))``; keyword arguments
    override the bundle's serve limits (``num_kv_blocks``, ``max_num_seqs``, ``enable_prefix_caching``, …) and
    name LoRA adapters (``lora_modules={"sql": "adapters/sql"}``, ``max_loras``) for a bundle compiled with
    ``compile.lora``: ``generate(prompts, params, lora="sql")``."""

    def __init__(self, bundle: str | Path, **engine_options: object):
        self.engine = open_engine(bundle, **engine_options)

    def embed(self, inputs: str | Sequence[str] | Sequence[Sequence[int]],
              dimensions: int | None = None) -> list[np.ndarray]:
        """An embedding per input (text, or token ids), in order, batched by the engine: an embed bundle's
        (``LLM(bundle).embed(["a", "b"])``); ``dimensions`` truncates a matryoshka model's vectors."""
        engine = self._pooling("embed")
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        return engine.run(list(inputs), PoolingParams(dimensions))  # type: ignore[arg-type]

    def score(self, query: str, documents: Sequence[str], instruction: str | None = None) -> list[float]:
        """``query``'s score against each document, in order: P(yes) of a score bundle (the reranker's prompt
        format), or the cosine of an embed bundle's embeddings (the query in its instruction format)."""
        engine = self._pooling(None)
        if engine.tokenizer is None:
            raise OmforgeError("score needs the bundle's tokenizer (this bundle has none)")
        seqs = score_inputs(engine.tokenizer, engine.pooling, query, documents, instruction)
        return scores_of(engine.pooling, engine.run(seqs))

    def _pooling(self, task: str | None) -> PoolingEngine:
        engine = self.engine
        if not isinstance(engine, PoolingEngine) or (task is not None and engine.task != task):
            have = engine.task if isinstance(engine, PoolingEngine) else "generate"
            raise OmforgeError(f"this bundle's task is {have}; {task or 'a pooling task'} needs a bundle compiled "
                               f"with task: {task or 'embed or score'}")
        return engine

    def close(self) -> None:
        """Release the engine's executor (see :meth:`LLMEngine.close`); also on leaving a ``with`` block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (for benchmarks that repeat the same prompts); only when idle."""
        return self.engine.reset_prefix_cache()

    @property
    def tokenizer(self):  # noqa: ANN201 - TextTokenizer | None
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Results in prompt order (for ``n > 1``, the n completions of a prompt follow each other). A progress
        line goes to stderr when stderr is a terminal (or ``use_tqdm=True``). ``lora``: the LoRA adapter of every
        prompt, or one per prompt (None: the base model); an adapter not loaded is an ``UnknownLora``."""
        if isinstance(self.engine, PoolingEngine):
            raise OmforgeError(f"this bundle's task is {self.engine.task}: use LLM.embed or LLM.score; generate "
                               "needs a bundle compiled with task: generate")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA adapters")
        order = []
        for prompt, p, name in zip(prompts, plist, loras):
            order += [r.request_id for r in self.engine.add_request(prompt, p, lora=name)]  # type: ignore[arg-type]
        done: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        t0, last = time.monotonic(), 0.0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
            if show and time.monotonic() - last > 0.5:
                last = time.monotonic()
                tokens = self.engine.stats.generation_tokens
                print(f"\r[generate] {len(done)}/{len(order)} done, {tokens} tokens, "
                      f"{tokens / max(last - t0, 1e-9):.0f} tok/s", end="", file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)
        return [done[rid] for rid in order]
