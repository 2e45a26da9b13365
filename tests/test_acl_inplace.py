"""The in-place paged-attention mode on the FAKE pyACL (tests/fake_acl.py): the fake's rules first, on small
hand-made twins (a ref write reaches the caller's pool only through RefData; no output may alias a ref input;
ScatterPaKvCache's and FIA/IFA's rules on what is fed; set_config_opt's size_t), then the executor end to end on
the tiny recipe compiled in place (float16): greedy tokens against the same-precision gather bundle and the ORT
engine, the pool rows read back at their slots, the bytes copied per step, the same OM without the RefData flip,
the fallback load and a pool GE copies. Nothing here ran on an NPU: it checks omforge against CANN's cited rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fake_acl import FakeAcl
from omforge.contract.ascend import REF_SUFFIX
from omforge.runtime.ascend.acl_api import AclParameterError, AclRuntime

NB, BS, W = 4, 16, 4  # hand-made pool: 4 blocks of 16 slots, rows of 4 floats
GEARS = [[2, 2, 1, 1, 1, 1], [4, 4, 2, 2, 2, 2]]  # each -1 of INPUT_SHAPE in order: T, T, B, M, B, B
INPUT_SHAPE = [["input_ids", [1, -1]], ["slot_mapping", [-1]], ["block_tables", [-1, -1]],
               ["actual_seq_lengths", [-1]], ["actual_seq_lengths_kv", [-1]]]


def twin(tmp: Path, *, alias: bool = False, table_type: int = TensorProto.INT32, lengths: bool = True) -> Path:
    """A plain-op in-place twin: row t = input_ids[t] · 1 is written at slot_mapping[t] of ``key_cache.0`` (ScatterND,
    out of place, its result the output ``key_cache.0.ref``) and ``logits`` = the written pool summed over slots.
    ``alias``: the written pool is also an output (what GE would copy)."""
    T, B, M = "num_tokens", "num_seqs", "max_blocks"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, T]),
              helper.make_tensor_value_info("slot_mapping", TensorProto.INT32, [T]),
              helper.make_tensor_value_info("block_tables", table_type, [B, M])]
    if lengths:
        inputs += [helper.make_tensor_value_info("actual_seq_lengths", TensorProto.INT64, [B]),
                   helper.make_tensor_value_info("actual_seq_lengths_kv", TensorProto.INT64, [B])]
    inputs.append(helper.make_tensor_value_info("key_cache.0", TensorProto.FLOAT, [NB, BS, 1, W]))
    nodes = [
        helper.make_node("Reshape", ["input_ids", "col"], ["ids_col"]),
        helper.make_node("Cast", ["ids_col"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "ones"], ["rows"]),
        helper.make_node("Reshape", ["key_cache.0", "flat"], ["pool_rows"]),
        helper.make_node("Cast", ["slot_mapping"], ["slots64"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["slots64", "col"], ["idx"]),
        helper.make_node("ScatterND", ["pool_rows", "idx", "rows"], ["written_rows"]),
        helper.make_node("Reshape", ["written_rows", "pool_shape"], ["written"]),
        helper.make_node("Identity", ["written"], ["key_cache.0" + REF_SUFFIX]),
        helper.make_node("ReduceSum", ["written_rows", "axis0"], ["logits"], keepdims=1),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, W]),
               helper.make_tensor_value_info("key_cache.0" + REF_SUFFIX, TensorProto.FLOAT, [NB, BS, 1, W])]
    if alias:
        nodes.append(helper.make_node("Identity", ["written"], ["pool_out"]))
        outputs.append(helper.make_tensor_value_info("pool_out", TensorProto.FLOAT, [NB, BS, 1, W]))
    inits = [helper.make_tensor("col", TensorProto.INT64, [2], [-1, 1]),
             helper.make_tensor("ones", TensorProto.FLOAT, [1, W], [1.0] * W),
             helper.make_tensor("flat", TensorProto.INT64, [2], [NB * BS, W]),
             helper.make_tensor("pool_shape", TensorProto.INT64, [4], [NB, BS, 1, W]),
             helper.make_tensor("axis0", TensorProto.INT64, [1], [0])]
    graph = helper.make_graph(nodes, "inplace_twin", inputs, outputs, inits)
    path = tmp / "twin.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def fake_om(tmp: Path, onnx_path: Path, refdata: bool = True, **extra: object) -> Path:
    """The FAKE OM tests/fake_atc.py would write, with the build route's ``ref_inputs`` (none: plain ATC)."""
    shape = [s for s in INPUT_SHAPE if s[0] != "actual_seq_lengths" or extra.pop("lengths", True)]
    spec = {"fake_om": True, "onnx": str(onnx_path), "input_shape": shape, "gears": GEARS,
            "ref_inputs": ["key_cache.0"] if refdata else [], **extra}
    om = tmp / ("refdata.om" if refdata else "plain.om")
    om.write_text(json.dumps(spec))
    return om


