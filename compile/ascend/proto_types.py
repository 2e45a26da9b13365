"""What a GE op prototype's ``TensorType`` expression compiles to: the dtypes an input really accepts.

A prototype (``REG_OP(X).INPUT(x, TensorType…)`` in the ``op_graph/*_proto.h`` of CANN's ops repositories) is C++,
not a list to be read as text. ``TensorType({A, B, C})`` and ``TensorType{A, B, C}`` pass an initializer list: the
three types. ``TensorType{(A, B, C)}`` passes ONE value, the parenthesised comma expression, which C++ evaluates to
its last operand: the type C alone (hicann/ops-math c419332 ``math/sqrt/op_graph/sqrt_proto.h:35`` is
``TensorType{(DT_BF16, DT_FLOAT, …, DT_COMPLEX128)}``: complex128 only). Named sets (``TensorType::ALL()``,
``BasicType()``) are not resolved here: :func:`compiled_types` returns None for them.
"""

from __future__ import annotations

import re

_CALL = re.compile(r"TensorType\s*(?P<open>[({])(?P<body>.*)(?P<close>[)}])\s*$", re.S)
_DT = re.compile(r"DT_[A-Z0-9_]+")
ONNX_NAMES = {"DT_FLOAT": "FLOAT", "DT_FLOAT16": "FLOAT16", "DT_BF16": "BFLOAT16", "DT_BFLOAT16": "BFLOAT16",
              "DT_DOUBLE": "DOUBLE", "DT_INT8": "INT8", "DT_INT16": "INT16", "DT_INT32": "INT32", "DT_INT64": "INT64",
              "DT_UINT8": "UINT8", "DT_BOOL": "BOOL", "DT_COMPLEX64": "COMPLEX64", "DT_COMPLEX128": "COMPLEX128"}
"""GE ``DT_*`` → the ONNX dtype name the matrix rows use (the ones our graphs can hold)."""


def _split_top(text: str) -> list[str]:
    """``text`` split at its top-level commas (none inside (), {} or <>)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({<":
            depth += 1
        elif ch in ")}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _value(expr: str) -> list[str] | None:
    """The types one initializer element stands for: ``DT_X`` → [DT_X]; ``(a, b, c)`` → c's (the comma operator);
    ``{a, b}`` → a's and b's; anything else (a named set) → None."""
    expr = expr.strip()
    if expr.startswith("(") and expr.endswith(")"):
        return _value(_split_top(expr[1:-1])[-1])
    if expr.startswith("{") and expr.endswith("}"):
        out: list[str] = []
        for part in _split_top(expr[1:-1]):
            got = _value(part)
            if got is None:
                return None
            out += got
        return out
    return [expr] if _DT.fullmatch(expr) else None


def compiled_types(expr: str) -> tuple[str, ...] | None:
    """The ``DT_*`` types a ``TensorType…`` expression constructs, as C++ evaluates it (module docstring), in
    source order; None when it names a set this reader does not resolve. Raises ValueError for text that is no
    ``TensorType`` construction."""
    if re.match(r"\s*TensorType\s*::", expr):
        return None  # TensorType::ALL() and the other named sets
    m = _CALL.search(expr.strip())
    if m is None:
        raise ValueError(f"not a TensorType construction: {expr!r}")
    body = m["body"]
    if m["open"] == "(":  # TensorType(x): one argument, a DataType or an initializer list
        args = _split_top(body)
        if len(args) != 1:
            raise ValueError(f"TensorType(...) with {len(args)} arguments: {expr!r}")
        got = _value(args[0])
    else:  # TensorType{a, b, …}: list-initialization, every element one type (or a comma expression)
        got = _value("{" + body + "}")
    return None if got is None else tuple(dict.fromkeys(got))


def onnx_types(expr: str) -> tuple[str, ...] | None:
    """:func:`compiled_types` as the ONNX dtype names of :data:`ONNX_NAMES` (GE types without one left out)."""
    got = compiled_types(expr)
    return None if got is None else tuple(ONNX_NAMES[t] for t in got if t in ONNX_NAMES)


def text_types(expr: str) -> tuple[str, ...]:
    """Every ``DT_*`` the expression's text names, read as a list: the reading the matrix once used, wrong for a
    comma expression (kept so a test shows the difference)."""
    return tuple(dict.fromkeys(_DT.findall(expr)))
