"""The bucket planner (compile/bucket_plan.py): gear planning from recipes, its errors and warning, the manifest form,
ATC's strings, and ``pick`` choosing the smallest gear that fits every step the scheduler can produce.

Pure Python, no graphs: fast.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from helpers import TINY_RECIPE
from omforge.compile.bucket_plan import DEFAULT_GEAR_CAP, BucketWarning, plan
from omforge.contract import cdiv
from omforge.contract.buckets import MAX_GEARS, STEP_DIMS, BucketError, BucketPlan, Choice, om_gears, pick
from omforge.recipe import Buckets, CompileSection, load_recipe


def _section(**buckets: list[int] | int) -> CompileSection:
    """A small compile section: 1024 tokens, 8 sequences, 512 tokens per step; ``buckets`` lists as given."""
    maxima = {k: buckets.pop(k) for k in ("max_seq_len", "max_batch_size", "max_num_tokens") if k in buckets}
    return CompileSection(**{"max_seq_len": 1024, "max_batch_size": 8, "max_num_tokens": 512, **maxima},
                          buckets=Buckets(**buckets))


def _quiet_plan(section: CompileSection, target: str = "ascend", block_size: int = 64) -> BucketPlan:
    """plan() with warnings turned into errors: the case must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return plan(section, target=target, block_size=block_size)


def _gears(p: BucketPlan) -> dict[str, list[tuple[int, ...]]]:
    return {prof.name: list(prof.gears or ()) for prof in p.profiles}


# --- planning from the maxima ---------------------------------------------------------------------------------

def test_defaults_from_maxima_without_thinning() -> None:
    """Powers of two from 128 / 1 / 512 up to the bound, the bound itself added when it is not a power of two."""
    p = _quiet_plan(CompileSection(max_seq_len=1000, max_batch_size=5, max_num_tokens=300))
    # prefill: 128, 256, 300 (= min(max_num_tokens, max_seq_len)); context 512, 1000 → 8, 16 blocks of 64
    assert _gears(p)["prefill"] == [(c, m) for c in (128, 256, 300) for m in (8, 16)]
    assert _gears(p)["decode"] == [(b, m) for b in (1, 2, 4, 5) for m in (8, 16)]
    assert [prof.dims for prof in p.profiles] == [("num_tokens", "max_blocks"), ("num_seqs", "max_blocks")]


def test_defaults_thinned_to_the_cap() -> None:
    """The recipe defaults (2048 tokens, 64 sequences, block 128): 5 × 3 and 7 × 3 candidates thinned to ≤ 8 gears,
    keeping each list's smallest and largest value; the prefill gear (2048, 4 blocks) is dropped: a chunk of more
    than 1024 tokens needs at least 9 blocks."""
    p = _quiet_plan(CompileSection(), block_size=128)
    assert _gears(p)["prefill"] == [(128, 4), (128, 16), (256, 4), (256, 16), (1024, 4), (1024, 16), (2048, 16)]
    assert _gears(p)["decode"] == [(b, m) for b in (1, 4, 16, 64) for m in (4, 16)]


def test_planned_list_thinned_explicit_list_kept() -> None:
    p = _quiet_plan(CompileSection(max_seq_len=8192, buckets=Buckets(decode_batch_sizes=[1, 2, 4, 8])), block_size=128)
    assert sorted({b for b, _ in _gears(p)["decode"]}) == [1, 2, 4, 8]  # explicit: whole
    assert sorted({m for _, m in _gears(p)["decode"]}) == [4, 64]  # planned 512..8192: thinned to its ends


def test_tiny_recipe_plans_on_ascend() -> None:
    """The test recipe (max_seq_len 256, other maxima default) plans on ascend without warnings."""
    p = _quiet_plan(load_recipe(TINY_RECIPE).compile, block_size=128)
    assert _gears(p) == {"prefill": [(128, 2), (256, 2)], "decode": [(b, 2) for b in (1, 2, 4, 8, 16, 32, 64)]}


@settings(max_examples=150, deadline=None)
@given(max_seq_len=st.integers(16, 65536), max_batch_size=st.integers(1, 512), max_num_tokens=st.integers(1, 16384),
       block_size=st.sampled_from([16, 64, 128, 256]))