class Loaded:
    """One FAKE OM loaded through omforge's AclRuntime, its buffers and datasets (the executor's steps, by hand)."""

    def __init__(self, om: Path, fake: FakeAcl | None = None):
        self.fake = fake or FakeAcl()
        self.rt = rt = AclRuntime(self.fake)
        rt.init()
        rt.set_device(0)
        self.model_id, self.refused = rt.load_model(str(om))
        self.desc = rt.describe(rt.create_desc(self.model_id))
        self.ptr = {t.name: rt.malloc(t.size) for t in self.desc.inputs + self.desc.outputs}
        for t in self.desc.inputs:
            rt.memset(self.ptr[t.name], t.size)
        self.ins, _ = rt.create_dataset([(self.ptr[t.name], t.size) for t in self.desc.inputs])
        self.outs, _ = rt.create_dataset([(self.ptr[t.name], t.size) for t in self.desc.outputs])

    def run(self, gear: int, feeds: dict[str, np.ndarray]) -> None:
        for t in self.desc.inputs:
            if t.name in feeds:
                self.rt.host_to_device(self.ptr[t.name], t.size, np.ascontiguousarray(feeds[t.name]).tobytes())
        dims = [1, *GEARS[gear]]  # every dim of the listed inputs, static ones included (§3.4)
        self.rt.set_dynamic_dims(self.model_id, self.ins, self.desc.dynamic_index, dims)
        self.rt.execute(self.model_id, self.ins, self.outs)

    def pool(self) -> np.ndarray:
        size = self.desc.input("key_cache.0").size
        host = self.rt.malloc_host(size)
        raw = self.rt.device_to_host(host, size, self.ptr["key_cache.0"], size)
        return np.frombuffer(raw, np.float32).reshape(NB * BS, W)


def feeds(slots: list[int], tables: list[list[int]], q: list[int], kv: list[int]) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(1, len(slots) + 1, dtype=np.int64)[None, :],
            "slot_mapping": np.asarray(slots, np.int32), "block_tables": np.asarray(tables, np.int32),
            "actual_seq_lengths": np.asarray(q, np.int64), "actual_seq_lengths_kv": np.asarray(kv, np.int64)}


GOOD = feeds([17, 63], [[1]], [2], [2])  # gear 0: two rows, one sequence over block 1


def test_a_ref_write_reaches_the_callers_pool_only_through_refdata(tmp_path: Path) -> None:
    """GE keeps a RefData input at the user's address (davinci_model.cc:2190-2200); before a ref op on a plain Data
    it inserts an Identity copy (inner_identity_add_pass.cc:30-60, 95-104): the write is lost. The same twin, with
    and without the build route's flip."""
    path = twin(tmp_path)
    flipped = Loaded(fake_om(tmp_path, path, refdata=True))
    assert [t.name.rsplit(":", 1)[1] for t in flipped.desc.outputs] == ["logits"]  # the .ref output is not the OM's
    flipped.run(0, GOOD)
    pool = flipped.pool()
    assert pool[17].tolist() == [1.0] * W and pool[63].tolist() == [2.0] * W
    assert np.count_nonzero(pool) == 2 * W and not flipped.fake.lost_writes
    plain = Loaded(fake_om(tmp_path, path, refdata=False))
    plain.run(0, GOOD)
    assert not plain.pool().any() and plain.fake.lost_writes == {"key_cache.0": 1}


def test_an_output_aliasing_a_ref_input_is_refused_at_load(tmp_path: Path) -> None:
    """A ref output reaching NetOutput gets a copy (mem_layout_conflict_util.cc:1246-1251): the FAKE OM is refused."""
    om = fake_om(tmp_path, twin(tmp_path, alias=True))
    with pytest.raises(AclParameterError, match="load_with_config"):
        Loaded(om)
    fake = FakeAcl()
    with pytest.raises(AclParameterError):
        Loaded(om, fake)
    assert any("pool_out aliases ref input key_cache.0" in c for c in fake.calls)


