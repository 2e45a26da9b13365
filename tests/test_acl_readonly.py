"""The ``readonly`` paged-attention mode (issue 60 item 3): FIA with its log-sum-exp over the pools as they were, the
step's own rows in plain ops, the two merged; ``kv_new`` out, copied into the pools by the executor. The graph's
structure, its plain twin against the ORT step graph (logits, and kv_new placed at the slots equals ORT's pools),
then the tiny recipe compiled ``readonly`` (float16) on the FAKE pyACL: greedy tokens equal the in-place bundle's and
track the ORT engine, the pool rows at their slots equal the twin's kv_new, 2L device copies per run of slots.
Nothing here ran on an NPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from helpers import TINY_RECIPE
from omforge.compile.ort import build
from omforge.contract.ascend import KV_NEW, SEQ_LENS_KV, SEQ_LENS_Q
from omforge.export.onnx_export import export_recipe
from omforge.passes import manager
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.paged_kv import insert_paged_kv
from omforge.recipe import load_recipe
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step

BLOCK, BLOCKS = 16, 16
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16  # tests/recipes/tiny-llama.yaml


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("readonly") / "export"
    export_recipe(load_recipe(TINY_RECIPE), out, quiet=True)
    return out


def lowered(export_dir: Path, **options: object) -> tuple[ir.Model, lower_ascend.AscendLowering]:
    model = ir.load(export_dir / "model.onnx")
    manager.run_fusions(model)
    insert_paged_kv(model, BLOCK)
    result = lower_ascend.lower(model, num_slots=BLOCKS * BLOCK, paged_attention="readonly", **options)
    manager.cleanup(model)
    return model, result


def test_910b_readonly_graph_reads_the_pools_with_lse_and_returns_kv_new(export_dir: Path) -> None:
    model, result = lowered(export_dir, soc_version="Ascend910B3")
    inputs = {v.name: v for v in model.graph.inputs}
    pools = [f"{kind}_cache.{n}" for n in range(LAYERS) for kind in ("key", "value")]
    assert result.ref_inputs == [] and result.new_kv_outputs == [KV_NEW] and "slot_mapping" not in inputs
    for name in pools:
        assert list(inputs[name].shape) == [BLOCKS, BLOCK, KV_HEADS, HEAD_DIM]
    assert inputs["block_tables"].dtype == ir.DataType.INT32
    assert inputs[SEQ_LENS_Q].dtype == inputs[SEQ_LENS_KV].dtype == ir.DataType.INT64
    (kv_new,) = [o for o in model.graph.outputs if o.name == KV_NEW]
    assert [o.name for o in model.graph.outputs] == ["logits", KV_NEW]
    assert list(kv_new.shape) == [LAYERS, 2, "num_tokens", KV_HEADS, HEAD_DIM]
    types = {n.op_type for n in model.graph}
    assert not types & {"OmScatterPaKvCache", "ScatterND", "ScatterNdUpdate", "OmFusedInferAttentionScore"}
    reads = [n for n in model.graph if n.op_type == "OmFusedInferAttentionScoreLse"]
    assert len(reads) == LAYERS
    for layer, read in enumerate(reads):
        assert len(read.inputs) == 15 and len(read.outputs) == 2
        assert read.inputs[3] is None and read.inputs[4] is None and set(read.inputs[7:14]) == {None}
        for i, name in ((1, f"key_cache.{layer}"), (2, f"value_cache.{layer}")):  # the pool as it was, reshaped
            assert read.inputs[i].producer().op_type == "Reshape" and read.inputs[i].producer().inputs[0].name == name
        assert [read.inputs[i].name for i in (5, 6, 14)] == [SEQ_LENS_Q, SEQ_LENS_KV, "block_tables"]
        assert {k: a.value for k, a in read.attributes.items()} == {
            "num_heads": HEADS, "num_key_value_heads": KV_HEADS, "scale": pytest.approx(HEAD_DIM ** -0.5),
            "input_layout": "BSH", "sparse_mode": 0, "block_size": BLOCK, "inner_precise": 0, "softmax_lse_flag": 1}
        assert read.outputs[1].uses()  # the LSE feeds the merge
    op = result.custom_ops["OmFusedInferAttentionScoreLse"]
    assert op.ge_type == "FusedInferAttentionScore" and op.own_plugin and op.outputs[1] == "softmax_lse"


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend310B1"])
def test_readonly_is_refused_where_fia_does_not_ship(export_dir: Path, soc: str) -> None:
    with pytest.raises(ValueError, match=f"'readonly' on {soc}: FusedInferAttentionScore: no kernel ships"):
        lowered(export_dir, soc_version=soc)


def test_twin_with_kv_new_placed_matches_the_ort_step_graph(export_dir: Path, tmp_path: Path) -> None:
    """The twin on ORT (float32): logits equal the ORT step graph's, and its kv_new rows written at the step's slots
    (what the executor copies) equal ORT's pools after each step: a first prefill (no context before it: the merge
    drops FIA's part), decodes across a block, a chunk over a cached prefix, a mixed step."""
    report = build(export_dir, tmp_path / "ort" / "model.onnx", block_size=BLOCK)
    ref = OrtExecutor(tmp_path / "ort" / "model.onnx", report.layout, num_blocks=BLOCKS, threads=2)
    model, result = lowered(export_dir, plain=True, soc_version="Ascend910B3")
    assert not result.custom_ops and [o.name for o in model.graph.outputs] == ["logits", KV_NEW]
    ir.save(model, tmp_path / "twin.onnx", external_data="twin.onnx.data")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(tmp_path / "twin.onnx"), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    pools = {f"{k}_cache.{n}": np.zeros((BLOCKS * BLOCK, KV_HEADS, HEAD_DIM), np.float32)
             for n in range(LAYERS) for k in ("key", "value")}

    def check(work: list[SeqWork]) -> np.ndarray:
        step = build_step(work, BLOCK)
        feeds = {k: v for k, v in step.items() if k in names}
        feeds.update({"block_tables": step["block_tables"].astype(np.int32),
                      SEQ_LENS_Q: np.array([len(w.token_ids) for w in work], np.int64),
                      SEQ_LENS_KV: np.array([max(w.start, 1) for w in work], np.int64)})  # context BEFORE the step
        feeds.update({n: p.reshape(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) for n, p in pools.items()})
        logits, kv_new = sess.run(["logits", KV_NEW], feeds)
        assert kv_new.shape == (LAYERS, 2, len(step["slot_mapping"]), KV_HEADS, HEAD_DIM)
        for n in range(LAYERS):  # what the executor's copies do
            pools[f"key_cache.{n}"][step["slot_mapping"]] = kv_new[n, 0]
            pools[f"value_cache.{n}"][step["slot_mapping"]] = kv_new[n, 1]
        np.testing.assert_allclose(logits[0], ref.run(step), atol=1e-5, rtol=0)
        for n in range(LAYERS):
            np.testing.assert_allclose(pools[f"key_cache.{n}"].reshape(-1), ref.key_pools[n].reshape(-1), atol=1e-6)
            np.testing.assert_allclose(pools[f"value_cache.{n}"].reshape(-1), ref.value_pools[n].reshape(-1),
                                       atol=1e-6)
        return logits[0]

    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(3, 256, 37)]
    ta, tb = [9, 2, 11, 5], [3, 14, 8]
    logits = check([SeqWork(a, 0, ta)])
    for _ in range(12):
        a.append(int(logits[0].argmax()))
        logits = check([SeqWork(a[-1:], len(a) - 1, ta)])
    b = [int(t) for t in rng.integers(3, 256, 21)]
    check([SeqWork(b[:6], 0, tb, needs_logits=False)])
    a.append(int(logits[0].argmax()))
    assert check([SeqWork(a[-1:], len(a) - 1, ta), SeqWork(b[6:], 6, tb)]).shape == (2, 256)