def test_planned_plans_cover_the_maxima_within_the_cap(max_seq_len: int, max_batch_size: int, max_num_tokens: int,
                                                       block_size: int) -> None:
    section = CompileSection(max_seq_len=max_seq_len, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
    try:
        p = _quiet_plan(section, block_size=block_size)  # never warns: the cap is the warning threshold
    except BucketError as e:  # only degenerate maxima (a single chunk length and a single context gear)
        assert "ATC needs at least 2 gears per model" in str(e)
        assert min(max_num_tokens, max_seq_len) <= 128 or min(max_batch_size, max_num_tokens) == 1
        return
    prefill, decode = p.profile("prefill"), p.profile("decode")
    for prof in (prefill, decode):
        assert 2 <= len(prof.gears or ()) <= DEFAULT_GEAR_CAP
        assert prof.largest("max_blocks") == math.ceil(max_seq_len / block_size)
    assert prefill.largest("num_tokens") == min(max_num_tokens, max_seq_len)
    assert decode.largest("num_seqs") == min(max_batch_size, max_num_tokens)
    assert plan(section, target="ascend", block_size=block_size) == p  # deterministic


def test_context_lens_round_up_to_whole_blocks() -> None:
    p = _quiet_plan(_section(decode_batch_sizes=[1, 2], context_lens=[100, 120, 300, 1000]), block_size=128)
    assert sorted({m for _, m in _gears(p)["decode"]}) == [1, 3, 8]  # 100 and 120 are both one block


def test_ort_plans_one_dynamic_profile() -> None:
    p = _quiet_plan(CompileSection(), target="ort")
    (step,) = p.profiles
    assert (step.name, step.gears, step.dims) == ("step", None, STEP_DIMS)
    assert step.largest("num_tokens") is None


# --- errors and the warning -----------------------------------------------------------------------------------

def test_exactly_one_gear_is_an_error() -> None:
    with pytest.raises(BucketError, match=r"^compile\.buckets: the decode model has 1 gear .*ATC needs at least 2 "
                       r"gears per model; give at least two values in compile\.buckets\.decode_batch_sizes or "
                       r"compile\.buckets\.context_lens$"):
        plan(_section(decode_batch_sizes=[4], context_lens=[512]), target="ascend", block_size=64)


def test_one_gear_after_dropping_unusable_prefill_gears() -> None:
    """Chunks 64 and 512 with one context gear of 64 tokens: no chunk over 64 tokens fits one block, so only
    (64, 1) is left."""
    with pytest.raises(BucketError, match=r"prefill model has 1 gear .*1 gears no chunk can use dropped.*"
                                          r"compile\.buckets\.prefill_seq_lens"):
        plan(_section(prefill_seq_lens=[64, 512], context_lens=[64]), target="ascend", block_size=64)


def test_101_gears_is_an_error_100_warns() -> None:
    batches = list(range(1, 102))
    with pytest.raises(BucketError, match=r"the decode model has 101 gears .*ATC allows at most 100 per model; give "
                                          r"fewer values in compile\.buckets\.decode_batch_sizes"):
        plan(_section(max_batch_size=128, decode_batch_sizes=batches, context_lens=[512]), target="ascend",
             block_size=64)
    # the one OM holds both profiles' gears: 97 decode + the 3 prefill gears (1 shared with decode 1) fit 100
    with pytest.warns(BucketWarning):
        p = plan(_section(max_batch_size=128, decode_batch_sizes=batches[:97], context_lens=[512]),
                 target="ascend", block_size=64)
    assert len(p.profile("decode").gears or ()) == 97 and len(om_gears(p)) <= MAX_GEARS
    # 100 decode gears warn as the decode model's count, then the OM's total (with prefill's) is refused
    with pytest.warns(BucketWarning, match="the decode model has 100 gears"), \
            pytest.raises(BucketError, match=r"the OM's gears \(prefill and decode together\) number 10[0-9]"):
        plan(_section(max_batch_size=128, decode_batch_sizes=batches[:MAX_GEARS], context_lens=[512]),
             target="ascend", block_size=64)


@pytest.mark.parametrize("target", ["ascend", "ort"])
@pytest.mark.parametrize("buckets, message", [
    (dict(prefill_seq_lens=[128, 1024]),
     r"compile\.buckets\.prefill_seq_lens: 1024 exceeds compile\.max_num_tokens \(512\)"),
    (dict(max_num_tokens=4096, prefill_seq_lens=[2048]),
     r"compile\.buckets\.prefill_seq_lens: 2048 exceeds compile\.max_seq_len \(1024\)"),
    (dict(decode_batch_sizes=[4, 16]),
     r"compile\.buckets\.decode_batch_sizes: 16 exceeds compile\.max_batch_size \(8\)"),
    (dict(max_num_tokens=4, decode_batch_sizes=[1, 8]),
     r"compile\.buckets\.decode_batch_sizes: 8 exceeds compile\.max_num_tokens \(4\)"),
    (dict(context_lens=[512, 2048]),
     r"compile\.buckets\.context_lens: 2048 exceeds compile\.max_seq_len \(1024\)"),
])
def test_value_beyond_its_maximum(target: str, buckets: dict, message: str) -> None:
    with pytest.raises(BucketError, match="^" + message) as err:
        plan(_section(**buckets), target=target, block_size=64)
    assert "\n" not in str(err.value)


def test_bad_target_and_block_size() -> None:
    with pytest.raises(BucketError, match=r"compile\.target: 'cuda' is not one of ort, ascend"):
        plan(_section(), target="cuda", block_size=64)
    with pytest.raises(BucketError, match=r"compile\.kv_block_size"):
        plan(_section(), target="ascend", block_size=0)


def test_more_than_8_gears_warns_with_the_reason() -> None:
    with pytest.warns(BucketWarning) as record:
        plan(_section(decode_batch_sizes=[1, 2, 4], context_lens=[256, 512, 1024]), target="ascend", block_size=64)
    (w,) = record
    text = str(w.message)
    assert "the decode model has 9 gears" in text
    assert "each gear is a separately compiled subgraph" in text and "compile time" in text and "size" in text
    _quiet_plan(_section(decode_batch_sizes=[1, 2, 4, 8], context_lens=[512, 1024]))  # exactly 8: silent


# --- manifest form and ATC strings ----------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["ascend", "ort"])
def test_to_dict_from_dict_round_trip(target: str) -> None:
    p = _quiet_plan(CompileSection(), target=target, block_size=128)
    data = json.loads(json.dumps(p.to_dict()))
    assert data == p.to_dict()
    assert BucketPlan.from_dict(data) == p


def _manifest() -> dict:
    return _quiet_plan(_section(decode_batch_sizes=[1, 2], context_lens=[512, 1024])).to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["profiles"][1]["gears"].__setitem__(0, [1, 8, 3]),
     r"bucket profile 'decode': gear 0 \[1, 8, 3\]: dims mismatch: 3 values for 2 dims \(num_seqs, max_blocks\)"),
    (lambda d: d["profiles"][1].__setitem__("gears", [[1, 8]]), r"'decode': 1 gears; ATC takes 2\.\.100 per model"),
    (lambda d: d["profiles"][1]["gears"].reverse(), r"'decode': gears must be distinct and sorted"),
    (lambda d: d["profiles"][0]["shape"].__setitem__("num_seqs", "batch"), r"'prefill': shape\[num_seqs\] = 'batch'"),
    (lambda d: d.pop("block_size"), r"buckets: missing key 'block_size'"),
    (lambda d: d.__setitem__("max_seq_len", True), r"buckets\.max_seq_len: expected a positive integer"),
    (lambda d: d.__setitem__("target", "tpu"), r"buckets\.target: 'tpu' is not one of ort, ascend"),
    (lambda d: d["profiles"][0].pop("dims"), r"buckets\.profiles\[0\]: missing key 'dims'"),
    (lambda d: d["profiles"][0].pop("gears"), r"buckets\.profiles\[0\]: missing key 'gears'"),
    (lambda d: d["profiles"][0].__setitem__("gears", None), r"'prefill': a profile without gears is fully dynamic"),
    (lambda d: d["profiles"][0].__setitem__("dims", [["num_tokens"], "max_blocks"]), r"'prefill': dims .* must be"),
])
def test_from_dict_rejects_bad_manifests(edit, message: str) -> None:  # noqa: ANN001
    data = _manifest()
    edit(data)
    with pytest.raises(BucketError, match=message):
        BucketPlan.from_dict(data)


