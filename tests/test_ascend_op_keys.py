"""Every ONNX op key the ascend step graphs rely on is backed (issue 60 item 6): a default-domain op type that is not
standard ONNX at the graph's opset is either registered by a CANN built-in plugin at a cited line of a hicann
repository (the open sources of the release the path targets, contract/ascend.py CANN_RELEASE; a third-party mirror
does not count) or carried by a plugin of ours (compile/ascend/atc_plugins.py PLUGINS, rendered into the bundle).
ATC without a plugin for a key stops with E16002 (reference/ascend.md §1.7, §5.3): CANN's NPURotaryPositionEmbedding
plugin is in mirrors only, so a lowering that emits it again fails here. Nothing here has run through a real ATC."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import defs

from helpers import TINY_RECIPE
from omforge.compile.ascend import cann_matrix
from omforge.compile.ascend.atc_plugins import PLUGINS
from omforge.export.onnx_export import export_recipe
from omforge.passes import manager
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.paged_kv import insert_paged_kv
from omforge.recipe import load_recipe

RELEASE_REPOS = frozenset(r for r in cann_matrix.REPOSITORIES if r.startswith("hicann/"))
"""The repositories whose sources stand for the targeted release (contract/ascend.py CANN_RELEASE)."""

LOWERINGS = {
    "910B inplace": {"soc_version": "Ascend910B3", "paged_attention": "inplace"},
    "910B gather": {"soc_version": "Ascend910B3"},
    "910_93 inplace": {"soc_version": "Ascend910_9392", "paged_attention": "inplace"},
    "310P": {"soc_version": "Ascend310P3"},
    "310B": {"soc_version": "Ascend310B1"},
}
"""The lowerings the shipped recipes and the documented options produce (compile.paged_attention, attention)."""


def standard(op_type: str, opset: int) -> bool:
    """True when ``op_type`` is an ai.onnx op at ``opset`` (ATC's plugins for those are rows of the matrix)."""
    try:
        defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return False
    return True


def backing(op_type: str, opset: int) -> str | None:
    """What registers ``ai.onnx::<opset>::<op_type>`` for ATC: our plugin, or a matrix row parsed at a release
    source; None when nothing does."""
    if op_type in PLUGINS:
        return "omforge plugin (compile/ascend/atc_plugins.py PLUGINS)"
    for row in cann_matrix.ROWS:
        lo, hi = row.opsets
        if row.domain == "" and row.op_type == op_type and lo <= opset <= hi and row.parsed_at.repo in RELEASE_REPOS:
            return str(row.parsed_at)
    return None


def unbacked(keys: set[tuple[str, int]]) -> list[str]:
    """The non-standard keys in ``keys`` with no backing, as ATC would name them."""
    return sorted(f"ai.onnx::{v}::{op}" for op, v in keys if not standard(op, v) and backing(op, v) is None)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[str, int]]]:
    """Each lowering's (op type, opset) keys of the tiny recipe's step graph."""
    out = tmp_path_factory.mktemp("opkeys") / "export"
    export_recipe(load_recipe(TINY_RECIPE), out, quiet=True)
    found = {}
    for name, options in LOWERINGS.items():
        model = ir.load(out / "model.onnx")
        manager.run_fusions(model)
        insert_paged_kv(model, 16)
        lower_ascend.lower(model, num_slots=256, **options)
        manager.cleanup(model)
        proto = ir.to_proto(model)
        opset = next(o.version for o in proto.opset_import if o.domain == "")
        assert {n.domain for n in proto.graph.node} == {""}, name
        found[name] = {(n.op_type, opset) for n in proto.graph.node}
    return found


def test_every_non_standard_key_of_every_lowering_is_backed(keys: dict[str, set[tuple[str, int]]]) -> None:
    assert {name: unbacked(k) for name, k in keys.items()} == {name: [] for name in keys}
    own = {op for k in keys.values() for op, v in k if not standard(op, v)}
    assert {"OmRotaryPositionEmbedding", "OmScatterPaKvCache", "OmFusedInferAttentionScore"} <= own  # rotary too


def test_the_pfa_key_is_ours() -> None:
    """``attention="pfa"`` (the full-sequence graph, not the step graph) emits NPUPromptFlashAttention at the export's
    opset 18, which CANN's plugin does not register (11-16 and 19): ours carries it."""
    assert backing("NPUPromptFlashAttention", 18) is not None and unbacked({("NPUPromptFlashAttention", 18)}) == []


def test_the_rotary_key_is_ours_and_cann_s_is_not_backed(keys: dict[str, set[tuple[str, int]]]) -> None:
    """CANN's NPURotaryPositionEmbedding plugin is cited from a third-party mirror only (cann_matrix
    TRANSFORMER_MIRROR): emitting that key again would be refused; our OmRotaryPositionEmbedding is carried."""
    assert ("OmRotaryPositionEmbedding", 18) in keys["910B gather"]
    assert not any(op == "NPURotaryPositionEmbedding" for k in keys.values() for op, _ in k)
    assert unbacked({("NPURotaryPositionEmbedding", 18)}) == ["ai.onnx::18::NPURotaryPositionEmbedding"]
    assert unbacked({("NPUWeightQuantBatchMatmulV2", 18)}) == []  # hicann/ops-nn registers it (a release source)
    assert unbacked({("MyFusedOp", 18), ("Softmax", 18)}) == ["ai.onnx::18::MyFusedOp"]


def test_a_recorded_bundle_key_is_backed() -> None:
    """The committed record of every shipped recipe's bundle (docs/ascend-conformance.json: SmolLM2 and the 8B
    path too) holds no unbacked key."""
    from omforge.compile.ascend.conformance_doc import load_record

    record = load_record()
    assert {n: unbacked({(u.op_type, u.opset) for u in us if u.op_type != cann_matrix.INITIALIZER})
            for n, us in record.items()} == {n: [] for n in record}
