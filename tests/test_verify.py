"""``omforge verify`` (verify.py) on the FAKE pyACL (tests/fake_acl.py): every gear of the tiny ascend bundle against
the ORT plain twin, per paged-attention mode — in place (the tiny recipe's float16 default on Ascend910B3: logits and
the pool rows read back at the step's slots against the twin's ``<pool>.ref`` values) and gather (logits and
``kv_new``). The fake's "OM" runs that same twin, so a pass here proves the plumbing (gear inputs, the run, the
read-back, the comparison, the memory report), not the NPU, which has never run this."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fake_atc
import pytest

from fake_acl import FakeAcl
from helpers import TINY_RECIPE, compile_bundle
from omforge.contract.manifest import load_manifest
from omforge.errors import OmforgeError
from omforge.verify import verify


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``inplace``: the tiny recipe for ascend (float16, auto → in place); ``gather`` and ``readonly``: the same with
    ``compile.paged_attention`` set (their recipes under ``<mode>-recipe``). FAKE OMs on their plain twins."""
    from test_acl_executor import plain_twin
    from test_ascend_precision import plain_twin as precision_twin
    from test_ascend_precision import precision_recipe

    root = tmp_path_factory.mktemp("verify")
    asc = compile_bundle(TINY_RECIPE, root / "ascend", root / "cache", target="ascend")
    fake_atc.build_bundle(asc, plain_twin(asc, root / "plain"))
    recipe = precision_recipe(root, "float16", "gather", paged_attention="gather")
    gather = compile_bundle(recipe, root / "gather", root / "cache")
    fake_atc.build_bundle(gather, plain_twin(gather, root / "plain-gather", recipe))
    readonly_recipe = precision_recipe(root, "float16", "readonly", paged_attention="readonly")
    readonly = compile_bundle(readonly_recipe, root / "readonly", root / "cache")
    fake_atc.build_bundle(readonly, precision_twin(readonly, readonly_recipe, root / "plain-readonly"))
    return {"inplace": asc, "gather": gather, "gather-recipe": recipe, "readonly": readonly,
            "readonly-recipe": readonly_recipe}


@pytest.fixture(scope="module")
def bundle(bundles: dict[str, Path]) -> Path:
    return bundles["inplace"]


@pytest.mark.parametrize(("mode", "checked"), [("inplace", "pool rows"), ("gather", "kv_new"), ("readonly", "kv_new")])
def test_every_gear_passes_against_the_plain_twin(bundles: dict[str, Path], mode: str, checked: str) -> None:
    """The report names the mode first, then one line per gear with the logits and the mode's KV check (in place:
    the pool rows at the step's slots; gather: kv_new) and the run's time, the memory, the verdict."""
    lines: list[str] = []
    recipe = bundles.get(f"{mode}-recipe", TINY_RECIPE)
    assert verify(bundles[mode], recipe, acl=FakeAcl(), say=lines.append)
    gears = load_manifest(bundles[mode]).ascend.gears
    assert lines[0].startswith(f"mode: paged attention {mode}")
    per_gear = [line for line in lines if line.startswith(("pass", "FAIL"))]
    assert len(per_gear) == len(gears) and all(line.startswith("pass") for line in per_gear)
    assert all(f"logits 0.00e+00, {checked} 0.00e+00" in line and line.endswith(" ms") for line in per_gear)
    assert {"prefill", "decode"} <= {line.split()[1] for line in per_gear}
    assert "device memory:" in lines[-2] and "in the manifest's plan" in lines[-2]
    assert lines[-1].startswith(f"{len(gears)}/{len(gears)} gears within tolerance")
    assert lines[-1].endswith(f"paged attention {mode}")


def test_pool_rows_an_om_did_not_keep_fail(bundle: Path, tmp_path: Path) -> None:
    """The same in-place OM without the RefData flip (plain Data pools: the ref writes land in GE's Identity copy,
    dropped by the FAKE pyACL): its logits still equal the twin's — the kernel read the written copy — but the pool
    rows read back at the step's slots are not the twin's, so every gear FAILs on them."""
    from test_acl_executor import plain_twin

    b = tmp_path / "noflip"
    shutil.copytree(bundle, b)
    fake_atc.build_bundle(b, plain_twin(b, tmp_path / "plain"), flip=False)
    lines: list[str] = []
    fake = FakeAcl()
    assert not verify(b, TINY_RECIPE, acl=fake, say=lines.append)
    per_gear = [line for line in lines if line.startswith(("pass", "FAIL"))]
    assert per_gear and all(line.startswith("FAIL") and "logits 0.00e+00" in line for line in per_gear)
    assert fake.lost_writes


def test_an_om_that_computes_something_else_fails(bundle: Path, tmp_path: Path) -> None:
    """The OM (here: the fake's twin with the final norm's weight changed) differs from the twin: verify says FAIL
    per gear and returns False."""
    import onnx
    from onnx import numpy_helper

    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    (om,) = (b / "ascend" / "om").glob("step*.om")
    spec = json.loads(om.read_text())
    model = onnx.load(spec["onnx"])
    norm = next(t for t in model.graph.initializer if "norm" in t.name and len(t.dims) == 1)
    weight = numpy_helper.to_array(norm)
    norm.CopyFrom(numpy_helper.from_array(weight * weight.dtype.type(3), norm.name))
    onnx.save(model, str(tmp_path / "other.onnx"), save_as_external_data=True, location="other.onnx.data")
    om.write_text(json.dumps({**spec, "onnx": str(tmp_path / "other.onnx")}))
    lines: list[str] = []
    assert not verify(b, TINY_RECIPE, acl=FakeAcl(), say=lines.append)
    assert any(line.startswith("FAIL") for line in lines)


def test_another_recipe_is_refused_in_one_line(bundle: Path, tmp_path: Path) -> None:
    import yaml

    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["compile"]["max_seq_len"] = data["compile"].get("max_seq_len", 256) * 2
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data))
    with pytest.raises(OmforgeError, match="not the recipe .* was compiled from") as e:
        verify(bundle, other, acl=FakeAcl(), say=lambda _: None)
    assert "\n" not in str(e.value)
