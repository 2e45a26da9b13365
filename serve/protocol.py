"""The OpenAI request schemas the server accepts, their mapping onto :class:`SamplingParams`, and the API error.

Parameter names, defaults and ranges are OpenAI's (plus vLLM's extras: ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``), so existing clients work
unchanged. Unknown fields are a 400 naming the field, as OpenAI answers "Unrecognized request argument";
fields OpenAI has and we do not implement (``suffix``, ``best_of`` > n) are a
400 saying so, never silently ignored. Ranges live in :meth:`SamplingParams.validate`, not here.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omforge.contract import cdiv
from omforge.runtime.sampling_params import MAX_LOGPROBS, SamplingParams
from omforge.runtime.structured import StructuredOutput, compiled_grammar
from omforge.serve.tools import ToolError, choice_mode, functions


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        message = _LONG_NUMBER.sub(_abbreviated, message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_LONG_NUMBER = re.compile(r"\d{40,}")  # a client's 4,000-digit value is not echoed back whole


def _abbreviated(match: re.Match[str]) -> str:
    digits = match.group()
    return f"{digits[:6]}…{digits[-3:]} ({len(digits):,} digits)"


def validation_message(exc: ValidationError) -> tuple[str, str]:
    """(param, what was wrong) of a request that failed validation. A value that matches no member of a union
    (``prompt: [true]``) names the types the field takes, not the first member's complaint."""
    errors = exc.errors()
    err = errors[0]
    param = param_of([p for p in err["loc"] if not _union_tag(p)])
    if err["type"] == "extra_forbidden":
        return param, "unrecognized request argument"
    if err["type"] == "missing":
        return param, "missing required argument"
    tags = [next(p for p in e["loc"] if _union_tag(p)) for e in errors
            if any(_union_tag(p) for p in e["loc"]) and param_of([p for p in e["loc"] if not _union_tag(p)]) == param]
    if tags:
        return param, f"must be {' or '.join(dict.fromkeys(str(t) for t in tags))}"
    return param, err["msg"]


def _union_tag(segment: str | int) -> bool:
    """A location segment pydantic adds for a union member (``str``, ``list[int]``), not a field name."""
    return isinstance(segment, str) and (segment in ("str", "int", "float", "bool") or "[" in segment)


