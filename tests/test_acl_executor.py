"""The AscendCL executor (runtime/ascend/acl_executor.py, runtime/ascend/acl_api.py) against tests/fake_acl.py —
a FAKE pyACL whose "OM" (written by tests/fake_atc.py from the bundle's exact atc command) runs the plain-op twin of
the ascend step graph on onnxruntime and enforces CANN's documented rules (output names in ``op:edge:name`` form, ≤ 128
gear dims built from the listed inputs, async copies synchronized before use). This checks the executor's own
work (set-up, description checks, buffers, datasets, gear selection, the row copies into the resident pool,
logits, teardown) end to end; it says nothing about real NPU behaviour, which has not been run. Tests that need
the real pyACL are skipped where it is not importable."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import fake_atc
import numpy as np
import pytest

from fake_acl import FakeAcl
from helpers import TINY_RECIPE, compile_bundle
from omforge.contract.manifest import BundleError, load_manifest
from omforge.runtime.ascend.acl_api import AclError, AclParameterError, AclResourceError, AclUnavailable, acl_error

HAS_ACL = importlib.util.find_spec("acl") is not None


def plain_twin(bundle: Path, out: Path, recipe_path: Path = TINY_RECIPE) -> Path:
    """The ascend step graph with every op lowered to standard ONNX (``lower_step_graph(plain=True)``, our RMSNorm
    epsilon): what the fake's "OM" runs."""
    from omforge.compile.ascend.stages import lower_step_graph
    from omforge.compile.options import lora_options
    from omforge.recipe import load_recipe, retarget

    manifest = load_manifest(bundle, verify=False)
    out.mkdir(parents=True, exist_ok=True)
    export = Path(manifest.export.dir)  # the stage cache's export: bundles keep no copy of it
    recipe = retarget(load_recipe(recipe_path), manifest.target)  # as compile --target read it
    lower_step_graph(export, out, recipe, manifest.kv.block_size, plain=True,
                     lora=lora_options(recipe, manifest.model.config))
    return out / "step.onnx"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny ascend bundle with FAKE OM files, the tiny ort bundle), one stage cache."""
    root = tmp_path_factory.mktemp("acl")
    cache = root / "cache"
    recipe = root / "tiny-f32.yaml"  # float32 weights (the ascend default is float16): logprobs equal ORT's to 1e-4
    recipe.write_text(TINY_RECIPE.read_text() + "  target: ascend\n  weights: float32\n")
    asc = compile_bundle(recipe, root / "ascend", cache)
    fake_atc.build_bundle(asc, plain_twin(asc, root / "plain", recipe))
    return asc, compile_bundle(TINY_RECIPE, root / "ort", cache)


PROMPTS = [[5, 9, 2, 77], list(range(3, 43)), [7], [int(x) for x in np.random.default_rng(1).integers(3, 250, 129)],
           [int(x) for x in np.random.default_rng(2).integers(3, 250, 100)]]


def test_engine_on_the_fake_acl_gives_the_ort_engines_tokens(bundles: tuple[Path, Path]) -> None:
    from omforge import LLM, SamplingParams

    asc, ort_bundle = bundles
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    fake = FakeAcl()
    on_acl = LLM(asc, acl_module=fake).generate(PROMPTS, params, use_tqdm=False)
    on_ort = LLM(ort_bundle).generate(PROMPTS, params, use_tqdm=False)
    for a, o in zip(on_acl, on_ort):
        assert a.token_ids == o.token_ids
        np.testing.assert_allclose([e.logprob for e in a.logprobs], [e.logprob for e in o.logprobs], atol=1e-4)
    executed = fake.calls.count("execute")
    assert executed >= 24  # decode runs batched across prompts, prefill per prompt
    assert not any(c.startswith("FAILED") for c in fake.calls), [c for c in fake.calls if c.startswith("FAILED")]


def test_teardown_releases_everything_in_reverse_order(bundles: tuple[Path, Path]) -> None:
    from omforge.runtime.engine import LLMEngine

    fake = FakeAcl()
    engine = LLMEngine(bundles[0], acl_module=fake)
    assert fake.live  # pools, step buffers, staging
    engine.executor.close()
    assert fake.live == []
    tail = [c for c in fake.calls if c in ("unload", "destroy_stream", "destroy_context", "reset_device", "finalize")]
    assert tail[-4:] == ["destroy_stream", "destroy_context", "reset_device", "finalize"]
    assert tail.count("unload") == 1  # one OM for prefill and decode: the weights are on the device once
    engine.executor.close()  # idempotent


def test_failed_setup_releases_what_it_took(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    from omforge.runtime.ascend.acl_executor import AclExecutor

    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    manifest = load_manifest(bundle, verify=False)
    (bundle / "ascend" / "om" / "step_linux_x86_64.om").write_text("not an OM")
    fake = FakeAcl()
    with pytest.raises(AclParameterError, match="acl.mdl.load_with_config"):
        AclExecutor(bundle, manifest, acl=fake)
    assert fake.live == [] and fake.calls[-1] == "finalize"


def _om(bundle: Path) -> Path:
    (om,) = (bundle / "ascend" / "om").glob("step*.om")
    return om


def test_a_stale_om_is_refused_with_the_difference(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.ascend.acl_plan import AclModelMismatch

    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    manifest = load_manifest(bundle, verify=False)
    om = _om(bundle)
    spec = json.loads(om.read_text())
    spec["gears"] = spec["gears"][:-1]  # compiled with one gear fewer than the manifest says
    om.write_text(json.dumps(spec))
    fake = FakeAcl()
    with pytest.raises(AclModelMismatch, match="gears"):
        AclExecutor(bundle, manifest, acl=fake)
    assert fake.live == []


def test_the_om_is_found_with_atcs_os_cpu_suffix(bundles: tuple[Path, Path]) -> None:
    """Issue 20: ATC may write ``<output>_<os>_<cpu>.om`` (hicann/ge model_helper.cc); the fake ATC does, and the
    executor loads it (it looked for ``<output>.om`` before)."""
    from omforge.runtime.ascend.acl_executor import check_bundle

    assert check_bundle(bundles[0], load_manifest(bundles[0])).name == "step_linux_x86_64.om"


def test_an_ascend_bundle_from_before_the_one_om_layout_is_refused_in_one_line(bundles: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    old = {**manifest, "ascend": {"models": {"prefill": "ascend/om/prefill.om", "decode": "ascend/om/decode.om"}}}
    (bundle / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(BundleError, match="manifest.json: an ascend bundle from before issue 20.*recompile it$"):
        load_manifest(bundle)


def test_outputs_are_matched_by_index_in_canns_name_form(bundles: tuple[Path, Path]) -> None:
    """Issue 20 defect 3: ACL names an ONNX model's outputs ``op-name:edge-index:tensor-name``; the executor
    matches outputs by index and checks the part after the last ':' (bare-name matching failed at load)."""
    from omforge.runtime.ascend.acl_api import AclRuntime
    from omforge.runtime.ascend.acl_executor import AclExecutor

    manifest = load_manifest(bundles[0])
    fake = FakeAcl()
    with AclExecutor(bundles[0], manifest, acl=fake) as ex:
        names = [t.name for t in AclRuntime(fake).describe(_desc(fake, ex.model.model_id)).outputs]
        assert [n.count(":") for n in names] == [2, 2] and [n.rsplit(":", 1)[1] for n in names] == ["logits", "kv_new"]
    assert fake.live == []


def _desc(fake: FakeAcl, model_id: int):  # noqa: ANN202
    desc = fake.mdl.create_desc()
    fake.mdl.get_desc(desc, model_id)
    return desc


def test_a_gear_model_over_128_dims_fails_to_describe(tmp_path: Path) -> None:
    """Issue 20 defect 2, on the FAKE pyACL: a gear model's dims list holds every dim of every input listed in
    --input_shape; with 33 listed 4-D inputs (132 dims) aclmdlGetInputDynamicDims fails (ACL_MAX_DIM_CNT, hicann/ge
    model_om2.cpp) — as it would have for SmolLM2's step graph with its 60 pools listed (190 dims)."""
    import onnx
    from onnx import TensorProto, helper

    from omforge.runtime.ascend.acl_api import AclInternalError, AclRuntime

    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 2, 2, "n"]) for i in range(33)]
    graph = helper.make_graph([helper.make_node("Identity", ["x0"], ["y"])], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 2, "n"])])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    om = tmp_path / "g.om"
    om.write_text(json.dumps({"fake_om": True, "onnx": str(path), "gears": [[1] * 33, [2] * 33],
                              "input_shape": [[f"x{i}", [2, 2, 2, -1]] for i in range(33)]}))
    fake = FakeAcl()
    rt = AclRuntime(fake)
    rt.init()
    rt.set_device(0)
    desc = rt.create_desc(rt.load_model(str(om))[0])
    with pytest.raises(AclInternalError, match="get_input_dynamic_dims"):
        rt.describe(desc)


