"""Issue 44 item 6 (compile side): the ascend target's float16 default, and the whole-pool Gather's 2^31 bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY_RECIPE
from omforge.cli import main
from omforge.contract.manifest import load_manifest
from omforge.recipe import RecipeError, load_recipe, retarget


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: compile stops before the ATC step (exit 3)
    return tmp_path


def test_ascend_defaults_to_float16_weights(env: Path) -> None:
    """From the recipe's target and from --target alike; an explicit float32 stays float32."""
    recipe = env / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text() + "  target: ascend\n")
    c = load_recipe(recipe).compile
    assert (c.weights, c.precision_mode) == ("float16", "must_keep_origin_dtype")
    assert retarget(load_recipe(TINY_RECIPE), "ascend").compile.weights == "float16"
    explicit = env / "f32.yaml"
    explicit.write_text(TINY_RECIPE.read_text() + "  target: ascend\n  weights: float32\n")
    c = load_recipe(explicit).compile
    assert (c.weights, c.precision_mode) == ("float32", "allow_fp32_to_fp16")
    assert main(["compile", str(TINY_RECIPE), "-o", str(env / "b"), "--target", "ascend"]) == 3
    m = load_manifest(env / "b")
    assert m.kv.dtype == "float16"


def test_retarget_names_a_key_set_for_the_other_target(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text() + "  weights: int4\n")
    with pytest.raises(RecipeError, match=r"r.yaml: --target ascend: compile.weights: int4 weights on ascend"):
        retarget(load_recipe(recipe), "ascend")


def test_a_pool_beyond_the_gather_bound_is_refused_in_one_line(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The gather path's whole-pool Gather: tiny-llama: 2 layers x K/V x 2 kv heads x 16 = 128 elements a slot;
    2^31 / 128 slots = 131,072 blocks of 128. One block more is refused before any ATC input is written."""
    recipe = env / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text()
                      + "  target: ascend\n  paged_attention: gather\nserve:\n  num_kv_blocks: 131072\n")
    assert main(["compile", str(recipe), "-o", str(env / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("omforge: error: ") and "serve.num_kv_blocks" in err and "above 2^31 - 1" in err
    assert "use at most 16,777,215 slots" in err and "(131,071 blocks of 128)" in err
    assert not (env / "b" / "ascend" / "atc_commands.txt").exists()