def test_the_lse_plugin_sets_softmax_lse_flag_as_a_bool_and_compiles(export_dir: Path, tmp_path: Path) -> None:
    """Our plugin for the readonly FIA node copies softmax_lse_flag as GE's Bool (def.cpp:555; SetAttr(bool):
    operator.h:345), syntax-checked with g++ against the stub headers when g++ is here."""
    import shutil
    import subprocess

    from omforge.compile.ascend import atc_plugins

    _, result = lowered(export_dir, soc_version="Ascend910B3")
    project = atc_plugins.render_plugins(result.to_dict(), tmp_path / "plugins")
    assert project is not None
    source = tmp_path / "plugins" / "om_fused_infer_attention_score_lse_onnx_plugin.cc"
    text = source.read_text()
    assert 'REGISTER_CUSTOM_OP("FusedInferAttentionScore")' in text
    assert 'op_dest.SetAttr("softmax_lse_flag", softmax_lse_flag != 0);' in text
    stubs = Path(__file__).resolve().parent / "stubs"
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: rendered, not syntax-checked")
    run = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I", str(stubs),
                          "-I", str(stubs / "json_stub"), "-I", str(project.dir), str(source)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr


# --- the tiny recipe compiled readonly, on the FAKE pyACL --------------------------------------------------------

