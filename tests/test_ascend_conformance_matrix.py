"""The CANN conformance matrix (compile/ascend/cann_matrix.py) against the ascend bundles: the tiny recipe's bundles
(compiled here, every weight form and SoC that compiles in seconds) carry nothing without a row, every row and
every attribute form and dtype signature in it is used by some bundle (so deleting one fails), and the FAKE atc
refuses a graph with an op, an attribute form or a dtype outside the matrix — a ``Constant(value_ints=…)`` first
among them (hicann/ge reads a Constant only through ``value``). Nothing here has run through a real ATC."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import fake_atc
import onnx
import pytest
from onnx import TensorProto, helper

from omforge.compile.ascend import cann_matrix
from omforge.compile.ascend.conformance_doc import DOC, FAST, VARIANTS, acl_rows, collect, load_record, render
from omforge.compile.ascend.step_usage import Use, uses


@pytest.fixture(scope="module")
def fast_uses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Use]]:
    return collect(FAST, tmp_path_factory.mktemp("conformance"))


def _entries(rows: list[cann_matrix.Row] | tuple[cann_matrix.Row, ...]) -> set[tuple]:
    out = set()
    for row in rows:
        out.add((row.op_type, "row"))
        out.update((row.op_type, a.name, a.form) for a in row.attrs)
        out.update((row.op_type, sig) for sig in row.dtypes)
    return out


def _used(record: dict[str, list[Use]]) -> set[tuple]:
    out = set()
    for items in record.values():
        for use in items:
            row = cann_matrix.row_for(use)
            if row is not None:
                out.add((row.op_type, "row"))
                out.update((row.op_type, *a) for a in use.attrs)
                out.add((row.op_type, use.dtypes))
    return out


def test_the_tiny_bundles_carry_nothing_without_a_row(fast_uses: dict[str, list[Use]]) -> None:
    assert {name: cann_matrix.violations(items) for name, items in fast_uses.items()} == \
        {name: [] for name in fast_uses}
    assert all(cann_matrix.rows_for(items) for items in fast_uses.values())


def _without_each_entry(row: cann_matrix.Row) -> list[cann_matrix.Row | None]:
    """``row`` deleted (None), and ``row`` less each of its attribute forms and dtype signatures in turn."""
    return [None, *(replace(row, attrs=row.attrs[:j] + row.attrs[j + 1:]) for j in range(len(row.attrs))),
            *(replace(row, dtypes=row.dtypes[:j] + row.dtypes[j + 1:]) for j in range(len(row.dtypes)))]


def test_deleting_a_row_or_an_entry_the_bundles_use_fails(fast_uses: dict[str, list[Use]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row, attribute form and dtype signature the tiny bundles rely on is removed in turn: each removal
    leaves a use without its place. (Entries only the slow bundles use are checked against their committed record
    by the document's test.)"""
    items = [u for us in fast_uses.values() for u in us]
    used, full = _used(fast_uses), cann_matrix.ROWS
    checked = 0
    for i, row in enumerate(full):
        for smaller in _without_each_entry(row):
            rows = full[:i] + ((smaller,) if smaller is not None else ()) + full[i + 1:]
            lost = _entries(full) - _entries(rows)
            if not lost & used:
                continue
            monkeypatch.setattr(cann_matrix, "ROWS", rows)
            assert cann_matrix.violations(items), f"removing {sorted(lost, key=str)} went unnoticed"
            checked += 1
    monkeypatch.setattr(cann_matrix, "ROWS", full)
    assert checked >= len(full) - 2  # every row but those only the slow bundles use (Constant INT64 is an entry)


def test_the_document_is_what_its_script_writes_from_the_matrix_and_the_record() -> None:
    """docs/ascend-conformance.md = render(compile/ascend/cann_matrix.py, docs/ascend-conformance.json, pyACL's table):
    editing the matrix or the record without regenerating the document fails here."""
    record = load_record()
    assert list(record) == [v.name for v in VARIANTS]
    assert DOC.read_text() == render(record, acl_rows())


