"""Packing the step ABI's inputs (runtime/step.py): invariants on random work, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omforge.contract import cdiv
from omforge.runtime.step import SeqWork, build_step


@st.composite
def work_items(draw):  # noqa: ANN001, ANN201
    block = draw(st.sampled_from([1, 2, 4, 16]))
    items = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        n = draw(st.integers(1, 12))
        need = cdiv(start + n, block)
        table = draw(st.lists(st.integers(0, 500), min_size=need, max_size=need + 3, unique=True))
        items.append(SeqWork([draw(st.integers(0, 99)) for _ in range(n)], start, table, draw(st.booleans())))
    return block, items


@settings(max_examples=200, deadline=None)
@given(work_items())
def test_packing_invariants(case) -> None:  # noqa: ANN001
    block, work = case
    s = build_step(work, block)
    lens = [len(w.token_ids) for w in work]
    total, q = sum(lens), max(lens)
    assert s["input_ids"].shape == (1, total) and s["position_ids"].shape == (1, total)
    assert s["query_index"].shape == (len(work), q)
    assert np.concatenate([w.token_ids for w in work]).tolist() == s["input_ids"][0].tolist()
    t = 0
    for b, w in enumerate(work):
        for i in range(lens[b]):
            pos = w.start + i
            assert s["position_ids"][0, t] == pos
            assert s["slot_mapping"][t] == w.block_table[pos // block] * block + pos % block
            assert s["query_index"][b, i] == t and s["token_index"][t] == b * q + i  # inverse maps
            t += 1
        padded = s["query_index"][b, lens[b]:]
        assert (padded == t - 1).all()  # padding points at the sequence's own last token
        row = s["block_tables"][b]
        need = cdiv(w.start + lens[b], block)
        assert row[:need].tolist() == list(w.block_table[:need]) and (row[need:] == w.block_table[0]).all()
    starts = np.cumsum([0] + lens)
    assert s["logits_indices"].tolist() == [int(starts[b + 1] - 1) for b, w in enumerate(work) if w.needs_logits]


def test_fixed_table_width_pads() -> None:
    s = build_step([SeqWork([1, 2], 0, [7])], block_size=4, max_blocks=8)
    assert s["block_tables"].tolist() == [[7] * 8]


@pytest.mark.parametrize("work, message", [
    ([], "at least one sequence"),
    ([SeqWork([], 0, [1])], "at least one token"),
    ([SeqWork([1, 2, 3], 2, [1])], "cannot hold 5 tokens"),
])
def test_errors(work, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        build_step(work, block_size=4)
