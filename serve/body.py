"""Reading a request body into a JSON object, with every way a client can get it wrong answered as an
:class:`APIError` (never a 500): a body over the size limit (413), one that does not arrive in time (408), a
client that hangs up while sending it (logged as a disconnect), malformed or too deeply nested JSON, an integer
literal beyond Python's digit limit, and a lone UTF-16 surrogate (``"\\ud800"``, valid JSON but no Unicode text:
the tokenizer refuses it) — each a 400 naming the field where one can be named.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request

from omforge.serve.protocol import APIError, param_of

log = logging.getLogger("omforge.serve")
_SURROGATE = re.compile("[\ud800-\udfff]")
# how a lone surrogate can enter a UTF-8 body (json.loads decodes with surrogatepass): an escape, or its bytes
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


DRAIN_BYTES = 64 << 20
"""A body over the limit is read and dropped up to this many bytes before the 413 goes out: a server that closes
with the body unread resets the connection, and the client may then never see the answer (httpx: "peer closed
connection without sending complete message body"). Beyond it, or when the rest stops arriving, the connection
is closed instead."""
DRAIN_IDLE_S = 1.0
"""Draining stops when no more of the body arrives for this long (a client that waits before sending it)."""


async def read_json(request: Request, timeout: float, limit: int) -> dict[str, Any]:
    """The body (at most ``limit`` bytes, else 413) as a JSON object; raises :class:`APIError` (408, 413, 400, or
    499 for a client gone mid-body)."""
    declared = request.headers.get("content-length", "")
    try:
        if declared.isdigit() and int(declared) > limit:  # refused on its length; the body is drained, not kept
            raise _too_large(limit, close=int(declared) > DRAIN_BYTES or not await _drain(request.stream(), 0))
        raw = await asyncio.wait_for(_read(request, limit), timeout)
    except TimeoutError:
        # the rest of the body may still arrive: the connection cannot carry another request (RFC 9110 §15.5.9)
        raise APIError(408, f"the request body did not arrive within {timeout:g}s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        log.info("client disconnected while sending the body of %s %s", request.method, request.url.path)
        raise APIError(499, "the client closed the connection") from None
    return decode(raw)


async def _read(request: Request, limit: int) -> bytes:
    """The body, counted as it arrives (a chunked body declares no length)."""
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, close=not await _drain(stream, size))
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(stream: AsyncIterator[bytes], size: int) -> bool:
    """Read and drop the rest of ``stream`` (``size`` bytes already read); False when it stopped short (over
    :data:`DRAIN_BYTES`, idle for :data:`DRAIN_IDLE_S`, or the client left): the connection must then close."""
    it = stream.__aiter__()
    while size <= DRAIN_BYTES:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), DRAIN_IDLE_S)
        except StopAsyncIteration:
            return True
        except (TimeoutError, ClientDisconnect):
            return False
        size += len(chunk)
    return False


def _too_large(limit: int, close: bool) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes; "
                    "--max-request-body-bytes)", code="request_too_large",
                    headers={"Connection": "close"} if close else None)


def decode(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object whose strings are all valid Unicode; raises :class:`APIError` 400."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError:  # int() of a literal over sys.get_int_max_str_digits(), raised from inside the decoder
        raise APIError(400, f"the request body has an integer literal of more than {sys.get_int_max_str_digits()} "
                       "digits") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    maybe = json.detect_encoding(raw) != "utf-8" or _SURROGATE_BYTES.search(raw) is not None
    if maybe and (loc := _lone_surrogate(data)) is not None:
        param = param_of(loc) or "body"
        raise APIError(400, f"{param}: the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                       "escape), which is not Unicode text", param=param)
    return data


def _lone_surrogate(data: Any) -> tuple[str | int, ...] | None:
    """The path of the first string (a value or a key) holding a lone surrogate; None when none does."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return path  # not the key itself: the error message must stay encodable
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))
    return None
