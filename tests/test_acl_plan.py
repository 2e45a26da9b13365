"""The ACL executor's pure logic (runtime/ascend/acl_plan.py): splitting scheduler steps into gear runs, padding
them, the dims that select a gear, the coalesced slot-copy plan, and the description check. No acl needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import SMOLLM2_RECIPE
from omforge.compile.bucket_plan import plan
from omforge.contract import cdiv
from omforge.contract.ascend import DYNAMIC_INPUT
from omforge.contract.buckets import BucketError, om_gear, om_gears
from omforge.recipe import load_recipe
from omforge.runtime.ascend.acl_plan import (
    AclModelMismatch,
    ModelDesc,
    TensorDesc,
    check_desc,
    gear_dims,
    max_prompt_len,
    pack_run,
    plan_runs,
    slot_copy_plan,
)
from omforge.runtime.step import SeqWork, build_step

BS = 128
PLAN = plan(load_recipe(SMOLLM2_RECIPE).compile, target="ascend", block_size=BS)
MAX_LEN = PLAN.max_seq_len
MAX_PROMPT = max_prompt_len(PLAN)
NUM_SLOTS = 64 * 16 * BS
# the ascend step graph's data inputs in graph order, and those ATC's --input_shape lists (the pool is static)
INPUT_SHAPE = [("input_ids", [1, "num_tokens"]), ("position_ids", [1, "num_tokens"]),
               ("block_tables", ["num_seqs", "max_blocks"]), ("query_index", ["num_seqs", "max_query_len"]),
               ("token_index", ["num_tokens"]), ("logits_indices", ["num_logits"])]
INPUTS = [n for n, _ in INPUT_SHAPE] + ["kv_cache"]
POOL_BYTES = 4 * 30 * 2 * 3 * 64 * NUM_SLOTS  # SmolLM2: 30 layers, 3 KV heads of 64
OUTPUTS = ["logits", "kv_new"]


def table_for(rng: np.random.Generator, tokens: int) -> list[int]:
    """A random block table (distinct blocks in random order) long enough for ``tokens``."""
    return [int(b) for b in rng.permutation(NUM_SLOTS // BS)[: cdiv(tokens, BS)]]


@st.composite
def steps(draw) -> list[SeqWork]:  # noqa: ANN001
    """Any step the scheduler can make: decodes anywhere in the context, prefill chunks of prompts that the
    engine admits (≤ max_prompt_len), mixed, up to 80 items (more than the largest decode gear)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    work = []
    for _ in range(draw(st.integers(1, 80))):
        if draw(st.booleans()):
            start = draw(st.integers(0, MAX_LEN - 1))
            work.append(SeqWork([int(rng.integers(49152))], start, table_for(rng, start + 1), draw(st.booleans())))
        else:
            prompt = draw(st.integers(2, MAX_PROMPT))
            start = draw(st.integers(0, prompt - 2))
            n = draw(st.integers(2, prompt - start))
            work.append(SeqWork(rng.integers(49152, size=n).tolist(), start, table_for(rng, start + n),
                                draw(st.booleans())))
    return work


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_every_scheduler_step_splits_into_compiled_gears(work: list[SeqWork]) -> None:
    runs = plan_runs(work, PLAN)
    covered: dict[int, list[tuple[int, int]]] = {}
    for run in runs:
        c = run.choice
        profile = PLAN.profile(c.model)
        assert c.gear in profile.gears
        assert (c.num_tokens, c.num_seqs, c.max_query_len, c.num_logits, c.max_blocks) == profile.padded(c.gear)
        if c.model == "prefill":
            (p,) = run.pieces
            assert p.count <= c.num_tokens and p.start + c.num_tokens <= min(c.max_blocks * BS, MAX_LEN)
        else:
            assert len(run.pieces) <= c.num_seqs
            assert all(p.count == 1 and cdiv(p.start + 1, BS) <= c.max_blocks for p in run.pieces)
        for p in run.pieces:
            covered.setdefault(p.item, []).append((p.start, p.count))
    for i, w in enumerate(work):  # every token once, pieces of one item in order
        pieces = covered[i]
        assert pieces[0][0] == w.start and sum(n for _, n in pieces) == len(w.token_ids)
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    logits = [p.item for r in runs for p in r.pieces if p.logits]
    assert sorted(logits) == [i for i, w in enumerate(work) if w.needs_logits]


