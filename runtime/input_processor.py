"""The engine's intake (vLLM v1's InputProcessor): a request checked once, on the caller's thread, into an immutable
:class:`CheckedRequest` that the engine core adds without looking at it again.

The check is pure: it reads only limits fixed at load (the context, the vocabulary, the executor's capabilities,
the KV pool's size, this replica's PD role), so the server calls it from a tokenizer worker. Whether a request's
LoRA adapter is served is not the intake's to say (adapters come and go): the registry's ``use`` says it once
(runtime/lora/registry.py), offline when the request is added, served when it is parsed (held until submission).

Invariants of a :class:`CheckedRequest`: its prompt is non-empty and inside the vocabulary; ``params.max_tokens``
is resolved (never None) and ``prompt + max_tokens`` fits the context and the pool; ``params`` passed
``SamplingParams.validate``; its grammar compiled; ``kv_transfer`` is its PD leg's parsed parameters (None: not a
PD leg): a decode leg's parameters name its prompt, a leg sent with ``kv_transfer_params`` asks no prompt
logprobs, and a request with an adapter is no leg; ``lora`` is None on a bundle without adapter slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from omforge.contract import cdiv
from omforge.contract.manifest import ModelConfig
from omforge.runtime.kv_transfer.connector import request_params
from omforge.runtime.lora.registry import UnknownLora
from omforge.runtime.request import RequestRejected
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError
from omforge.runtime.structured import StructuredOutputError, compiled_grammar
from omforge.runtime.tokenizer import TextTokenizer


@dataclass(frozen=True)
class CheckedRequest:
    """One prompt as the intake passed it (see the module's invariants); ``prompt``: its text, when it came as
    text. ``params`` is the checked copy (treat it as read-only)."""

    prompt_token_ids: tuple[int, ...]
    params: Any  # SamplingParams (generate) or PoolingParams (runtime/pooling.py)
    lora: str | None = None
    prompt: str | None = None
    kv_transfer: Any = None  # runtime/kv_transfer's KVTransferParams of a PD leg

    @property
    def n(self) -> int:
        """Sequences it becomes (``params.n``; 1 for pooling)."""
        return getattr(self.params, "n", 1)


@dataclass(frozen=True)
class IntakeLimits:
    """What the check reads, fixed when the engine loads."""

    config: ModelConfig
    max_model_len: int
    block_size: int
    max_num_seqs: int
    has_lora: bool  # the bundle has adapter slots (compile.lora)
    max_prompt_len: int | None = None  # an ascend bundle's gears
    supports_prompt_logits: bool = False
    has_tokenizer: bool = False


class InputProcessor:
    """Checks requests against :class:`IntakeLimits`; ``usable_blocks`` reads the KV pool's usable size (it shrinks
    only while NIXL cannot cancel a transfer), ``pd`` is the replica's PD connector (None: none)."""

    def __init__(self, limits: IntakeLimits, tokenizer: TextTokenizer | None, usable_blocks: Callable[[], int],
                 num_blocks: int, pd: Any = None):
        self.limits, self.tokenizer, self.pd = limits, tokenizer, pd
        self._usable_blocks, self._num_blocks = usable_blocks, num_blocks
        self.num_checks = 0  # requests checked so far (each is checked once: tests count it)

    def process(self, prompt: str | Sequence[int], params: SamplingParams, lora: str | None = None) -> CheckedRequest:
        """A text prompt tokenized (the bundle's tokenizer), or token ids as given, then :meth:`check`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this bundle has no tokenizer: give prompt token ids")
            return self.check(self.tokenizer.encode(prompt), params, lora, text=prompt)
        return self.check(prompt, params, lora)

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams, lora: str | None = None,
              text: str | None = None) -> CheckedRequest:
        """The admission check: raises :class:`RequestRejected` naming the limit (:class:`UnknownLora` for an
        adapter on a bundle without slots), or :class:`SamplingParamsError` naming the parameter; returns the
        :class:`CheckedRequest` with ``max_tokens`` resolved (None → the room left in the context)."""
        self.num_checks += 1
        lim = self.limits
        params.validate()
        if lora is not None and not lim.has_lora:
            raise UnknownLora(f"the LoRA adapter '{lora}' does not exist: this bundle was compiled without "
                              "compile.lora")
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = lim.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if any(t >= vocab for t in params.logit_bias):
            raise SamplingParamsError("logit_bias",
                                      f"logit_bias keys must be token ids below the vocabulary size {vocab}")
        if lim.max_prompt_len is not None and len(ids) > lim.max_prompt_len:
            raise RequestRejected(f"the prompt ({len(ids)} tokens) is longer than this ascend bundle's gears admit "
                                  f"({lim.max_prompt_len} tokens: a padded prefill chunk must end inside the context)")
        room = lim.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise RequestRejected(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                  f"context of {lim.max_model_len} tokens")
        if params.structured is not None:
            if not lim.has_tokenizer:
                raise SamplingParamsError(params.structured.param, "structured output needs the model's tokenizer")
            try:
                compiled_grammar(params.structured)
            except StructuredOutputError as exc:
                raise SamplingParamsError(exc.param, str(exc)) from None
        if params.reasoning is not None and any(not 0 <= t < vocab for t in (params.reasoning.start_token_id,
                                                                             params.reasoning.end_token_id)):
            raise SamplingParamsError("reasoning", f"reasoning marker token ids must be in [0, {vocab})")
        if params.prompt_logprobs is not None and not lim.supports_prompt_logits:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs: this bundle's executor returns one logits "
                                      "row per sequence (the ascend OM models); use an ort bundle")
        if params.n > lim.max_num_seqs:  # its sequences are admitted together
            raise SamplingParamsError("n", f"n must be at most max_num_seqs ({lim.max_num_seqs}), got {params.n}")
        if lora is not None and params.kv_transfer_params:
            raise SamplingParamsError("kv_transfer_params", f"the LoRA adapter '{lora}': LoRA adapters are not "
                                      "supported with kv_transfer_params (a prefill/decode disaggregation leg)")
        try:  # a PD leg this replica's role, protocol, layout or the prompt itself cannot serve
            kv_transfer = request_params(self.pd, params.kv_transfer_params, lim.block_size, ids)
        except ValueError as exc:
            raise SamplingParamsError("kv_transfer_params", str(exc)) from None
        if lora is not None and kv_transfer is not None:  # a kv_producer makes every request a prefill leg
            raise SamplingParamsError("model", f"the LoRA adapter '{lora}' cannot be served here: this "
                                      f"{self.pd.config.kv_role} replica runs every request as a prefill/decode "
                                      "disaggregation leg, and LoRA adapters are not supported with those")
        if params.prompt_logprobs is not None and params.kv_transfer_params and kv_transfer is not None \
                and (kv_transfer.is_prefill_leg or kv_transfer.pulls_blocks):
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs (or echo with logprobs) with "
                                      "kv_transfer_params: a decode leg reads its prompt's KV from the prefill "
                                      "replica instead of computing it, so it has no prompt logits")
        need = cdiv(len(ids) + max_tokens, lim.block_size)
        usable = self._usable_blocks()  # less the blocks a transfer NIXL could not cancel may still write
        if need > usable:
            raise RequestRejected(f"prompt + max_tokens needs {need} KV blocks but the pool has {usable} "
                                  f"(of {self._num_blocks}) it can use; it could never run")
        return CheckedRequest(tuple(ids), replace(params, max_tokens=max_tokens), lora, text, kv_transfer)
