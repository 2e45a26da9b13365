"""The offline API: ``LLM(bundle).generate(prompts, params)`` runs every prompt through the engine, batched."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omforge.runtime.engine import LLMEngine, RequestOutput
from omforge.runtime.sampling_params import SamplingParams


class LLM:
    """``LLM("build/smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=32))``; keyword arguments
    override the bundle's serve limits (``num_kv_blocks``, ``max_num_seqs``, ``enable_prefix_caching``, …)."""

    def __init__(self, bundle: str | Path, **engine_options: object):
        self.engine = LLMEngine(bundle, **engine_options)  # type: ignore[arg-type]

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
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Results in prompt order (for ``n > 1``, the n completions of a prompt follow each other). A progress
        line goes to stderr when stderr is a terminal (or ``use_tqdm=True``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        order = []
        for prompt, p in zip(prompts, plist):
            order += [r.request_id for r in self.engine.add_request(prompt, p)]  # type: ignore[arg-type]
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
