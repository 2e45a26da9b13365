"""One planned soak request sent with the official openai client and its outcome (benchmarks/soak.py).

Contract: :func:`send` returns exactly one :class:`Outcome` per plan and never raises; its wait is bounded by
``Endpoints.bound_s`` as a whole (a stream that trickles is bounded too), and past the bound the request is
``hung``. Outcomes: ``ok`` (every choice finished with a finish reason; JSON mode's finished text parses; a
finished tool call's arguments parse; embeddings of the right count), ``client-cancelled`` (the client closed its stream
on purpose), ``http NNN`` (the status the server answered; a stream's error event counts as the status its code
stands for: ``queue_timeout`` and ``kv_transfer_failed`` are 503s), ``malformed`` (a 200 whose answer breaks a rule
above), ``connection`` (nothing answered), ``hung``, ``client error`` (the soak's own client failed). A PD request
is one outcome: its prefill leg's failure, or what its decode leg ended with.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import openai
from soak_mix import WEATHER_TOOL, Plan

PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # as vLLM's toy proxy sends it
STREAM_CODES = {"queue_timeout": 503, "kv_transfer_failed": 503}
"""A stream's error event → the status the same error has before the stream starts (serve/respond.py)."""


@dataclass(frozen=True)
class Endpoints:
    """The servers' base URLs (``…/v1``; ``prefill``/``decode`` None: no PD pair) and the served model names;
    ``bound_s``: the whole wait of one request."""

    main: str
    base_model: str
    embed: str
    embed_model: str
    bound_s: float
    prefill: str | None = None
    decode: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What one planned request ended with; ``seconds``: from sending the request (for a PD request's failing leg,
    that leg) to its outcome; ``code``: the error's ``code`` when the server gave one."""

    index: int
    target: str
    outcome: str
    seconds: float
    code: str | None = None
    detail: str = ""


class Malformed(Exception):
    """A 200 answer that breaks the rules of an ``ok``."""


def _client(base_url: str, bound_s: float) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=bound_s)


def _messages(plan: Plan) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": plan.prompt}]


def _body(plan: Plan, model: str) -> dict[str, Any]:
    """The request's keyword arguments for the openai client (chat or completion)."""
    body: dict[str, Any] = {"model": plan.model or model, "max_tokens": plan.max_tokens, "n": plan.n,
                            "temperature": 0.8, "seed": plan.index}
    if plan.target == "completion":
        body["prompt"] = plan.prompt
    else:
        body["messages"] = _messages(plan)
    if plan.json_mode:  # the openai client's completions take it as an extra field (vLLM's and ours)
        fmt = {"response_format": {"type": "json_object"}}
        body |= fmt if plan.target != "completion" else {"extra_body": fmt}
    if plan.tools:
        body |= {"tools": [WEATHER_TOOL], "tool_choice": "required"}
    return body


def _check_finished(plan: Plan, index: int, finish: str | None, text: str, arguments: list[str]) -> None:
    if finish is None:
        raise Malformed(f"choice {index} ended without a finish_reason")
    if plan.json_mode and finish == "stop":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            raise Malformed(f"choice {index}: JSON mode finished with text that is not JSON: {text[:80]!r}") from None
    for args in arguments:
        try:
            json.loads(args)
        except json.JSONDecodeError:
            raise Malformed(f"choice {index}: tool call arguments are not JSON: {args[:80]!r}") from None


async def _whole(client: openai.AsyncOpenAI, plan: Plan, body: dict[str, Any]) -> Any:
    if plan.target == "completion":
        r = await client.completions.create(**body)
        texts = [(c.index, c.finish_reason, c.text, []) for c in r.choices]
    else:
        r = await client.chat.completions.create(**body)
        texts = [(c.index, c.finish_reason, c.message.content or "",
                  [t.function.arguments for t in c.message.tool_calls or []]) for c in r.choices]
    if sorted(t[0] for t in texts) != list(range(plan.n)):
        raise Malformed(f"choices {sorted(t[0] for t in texts)}, n = {plan.n}")
    for index, finish, text, calls in texts:
        _check_finished(plan, index, finish, text, calls)
    return r