@settings(max_examples=60, deadline=None)
@given(steps())
def test_packed_runs_put_each_row_at_the_slot_the_ort_abi_would(work: list[SeqWork]) -> None:
    """Cross-check with build_step (the ORT path): the slots the executor copies rows to are slot_mapping's."""
    reference = build_step(work, BS)["slot_mapping"]
    starts = np.concatenate(([0], np.cumsum([len(w.token_ids) for w in work])[:-1]))
    for run in plan_runs(work, PLAN):
        packed = pack_run(run, work, BS)
        c = run.choice
        assert packed.inputs["input_ids"].shape == (1, c.num_tokens)
        assert packed.inputs["block_tables"].shape == (c.num_seqs, c.max_blocks)
        assert packed.inputs["query_index"].shape == (c.num_seqs, c.max_query_len)
        assert packed.inputs["logits_indices"].shape == (c.num_logits,)
        expect = np.concatenate([reference[starts[p.item] + p.start - work[p.item].start:][:p.count]
                                 for p in run.pieces])
        np.testing.assert_array_equal(packed.slots, expect)
        real = sum(p.count for p in run.pieces)
        ids = np.concatenate([np.asarray(work[p.item].token_ids)[p.start - work[p.item].start:][:p.count]
                              for p in run.pieces])
        np.testing.assert_array_equal(packed.inputs["input_ids"][0, :real], ids)
        assert int(packed.inputs["block_tables"].max()) < NUM_SLOTS // BS