# The step graph's inputs as the ascend lowering leaves them (slot_mapping is gone; pools by slot).
STEP_INPUTS = [("input_ids", [1, "num_tokens"]), ("position_ids", [1, "num_tokens"]),
               ("block_tables", ["num_seqs", "max_blocks"]), ("query_index", ["num_seqs", "max_query_len"]),
               ("token_index", ["num_tokens"]), ("logits_indices", ["num_logits"]),
               ("key_cache.0", ["num_slots", 2, 16])]


def test_dynamic_dims_string() -> None:
    p = _quiet_plan(_section(prefill_seq_lens=[128, 256], decode_batch_sizes=[1, 4], context_lens=[512, 1000]))
    prefill, decode = p.profile("prefill"), p.profile("decode")
    assert prefill.dynamic_dims_string() == "128,8;128,16;256,8;256,16"  # (num_tokens, max_blocks) per gear
    assert decode.dynamic_dims_string() == "1,8;1,16;4,8;4,16"  # (num_seqs, max_blocks)
    # per -1 of --input_shape, input order then dim order: what ATC reads
    assert prefill.input_shape_string(STEP_INPUTS, {"num_slots": 4096}) == (
        "input_ids:1,-1;position_ids:1,-1;block_tables:1,-1;query_index:1,-1;token_index:-1;logits_indices:1;"
        "key_cache.0:4096,2,16")
    assert prefill.dynamic_dims_string(STEP_INPUTS).split(";")[:2] == ["128,128,8,128,128", "128,128,16,128,128"]
    assert decode.input_shape_string(STEP_INPUTS, {"num_slots": 4096}) == (
        "input_ids:1,-1;position_ids:1,-1;block_tables:-1,-1;query_index:-1,1;token_index:-1;logits_indices:-1;"
        "key_cache.0:4096,2,16")
    assert decode.dynamic_dims_string(STEP_INPUTS).split(";")[-1] == "4,4,4,16,4,4,4"
    for gear in decode.dynamic_dims_string(STEP_INPUTS).split(";"):  # as many values as -1s
        assert len(gear.split(",")) == decode.input_shape_string(STEP_INPUTS, {"num_slots": 1}).count("-1")