def test_a_plan_above_the_devices_free_memory_is_refused(bundles: tuple[Path, Path]) -> None:
    """Issue 20 deliverable 3: serve refuses, in one line, a device memory plan that does not fit."""
    from omforge.runtime.ascend.acl_executor import AclExecutor, DeviceMemoryTooSmall

    manifest = load_manifest(bundles[0])
    plan = manifest.ascend.memory
    assert plan.om_models == 1 and plan.total_bytes == (plan.weights_bytes + plan.kv_pool_bytes + plan.io_bytes
                                                        + plan.workspace_bytes_estimate)
    fake = FakeAcl(hbm_free=plan.kv_pool_bytes, hbm_total=1 << 30)
    with pytest.raises(DeviceMemoryTooSmall, match="KV pool") as e:
        AclExecutor(bundles[0], manifest, acl=fake)
    assert "\n" not in str(e.value) and "num_kv_blocks" in str(e.value)
    assert fake.live == []


def test_a_decode_step_makes_one_copy_per_run_of_slots(bundles: tuple[Path, Path]) -> None:
    """Issue 20 deliverable 4: the new rows of every layer reach the pool with ONE async copy per run of
    consecutive slots and one synchronize per run (was 2 x layers synchronous copies per run)."""
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.step import SeqWork

    manifest = load_manifest(bundles[0])
    fake = FakeAcl()
    with AclExecutor(bundles[0], manifest, acl=fake) as ex:
        seqs = [SeqWork(list(range(3, 40)), 0, [b]) for b in range(4)]
        for w in seqs:
            ex.execute([w])  # prefill 4 sequences, one block each
        before = len(fake.calls)
        ex.execute([SeqWork([5], 37, [b], needs_logits=True) for b in range(4)])  # one decode step of 4
        step = fake.calls[before:]
    assert step.count("execute") == 1
    assert step.count("memcpy_async") == 4 and step.count("synchronize_stream") == 1
    assert step.count("memcpy 3") == 0  # no synchronous device-to-device copy
    assert not [c for c in fake.calls if c.startswith("FAILED")]


