"""Structured output: a grammar per request (JSON schema, any JSON object, regex, a choice of strings, a Lark
grammar) turned into a token mask per step by llguidance (why llguidance: benchmarks/RESULTS.md, "structured output").

Contract: :func:`grammar` turns a :class:`StructuredOutput` into an llguidance grammar string or raises
:class:`StructuredOutputError` naming the request field; :class:`GrammarBackend` owns the tokenizer (built
once, from the bundle's tokenizer.json) and makes one :class:`llguidance.LLMatcher` per sequence; masks are
bitmasks ``int32 [rows, ceil(V / 32)]`` whose bit ``t`` allows token ``t``. :class:`GrammarMasks` is what the engine
holds: the backend, made at start-up by a server (:meth:`GrammarMasks.prepare`) or at the first structured
request, and the worker thread that fills a step's masks.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from omforge.contract import cdiv
from omforge.errors import OmforgeError
from omforge.runtime.finite_grammar import unending_rules


class StructuredOutputError(OmforgeError):
    """A structured-output request the grammar engine cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: ``kind`` json (``value`` a JSON schema, dict or string), json_object,
    regex, choice (a list of strings), grammar (Lark, llguidance's dialect). ``param``: the request field it came
    from (errors name it)."""

    kind: str
    value: Any = None
    param: str = "structured_outputs"


KINDS = ("json", "json_object", "regex", "choice", "grammar")


def grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar for ``spec``, validated; raises :class:`StructuredOutputError`."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError("structured output needs llguidance (pip install llguidance)",
                                    spec.param) from None
    m = llguidance.LLMatcher
    if spec.kind not in KINDS:
        raise StructuredOutputError(f"unknown structured output kind {spec.kind!r} (one of {', '.join(KINDS)})",
                                    spec.param)
    try:
        if spec.kind == "json":
            schema = spec.value if isinstance(spec.value, str) else json.dumps(spec.value)
            text = m.grammar_from_json_schema(schema)
        elif spec.kind == "json_object":
            text = m.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif spec.kind == "regex":
            text = m.grammar_from_regex(str(spec.value))
        elif spec.kind == "choice":
            if not isinstance(spec.value, list) or not spec.value or not all(isinstance(c, str) for c in spec.value):
                raise StructuredOutputError("choice must be a non-empty list of strings", spec.param)
            text = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
        else:
            text = m.grammar_from_lark(str(spec.value))
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"{spec.param}: {exc}", spec.param) from None
    error = m.validate_grammar(text)
    if error:
        raise StructuredOutputError(f"{spec.param}: the grammar engine cannot compile it: {error.strip()}",
                                    spec.param)
    if spec.kind == "grammar" and "start" in (unending := unending_rules(str(spec.value)) or []):
        others = [r for r in unending if r != "start"]
        via = f" (nor do {', '.join(others)})" if others else ""
        raise StructuredOutputError(f"{spec.param}: no finite text matches this grammar: every alternative of "
                                    f"rule start needs a rule that never ends{via}", spec.param)
    return text


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, value_json: str, param: str) -> str:
    return grammar(StructuredOutput(kind, json.loads(value_json), param))


def compiled_grammar(spec: StructuredOutput) -> str:
    """:func:`grammar`, cached by the spec's content (clients repeat one schema across many requests)."""
    return _compiled(spec.kind, json.dumps(spec.value, sort_keys=True), spec.param)


class GrammarBackend:
    """llguidance over one model's tokenizer (``tokenizer_json``: tokenizer.json's text; ``vocab_size``: the
    logits' width, which may exceed the tokenizer's; ``eos_token_ids``: what ends a finished grammar)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        eos = list(eos_token_ids) or None
        tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        if tokenizer.vocab_size < vocab_size:  # the logits may be wider than the tokenizer (padded embeddings)
            tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        # a tokenizer wider than the logits (added tokens the model cannot produce): masked over its own width,
        # read over the model's (allowed() cuts the rest)
        self.tokenizer = tokenizer
        self.words = cdiv(tokenizer.vocab_size, 32)

    def matcher(self, grammar_text: str) -> Any:
        """A fresh matcher (one per sequence: it holds that sequence's position in the grammar)."""
        m = self._llg.LLMatcher(self.tokenizer, grammar_text)
        if m.is_error():
            raise StructuredOutputError(f"the grammar engine rejected it: {m.get_error()}", "structured_outputs")
        return m

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        """Row ``i`` of ``out`` ← the allowed tokens of ``matchers[i]`` (llguidance releases the GIL while it
        computes, so this runs beside the model step)."""
        import llguidance.numpy as lnp

        for i, m in enumerate(matchers):
            lnp.fill_next_token_bitmask(m, out, i)

    def allowed(self, bitmask: np.ndarray) -> np.ndarray:
        """``uint8 0/1 [rows, vocab_size]`` from the bitmask (bit t of word t // 32, little-endian)."""
        return np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little",
                             count=self.vocab_size)


class GrammarMasks:
    """The engine's structured output: matchers for new sequences and each step's masks, computed on one worker
    thread while the executor runs (llguidance releases the GIL). ``tokenizer_json`` gives tokenizer.json's text;
    it and the backend are made by :meth:`prepare` or at the first structured request, the thread at the first
    structured step."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self._backend: GrammarBackend | None = None
        self._making = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> GrammarBackend:
        with self._making:  # made once, whichever thread asks first
            if self._backend is None:
                self._backend = GrammarBackend(self._tokenizer_json(), self.vocab_size, self.eos_token_ids)
        return self._backend

    def prepare(self) -> None:
        """Make the backend now. llguidance builds its tokenizer holding the GIL (~1.6 s for SmolLM2's on a 2-core
        VM): a server does it before it listens, so no request's first grammar stalls every thread (``/health``
        included) while the server runs."""
        _ = self.backend

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher of ``spec``'s grammar (compiled once per distinct spec: :func:`compiled_grammar`)."""
        return self.backend.matcher(compiled_grammar(spec))

    def start(self, matchers: Sequence[Any]) -> Future | None:
        """The allowed tokens of the rows whose matcher is not None (one per sampled row), as a future of
        ``(rows, 0/1 uint8 [len(rows), vocab_size])`` — the sampler's ``allowed``; None when no row has one."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        backend, chosen = self.backend, [matchers[i] for i in rows]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="omforge-grammar")

        def fill() -> tuple[np.ndarray, np.ndarray]:
            bitmask = np.zeros((len(rows), backend.words), np.int32)
            backend.fill(chosen, bitmask)
            return np.asarray(rows), backend.allowed(bitmask)

        return self._pool.submit(fill)

    def close(self) -> None:
        """Stop the worker thread (after the step it serves)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
