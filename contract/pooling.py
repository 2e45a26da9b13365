"""The pooling bundle's contract: what a recipe's ``task: embed | score`` compiles and the runtime reads.

A pooling bundle's step graph (``passes/pooling.py`` builds it) has no KV pool and samples nothing. One execution
takes ``B`` whole sequences, right-padded to the longest (``Q`` tokens): causal attention means a padding token
never reaches a real one, so each sequence's last real position is exact with no mask input.

  input_ids     [num_seqs, max_query_len] int64   the sequences, right-padded (any valid id)
  position_ids  [num_seqs, max_query_len] int64   0 .. max_query_len - 1 on every row
  pool_index    [num_seqs]                int64   row-major index of each sequence's last token: b * Q + len_b - 1
outputs:
  pooled        [num_seqs, hidden_size]   float32  embed: the final-norm hidden state there (last-token pooling)
  logits        [num_seqs, 2]             float32  score: the LM head's rows of the ``no`` and ``yes`` tokens there

Dependency-free (stdlib only): the runtime imports it.
"""

from __future__ import annotations

TASKS = ("generate", "embed", "score")
"""Recipe ``task``: ``generate`` (the paged step graph, sampling), ``embed`` (last-token pooling of the final-norm
hidden state, Qwen3-Embedding's) or ``score`` (the last position's logits of two tokens, ``P(yes)`` over
``[no, yes]``: Qwen3-Reranker's)."""

POOLING_INPUTS = ("input_ids", "position_ids", "pool_index")
POOLED_OUTPUT = {"embed": "pooled", "score": "logits"}
"""The graph output each pooling task returns."""

PROMPT_FORMATS = ("none", "qwen3")
"""How the server writes queries and documents for a pooling model (recipe ``pooling.prompt_format``): ``none``
(as given) or ``qwen3`` (Qwen3-Embedding's ``Instruct: …\\nQuery:…`` queries; Qwen3-Reranker's judge prompt).
The texts are serve/pooling_prompts.py's."""
