"""The attribute forms CANN's ONNX parser reads, written into an ATC input: ``Constant`` as ``value``, ``Shape``
without ``start`` / ``end``.

ATC sends ``Constant`` straight to its constant parser, whose ``ParseConstFromInput`` reads only the attribute
named ``value`` (hicann/ge ``parser/parser/onnx/onnx_constant_parser.cc``; ``kAttrNameValue = "value"`` in
``parser/parser/onnx/onnx_util.h``). ``value_int``, ``value_ints``, ``value_float``, ``value_floats`` and
``value_string(s)`` become a Const holding an EMPTY tensor, which graph preparation then accepts as a "pytorch
empty tensor" (``compiler/graph/preprocess/graph_prepare.cc``, CheckTensorIsValid): the Reshape shape, Unsqueeze
axes or Range bound it feeds is silently empty (reference/ascend.md §5.2). ONNX defines each short form as the
tensor below (onnx/defs/generator/defs.cc, Constant-13+), so rewriting it to ``value`` changes no numerics.

``Shape``'s ``start`` / ``end`` (opset 15+) are read by nothing: CANN's Shape plugin parses no attribute
(hicann/ops-math ``math/shape/framework/shape_onnx_plugin.cpp:20-22``), so ATC would return the whole shape where
the graph asked for a slice of it. The export carries such nodes when onnxsim is skipped (> ``ONNXSIM_LIMIT``);
:func:`shape_slices_as_slice` writes each as ``Shape`` → ``Slice``, which ONNX defines it to equal
(onnx/defs/tensor/defs.cc, Shape-15: "the output is the slice [start, end) of the shape").

Works on the ``GraphProto`` read without external data, so a graph of any size (onnxsim skipped above 2 GiB of
weights) is rewritten without touching its weights file.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto, helper

SHORT_FORMS = ("value_int", "value_ints", "value_float", "value_floats", "value_string", "value_strings")
"""The Constant attributes ONNX allows besides ``value`` and ``sparse_value``: CANN reads none of them."""


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node`` holds in its attributes (If / Loop / Scan bodies)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == AttributeProto.GRAPH else a.graphs)]


def _tensor(attr: AttributeProto) -> TensorProto:
    """The tensor ONNX defines for a Constant's short-form attribute (a scalar for the singular forms)."""
    if attr.name == "value_int":
        return helper.make_tensor("", TensorProto.INT64, [], [attr.i])
    if attr.name == "value_ints":
        return helper.make_tensor("", TensorProto.INT64, [len(attr.ints)], list(attr.ints))
    if attr.name == "value_float":
        return helper.make_tensor("", TensorProto.FLOAT, [], [attr.f])
    if attr.name == "value_floats":
        return helper.make_tensor("", TensorProto.FLOAT, [len(attr.floats)], list(attr.floats))
    if attr.name == "value_string":
        return helper.make_tensor("", TensorProto.STRING, [], [attr.s])
    if attr.name == "value_strings":
        return helper.make_tensor("", TensorProto.STRING, [len(attr.strings)], list(attr.strings))
    raise ValueError(f"a Constant's {attr.name!r} attribute has no value form that CANN's ONNX parser reads "
                     "(it reads only 'value'; hicann/ge onnx_constant_parser.cc)")


def constants_as_value(graph: onnx.GraphProto) -> int:
    """Rewrite, in place, every default-domain ``Constant`` of ``graph`` and its subgraphs to carry its tensor as
    ``value``; returns how many were rewritten. Raises ``ValueError`` on ``sparse_value`` (nothing we emit)."""
    count = 0
    for node in graph.node:
        for sub in _subgraphs(node):
                count += constants_as_value(sub)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        if [a.name for a in node.attribute] == ["value"]:
            continue
        if len(node.attribute) != 1:
            raise ValueError(f"Constant {node.name!r} has attributes {[a.name for a in node.attribute]}; ONNX "
                             "allows exactly one")
        tensor = _tensor(node.attribute[0])
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", tensor))
        count += 1
    return count


def shape_slices_as_slice(graph: onnx.GraphProto) -> int:
    """Rewrite, in place, every default-domain ``Shape(x; start, end)`` of ``graph`` (subgraphs included) as
    ``Slice(Shape(x), [start], [end], [0])`` with ``value`` Constants; returns how many were rewritten."""
    count, nodes = 0, []
    for node in graph.node:
        for sub in _subgraphs(node):
                count += shape_slices_as_slice(sub)
        bounds = {a.name: a.i for a in node.attribute if a.name in ("start", "end")}
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or not bounds:
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        full = f"{base}_full"
        const = {k: f"{base}_{k}" for k in ("starts", "ends", "axes")}
        values = {"starts": bounds.get("start", 0), "ends": bounds.get("end", 2**63 - 1), "axes": 0}
        nodes.append(helper.make_node("Shape", [node.input[0]], [full], name=f"{base}_shape"))
        nodes += [helper.make_node("Constant", [], [const[k]], name=const[k],
                                   value=helper.make_tensor("", TensorProto.INT64, [1], [values[k]]))
                  for k in ("starts", "ends", "axes")]
        nodes.append(helper.make_node("Slice", [full, const["starts"], const["ends"], const["axes"]],
                                      list(node.output), name=base))
        count += 1
    if count:
        kept = [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes]  # own copies before the clear
        del graph.node[:]
        graph.node.extend(kept)
    return count


def short_form_constants(graph: onnx.GraphProto) -> list[str]:
    """Names of the default-domain Constants (subgraphs included) with any attribute but ``value``."""
    found = []
    for node in graph.node:
        for sub in _subgraphs(node):
                found += short_form_constants(sub)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") \
                and [a.name for a in node.attribute] != ["value"]:
            found.append(f"{node.name or node.output[0]} ({', '.join(a.name for a in node.attribute)})")
    return found


def rewrite_file(path: Path) -> int:
    """:func:`shape_slices_as_slice` then :func:`constants_as_value` over the model file ``path`` (its external
    data untouched); returns the nodes rewritten."""
    model = onnx.load(str(path), load_external_data=False)
    count = shape_slices_as_slice(model.graph) + constants_as_value(model.graph)
    if count:
        onnx.save(model, str(path))
    return count