def test_atc_strings_errors() -> None:
    p = _quiet_plan(_section())
    with pytest.raises(BucketError, match=r"input key_cache\.0: dim 'num_slots' is not a step dim of profile "
                                          r"'prefill'"):
        p.profile("prefill").input_shape_string(STEP_INPUTS)
    ort = _quiet_plan(_section(), target="ort").profile("step")
    with pytest.raises(BucketError, match="has no gears"):
        ort.dynamic_dims_string()


# --- pick ------------------------------------------------------------------------------------------------------

def _step(t: int, b: int, q: int, l: int, m: int) -> dict[str, int]:  # noqa: E741
    return dict(num_tokens=t, num_seqs=b, max_query_len=q, num_logits=l, max_blocks=m)


def test_pick_examples() -> None:
    p = _quiet_plan(_section(prefill_seq_lens=[128, 256, 512], decode_batch_sizes=[1, 2, 4, 8],
                             context_lens=[256, 512]))
    # three decodes, longest context 5 blocks of 64: batch → 4, blocks → 8 (512 tokens)
    assert pick(p, **_step(3, 3, 1, 3, 5)) == Choice("decode", 4, 4, 1, 4, 8, gear=(4, 8))
    # one sequence's 200-token chunk that needs no logits (not its last): chunk → 256, one logits row
    assert pick(p, **_step(200, 1, 200, 0, 4)) == Choice("prefill", 256, 1, 256, 1, 4, gear=(256, 4))
    # a single-token chunk is a decode of one
    assert pick(p, **_step(1, 1, 1, 1, 2)).model == "decode"
    # ort: the step's own shape, whatever it mixes
    ort = _quiet_plan(_section(), target="ort")
    assert pick(ort, **_step(37, 5, 30, 5, 9)) == Choice("step", 37, 5, 30, 5, 9, gear=None)


def test_pick_refuses_what_no_model_takes() -> None:
    p = _quiet_plan(_section(prefill_seq_lens=[128, 256], decode_batch_sizes=[1, 4], context_lens=[256, 512]))
    with pytest.raises(BucketError, match=r"^no compiled model takes the step \(num_tokens=7.*prefill takes "
                                          r"num_seqs ≤ 1, the step has 3; decode takes max_query_len ≤ 1, the step "
                                          r"has 5; the scheduler must split mixed prefill/decode steps"):
        pick(p, **_step(7, 3, 5, 3, 4))
    with pytest.raises(BucketError, match=r"prefill: num_tokens=300 is beyond its largest gear \(256\)"):
        pick(p, **_step(300, 1, 300, 1, 5))
    with pytest.raises(BucketError, match=r"decode: num_seqs=5 is beyond its largest gear \(4\)"):
        pick(p, **_step(5, 5, 1, 5, 2))
    with pytest.raises(BucketError, match=r"decode: max_blocks=9 is beyond its largest gear \(8\)"):
        pick(p, **_step(2, 2, 1, 2, 9))
    ort = _quiet_plan(_section(), target="ort")
    with pytest.raises(BucketError, match=r"exceeds the build-time maximum compile\.max_num_tokens 512"):
        pick(ort, **_step(513, 1, 513, 1, 9))
    with pytest.raises(BucketError, match=r"exceeds the build-time maximum compile\.max_seq_len 1024: 17 blocks of 64"):
        pick(ort, **_step(1, 1, 1, 1, 17))
    with pytest.raises(ValueError, match="not a step shape"):
        pick(ort, **_step(2, 3, 1, 1, 1))  # fewer tokens than sequences