def test_block_copies_and_swaps_move_whole_blocks(bundles: tuple[Path, Path]) -> None:
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.step import SeqWork

    manifest = load_manifest(bundles[0])
    fake = FakeAcl()
    with AclExecutor(bundles[0], manifest, acl=fake, num_host_blocks=2) as ex:
        ex.execute([SeqWork(list(range(3, 60)), 0, [4])])  # fills slots of block 4
        pool = ex.pool

        def block(b: int) -> bytes:
            buf, off, _ = fake.resolve(pool + b * ex.block_bytes, ex.block_bytes)
            return bytes(buf[off:off + ex.block_bytes])

        original = block(4)
        assert original != bytes(ex.block_bytes)  # the rows arrived
        ex.copy_blocks([(4, 6)])
        assert block(6) == original
        ex.swap_out([(4, 1)])
        fake.rt.memset(pool + 4 * ex.block_bytes, ex.block_bytes, 0, ex.block_bytes)
        ex.swap_in([(1, 4)])
        assert block(4) == original
    assert fake.live == []


def test_prompt_longer_than_the_gears_admit_is_rejected(bundles: tuple[Path, Path]) -> None:
    from omforge.runtime.engine import LLMEngine, RequestRejected

    engine = LLMEngine(bundles[0], acl_module=FakeAcl())
    limit = engine.max_prompt_len
    assert limit == 256 - 128 + 1  # tiny recipe: context 256, smallest prefill gear 128
    engine.add_request(list(range(limit)), None)
    with pytest.raises(RequestRejected, match="gears admit"):
        engine.add_request(list(range(limit + 1)), None)
    engine.executor.close()