def test_a_prompt_beyond_max_prompt_len_cannot_be_prefilled() -> None:
    rng = np.random.default_rng(0)
    # the last token of the longest admitted prompt still fits (padded to the smallest chunk gear)
    ok = SeqWork([1], MAX_PROMPT - 1, table_for(rng, MAX_PROMPT))
    ok2 = SeqWork([1, 2], MAX_PROMPT - 2, table_for(rng, MAX_PROMPT))
    assert plan_runs([ok2], PLAN) and plan_runs([ok], PLAN)
    with pytest.raises(BucketError, match="prompts up to"):
        plan_runs([SeqWork([1, 2], MAX_PROMPT, table_for(rng, MAX_PROMPT + 2))], PLAN)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_slot_copy_plan_coalesces_consecutive_slots(chunk_lens: list[int], seed: int) -> None:
    """Rows of chunks laid into random block tables: one copy per run of consecutive slots, every row once."""
    rng = np.random.default_rng(seed)
    slots = []
    for n in chunk_lens:
        table = table_for(rng, 600)
        start = int(rng.integers(0, 100))
        slots += [table[q // BS] * BS + q % BS for q in range(start, start + n)]
    plan_ = slot_copy_plan(slots)
    rows = [r for c in plan_ for r in range(c.src_row, c.src_row + c.rows)]
    assert rows == list(range(len(slots)))
    for c in plan_:
        assert slots[c.src_row:c.src_row + c.rows] == list(range(c.dst_slot, c.dst_slot + c.rows))
    for a, b in zip(plan_, plan_[1:]):  # maximal: two neighbouring copies could not be one
        assert a.dst_slot + a.rows != b.dst_slot
    breaks = sum(1 for x, y in zip(slots, slots[1:]) if y != x + 1)
    assert len(plan_) == breaks + 1 if slots else not plan_


def test_slot_copy_plan_of_a_prefill_chunk_is_one_copy_per_block() -> None:
    table = [7, 3, 9]
    slots = [table[q // BS] * BS + q % BS for q in range(100, 300)]
    assert [(c.dst_slot, c.rows) for c in slot_copy_plan(slots)] == [(7 * BS + 100, 28), (3 * BS, 128), (9 * BS, 44)]


def _desc(**changes: object) -> ModelDesc:
    inputs = tuple(TensorDesc(n, POOL_BYTES if n == "kv_cache" else 64, (), 0 if n == "kv_cache" else 9)
                   for n in INPUTS) + (TensorDesc(DYNAMIC_INPUT, 8, (1,), 9),)
    outputs = tuple(TensorDesc(f"node_{i}:0:{n}", 64, (), 0) for i, n in enumerate(OUTPUTS))  # ACL's form
    gears = tuple(tuple(gear_dims(g, INPUT_SHAPE)) for g in om_gears(PLAN))
    fields = {"inputs": inputs, "outputs": outputs, "gears": gears, "dynamic_index": len(inputs) - 1, **changes}
    return ModelDesc(**fields)


def test_check_desc_accepts_the_matching_model_and_names_each_mismatch() -> None:
    check_desc(_desc(), INPUTS, OUTPUTS, INPUT_SHAPE, om_gears(PLAN), [("kv_cache", POOL_BYTES)])
    good = _desc()
    cases = {
        "input 0 is 'position_ids', the executor binds 'input_ids'": good.__class__(
            good.inputs[1:], good.outputs, good.gears, good.dynamic_index - 1),
        "no ascend_mbatch_shape_data": _desc(dynamic_index=None),
        "1 outputs": _desc(outputs=good.outputs[:-1]),
        "output 1 is 'node_1:0:kv'": _desc(outputs=(good.outputs[0], TensorDesc("node_1:0:kv", 64, (), 0))),
        "gears compiled": _desc(gears=good.gears[:-1]),
        "not among the compiled gears": _desc(gears=good.gears[:-1] + ((1, 2, 3),)),
        "pool needs": _desc(inputs=tuple(TensorDesc(t.name, 99, t.dims, t.dtype) if t.name == "kv_cache" else t
                                         for t in good.inputs)),
    }
    for message, desc in cases.items():
        with pytest.raises(AclModelMismatch, match=message):
            check_desc(desc, INPUTS, OUTPUTS, INPUT_SHAPE, om_gears(PLAN), [("kv_cache", POOL_BYTES)])


def test_bare_output_names_still_match_and_cann_names_are_cut_at_the_last_colon() -> None:
    """Issue 20 defect 3: CANN names an ONNX model's outputs ``op-name:edge-index:tensor-name``."""
    from omforge.runtime.ascend.acl_plan import output_name

    assert output_name("logits_f32:0:logits") == "logits" and output_name("logits") == "logits"
    bare = _desc(outputs=tuple(TensorDesc(n, 64, (), 0) for n in OUTPUTS))
    check_desc(bare, INPUTS, OUTPUTS, INPUT_SHAPE, om_gears(PLAN), [("kv_cache", POOL_BYTES)])


def test_gear_dims_agree_with_the_atc_command() -> None:
    """The dims set at run time carry, at ATC's -1 positions, exactly the values of ATC's --dynamic_dims, and the
    list stays far below ACL's 128 (only the step inputs are listed)."""
    from omforge.compile.ascend.atc import AtcModelSpec
    from omforge.contract.buckets import STEP_DIMS

    spec = AtcModelSpec("step", Path("step.onnx"), dict(INPUT_SHAPE), list(om_gears(PLAN)), list(STEP_DIMS))
    shape = spec.input_shape_arg()
    minus = [i for i, v in enumerate(v for part in shape.split(";") for v in part.split(":")[1].split(","))
             if v == "-1"]
    atc_gears = [[int(v) for v in g.split(",")] for g in spec.dynamic_dims_arg().split(";")]
    for gear, atc in zip(om_gears(PLAN), atc_gears, strict=True):
        dims = gear_dims(gear, INPUT_SHAPE)
        assert len(dims) == 10 <= 128
        assert [dims[i] for i in minus] == atc
    for runs in (plan_runs([SeqWork([1] * 300, 0, list(range(3)))], PLAN), ):
        assert all(om_gear(r.choice) in om_gears(PLAN) for r in runs)


def _pool_desc(size: int) -> ModelDesc:
    return _desc(inputs=tuple(TensorDesc(t.name, size, t.dims, t.dtype) if t.name == "kv_cache" else t
                              for t in _desc().inputs))


def test_a_pool_described_up_to_64_bytes_larger_is_accepted() -> None:
    """Issue 44 item 6: the graph engine pads tensor descriptors by 32 bytes (graph_metadef tensor_utils.cc;
    reference §5.2), so the pool's described size may exceed its bytes a little (equality was required before)."""
    for extra in (0, 32, 64):
        check_desc(_pool_desc(POOL_BYTES + extra), INPUTS, OUTPUTS, INPUT_SHAPE, om_gears(PLAN),
                   [("kv_cache", POOL_BYTES)])
    for size in (POOL_BYTES - 1, POOL_BYTES + 65):
        with pytest.raises(AclModelMismatch, match="pool needs"):
            check_desc(_pool_desc(size), INPUTS, OUTPUTS, INPUT_SHAPE, om_gears(PLAN), [("kv_cache", POOL_BYTES)])


def test_pool_slots_must_be_64_byte_aligned_for_memcpy_async() -> None:
    """Issue 44 item 6: memcpy_async needs 64-byte-aligned addresses (aclpythondevg_01_0125); a slot is the unit of
    every row copy, so its size must be a multiple of 64."""
    from omforge.runtime.ascend.acl_plan import check_slot_alignment

    check_slot_alignment(30 * 2 * 3 * 64 * 2)  # SmolLM2 in float16: 23,040 bytes
    with pytest.raises(AclModelMismatch, match="not a multiple of 64"):
        check_slot_alignment(1 * 2 * 1 * 12 * 2)  # 48 bytes


def test_device_need_counts_the_pool_once() -> None:
    """Issue 44 item 2: aclmdlQuerySize's work includes the model's inputs and outputs, the pool too (hicann/ge
    graph_builder.cc); loaded with ACL_MDL_WORKSPACE_MEM_OPTIMIZE they are ours, counted once."""
    from omforge.runtime.ascend.acl_plan import device_need

    pool, io, weights, own = 16 << 30, 1 << 28, 15 << 30, 1 << 30
    need = device_need(weights, 123, io, pool, queried=(own + pool + io, weights))
    assert need.measured and need.total == weights + own + pool + io
    estimate = device_need(weights, own, io, pool, queried=None)
    assert not estimate.measured and estimate.total == weights + own + pool + io


def test_device_need_on_the_fallback_load_counts_the_pool_twice() -> None:
    """Issue 60 item 6: when ACL refuses ACL_MDL_WORKSPACE_MEM_OPTIMIZE the executor loads with load_from_file, and
    GE reserves the inputs and outputs in its work memory again: the plan counts the pool (and I/O) twice."""
    from omforge.runtime.ascend.acl_plan import device_need

    pool, io, weights, own = 16 << 30, 1 << 28, 15 << 30, 1 << 30
    need = device_need(weights, 123, io, pool, queried=(own + pool + io, weights), optimized=False)
    assert not need.optimized and need.total == weights + own + 2 * (pool + io)
    estimate = device_need(weights, own, io, pool, queried=None, optimized=False)
    assert estimate.total == weights + own + 2 * (pool + io)


# --- in place: slot mapping with scratch slots, actual lengths, and the prefill rule without padded context ------

SCRATCH_BLOCKS = cdiv(max(g[0] for g in om_gears(PLAN)) - 1, BS)  # every gear's padding rows, distinct
TOTAL_BLOCKS = NUM_SLOTS // BS + SCRATCH_BLOCKS  # the blocks steps() draws from, then the scratch ones


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_in_place_runs_write_distinct_in_range_slots_and_read_within_their_tables(work: list[SeqWork]) -> None:
    """Every in-place run feeds what ScatterPaKvCache and FIA/IFA take (reference §5.3): slots unique and in range,
    real rows at their sequence's slots, padding rows in the scratch blocks only; block-table entries valid blocks;
    lengths q ≤ kv ≤ the table's capacity, padding sequences 1/1 over a scratch block."""
    from omforge.runtime.ascend.acl_plan import Scratch

    scratch = Scratch(TOTAL_BLOCKS - SCRATCH_BLOCKS, SCRATCH_BLOCKS, BS)
    for run in plan_runs(work, PLAN, inplace=True):
        c = run.choice
        packed = pack_run(run, work, BS, scratch)
        slots, tables = packed.inputs["slot_mapping"], packed.inputs["block_tables"]
        q, kv = packed.inputs["actual_seq_lengths"], packed.inputs["actual_seq_lengths_kv"]
        n = len(packed.slots)  # the real rows' slots are the scheduler's (unique in its steps; random here)
        assert slots.shape == (c.num_tokens,) and len(set(slots[n:].tolist()) | set(slots[:n].tolist())) == \
            len(set(slots[:n].tolist())) + c.num_tokens - n
        assert 0 <= slots.min() and slots.max() < TOTAL_BLOCKS * BS
        assert (slots[:n] == packed.slots).all() and (slots[:n] < scratch.first * BS).all()
        assert (slots[n:] >= scratch.first * BS).all()
        assert 0 <= tables.min() and tables.max() < TOTAL_BLOCKS
        assert q.shape == kv.shape == (c.num_seqs,) and (1 <= q).all() and (q <= kv).all()
        assert (kv <= c.max_blocks * BS).all()
        for b, p in enumerate(run.pieces):
            assert (q[b], kv[b]) == (p.count, p.start + p.count)
        for b in range(len(run.pieces), c.num_seqs):  # padding sequences
            assert (q[b], kv[b]) == (1, 1) and (tables[b] == scratch.first).all()
        assert packed.inputs["position_ids"].max() < PLAN.max_seq_len  # padding stays inside the context


def test_in_place_prefill_needs_no_room_for_its_padding() -> None:
    """Gather: a last piece pads past its end inside the context, so prompts stop at max_seq_len − g0 + 1. In place
    the padding rows go to scratch slots: a prompt of max_seq_len tokens takes the gears whose blocks it fills."""
    assert max_prompt_len(PLAN, inplace=True) == MAX_LEN > MAX_PROMPT
    tail = [SeqWork([5, 6], MAX_LEN - 2, list(range(MAX_LEN // BS)))]  # a 2-token chunk ending the context
    with pytest.raises(BucketError, match="would end past the context"):
        plan_runs(tail, PLAN)
    (run,) = plan_runs(tail, PLAN, inplace=True)
    assert run.choice.max_blocks * BS == MAX_LEN and run.choice.num_tokens > 2
    work = [SeqWork(list(range(MAX_LEN)), 0, list(range(MAX_LEN // BS)))]
    runs = plan_runs(work, PLAN, inplace=True)
    assert sum(r.pieces[0].count for r in runs) == MAX_LEN
    assert all(r.choice.max_blocks * BS >= r.pieces[0].start + r.pieces[0].count for r in runs)


def test_scratch_slots_run_out_in_one_line() -> None:
    from omforge.runtime.ascend.acl_plan import Scratch

    assert Scratch(10, 1, 16).slots(3).tolist() == [160, 161, 162]
    with pytest.raises(ValueError, match="17 padding rows, the 1 scratch block"):
        Scratch(10, 1, 16).slots(17)


def test_check_desc_checks_every_pool_of_an_in_place_om() -> None:
    """In place the OM binds 2 × layers pool inputs (key_cache.N, value_cache.N): each is checked by size."""
    inputs = ["input_ids", "key_cache.0", "value_cache.0"]
    shape = [("input_ids", [1, "num_tokens"])]
    gears = [(1, 1, 1, 1, 1), (2, 1, 2, 1, 1)]
    desc = ModelDesc(tuple(TensorDesc(n, 4096 if "cache" in n else 64, (), 1) for n in inputs)
                     + (TensorDesc(DYNAMIC_INPUT, 8, (1,), 9),), (TensorDesc("n:0:logits", 64, (), 0),),
                     tuple(tuple(gear_dims(g, shape)) for g in gears), 3)
    check_desc(desc, inputs, ["logits"], shape, gears, [("key_cache.0", 4096), ("value_cache.0", 4096)])
    with pytest.raises(AclModelMismatch, match="'value_cache.0' holds 4096 bytes, the manifest's pool needs 8192"):
        check_desc(desc, inputs, ["logits"], shape, gears, [("key_cache.0", 4096), ("value_cache.0", 8192)])
    with pytest.raises(AclModelMismatch, match="input 1 is 'key_cache.0', the executor binds 'value_cache.0'"):
        check_desc(desc, ["input_ids", "value_cache.0", "key_cache.0"], ["logits"], shape, gears, [])