@st.composite
def plans(draw: st.DrawFn) -> BucketPlan:
    """An ascend plan over small maxima: planned from them, or explicit lists that reach them (so every step
    within the maxima has a gear)."""
    max_seq_len, max_batch = draw(st.integers(16, 3000)), draw(st.integers(1, 48))
    max_tokens = draw(st.integers(1, 3000))
    block = draw(st.sampled_from([16, 32, 128]))
    chunk_max, batch_max = min(max_tokens, max_seq_len), min(max_batch, max_tokens)

    def gear_list(top: int) -> list[int]:
        return sorted({*draw(st.lists(st.integers(1, top), max_size=5)), top})

    buckets = {} if draw(st.booleans()) else dict(
        prefill_seq_lens=gear_list(chunk_max), decode_batch_sizes=gear_list(batch_max),
        context_lens=gear_list(max_seq_len))
    section = CompileSection(max_seq_len=max_seq_len, max_batch_size=max_batch, max_num_tokens=max_tokens,
                             buckets=Buckets(**buckets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BucketWarning)
        try:
            return plan(section, target="ascend", block_size=block)
        except BucketError:  # fewer than 2 gears for these lists
            assume(False)
            raise


@st.composite
def steps(draw: st.DrawFn, p: BucketPlan) -> dict[str, int]:
    """A step the scheduler can produce on ascend within the maxima: one sequence's chunk, or decodes."""
    bs = p.block_size
    if draw(st.booleans()):  # prefill chunk: T tokens at positions start .. start + T - 1
        t = draw(st.integers(1, min(p.max_num_tokens, p.max_seq_len)))
        start = draw(st.integers(0, p.max_seq_len - t))
        return _step(t, 1, t, draw(st.integers(0, 1)), cdiv(start + t, bs))
    b = draw(st.integers(1, min(p.max_batch_size, p.max_num_tokens)))
    longest = draw(st.integers(1, p.max_seq_len))  # the longest context among the b sequences, new token included
    return _step(b, b, 1, draw(st.integers(0, b)), cdiv(longest, bs))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_pick_returns_the_smallest_gear_that_fits(data: st.DataObject) -> None:
    p = data.draw(plans())
    step = data.draw(steps(p))
    choice = pick(p, **step)
    got = (choice.num_tokens, choice.num_seqs, choice.max_query_len, choice.num_logits, choice.max_blocks)
    want = tuple(step[d] for d in STEP_DIMS)
    assert all(g >= s for g, s in zip(got, want))  # every dim ≥ the step's
    prof = p.profile(choice.model)
    assert choice.gear in (prof.gears or ()) and prof.padded(choice.gear) == got
    fitting = {name: [g for g in prof_.gears or () if all(x >= s for x, s in zip(prof_.padded(g), want))]
               for name, prof_ in ((q.name, q) for q in p.profiles)}
    # no smaller gear of the chosen model also fits: the choice is ≤ every fitting gear, dim by dim
    assert all(all(c <= g for c, g in zip(choice.gear, other)) for other in fitting[choice.model])
    # and no gear of another model does less work (fewer padded tokens, or as many and fewer blocks)
    for name, gears in fitting.items():
        for g in gears:
            t, _, _, _, m = p.profile(name).padded(g)
            assert (choice.num_tokens, choice.max_blocks) <= (t, m)
    assert pick(p, **step) == choice  # pure


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_ascend_refuses_mixed_steps_ort_takes_them_as_they_are(data: st.DataObject) -> None:
    p = data.draw(plans())
    assume(p.max_batch_size >= 2 and p.max_num_tokens >= 3)
    b = data.draw(st.integers(2, min(p.max_batch_size, p.max_num_tokens - 1, 8)))
    q = data.draw(st.integers(2, min(p.max_num_tokens - b + 1, 8)))
    step = _step(b + q - 1, b, q, b, 1)  # one chunk of q tokens beside b - 1 decodes
    with pytest.raises(BucketError, match="scheduler must split"):
        pick(p, **step)
    ort = BucketPlan.from_dict({**p.to_dict(), "target": "ort", "profiles": [{"name": "step", "dims": list(STEP_DIMS),
                                              "shape": {d: d for d in STEP_DIMS}, "gears": None}]})
    assert pick(ort, **step) == Choice("step", *(step[d] for d in STEP_DIMS), gear=None)