def param_of(loc: Sequence[str | int]) -> str:
    """A field's path as errors name it: ``prompt``, ``messages[0].content`` (list indices kept for messages, in
    the form the routes' own errors write them)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]" if loc and loc[0] == "messages" else ""
        else:
            out += f".{p}" if out else str(p)
    return out


def check_satisfiable(spec: StructuredOutput) -> None:
    """A constraint must admit some output. A schema that is only a ``$ref`` loop, or a regex / grammar that
    matches nothing (``[^\\s\\S]``), compiles, and then allows no token but EOS: the request ended at once, an
    empty 200. Asked of llguidance over a byte vocabulary (the model's tokenizer is the engine thread's); raises
    :class:`APIError` 400 naming the field."""
    import llguidance
    import llguidance.numpy
    import numpy as np

    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, compiled_grammar(spec))
    llguidance.numpy.fill_next_token_bitmask(matcher, np.zeros((1, cdiv(tokenizer.vocab_size, 32)), np.int32), 0)
    if matcher.is_error():
        what = ("no JSON value matches this schema (e.g. a $ref that only refers to itself)"
                if spec.kind in ("json", "json_object") else f"no text matches this {spec.kind}")
        raise APIError(400, f"{spec.param}: {what}", param=spec.param)


@functools.cache
def _byte_tokenizer() -> Any:
    """An llguidance tokenizer of the 256 bytes and an EOS: enough to ask whether a grammar admits any text."""
    import llguidance
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<eos>": len(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return llguidance.LLTokenizer(tok.to_str(), eos_token=len(vocab))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints share. ``None`` means "the default" everywhere, as OpenAI clients send null. Types are
    strict, as OpenAI's are: ``"10"`` is not an integer, ``"yes"`` not a boolean, ``true`` not a token id (an
    integer still passes for a float)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a prefill/decode disaggregation leg (docs/pd.md)
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutput | None:
        """The one structured-output constraint of the request (400 when several are set)."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(StructuredOutput("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                    raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                                   param="response_format")
                found.append(StructuredOutput("json", js.get("schema", {}), "response_format"))
            elif kind != "text":
                raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                               "json_schema)", param="response_format")
        so = self.structured_outputs or {}
        names = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
        for key, value in so.items():
            if key == "json_object" and value:
                found.append(StructuredOutput("json_object", None, "structured_outputs"))
            elif key in names and value is not None:
                found.append(StructuredOutput(names[key], value, f"structured_outputs.{key}"))
            elif key not in ("json_object", "disable_fallback", "disable_any_whitespace",
                             "disable_additional_properties", "whitespace_pattern"):
                raise APIError(400, f"structured_outputs.{key}: unknown key (json, regex, choice, grammar, "
                               "json_object)", param=f"structured_outputs.{key}")
        for field_, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                             ("guided_grammar", "grammar")):
            value = getattr(self, field_)
            if value is not None:
                if kind == "json" and isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError as exc:
                        raise APIError(400, f"guided_json is not a JSON schema: {exc}", param=field_) from None
                found.append(StructuredOutput(kind, value, field_))
        if len(found) > 1:
            raise APIError(400, f"set one structured-output constraint, got {', '.join(f.param for f in found)}",
                           param=found[1].param)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises :class:`APIError` 400 for a malformed ``logit_bias`` key."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        d = SamplingParams()
        return SamplingParams(
            n=_or(self.n, 1), max_tokens=max_tokens, min_tokens=_or(self.min_tokens, 0),
            temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0), top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0), seed=self.seed, presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=_or(self.ignore_eos, False),
            logprobs=logprobs, skip_special_tokens=_or(self.skip_special_tokens, d.skip_special_tokens),
            logit_bias=bias, prompt_logprobs=self.prompt_logprobs, structured=self.structured(),
            kv_transfer_params=self.kv_transfer_params)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_streaming(self) -> None:
        """``stream_options`` belongs to a streamed request (OpenAI and vLLM answer 400 otherwise)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def check_kv_transfer(self, num_prompts: int) -> None:
        """A PD leg sent with ``kv_transfer_params`` is one prompt (the hand-off names one prompt's blocks: a decode
        leg of several would read the same blocks for each), and a prefill leg is answered non-streamed (its
        hand-off is the body's top-level field)."""
        raw = self.kv_transfer_params or {}
        prefill, decode = raw.get("do_remote_decode") is True, raw.get("do_remote_prefill") is True
        if (prefill or decode) and num_prompts > 1:
            raise APIError(400, f"kv_transfer_params: a prefill/decode disaggregation leg is one prompt, got "
                           f"{num_prompts}; send each prompt as its own request", param="kv_transfer_params")
        if prefill and self.stream:
            raise APIError(400, "kv_transfer_params: a prefill leg (do_remote_decode) answers its hand-off in the "
                           "response body; send it with stream false", param="kv_transfer_params")


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, a string or token ids; raises :class:`APIError` for an empty one."""
        p = self.prompt
        items: list[str | list[int]] = [p] if isinstance(p, str) else (
            [p] if p and isinstance(p[0], int) else list(p))  # type: ignore[list-item]
        if not items or any(len(x) == 0 for x in items):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return items

    @property
    def scoring_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (what evaluation harnesses send to score a text): the prompt's
        logprobs, no completion. Run as one generated token that the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def engine_params(self) -> SamplingParams:
        """The sampling parameters the engine runs: echo with logprobs asks for the prompt's logprobs too."""
        max_tokens = 1 if self.scoring_only else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, self.logprobs)
        return params

    def check_supported(self) -> None:
        self.check_streaming()
        p = self.prompt
        self.check_kv_transfer(1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p))
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if self.best_of is not None and self.best_of != _or(self.n, 1):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                           param="logprobs")


RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "return_tensors", "chat_template", "tools", "documents", "padding", "truncation", "max_length",
})
"""``chat_template_kwargs`` keys the server renders itself; any other key is a template variable."""


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict[str, Any]  # OpenAI's JSON text; a mapping is what templates read (conversation())


class ToolCallParam(BaseModel):
    """An assistant message's earlier tool call, as the client sends it back."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other keys pass through to the template
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``; the prompt is the bundle's chat template rendered over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extras for the template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reasoning tokens after which </think> is forced (MindIE thinking_budget; --reasoning-parser)
    thinking_token_budget: int | None = None

    def check_supported(self) -> None:
        self.check_streaming()
        self.check_kv_transfer(1)
        for i, m in enumerate(self.messages):  # OpenAI: a tool result names the call it answers
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, f"messages[{i}].tool_call_id: a tool message must name the tool call it "
                               "answers", param=f"messages[{i}].tool_call_id")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the server, not the request "
                           "(use the request's own field, e.g. add_generation_prompt); other keys are passed to "
                           "the template as variables", param="chat_template_kwargs")
        try:
            choice_mode(self.tool_choice, functions(self.tools))
        except ToolError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the template expects them: text parts joined, other part types rejected, a null
        content (OpenAI allows it on assistant turns) as the empty string."""
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            msg.setdefault("content", "")
            for call in msg.get("tool_calls") or []:  # templates index the arguments as a mapping (vLLM does this)
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                       f"{part.get('type')!r}", param=f"messages[{i}].content")
                    texts.append(part["text"])
                msg["content"] = "\n".join(texts)
            out.append(msg)
        return out


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value




class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` as the completions endpoint encodes it, or ``messages`` through the
    chat template as the chat endpoint renders them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if self.messages is not None:
            self.chat().check_supported()

    def chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=self.messages or [], add_generation_prompt=self.add_generation_prompt,
                                     chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter at ``lora_path`` (a PEFT directory or a GGUF LoRA
    file, on the server's file system) as model ``lora_name``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving adapter ``lora_name`` (``lora_int_id`` is vLLM's and
    ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
