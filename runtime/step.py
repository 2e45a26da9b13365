"""Build the step ABI's inputs (see :mod:`omforge.passes.paged_kv`) from per-sequence work items.

Pure numpy, no ORT: the scheduler decides the work, this packs it. Invariants of the result: tokens are
packed sequence after sequence; ``query_index[b, i]`` and ``token_index`` are inverse maps between the
packed and the padded layouts; every block-table row is padded with a valid block id (its own first live one);
a negative entry (a block released because it fell out of the sliding window, never read) is packed as that id;
``lora_slots [1, T]`` holds each token's adapter slot (its item's ``lora_slot``; only graphs with LoRA read it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omforge.contract import cdiv


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step: ``token_ids`` at positions ``start .. start + len - 1``."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    needs_logits: bool = True
    all_logits: bool = False  # a logits row for every token (prompt logprobs), in order, instead of the last
    lora_slot: int = 0  # the LoRA adapter slot of every token of this item (0: the base model; docs/lora.md)


def build_step(work: Sequence[SeqWork], block_size: int, max_blocks: int | None = None,
               split_decodes: bool = False) -> dict[str, np.ndarray]:
    """Pack ``work`` into the step inputs. ``max_blocks`` pads the block tables to a fixed width (a bucket).

    ``split_decodes`` (graphs with a decode group, ``contract.DECODE_GROUP_INPUTS``): when the step has both
    single-token items and longer chunks, the single-token ones form the decode group — attended apart, not padded
    to the longest chunk — and ``token_index`` indexes the rows ``[B * Q + Bd]``. Otherwise (and always without
    ``split_decodes``) every item is in the main group and the decode group is one unreferenced row.
    """
    if not work:
        raise ValueError("a step needs at least one sequence")
    lens = np.array([len(w.token_ids) for w in work], dtype=np.int64)
    if (lens < 1).any():
        raise ValueError("every sequence in a step brings at least one token")
    need_blocks = [cdiv(w.start + n, block_size) for w, n in zip(work, lens)]
    for w, need in zip(work, need_blocks):
        if len(w.block_table) < need:
            raise ValueError(f"block table of {len(w.block_table)} blocks cannot hold "
                             f"{w.start + len(w.token_ids)} tokens")
    single = lens == 1
    split = split_decodes and single.any() and not single.all()
    main = np.flatnonzero(~single) if split else np.arange(len(work))
    dec = np.flatnonzero(single) if split else np.empty(0, np.int64)
    total = int(lens.sum())
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    q_max = int(lens[main].max())
    ids = np.concatenate([np.asarray(w.token_ids, dtype=np.int64) for w in work])
    seq_of = np.repeat(np.arange(len(work)), lens)
    offset = np.arange(total) - starts[seq_of]
    positions = np.repeat([w.start for w in work], lens) + offset

    need = np.asarray(need_blocks, dtype=np.int64)
    width = max(int(need.max()), max_blocks or 0)
    all_tables = np.empty((len(work), width), dtype=np.int64)  # every item's table, padded with its first block
    for b, w in enumerate(work):
        row = np.asarray(w.block_table[:need_blocks[b]], dtype=np.int64)
        fill = row[row >= 0][0]  # the first live block (leading ones may be released out of the window)
        all_tables[b, :len(row)] = np.where(row >= 0, row, fill)
        all_tables[b, len(row):] = fill
    tables = all_tables[main, :max(int(need[main].max()), max_blocks or 0)]
    slots = all_tables[seq_of, positions // block_size] * block_size + positions % block_size
    # padded query rows point at the sequence's last token: a valid, unmasked position (no NaN rows)
    m_starts, m_lens = starts[main], lens[main]
    qi = np.minimum(np.arange(q_max)[None, :], m_lens[:, None] - 1) + m_starts[:, None]
    row_of_seq = np.empty(len(work), dtype=np.int64)  # first padded row of each item in [B * Q + Bd]
    row_of_seq[main] = np.arange(len(main)) * q_max
    row_of_seq[dec] = len(main) * q_max + np.arange(len(dec))
    if split:
        d_tables, d_qidx = all_tables[dec, :int(need[dec].max())], starts[dec][:, None]
    else:  # one unreferenced row: the first token over its own first block
        d_tables, d_qidx = all_tables[:1, :1], np.zeros((1, 1), dtype=np.int64)
    logits_rows = [r for s, n, w in zip(starts, lens, work)
                   for r in (range(int(s), int(s + n)) if w.all_logits else [int(s + n - 1)] * w.needs_logits)]
    return {
        "input_ids": ids[None, :],
        "position_ids": positions[None, :].astype(np.int64),
        "slot_mapping": slots.astype(np.int64),
        "block_tables": tables,
        "query_index": qi.astype(np.int64),
        "token_index": (row_of_seq[seq_of] + offset).astype(np.int64),
        "logits_indices": np.asarray(logits_rows, dtype=np.int64),
        "decode_block_tables": d_tables,
        "decode_query_index": d_qidx.astype(np.int64),
        "lora_slots": np.repeat(np.asarray([w.lora_slot for w in work], dtype=np.int64), lens)[None, :],
    }