@pytest.mark.parametrize(("bad", "why"), [
    (feeds([17, 17], [[1]], [2], [2]), "repeated slots"),
    (feeds([17, NB * BS], [[1]], [2], [2]), "slot_mapping outside"),
    (feeds([17, 18], [[NB]], [2], [2]), "block_tables entries outside"),
    (feeds([17, 18], [[1]], [2], [BS + 1]), "actual lengths"),
    (feeds([17, 18], [[1]], [3], [2]), "actual lengths"),
])
def test_what_the_executor_feeds_must_meet_the_kernels_rules(tmp_path: Path, bad: dict, why: str) -> None:
    """ScatterPaKvCache: slots unique, in [0, num_blocks·block_size−1] (scatter_pa_kv_cache_def.cpp:115-176); FIA/IFA
    paged: every table entry a block, kv length within the table (aclnnIncreFlashAttentionV4.md:465-473)."""
    loaded = Loaded(fake_om(tmp_path, twin(tmp_path)))
    loaded.run(0, GOOD)
    with pytest.raises(AclParameterError, match="acl.mdl.execute"):
        loaded.run(0, bad)
    assert any(why in c for c in loaded.fake.calls if c.startswith("FAILED execute"))


def test_a_paged_om_needs_an_int32_table_and_the_actual_lengths(tmp_path: Path) -> None:
    for kwargs, why in (({"table_type": TensorProto.INT64}, "block_tables must be int32"),
                        ({"lengths": False}, "without the input actual_seq_lengths")):
        fake = FakeAcl()
        sub = tmp_path / why.split()[0]
        sub.mkdir()
        om = fake_om(sub, twin(sub, **kwargs), lengths=kwargs.get("lengths", True))
        if not kwargs.get("lengths", True):  # the twin has neither length: drop both from the listed inputs
            spec = json.loads(om.read_text())
            spec["input_shape"] = [s for s in spec["input_shape"] if not s[0].startswith("actual")]
            spec["gears"] = [g[:4] for g in GEARS]
            om.write_text(json.dumps(spec))
        with pytest.raises(AclParameterError):
            Loaded(om, fake)
        assert any(why in c for c in fake.calls), fake.calls


def test_set_config_opt_takes_size_t_attributes_as_the_c_layer_checks_them(tmp_path: Path) -> None:
    """aclmdlSetConfigOpt refuses ACL_MDL_LOAD_TYPE_SIZET and ACL_MDL_WORKSPACE_MEM_OPTIMIZE unless valueSize ==
    sizeof(size_t) and the value is in range (hicann/ge model_config_om2.cpp:101-124, 294-316). A pyACL that
    passed attribute 13 otherwise is refused; omforge then loads with load_from_file, which reserves the inputs and
    outputs (the pool too) in GE's work memory."""
    om = str(fake_om(tmp_path, twin(tmp_path)))
    fake = FakeAcl()
    handle = fake.mdl.create_config_handle()
    assert fake.mdl.set_config_opt(handle, 13, 1) == 0
    assert fake.mdl.set_config_opt(handle, 13, 2) == 100000  # ACL_WORKSPACE_MEM_OPTIMIZE_INPUTOUTPUT is the top
    assert fake.mdl.set_config_opt(handle, 1, 0) == 100000  # load types are 1..6
    assert fake.mdl.set_config_opt(handle, 2, 5) == 100000  # the path is a string
    reserved = {}
    for size in (8, 4):
        loaded = Loaded(Path(om), FakeAcl(attr13_value_size=size))
        assert (loaded.refused is None) == (size == 8)
        reserved[size] = loaded.fake.models[loaded.model_id].reserved
    assert reserved[4] - reserved[8] == loaded.fake.models[loaded.model_id].io_bytes  # the I/O, the pool in it


# --- the executor end to end, on the tiny recipe compiled in place (float16) ------------------------------------

