"""How queries and documents are written for a pooling model (the bundle's ``pooling.prompt_format``,
contract/pooling.py's PROMPT_FORMATS), as token ids.

``qwen3`` follows the Qwen3-Embedding / Qwen3-Reranker model cards (github.com/QwenLM/Qwen3-Embedding, README):

  embed — a query is ``Instruct: {instruction}\\nQuery:{query}``, a document is as given; each ends with
          ``<|endoftext|>`` (the bundle's ``append_token_id``; :func:`omforge.runtime.pooling.encode_text`).
  score — one sequence per (query, document): the system/user prefix, ``<Instruct>: {instruction}\\n<Query>:
          {query}\\n<Document>: {document}``, then the assistant suffix with an empty think block; the three parts
          tokenized apart and joined, as the model card does. The score is P(yes) at its last position.

``none`` writes both as given (score: the query's tokens, then the document's).
"""

from __future__ import annotations

from collections.abc import Callable

QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""The model cards' default task instruction (a bundle's ``pooling.instruction`` replaces it)."""
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                       "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

Encode = Callable[[str], list[int]]


def instruction_of(prompt_format: str, given: str | None, default: str | None) -> str | None:
    """The instruction a request uses: its own, the bundle's, or the format's default."""
    return given or default or (QWEN3_INSTRUCTION if prompt_format == "qwen3" else None)


def query_text(prompt_format: str, query: str, instruction: str | None) -> str:
    """An embedding model's query as it is embedded (a document is embedded as given)."""
    if prompt_format == "qwen3" and instruction:
        return f"Instruct: {instruction}\nQuery:{query}"
    return query


def pair_ids(prompt_format: str, encode: Encode, query: str, document: str, instruction: str | None) -> list[int]:
    """A score model's sequence for (``query``, ``document``); ``encode``: text → ids without special tokens."""
    if prompt_format == "qwen3":
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        return encode(QWEN3_RERANK_PREFIX) + encode(body) + encode(QWEN3_RERANK_SUFFIX)
    return encode(query) + encode(document)