def test_every_recorded_bundle_is_within_the_matrix() -> None:
    """Every shipped recipe's recorded ascend bundle, the 8B path (onnxsim skipped) included, has a row for all it
    holds: before compile/ascend/atc_forms.py rewrote Shape(start, end), the 8B bundles did not."""
    assert {name: cann_matrix.violations(u) for name, u in load_record().items() if cann_matrix.violations(u)} == {}


def test_every_row_attribute_form_and_dtype_is_used_by_a_recorded_bundle() -> None:
    """No entry of the matrix is dead: each row, attribute form and dtype signature is used by some bundle of the
    record, so removing any of them leaves a recorded use without its place."""
    assert _entries(cann_matrix.ROWS) - _used(load_record()) == set()


def test_the_record_of_the_tiny_bundles_is_current(fast_uses: dict[str, list[Use]]) -> None:
    """The committed record holds what the tiny bundles use today (regenerate with ``python -m
    omforge.compile.ascend.conformance_doc`` after a change to the passes)."""
    record = load_record()
    assert {name: record[name] for name in fast_uses} == fast_uses


def _graph(path: Path, nodes: list[onnx.NodeProto], dtype: int = TensorProto.FLOAT) -> Path:
    x = helper.make_tensor_value_info("x", dtype, ["T", 4])
    y = helper.make_tensor_value_info("y", dtype, None)
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(path))
    return path


def _atc(model: str) -> list[str]:
    return ["atc", f"--model={model}", "--framework=5", "--output=om/step", "--soc_version=Ascend910B3",
            "--input_format=ND", "--input_shape=x:-1,4", "--dynamic_dims=1;8", "--log=error"]


SHAPE_VALUE = helper.make_tensor("s", TensorProto.INT64, [2], [-1, 2])
OUTSIDE = {
    "Constant(value_ints)": ([helper.make_node("Constant", [], ["s"], value_ints=[-1, 2]),
                              helper.make_node("Reshape", ["x", "s"], ["y"])], TensorProto.FLOAT,
                             "Constant: attribute value_ints: INTS"),
    "unknown op": ([helper.make_node("MyFusedOp", ["x"], ["y"])], TensorProto.FLOAT, "MyFusedOp: no row"),
    "attribute form": ([helper.make_node("Softmax", ["x"], ["y"], axis=-1.0)], TensorProto.FLOAT,
                       "Softmax: attribute axis: FLOAT"),
    "dtype": ([helper.make_node("Constant", [], ["s"], value=SHAPE_VALUE),
               helper.make_node("Reshape", ["x", "s"], ["y"])], TensorProto.INT32, "Reshape: input dtypes (INT32"),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_the_fake_atc_refuses_what_the_matrix_lacks(case: str, tmp_path: Path) -> None:
    nodes, dtype, why = OUTSIDE[case]
    _graph(tmp_path / "m.onnx", nodes, dtype)
    with pytest.raises(fake_atc.FakeAtcError, match="has a row of the CANN matrix") as e:
        fake_atc.run(_atc("m.onnx"), tmp_path, twin=tmp_path / "m.onnx")
    assert why in str(e.value)


def test_the_same_graph_in_the_value_form_passes(tmp_path: Path) -> None:
    """The control of the first case: ``value`` instead of ``value_ints`` leaves nothing to refuse."""
    _graph(tmp_path / "m.onnx", [helper.make_node("Constant", [], ["s"], value=SHAPE_VALUE),
                                 helper.make_node("Reshape", ["x", "s"], ["y"])])
    assert cann_matrix.violations(uses(onnx.load(str(tmp_path / "m.onnx")))) == []
    assert fake_atc.run(_atc("m.onnx"), tmp_path, twin=tmp_path / "m.onnx").is_file()