PROMPTS = [[5, 9, 2, 77], list(range(3, 43)), [int(x) for x in np.random.default_rng(1).integers(3, 250, 100)],
           [7]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as: ``inplace`` (float16, auto → in place on the default Ascend910B3) with the RefData flip,
    ``noflip`` (the same OM with plain Data inputs), ``gather`` (float16, the same precision) and ``ort`` (float32).
    FAKE OMs on each bundle's plain twin, built by tests/fake_atc.py from the bundle's own commands."""
    import shutil

    import fake_atc
    from test_ascend_precision import plain_twin, precision_recipe

    from helpers import TINY_RECIPE, compile_bundle

    root = tmp_path_factory.mktemp("acl-inplace")
    cache = root / "cache"
    out = {"ort": compile_bundle(TINY_RECIPE, root / "ort", cache)}
    for name, mode in (("inplace", "auto"), ("gather", "gather")):
        recipe = precision_recipe(root, "float16", name, paged_attention=mode)
        bundle = compile_bundle(recipe, root / name, cache, target="ascend")
        twin_path = plain_twin(bundle, recipe, root / f"plain-{name}")
        fake_atc.build_bundle(bundle, twin_path)
        out[name] = bundle
    shutil.copytree(out["inplace"], root / "noflip")
    fake_atc.build_bundle(root / "noflip", root / "plain-inplace" / "step.onnx", flip=False)
    out["noflip"] = root / "noflip"
    return out


def _executor(bundle: Path, fake: FakeAcl, **kw: object):  # noqa: ANN202
    from omforge.contract.manifest import load_manifest
    from omforge.runtime.ascend.acl_executor import AclExecutor

    return AclExecutor(bundle, load_manifest(bundle, verify=False), acl=fake, **kw)


def _failed(fake: FakeAcl) -> list[str]:
    return [c for c in fake.calls if c.startswith("FAILED")]


def test_the_bundle_is_in_place_with_refdata_pools(bundles: dict[str, Path]) -> None:
    from omforge.contract.manifest import load_manifest

    m = load_manifest(bundles["inplace"], verify=False)
    layers = m.kv.num_layers
    assert m.ascend.paged_attention == "inplace" and m.ascend.scratch_blocks >= 1
    assert sorted(m.ascend.ref_inputs) == sorted([f"{k}_cache.{i}" for i in range(layers) for k in ("key", "value")])
    assert "kv_new" not in [t.name for t in m.abi.outputs]


def test_greedy_tokens_equal_the_gather_bundle_and_track_ort(bundles: dict[str, Path]) -> None:
    """Float16 twins: the in-place bundle's greedy tokens equal the same-precision gather bundle's exactly; against
    the float32 ORT engine, the first token agrees and the log-probabilities stay within test_ascend_precision's
    float16 bound while the tokens agree. No FAILED call, no lost write."""
    from omforge import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    fake = FakeAcl()
    got = LLM(bundles["inplace"], acl_module=fake).generate(PROMPTS, greedy, use_tqdm=False)
    gather = LLM(bundles["gather"], acl_module=FakeAcl()).generate(PROMPTS, greedy, use_tqdm=False)
    ref = LLM(bundles["ort"]).generate(PROMPTS, greedy, use_tqdm=False)
    assert [g.token_ids for g in got] == [g.token_ids for g in gather]
    for r, g in zip(ref, got):
        assert g.token_ids[0] == r.token_ids[0]
        same = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        drift = np.abs(np.array([e.logprob for e in r.logprobs[:same]])
                       - np.array([e.logprob for e in g.logprobs[:same]]))
        assert drift.max() < 0.02, drift
    assert not _failed(fake) and not fake.lost_writes


def test_pool_rows_at_their_slots_are_the_twins_kv_and_a_step_copies_no_rows(bundles: dict[str, Path]) -> None:
    """After a prefill the device pools hold, at the sequence's slots, exactly the K/V rows the twin computed (its
    ``<pool>.ref`` outputs); scratch slots took the padding rows; other blocks stay zero. A decode step copies its
    step inputs in and its logits out: no device-to-device copy, no pool or new-row bytes."""
    import onnxruntime as ort

    from omforge.runtime.ascend.acl_plan import as_dtype, pack_run, plan_runs
    from omforge.runtime.step import SeqWork

    fake = FakeAcl()
    with _executor(bundles["inplace"], fake) as ex:
        bs = ex.layout.block_size
        prompt = PROMPTS[2]
        table = [3, 1]
        work = [SeqWork(prompt, 0, table, needs_logits=True)]
        ex.execute(work)
        (run,) = plan_runs(work, ex.plan, inplace=True)
        packed = pack_run(run, work, bs, ex.scratch)
        twin = ort.InferenceSession(str(bundles["inplace"].parent / "plain-inplace" / "step.onnx"),
                                    providers=["CPUExecutionProvider"])
        types = {i.name: i.type for i in twin.get_inputs()}
        feeds = {n: as_dtype(v, 3 if types[n] == "tensor(int32)" else 9, n) for n, v in packed.inputs.items()
                 if n in types}
        for name in ex.pool_names:
            feeds[name] = np.zeros([d for d in next(i.shape for i in twin.get_inputs() if i.name == name)],
                                   ex.pool_dtype)
        wanted = [o.name for o in twin.get_outputs() if o.name.endswith(REF_SUFFIX)]
        written = dict(zip(wanted, twin.run(wanted, feeds)))
        slots = packed.slots
        row = ex.piece_bytes // bs
        for name in ex.pool_names:
            buf, off, _ = fake.resolve(ex.pool_ptr[name], ex.one_pool_bytes)
            pool = np.frombuffer(bytes(buf[off:off + ex.one_pool_bytes]), ex.pool_dtype).reshape(
                ex.num_slots, row // ex.pool_dtype.itemsize)
            want = written[name + REF_SUFFIX].reshape(ex.num_slots, -1)
            np.testing.assert_array_equal(pool[slots], want[slots])
            assert np.abs(pool[slots]).sum() > 0
            others = np.setdiff1d(np.arange(ex.num_slots), np.concatenate(
                [slots, packed.inputs["slot_mapping"][len(slots):]]))
            assert not pool[others].any()
        before = dict(fake.copied)
        decode = [SeqWork([prompt[-1]], len(prompt), table, needs_logits=True)]
        ex.execute(decode)
        step = {k: fake.copied[k] - before.get(k, 0) for k in ("H2D", "D2H", "D2D")}
        (run,) = plan_runs(decode, ex.plan, inplace=True)
        inputs = pack_run(run, decode, bs, ex.scratch).inputs
        desc = ex.model.desc
        assert step == {"H2D": sum(as_dtype(inputs[n], desc.input(n).dtype, n).nbytes for n in ex.step_inputs),
                        "D2H": ex.vocab * 4, "D2D": 0}  # the step's inputs in, one float32 logits row out
        assert step["H2D"] < ex.piece_bytes  # never a block of a pool, let alone a pool or a new row's copy
    assert not _failed(fake) and fake.live == []


def test_the_same_om_without_the_refdata_flip_loses_the_writes(bundles: dict[str, Path]) -> None:
    """Issue 60's regression: with plain Data pools (atc --framework=5's only kind) every ref write lands in GE's
    Identity copy: the FAKE pyACL drops it (2 × layers lost writes per execute), the pools stay zero, and a decode
    step after the prefill no longer sees the prompt (its logits differ from the flipped OM's)."""
    from omforge import LLM, SamplingParams
    from omforge.runtime.step import SeqWork

    fake = FakeAcl()
    LLM(bundles["noflip"], acl_module=fake).generate(PROMPTS[1:3], SamplingParams(temperature=0.0, max_tokens=4),
                                                     use_tqdm=False)
    assert len(fake.lost_writes) == 2 * 2 and set(fake.lost_writes.values()) == {fake.calls.count("execute")}
    logits, pools = {}, {}
    for name in ("inplace", "noflip"):
        f = FakeAcl()
        with _executor(bundles[name], f) as ex:
            prompt = PROMPTS[2]
            ex.execute([SeqWork(prompt, 0, [0])])
            logits[name] = ex.execute([SeqWork([prompt[-1]], len(prompt), [0])])
            buf, off, _ = f.resolve(ex.pool, ex.one_pool_bytes)
            pools[name] = bytes(buf[off:off + ex.one_pool_bytes])
    assert pools["noflip"] == bytes(len(pools["noflip"])) != pools["inplace"]
    assert np.abs(logits["noflip"] - logits["inplace"]).max() > 1e-2


def test_block_copies_and_swaps_move_every_layers_k_and_v(bundles: dict[str, Path]) -> None:
    from omforge.runtime.step import SeqWork

    fake = FakeAcl()
    with _executor(bundles["inplace"], fake, num_host_blocks=2) as ex:
        assert ex.num_blocks == ex.num_slots // ex.layout.block_size - ex.scratch.blocks
        assert ex.capabilities.num_blocks == ex.num_blocks
        ex.execute([SeqWork(list(range(3, 60)), 0, [4])])

        def block(b: int) -> list[bytes]:
            return [bytes(fake.resolve(a, n)[0][fake.resolve(a, n)[1]:fake.resolve(a, n)[1] + n])
                    for a, _, n in ex._pieces(b)]

        original = block(4)
        assert len(original) == 2 * ex.layout.num_layers and all(p != bytes(len(p)) for p in original)
        ex.copy_blocks([(4, 6)])
        assert block(6) == original
        ex.swap_out([(4, 1)])
        for a, _, n in ex._pieces(4):
            fake.rt.memset(a, n, 0, n)
        ex.swap_in([(1, 4)])
        assert block(4) == original
    assert not _failed(fake) and fake.live == []


def test_a_refused_load_option_falls_back_and_counts_the_pool_twice(bundles: dict[str, Path]) -> None:
    """Issue 60 item 6: a pyACL that does not pass attribute 13 as a size_t is refused by the C layer
    (model_config_om2.cpp:294-303); the executor says so in one line, loads with load_from_file and plans the pool
    twice — and refuses a device that holds it once only."""
    from omforge.runtime.ascend.acl_executor import DeviceMemoryTooSmall
    from omforge.runtime.step import SeqWork

    fake = FakeAcl(attr13_value_size=4)
    with _executor(bundles["inplace"], fake) as ex:
        (note,) = ex.notes
        assert "refused ACL_MDL_WORKSPACE_MEM_OPTIMIZE" in note and "load_from_file" in note and "\n" not in note
        assert not ex.need.optimized and ex.need.total >= ex.need.weights + 2 * ex.pool_bytes
        assert any(c.startswith("load ") for c in fake.calls)
        ex.execute([SeqWork([5, 6, 7], 0, [0])])
        once = ex.need.total - ex.need.pool - ex.need.io  # weights + aclmdlQuerySize's work: the pool in it once
        assert ex.need.pool + ex.need.io > 1024
    assert _executor(bundles["inplace"], FakeAcl(hbm_free=once + 1024)).close() is None  # fits, optimized
    small = FakeAcl(hbm_free=once + 1024, attr13_value_size=4)
    with pytest.raises(DeviceMemoryTooSmall, match="counted twice"):
        _executor(bundles["inplace"], small)
    assert small.live == []


@pytest.mark.parametrize(("name", "copied", "said"), [
    ("inplace", "value_cache.1", "1 of the pool inputs key_cache.0 … value_cache.1"),
    ("gather", "kv_cache", "input 'kv_cache'")])
def test_a_pool_ge_copies_at_load_is_named_in_one_line(bundles: dict[str, Path], tmp_path: Path, name: str,
                                                        copied: str, said: str) -> None:
    """Zero copy lost (davinci_model.cc:2282-2290): the FAKE OM's load reserves a copy of the input; the executor
    compares what the load took with aclmdlQuerySize's plan and names the pool input."""
    import shutil

    bundle = tmp_path / name
    shutil.copytree(bundles[name], bundle)
    (om,) = (bundle / "ascend" / "om").glob("step*.om")
    spec = json.loads(om.read_text())
    with _executor(bundle, FakeAcl()) as ex:
        assert ex.notes == []
    om.write_text(json.dumps({**spec, "zero_copy_lost": [copied]}))
    with _executor(bundle, FakeAcl()) as ex:
        (note,) = ex.notes
    assert said in note and "zero copy lost" in note and "\n" not in note


def test_inspect_prints_the_attention_bytes_of_the_bundles_mode(bundles: dict[str, Path]) -> None:
    import subprocess
    import sys

    for name, mode in (("inplace", "inplace"), ("gather", "gather")):
        r = subprocess.run([sys.executable, "-m", "omforge", "inspect", str(bundles[name]), "--no-verify",
                            "--batch", "8", "--context", "256"], capture_output=True, text=True, timeout=120)
        line = next(x for x in r.stdout.splitlines() if "attn bytes" in x)
        assert f"attn bytes {mode}:" in line and "batch 8, context 256" in line and "paged floor" in line
