"""Build the step ABI's inputs (see :mod:`omforge.passes.paged_kv`) from per-sequence work items.

Pure numpy, no ORT: the scheduler decides the work, this packs it. Invariants of the result: tokens are
packed sequence after sequence; ``query_index[b, i]`` and ``token_index`` are inverse maps between the
packed and the padded layouts; every block-table row is padded with a valid block id (its own first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step: ``token_ids`` at positions ``start .. start + len - 1``."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    needs_logits: bool = True


def build_step(work: Sequence[SeqWork], block_size: int, max_blocks: int | None = None) -> dict[str, np.ndarray]:
    """Pack ``work`` into the step inputs. ``max_blocks`` pads the block tables to a fixed width (a bucket)."""
    if not work:
        raise ValueError("a step needs at least one sequence")
    lens = np.array([len(w.token_ids) for w in work], dtype=np.int64)
    if (lens < 1).any():
        raise ValueError("every sequence in a step brings at least one token")
    total, q_max = int(lens.sum()), int(lens.max())
    need_blocks = [-(-(w.start + n) // block_size) for w, n in zip(work, lens)]
    for w, need in zip(work, need_blocks):
        if len(w.block_table) < need:
            raise ValueError(f"block table of {len(w.block_table)} blocks cannot hold {w.start + len(w.token_ids)} tokens")
    width = max(max(need_blocks), max_blocks or 0)
    tables = np.empty((len(work), width), dtype=np.int64)
    for b, (w, need) in enumerate(zip(work, need_blocks)):
        row = np.asarray(w.block_table[:need], dtype=np.int64)
        tables[b, :need] = row
        tables[b, need:] = row[0]
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    ids = np.concatenate([np.asarray(w.token_ids, dtype=np.int64) for w in work])
    seq_of = np.repeat(np.arange(len(work)), lens)
    offset = np.arange(total) - starts[seq_of]
    positions = np.repeat([w.start for w in work], lens) + offset
    slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
    # padded query rows point at the sequence's last token: a valid, unmasked position (no NaN rows)
    qi = np.minimum(np.arange(q_max)[None, :], lens[:, None] - 1) + starts[:, None]
    logits_rows = [int(s + n - 1) for s, n, w in zip(starts, lens, work) if w.needs_logits]
    return {
        "input_ids": ids[None, :],
        "position_ids": positions[None, :].astype(np.int64),
        "slot_mapping": slots.astype(np.int64),
        "block_tables": tables,
        "query_index": qi.astype(np.int64),
        "token_index": (seq_of * q_max + offset).astype(np.int64),
        "logits_indices": np.asarray(logits_rows, dtype=np.int64),
    }
