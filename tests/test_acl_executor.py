"""The AscendCL executor (runtime/acl_executor.py, runtime/acl_api.py) against tests/fake_acl.py — a FAKE pyACL
whose "OM models" run the plain-op twin of the ascend step graph on onnxruntime. This checks the executor's own
work (set-up, description checks, buffers, datasets, gear selection, the D2D row copies into resident pools,
logits, teardown) end to end; it says nothing about real NPU behaviour, which has not been run. Tests that need
the real pyACL are skipped where it is not importable."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fake_acl import FakeAcl, write_fake_oms
from helpers import TINY_RECIPE, compile_bundle
from omforge.runtime.acl_api import AclError, AclParameterError, AclResourceError, AclUnavailable, acl_error

HAS_ACL = importlib.util.find_spec("acl") is not None


def plain_twin(bundle: Path, out: Path) -> Path:
    """The ascend step graph with every op lowered to standard ONNX (``lower_step_graph(plain=True)``, our RMSNorm
    epsilon): what the fake's "OM" runs."""
    from omforge.compile.ascend import lower_step_graph
    from omforge.recipe import load_recipe

    manifest = json.loads((bundle / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    export = Path(manifest["export"]["dir"])  # the stage cache's export: bundles keep no copy of it
    lower_step_graph(export, out, load_recipe(TINY_RECIPE), manifest["kv"]["block_size"], plain=True)
    return out / "step.onnx"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny ascend bundle with FAKE OM files, the tiny ort bundle), one stage cache."""
    root = tmp_path_factory.mktemp("acl")
    cache = root / "cache"
    asc = compile_bundle(TINY_RECIPE, root / "ascend", cache, target="ascend")
    write_fake_oms(asc, plain_twin(asc, root / "plain"))
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
        np.testing.assert_allclose([e["logprob"] for e in a.logprobs], [e["logprob"] for e in o.logprobs], atol=1e-4)
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
    assert tail.count("unload") == 2
    engine.executor.close()  # idempotent


def test_failed_setup_releases_what_it_took(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    from omforge.runtime.acl_executor import AclExecutor

    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / manifest["ascend"]["models"]["decode"]).write_text("not an OM")
    fake = FakeAcl()
    with pytest.raises(AclParameterError, match="acl.mdl.load_from_file"):
        AclExecutor(bundle, manifest, acl=fake)
    assert fake.live == [] and fake.calls[-1] == "finalize"


def test_a_stale_om_is_refused_with_the_difference(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    from omforge.runtime.acl_executor import AclExecutor
    from omforge.runtime.acl_plan import AclModelMismatch

    bundle = tmp_path / "b"
    shutil.copytree(bundles[0], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    om = bundle / manifest["ascend"]["models"]["decode"]
    spec = json.loads(om.read_text())
    spec["profile"]["gears"] = spec["profile"]["gears"][:-1]  # compiled with one gear fewer than the manifest says
    om.write_text(json.dumps(spec))
    fake = FakeAcl()
    with pytest.raises(AclModelMismatch, match="decode.*gears"):
        AclExecutor(bundle, manifest, acl=fake)
    assert fake.live == []


def test_block_copies_and_swaps_move_whole_blocks(bundles: tuple[Path, Path]) -> None:
    from omforge.runtime.acl_executor import AclExecutor
    from omforge.runtime.step import SeqWork

    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    fake = FakeAcl()
    with AclExecutor(bundles[0], manifest, acl=fake, num_host_blocks=2) as ex:
        ex.execute([SeqWork(list(range(3, 60)), 0, [4])])  # fills slots of block 4
        pool = ex.pools["key_cache.1"]

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
    assert "pyACL is not importable" in lines[0] and "CANN" in lines[0] and "OM models were not built" in lines[0]
    with pytest.raises(AclUnavailable):
        from omforge.runtime.acl_api import import_acl

        import_acl()


@pytest.mark.skipif(not HAS_ACL, reason="needs pyACL (the CANN toolkit) and an Ascend NPU; not available here")
def test_real_acl_initializes_a_device() -> None:  # pragma: no cover - hardware only
    from omforge.runtime.acl_api import AclRuntime, import_acl

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