def test_acl_codes_become_named_exceptions() -> None:
    assert isinstance(acl_error("acl.rt.malloc(1)", 207001), AclResourceError)
    e = acl_error("acl.mdl.execute", 100000)
    assert isinstance(e, AclParameterError) and e.code == 100000 and "acl.mdl.execute" in str(e)
    assert type(acl_error("x", 999)) is AclError


def test_serve_on_an_ascend_bundle_without_cann_fails_in_one_line(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    if HAS_ACL:
        pytest.skip("pyACL is importable here: the missing-CANN message cannot be shown")
    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    shutil.rmtree(bundle / "ascend" / "om")  # as compile leaves it without atc
    r = subprocess.run([sys.executable, "-m", "omforge", "serve", str(bundle), "--port", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "pyACL is not importable" in lines[0] and "CANN" in lines[0] and "OM model was not built" in lines[0]
    with pytest.raises(AclUnavailable):
        from omforge.runtime.ascend.acl_api import import_acl

        import_acl()


@pytest.mark.skipif(not HAS_ACL, reason="needs pyACL (the CANN toolkit) and an Ascend NPU; not available here")
def test_real_acl_initializes_a_device() -> None:  # pragma: no cover - hardware only
    from omforge.runtime.ascend.acl_api import AclRuntime, import_acl

    rt = AclRuntime(import_acl())
    rt.init()
    try:
        rt.set_device(0)
        ptr = rt.malloc(1 << 20)
        rt.memset(ptr, 1 << 20)
        rt.free(ptr)
        rt.reset_device(0)
    finally:
        rt.finalize()


def test_engine_close_releases_the_executor_once(bundles: tuple[Path, Path]) -> None:
    """Issue 12 defect 7: LLMEngine.close() tears the AscendCL executor down (serve calls it at shutdown),
    idempotently, and a closed engine refuses to step."""
    from omforge.runtime.engine import LLMEngine

    fake = FakeAcl()
    engine = LLMEngine(bundles[0], acl_module=fake)
    assert fake.live
    engine.close()
    assert fake.live == [] and fake.calls[-1] == "finalize"
    engine.close()
    assert fake.calls.count("finalize") == 1
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_the_kv_pool_is_on_the_device_once(bundles: tuple[Path, Path]) -> None:
    """Issue 44 item 2: a device that holds the OM's weights, its work memory and the pool ONCE serves the bundle.
    The FAKE pyACL reserves the model's inputs and outputs (the pool included) in its work memory unless the load
    sets ACL_MDL_WORKSPACE_MEM_OPTIMIZE, as GE does (reference §5.2); before, the executor loaded with load_from_file
    and its check counted query_size's work (which includes the pool) plus the pool again."""
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.step import SeqWork

    manifest = load_manifest(bundles[0])
    work, weights, ret = FakeAcl().mdl.query_size(str(_om(bundles[0])))
    assert ret == 0
    fake = FakeAcl(hbm_free=weights + work + (1 << 16))  # 64 KiB to spare: far less than the pool
    pool = manifest.ascend.memory.kv_pool_bytes
    assert pool > 1 << 16
    with AclExecutor(bundles[0], manifest, acl=fake) as ex:
        assert ex.need.measured and ex.need.pool == pool and ex.need.total <= weights + work
        ex.execute([SeqWork(list(range(3, 40)), 0, [0], needs_logits=True)])
        assert fake.device_used <= weights + work + (1 << 16)
    assert not [c for c in fake.calls if c.startswith("FAILED")]
    assert fake.live == []


def test_the_fake_reserves_the_models_inputs_and_outputs_unless_told_not_to(bundles: tuple[Path, Path]) -> None:
    """The FAKE pyACL as GE: query_size's work includes the I/O; a config-handle load reserves weights + work, less
    the I/O only with ACL_MDL_WORKSPACE_MEM_OPTIMIZE = 1 (aclmdlConfigAttr; hicann/ge davinci_model.cc)."""
    om = str(_om(bundles[0]))
    work, weights, _ = FakeAcl().mdl.query_size(om)
    reserved = {}
    for optimize in (0, 1):
        fake = FakeAcl()
        handle = fake.mdl.create_config_handle()
        for attr, value in ((1, 1), (2, om), (13, optimize)):
            assert fake.mdl.set_config_opt(handle, attr, value) == 0
        model_id, ret = fake.mdl.load_with_config(handle)
        assert ret == 0
        reserved[optimize] = fake.device_used
        assert fake.mdl.unload(model_id) == 0 and fake.device_used == 0
    assert reserved[0] == weights + work
    assert reserved[0] - reserved[1] > load_manifest(bundles[0]).ascend.memory.kv_pool_bytes  # the I/O, pool too


def test_the_fake_refuses_calls_and_argument_types_outside_the_call_table() -> None:
    """Issue 44 item 4: the FAKE pyACL offers only contract/acl_calls.py's rows, with their argument types."""
    from fake_acl import NotInCallTable

    fake = FakeAcl()
    with pytest.raises(NotInCallTable, match="acl.mdl.load_from_memory is not in"):
        fake.mdl.load_from_memory("x.om")
    with pytest.raises(NotInCallTable, match="acl.mdl.load_from_file: model_path must be str, got int"):
        fake.mdl.load_from_file(7)
    with pytest.raises(NotInCallTable, match="acl.rt.get_version"):
        fake.rt.get_version()
    fake.init()
    fake.rt.set_device(0)
    with pytest.raises(NotInCallTable, match="acl.rt.malloc: size must be int, got int64"):
        fake.rt.malloc(np.int64(64), 0)
    with pytest.raises(NotInCallTable, match="takes 2 arguments"):
        fake.rt.malloc(64)
    ptr, ret = fake.rt.malloc(64, 0)
    assert ret == 0 and fake.rt.free(ptr) == 0


def test_memcpy_async_refuses_unaligned_addresses() -> None:
    """aclrtMemcpyAsync: source and destination 64-byte aligned (aclpythondevg_01_0125), on the FAKE pyACL."""
    fake = FakeAcl()
    fake.init()
    fake.rt.set_device(0)
    a, _ = fake.rt.malloc(256, 0)
    b, _ = fake.rt.malloc(256, 0)
    assert fake.rt.memcpy_async(a + 32, 128, b, 64, 3, "stream") == 100000
    assert fake.rt.memcpy_async(a + 64, 128, b + 64, 64, 3, "stream") == 0
    assert fake.rt.synchronize_stream("stream") == 0


def test_every_pyacl_call_of_acl_api_is_a_row_of_the_table() -> None:
    """acl_api.py calls exactly the table's functions (read from its source): a call added without a row, or a row
    left after its call went, fails here."""
    import re

    from omforge.contract.acl_calls import BY_NAME
    from omforge.runtime.ascend import acl_api

    src = Path(acl_api.__file__).read_text()
    used = {f"acl.{ns}.{fn}" for ns, fn in re.findall(r"acl\.(rt|mdl|util)\.(\w+)(?![\w{])", src)}
    used |= {f"acl.mdl.{fn}" for fn in re.findall(r"(?<![\w.])mdl\.(\w+)", src)}
    used |= {f"acl.{fn}" for fn in re.findall(r"self\.acl\.(\w+)\(", src)}
    assert used == set(BY_NAME)
