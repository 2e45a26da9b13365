"""Tool calls (OpenAI ``tools`` / ``tool_choice``): which format a model writes calls in, the constraint for
``required`` / a named function, and the parsing of a completion into ``content`` + ``tool_calls``.

Formats (as the families' chat templates and vLLM's parsers write them):

  hermes       Qwen2.5 / Hermes: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` (one per call)
  llama3_json  Llama 3.x: the output is a JSON object ``{"name": …, "parameters": {…}}`` (optionally after
               ``<|python_tag|>``; several separated by ``;``)
  mistral      Mistral: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``

``auto`` needs the model's format (detected from its chat template, or named by ``--tool-call-parser``); a
template with none is refused with a 400. ``required`` and a named function do not depend on the format: as vLLM
does, the output is constrained to JSON — an array of ``{name, parameters}`` for ``required``, the function's
``parameters`` object for a named one — and read back as calls. The constraint is the tools' schemas exactly:
every object in them is closed (``additionalProperties: false``) unless it says otherwise (:func:`closed`), or a
model adds keys of its own until ``max_tokens`` and no call comes back.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")
_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice``; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template renders (None: it renders no tool calls we know)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return None


def functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``name → function`` of OpenAI ``tools``; raises :class:`ToolError` naming what is malformed."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        out[fn["name"]] = {**fn, "parameters": params}
    return out


def choice_mode(tool_choice: Any, fns: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    """(mode, function name): mode ``none``, ``auto``, ``required`` or ``named``."""
    if not fns:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return "none", None
    if tool_choice in (None, "auto"):
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in fns:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return "named", name
    raise ToolError("tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice")


COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # llguidance: no free whitespace between JSON tokens


def constraint(mode: str, name: str | None, fns: dict[str, dict[str, Any]],
               parallel: bool | None = None) -> dict[str, Any] | None:
    """The JSON schema the output must match for ``required`` / ``named`` (None otherwise): the tools'
    ``parameters`` closed (:func:`closed`), and for ``required`` an array of closed ``{name, parameters}``
    objects, one branch per tool with its name a ``const`` (so each name comes with its own parameters), at most
    one call when ``parallel`` (``parallel_tool_calls``) is false. Compact JSON, so a model cannot spend its
    tokens on whitespace inside a call."""
    if mode == "named":
        return {**closed(fns[name]["parameters"]), **COMPACT}  # type: ignore[index]
    if mode == "required":
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": n}, "parameters": _hoisted(closed(f["parameters"]), i, defs)}}
                 for i, (n, f) in enumerate(fns.items())]
        most = {"maxItems": 1} if parallel is False else {}
        shared = {"$defs": defs} if defs else {}
        return {"type": "array", "minItems": 1, **most, "items": {"anyOf": calls}, **shared, **COMPACT}
    return None


_DEF_KEYS = ("$defs", "definitions")


def _hoisted(params: Any, index: int, defs: dict[str, Any]) -> Any:
    """Tool ``index``'s parameters for the ``required`` wrapper: its local ``$defs`` / ``definitions`` moved to the
    wrapper's ``$defs`` as ``t{index}.NAME`` and every local ``$ref`` (``#``, ``#/$defs/NAME/…``, any other
    ``#/…`` pointer) rewritten to point there, so a pydantic-made schema's references still resolve once the
    parameters sit inside the array of calls (JSON pointers are relative to the document's root)."""
    if not isinstance(params, dict):
        return params
    prefix = f"t{index}."
    root = f"{prefix}$root"
    used_root = False

    def ref(target: str) -> str:
        nonlocal used_root
        if not target.startswith("#"):
            return target  # a remote reference: left to the grammar compiler, which refuses it by name
        parts = target[1:].lstrip("/").split("/") if target not in ("#", "#/") else []
        if len(parts) >= 2 and parts[0] in _DEF_KEYS:
            return "/".join(["#", "$defs", prefix + parts[1], *parts[2:]])
        used_root = True
        return "/".join(["#", "$defs", root, *parts])

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else walk(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    body = {k: v for k, v in params.items() if k not in _DEF_KEYS}
    for key in _DEF_KEYS:
        if isinstance(params.get(key), dict):
            defs.update({prefix + name: walk(sub) for name, sub in params[key].items()})
    out = walk(body)
    if used_root:
        defs[root] = out  # the whole parameters schema, for a pointer into it (``#``, ``#/properties/…``)
    return out


_ONE = ("items", "additionalItems", "contains", "propertyNames", "additionalProperties", "unevaluatedItems",
        "unevaluatedProperties")  # one subschema (items / additionalProperties: or a boolean)
_LIST = ("prefixItems", "items")  # a list of subschemas (items: in drafts before 2020-12)
_MAP = ("properties", "patternProperties", "$defs", "definitions")  # name → subschema
_ALTERNATIVES = ("anyOf", "oneOf")  # one branch applies to the value, beside the schema's own keywords
_REFINING = ("allOf", "then", "else", "dependentSchemas")  # apply to the value together with the schema
_NAMES = ("properties", "patternProperties", "$ref")  # a schema that may admit named properties
# "not" and "if" are kept as they are: closing inside a negation or a condition widens what passes


def closed(schema: Any, refines: bool = False) -> Any:
    """``schema`` (a copy) with every object schema closed — ``additionalProperties: false`` where it states
    neither ``additionalProperties`` nor ``unevaluatedProperties`` — so a model can write no key the schema does
    not name. An object schema declares ``type: object`` (or ``properties`` without a type). A schema is left
    open at its own level (its children are still closed) where closing it would refuse keys that another
    schema applied to the same value names (JSON Schema's ``additionalProperties`` sees only its own schema's
    ``properties``): an ``allOf`` / ``then`` / ``else`` / ``dependentSchemas`` member, an ``anyOf`` / ``oneOf``
    branch beside a schema that names properties itself, and a schema whose members name some."""
    if not isinstance(schema, dict):
        return schema
    own = any(k in schema for k in _NAMES)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {k: closed(v) for k, v in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [closed(v) for v in value]
        elif key in _ONE:
            out[key] = closed(value)
        elif key in _ALTERNATIVES and isinstance(value, list):
            beside = own or any(_names(m) for m in _members(schema, _REFINING))
            out[key] = [closed(v, beside) for v in value]
        elif key == "dependentSchemas" and isinstance(value, dict):
            out[key] = {k: closed(v, True) for k, v in value.items()}
        elif key in _REFINING:
            out[key] = [closed(v, True) for v in value] if isinstance(value, list) else closed(value, True)
        else:
            out[key] = value
    stated = {"additionalProperties", "unevaluatedProperties"} & set(schema)
    if _is_object(schema) and not refines and not stated \
            and not any(_names(m) for m in _members(schema, _REFINING + _ALTERNATIVES)):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) \
        or (kind is None and "properties" in schema)


def _members(schema: dict[str, Any], keys: tuple[str, ...]) -> list[Any]:
    """The subschemas under ``keys`` of ``schema`` (lists, a single schema, or dependentSchemas' mapping)."""
    out: list[Any] = []
    for key in keys:
        value = schema.get(key)
        out.extend(value if isinstance(value, list) else value.values() if key == "dependentSchemas"
                   and isinstance(value, dict) else [value] if value is not None else [])
    return out


def _names(schema: Any) -> bool:
    """Whether ``schema`` (or a schema it composes) may admit named properties."""
    return isinstance(schema, dict) and (any(k in schema for k in _NAMES)
                                         or any(_names(m) for m in _members(schema, _REFINING + _ALTERNATIVES)))


def parse_constrained(mode: str, name: str | None, text: str) -> list[ToolCall]:
    """The calls of an output made under :func:`constraint` (the grammar guarantees the shape)."""
    if mode == "named":
        return [ToolCall(name or "", json.dumps(json.loads(text)))]
    return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse(fmt: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a completion in format ``fmt``; text that is not a well-formed call stays content."""
    if fmt == "hermes":
        calls, content = [], text
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(m.group(0), "", 1)
        return (content.strip() if calls else content), calls
    if fmt == "mistral":
        head, marker, tail = text.partition(_START["mistral"])
        if not marker:
            return text, []
        try:
            items = json.loads(tail.strip())
        except json.JSONDecodeError:
            return text, []
        calls = [c for c in (_call(i, "arguments") for i in (items if isinstance(items, list) else [items])) if c]
        return (head.strip(), calls) if calls else (text, [])
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return "", calls
    raise ValueError(f"unknown tool-call format {fmt!r} ({', '.join(FORMATS)})")


class StreamSplitter:
    """Streaming ``auto``: text before a possible call goes out as content at once; from the point a call may
    start (the format's marker, or for llama3_json an output that begins with ``{`` / ``<|python_tag|>``) it is
    held back and parsed when the choice ends."""

    def __init__(self, fmt: str):
        self.fmt, self.text, self.sent = fmt, "", 0

    def feed(self, new_text: str) -> str:
        """Content that can be sent now."""
        self.text += new_text
        hold = self._hold_from()
        out = self.text[self.sent:hold]
        self.sent = max(self.sent, hold)
        return out

    def _hold_from(self) -> int:
        if self.fmt == "llama3_json":
            stripped = self.text.lstrip()
            if not stripped or stripped.startswith(("{", "<")):
                return 0
            return len(self.text)
        marker = _START[self.fmt]
        at = self.text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(self.text)), 0, -1):  # a marker may be arriving in pieces
            if self.text.endswith(marker[:k]):
                return len(self.text) - k
        return len(self.text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the choice has ended."""
        content, calls = parse(self.fmt, self.text)
        if calls:
            return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls
        return self.text[self.sent:], []


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output becomes tool calls: ``mode`` auto / required / named, the function
    ``name`` for named, the model's ``fmt`` for auto."""

    mode: str
    name: str | None
    fmt: str | None

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished choice; an output cut short (max_tokens) stays content."""
        if self.mode in ("required", "named"):
            try:
                return "", parse_constrained(self.mode, self.name, text)
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
        return parse(self.fmt or "", text)

    def streamer(self) -> StreamSplitter | None:
        """auto: the content that can go out before a call may start; required / named hold everything."""
        return StreamSplitter(self.fmt) if self.mode == "auto" and self.fmt else None