PROMPTS = [[5, 9, 2, 77], list(range(3, 43)), [int(x) for x in np.random.default_rng(1).integers(3, 250, 100)],
           [7]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as ``readonly`` and ``inplace`` (float16, FAKE OMs on each bundle's plain twin, built by
    tests/fake_atc.py from the bundle's own commands) and ``ort`` (float32)."""
    import fake_atc
    from test_ascend_precision import plain_twin, precision_recipe

    from helpers import compile_bundle

    root = tmp_path_factory.mktemp("acl-readonly")
    cache = root / "cache"
    out = {"ort": compile_bundle(TINY_RECIPE, root / "ort", cache)}
    for name in ("readonly", "inplace"):
        recipe = precision_recipe(root, "float16", name, paged_attention=name)
        bundle = compile_bundle(recipe, root / name, cache, target="ascend")
        fake_atc.build_bundle(bundle, plain_twin(bundle, recipe, root / f"plain-{name}"))
        out[name] = bundle
    return out


def _executor(bundle: Path, fake: object):  # noqa: ANN202
    from omforge.contract.manifest import load_manifest
    from omforge.runtime.ascend.acl_executor import AclExecutor

    return AclExecutor(bundle, load_manifest(bundle, verify=False), acl=fake)


def test_the_bundle_is_readonly_with_plain_pools_and_kv_new(bundles: dict[str, Path]) -> None:
    from omforge.contract.manifest import load_manifest

    m = load_manifest(bundles["readonly"], verify=False)
    assert m.ascend.paged_attention == "readonly" and m.ascend.paged_attention_note.startswith("readonly: ")
    assert m.ascend.ref_inputs == () and m.ascend.scratch_blocks == 0 and "kv_new" in m.kv.write
    assert KV_NEW in [t.name for t in m.abi.outputs] and "slot_mapping" not in [t.name for t in m.abi.inputs]
    commands = (bundles["readonly"] / "ascend" / "atc_commands.txt").read_text()
    assert commands.startswith("atc ") and "--framework=5" in commands  # plain ATC, no RefData builder
    from omforge.compile.ascend.step_usage import file_uses

    uses = file_uses(bundles["readonly"] / "ascend" / "step.onnx")  # float16 graph: the LSE math stays float32
    lse = {(u.op_type, u.dtypes[0]) for u in uses if u.op_type in ("Exp", "Log", "ReduceMax", "ReduceSum")}
    assert lse == {("Exp", "FLOAT"), ("Log", "FLOAT"), ("ReduceMax", "FLOAT"), ("ReduceSum", "FLOAT")}


def test_greedy_tokens_equal_the_inplace_bundle_and_track_ort(bundles: dict[str, Path]) -> None:
    """Float16 twins: readonly's greedy tokens equal the in-place bundle's; against the float32 ORT engine the first
    token agrees and the log-probabilities stay within the float16 bound while the tokens agree."""
    from fake_acl import FakeAcl
    from omforge import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    fake = FakeAcl()
    got = LLM(bundles["readonly"], acl_module=fake).generate(PROMPTS, greedy, use_tqdm=False)
    inplace = LLM(bundles["inplace"], acl_module=FakeAcl()).generate(PROMPTS, greedy, use_tqdm=False)
    ref = LLM(bundles["ort"]).generate(PROMPTS, greedy, use_tqdm=False)
    assert [g.token_ids for g in got] == [g.token_ids for g in inplace]
    for r, g in zip(ref, got):
        assert g.token_ids[0] == r.token_ids[0]
        same = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        drift = np.abs(np.array([e.logprob for e in r.logprobs[:same]])
                       - np.array([e.logprob for e in g.logprobs[:same]]))
        assert drift.max() < 0.02, drift
    assert not [c for c in fake.calls if c.startswith("FAILED")] and not fake.lost_writes


def test_pool_rows_at_their_slots_are_the_twins_kv_new_copied_2l_per_run(bundles: dict[str, Path]) -> None:
    """After a prefill over two non-consecutive blocks, the device pools hold, at the sequence's slots, the twin's
    kv_new rows (and nothing elsewhere: padding rows are not copied); the prefill's D2D copies are 2L per run of
    consecutive slots (2 runs), a decode's 2L (one slot)."""
    from fake_acl import FakeAcl
    from omforge.runtime.ascend.acl_plan import as_dtype, pack_run, plan_runs, slot_copy_plan
    from omforge.runtime.step import SeqWork

    fake = FakeAcl()
    with _executor(bundles["readonly"], fake) as ex:
        bs, layers = ex.layout.block_size, ex.layout.num_layers
        prompt = [int(x) for x in np.random.default_rng(2).integers(3, 250, 150)]  # across blocks 3 and 1
        table = [3, 1]
        work = [SeqWork(prompt, 0, table, needs_logits=True)]
        d2d = fake.calls.count("memcpy_async")
        ex.execute(work)
        (run,) = plan_runs(work, ex.plan, True)
        packed = pack_run(run, work, bs, readonly=True)
        assert packed.inputs[SEQ_LENS_KV].tolist() == [1] and len(packed.slots) == len(prompt)  # max(0, 1)
        assert run.choice.num_tokens > len(prompt)  # the gear pads: padding rows exist and are not copied
        runs = slot_copy_plan(packed.slots)
        assert len(runs) == 2 and fake.calls.count("memcpy_async") - d2d == 2 * layers * len(runs)
        twin = ort.InferenceSession(str(bundles["readonly"].parent / "plain-readonly" / "step.onnx"),
                                    providers=["CPUExecutionProvider"])
        types = {i.name: i.type for i in twin.get_inputs()}
        feeds = {n: as_dtype(v, 3 if types[n] == "tensor(int32)" else 9, n) for n, v in packed.inputs.items()
                 if n in types}
        for name in ex.pool_names:
            feeds[name] = np.zeros(next(i.shape for i in twin.get_inputs() if i.name == name), ex.pool_dtype)
        (kv_new,) = twin.run([KV_NEW], feeds)
        assert kv_new.shape[:3] == (layers, 2, run.choice.num_tokens)
        for i, name in enumerate(ex.pool_names):
            buf, off, _ = fake.resolve(ex.pool_ptr[name], ex.one_pool_bytes)
            pool = np.frombuffer(bytes(buf[off:off + ex.one_pool_bytes]), ex.pool_dtype).reshape(ex.num_slots, -1)
            want = kv_new[i // 2, i % 2, :len(prompt)].reshape(len(prompt), -1)
            np.testing.assert_array_equal(pool[packed.slots], want)
            assert np.abs(want).sum() > 0
            assert not pool[np.setdiff1d(np.arange(ex.num_slots), packed.slots)].any()
        d2d = fake.calls.count("memcpy_async")
        ex.execute([SeqWork([prompt[-1]], len(prompt), table, needs_logits=True)])
        assert fake.calls.count("memcpy_async") - d2d == 2 * layers
    assert not [c for c in fake.calls if c.startswith("FAILED")] and fake.live == []
