"""The pooling endpoints' request bodies and answers: OpenAI's ``/v1/embeddings``, the Jina/Cohere ``/v1/rerank``
(as vLLM serves it, also at ``/rerank`` and ``/v2/rerank``) and vLLM's ``/v1/score``. Parsed strictly, as the
generation bodies are (serve/protocol.py): an unknown field or a wrong type is a 400 naming it."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omforge.serve.protocol import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None

    def check_supported(self) -> None:
        """Checks beyond the schema (serve/intake.py ``parse`` calls it)."""


MAX_INPUTS = 2048
"""The most inputs one embeddings request may hold (OpenAI's limit on ``input``'s array)."""


class EmbeddingRequest(_Body):
    """OpenAI's embeddings request: ``input`` a string, strings, token ids or lists of token ids (at most
    :data:`MAX_INPUTS` inputs); ``dimensions`` where the model is matryoshka-trained; ``encoding_format`` float or
    base64 (little-endian float32)."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def check_supported(self) -> None:
        if not self.input or (isinstance(self.input, list) and any(isinstance(i, list | str) and not i
                                                                   for i in self.input)):
            raise APIError(400, "input: must not be empty, nor hold an empty string or list", param="input")
        if len(self.inputs()) > MAX_INPUTS:
            raise APIError(400, f"input: {len(self.inputs()):,} inputs, more than the {MAX_INPUTS:,} one request may "
                           "hold; send them in several requests", param="input")

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a text or one sequence of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str


class RerankRequest(_Body):
    """Jina's / Cohere's rerank request (vLLM's fields): the ``query``, the ``documents`` (strings or
    ``{"text": …}``), the ``top_n`` best to return (default all), whether to echo the documents; ``instruction``
    (omforge's): the task instruction of an instruction-aware model (default: the bundle's)."""

    query: str
    documents: list[str | TextDocument] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    """vLLM's score request: ``text_1`` scored against each ``text_2`` (one string against a list), or the pairs
    of two lists of one length; ``instruction`` as :class:`RerankRequest`'s."""

    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None

    def pairs(self) -> list[tuple[str, list[str]]]:
        """(query, documents) groups: one query against many, or one pair per group."""
        t1, t2 = self.text_1, self.text_2
        t2 = [t2] if isinstance(t2, str) else t2
        if isinstance(t1, str) or len(t1) == 1:
            return [(t1 if isinstance(t1, str) else t1[0], t2)]
        if len(t1) != len(t2):
            raise APIError(400, f"text_1 and text_2: lists of different lengths ({len(t1)} and {len(t2)}); give "
                           "one text_1, or one text_1 per text_2", param="text_1")
        return [(a, [b]) for a, b in zip(t1, t2)]

    def check_supported(self) -> None:
        if not self.text_1 or not self.text_2:
            raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not self.text_1 else "text_2")


def embedding_response(model: str, vectors: list[np.ndarray], encoding: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings body; base64 is the vector's little-endian float32 bytes, as OpenAI encodes it."""
    def encoded(v: np.ndarray) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return [float(x) for x in v]

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def rerank_response(rid: str, model: str, body: RerankRequest, scores: list[float], tokens: int) -> dict[str, Any]:
    """The rerank body: results sorted by relevance, best first, ``top_n`` of them."""
    texts = body.texts()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
    return {"id": rid, "model": model, "usage": {"total_tokens": tokens}, "results": results}


def score_response(rid: str, model: str, scores: list[float], tokens: int) -> dict[str, Any]:
    """vLLM's score body: one ``{index, object: score, score}`` per pair, in request order."""
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
