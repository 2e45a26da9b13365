"""What every route shares: :class:`ServerState`, built once by ``omforge serve`` and handed to the app, which
keeps it on ``app.state``; a route takes it as a parameter (:data:`AppState`), never from a closure."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from omforge.runtime.tokenizer import TextTokenizer
from omforge.serve.async_engine import AsyncEngine
from omforge.serve.metrics import ServerMetrics
from omforge.serve.responses import TokenText, token_text_fn

TOKENIZE_THREADS = 4  # worker threads for tokenization and chat templates (the tokenizer releases the GIL)
T = TypeVar("T")


@dataclass
class ServerState:
    """The engine, the metrics and the server's settings, plus what is derived from them at start: the
    tokenizer (None: the bundle has none, prompts are token ids), the token-text function of logprobs, and the
    pool of tokenizer workers."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_model_len: int
    created: int
    tool_format: str | None = None  # serve/tools.py FORMATS; None: tool_choice auto is refused
    body_timeout: float = 30.0  # seconds a client gets to send its whole request body (then 408)
    max_body_bytes: int = 8 << 20  # a larger request body is refused with a 413
    lora_dirs: tuple[str, ...] | None = None  # runtime adapter loads read only inside these (None: the routes are off)
    tokenizer: TextTokenizer | None = field(init=False)
    token_text: TokenText = field(init=False)
    workers: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.model.tokenizer
        self.token_text = token_text_fn(self.tokenizer) if self.tokenizer is not None else str
        self.workers = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="omforge-tokenize")

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects: None for the base model (its name, or no model), else
        the adapter's name (whether it is served: :func:`omforge.serve.intake.holding`, or ``parse``)."""
        return None if model is None or model == self.model_name else model

    def response_model(self, model: str | None) -> str:
        """The ``model`` an answer names: the adapter's name, or the base model's."""
        return model if model is not None else self.model_name

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tokenizer worker (tokenizing, templates, JSON of token lists): the event loop
        keeps answering, and at most ``TOKENIZE_THREADS`` such jobs run at once."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))


async def app_state(request: Request) -> ServerState:
    """The dependency behind :data:`AppState` (async, so FastAPI calls it on the event loop, not a thread)."""
    return request.app.state.omforge


AppState = Annotated[ServerState, Depends(app_state)]