async def _stream(client: openai.AsyncOpenAI, plan: Plan, body: dict[str, Any]) -> str:
    """Read the stream; ``client-cancelled`` when the client closed it on purpose, else ``ok`` (checked)."""
    create = client.completions.create if plan.target == "completion" else client.chat.completions.create
    stream = await create(stream=True, **body)
    finish: dict[int, str | None] = {}
    texts: dict[int, str] = {}
    arguments: dict[int, dict[int, str]] = {}  # choice → tool call index → its arguments so far
    chunks = 0
    try:
        async for chunk in stream:
            for c in chunk.choices:
                if plan.target == "completion":
                    texts[c.index] = texts.get(c.index, "") + (c.text or "")
                else:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    for call in c.delta.tool_calls or []:
                        parts = arguments.setdefault(c.index, {})
                        parts[call.index] = parts.get(call.index, "") + ((call.function and call.function.arguments)
                                                                         or "")
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
            chunks += 1
            if plan.mode == "cancel" and chunks >= plan.cancel_after and len(finish) < plan.n:
                return "client-cancelled"
    finally:
        await stream.close()
    for index in range(plan.n):
        calls = arguments.get(index, {})
        _check_finished(plan, index, finish.get(index), texts.get(index, ""), [calls[k] for k in sorted(calls)])
    return "ok"


async def _embed(client: openai.AsyncOpenAI, plan: Plan, model: str) -> None:
    r = await client.embeddings.create(model=model, input=plan.inputs, encoding_format="float")
    if len(r.data) != len(plan.inputs):
        raise Malformed(f"{len(r.data)} embeddings for {len(plan.inputs)} inputs")
    for d in r.data:
        norm = math.sqrt(sum(x * x for x in d.embedding))
        if not d.embedding or not abs(norm - 1.0) < 1e-3:
            raise Malformed(f"embedding {d.index}: {len(d.embedding)} values, norm {norm:.4g} (normalized: 1)")


async def _pd(ends: Endpoints, plan: Plan, body: dict[str, Any], legs: list[float]) -> str:
    """A PD router's two legs: the prefill leg (``max_tokens`` 1, not streamed, ``do_remote_decode``), then the
    request itself on the decode replica with the ``kv_transfer_params`` the prefill answered."""
    prefill = _client(ends.prefill, ends.bound_s)
    decode = _client(ends.decode, ends.bound_s)
    try:
        leg = {**body, "max_tokens": 1, "n": 1,
               "extra_body": {**body.get("extra_body", {}), "kv_transfer_params": PREFILL_LEG}}
        first = await prefill.chat.completions.create(**leg)
        params = (first.model_extra or {}).get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise Malformed(f"the prefill leg answered no kv_transfer_params: {params!r:.120}")
        legs.append(time.monotonic())  # the decode leg's send time: a failure's seconds count from here
        body = {**body, "extra_body": {**body.get("extra_body", {}), "kv_transfer_params": params}}
        if plan.mode == "whole":
            await _whole(decode, plan, body)
            return "ok"
        return await _stream(decode, plan, body)
    finally:
        await prefill.close()
        await decode.close()


async def _attempt(ends: Endpoints, plan: Plan, legs: list[float]) -> str:
    if plan.target == "embed":
        client = _client(ends.embed, ends.bound_s)
        try:
            await _embed(client, plan, ends.embed_model)
        finally:
            await client.close()
        return "ok"
    body = _body(plan, ends.base_model)
    if plan.target == "pd":
        return await _pd(ends, plan, body, legs)
    client = _client(ends.main, ends.bound_s)
    try:
        if plan.mode == "whole":
            await _whole(client, plan, body)
            return "ok"
        return await _stream(client, plan, body)
    finally:
        await client.close()


async def send(ends: Endpoints, plan: Plan) -> Outcome:
    """Send ``plan`` now; its outcome (never raises, bounded by ``ends.bound_s``)."""
    legs = [time.monotonic()]

    def out(outcome: str, code: str | None = None, detail: str = "") -> Outcome:
        return Outcome(plan.index, plan.target, outcome, time.monotonic() - legs[-1], code, detail[:300])

    try:
        return out(await asyncio.wait_for(_attempt(ends, plan, legs), ends.bound_s))
    except (TimeoutError, openai.APITimeoutError) as e:
        return out("hung", detail=f"no outcome within {ends.bound_s:.0f}s ({type(e).__name__})")
    except Malformed as e:
        return out("malformed", detail=str(e))
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return out(f"http {e.status_code}", body.get("code"), str(body.get("message") or e)[:300])
    except openai.APIConnectionError as e:
        return out("connection", detail=f"{type(e).__name__}: {e}")
    except openai.APIError as e:  # a stream's error event
        body = e.body if isinstance(e.body, dict) else {}
        code = body.get("code")
        status = STREAM_CODES.get(code)
        return out(f"http {status}" if status else "stream error", code, str(body.get("message") or e))
    except Exception as e:  # the soak's own client failed: an outcome, never a crash of the soak
        return out("client error", detail=f"{type(e).__name__}: {e}")
