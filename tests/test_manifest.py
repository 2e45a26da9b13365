"""The manifest's one schema (contract/manifest.py): compiled bundles' manifests round-trip exactly through it, a
missing, unknown or ill-typed field is a BundleError naming the field, optional sections read as None or their
default, and bundles from before the later fields still load."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge.contract.manifest import MANIFEST, BundleError, Manifest, ModelConfig, Weights, load_manifest


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Manifest | None]]:
    """``{target: (the tiny bundle, the manifest compile returned)}``; ascend's compile raises AtcMissing after
    writing its bundle (no atc here), so it returns none."""
    from omforge.compile.compiler import compile_recipe
    from omforge.recipe import load_recipe

    root = tmp_path_factory.mktemp("manifest")
    old = os.environ.get("OMFORGE_CACHE_DIR")
    os.environ["OMFORGE_CACHE_DIR"] = str(root / "cache")
    try:
        ort = compile_recipe(load_recipe(TINY_RECIPE), root / "ort", quiet=True)
    finally:
        if old is None:
            os.environ.pop("OMFORGE_CACHE_DIR")
        else:
            os.environ["OMFORGE_CACHE_DIR"] = old
    return {"ort": (ort.bundle, ort.manifest),
            "ascend": (compile_bundle(TINY_RECIPE, root / "ascend", root / "cache", target="ascend"), None)}


def raw(bundles: dict[str, tuple[Path, Manifest | None]], target: str) -> dict[str, Any]:
    return json.loads((bundles[target][0] / MANIFEST).read_text())


@pytest.mark.parametrize("target", ["ort", "ascend"])
def test_a_compiled_manifest_round_trips_exactly(bundles: dict, target: str) -> None:
    text = (bundles[target][0] / MANIFEST).read_text()
    m = Manifest.from_dict(json.loads(text))
    assert json.dumps(m.to_dict(), indent=2) == text  # the same file, byte for byte
    assert Manifest.from_dict(m.to_dict()) == m == load_manifest(bundles[target][0])
    assert (m.ascend is not None) == (target == "ascend")


def test_what_compile_builds_is_what_the_runtime_reads(bundles: dict) -> None:
    bundle, built = bundles["ort"]
    assert load_manifest(bundle) == built
    assert built.kv.paged_layout.bytes_per_token == built.kv.bytes_per_token
    assert built.buckets.profiles[0].name == "step" and built.graphs.step == "ort/step.onnx"


@pytest.mark.parametrize("target, path", [
    ("ort", "model"), ("ort", "kv.block_size"), ("ort", "abi.inputs[0].name"), ("ort", "files['ort/step.onnx'].size"),
    ("ort", "tokenizer"), ("ort", "limits.max_seq_len"), ("ascend", "ascend.memory.io_bytes"),
    ("ascend", "ascend.num_slots"), ("ort", "model.config.vocab_size"), ("ort", "model.config.head_dim"),
])
def test_a_missing_required_field_is_named(bundles: dict, target: str, path: str) -> None:
    data = raw(bundles, target)
    parent, key = _locate(data, path)
    del parent[key]
    with pytest.raises(BundleError, match=f"^{re.escape(path)}: missing"):
        Manifest.from_dict(data)


@pytest.mark.parametrize("path", ["extra", "kv.blocksize", "abi.outputs[1].stride", "buckets.extra",
                                  "model.config.heads"])
def test_an_unknown_field_is_named(bundles: dict, path: str) -> None:
    data = raw(bundles, "ort")
    parent, key = _locate(data, path)
    parent[key] = 1
    with pytest.raises(BundleError, match=f"^{re.escape(path)}: unknown field"):
        Manifest.from_dict(data)


@pytest.mark.parametrize("path, value, message", [
    ("kv.block_size", "64", "kv.block_size: expected int, got '64'"),
    ("kv.block_size", True, "kv.block_size: expected int, got True"),
    ("abi.inputs", {}, "abi.inputs: expected a list, got {}"),
    ("target", "tpu", "target: 'tpu' is not one of ort, ascend"),
    ("kv.bytes_per_token", 7, "kv.bytes_per_token: 7 disagrees with the layout's 512"),
    ("buckets.block_size", 0, "buckets.block_size: expected a positive integer"),
    ("schema_version", 2, "schema_version 2 is not supported by this omforge"),
    ("model.config.vocab_size", "64", "model.config.vocab_size: expected int, got '64'"),
    ("model.config.eos_token_ids", 2, "model.config.eos_token_ids: expected a list, got 2"),
    ("model.config.head_dim", 7, "model.config.head_dim: must be even for rotary embeddings (got 7)"),
    ("model.config.family", "gpt2",
     "model.config.family: 'gpt2' is not supported; supported: llama, qwen2, qwen3, mistral"),
])
def test_a_wrong_value_is_named(bundles: dict, path: str, value: object, message: str) -> None:
    data = raw(bundles, "ort")
    parent, key = _locate(data, path)
    parent[key] = value
    with pytest.raises(BundleError, match=f"^{re.escape(message)}"):
        Manifest.from_dict(data)


def test_load_manifest_names_the_file_and_the_field(bundles: dict, tmp_path: Path) -> None:
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundles["ort"][0], bundle)
    data = raw(bundles, "ort")
    del data["kv"]["write"]
    (bundle / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=f"^{re.escape(str(bundle / MANIFEST))}: kv.write: missing"):
        load_manifest(bundle)


def test_the_ascend_section_goes_with_the_ascend_target(bundles: dict) -> None:
    data = raw(bundles, "ascend")
    del data["ascend"]
    with pytest.raises(BundleError, match="^ascend: missing in an ascend bundle"):
        Manifest.from_dict(data)
    data = raw(bundles, "ort")
    data["ascend"] = raw(bundles, "ascend")["ascend"]
    with pytest.raises(BundleError, match="^ascend: present in an ort bundle"):
        Manifest.from_dict(data)


def test_a_bundle_from_before_the_later_fields_loads_with_their_defaults(bundles: dict) -> None:
    """No paged_attention, kernels, weights or export (added later), and the unfused graph in the bundle."""
    data = raw(bundles, "ort")
    for key in ("paged_attention", "kernels", "weights", "export"):
        del data[key]
    data["graphs"]["unfused"] = "export/model.onnx"
    m = Manifest.from_dict(data)
    assert (m.paged_attention, m.kernels, m.export) == ("plain", None, None)
    assert m.weights == Weights("float32", {}) and m.graphs.step == "ort/step.onnx"
    assert m.to_dict() == {**data, "paged_attention": "plain", "kernels": None, "weights": Weights("float32", {})
                           .to_dict()} and "export" not in m.to_dict()
    assert Manifest.from_dict(m.to_dict()) == m


def test_the_model_config_is_typed(bundles: dict) -> None:
    """The runtime reads the model's facts as attributes (issue 45 item 4): the manifest's config is a
    :class:`ModelConfig`, written by compile from export.json's and read back equal; one from before a later
    optional field (``sliding_window``, ``o_bias``) loads with its default."""
    data = raw(bundles, "ort")
    config = Manifest.from_dict(data).model.config
    assert isinstance(config, ModelConfig) and config == bundles["ort"][1].model.config
    assert isinstance(config.eos_token_ids, tuple) and config.to_dict() == data["model"]["config"]
    assert ModelConfig.from_dict(config.to_dict()) == config
    for key in ("sliding_window", "o_bias"):
        del data["model"]["config"][key]
    assert Manifest.from_dict(data).model.config == config


def test_from_dict_does_not_alias_its_input(bundles: dict) -> None:
    data = raw(bundles, "ort")
    before = copy.deepcopy(data)
    m = Manifest.from_dict(data)
    m.passes.op_histogram["MatMul"] = -1
    m.to_dict()["serve"]["max_num_seqs"] = 1
    assert data == before and m.serve["max_num_seqs"] == before["serve"]["max_num_seqs"]


def _locate(data: dict, path: str) -> tuple[Any, Any]:
    """The container holding ``path``'s last part (``a.b[0]['c'].d``) and that part's key."""
    keys = [q if q else int(i) if i else k for q, i, k in re.findall(r"\['([^']*)'\]|\[(\d+)\]|([^.\[\]]+)", path)]
    node = data
    for k in keys[:-1]:
        node = node[k]
    return node, keys[-1]
