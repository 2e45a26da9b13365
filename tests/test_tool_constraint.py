"""``tool_choice: required`` and a named function constrain the output to the tools' schemas exactly (issue 24,
defect 11): every object schema of a tool's ``parameters`` is closed (``additionalProperties: false``) unless it
says otherwise, and so is the ``{name, parameters}`` wrapper. Before, the parameters stayed open: SmolLM2 asked
for the weather under ``required`` wrote ``"temperature"``, ``"windSpeed"``, … until ``max_tokens`` (no tool
call came back, ``finish_reason: length``), and under a named function added a ``"country"`` key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import llguidance
import pytest

from omforge.runtime.structured import StructuredOutput, compiled_grammar
from omforge.serve.protocol import _byte_tokenizer
from omforge.serve.tools import closed, constraint, functions
from server_process import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def accepts(schema: dict, text: str) -> bool:
    """Whether the grammar the engine compiles for ``schema`` admits exactly ``text`` (over a byte vocabulary)."""
    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, compiled_grammar(StructuredOutput("json", schema, "tool_choice")))
    tokens = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and not matcher.is_error() and matcher.is_accepting()


def test_closed_closes_every_object_unless_it_says_otherwise() -> None:
    schema = {"type": "object", "properties": {
        "place": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "maybe": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
        "extra": {"type": "object", "additionalProperties": {"type": "object", "properties": {"v": {}}}},
        "loose": {"type": "object", "additionalProperties": True},
        "ref": {"$ref": "#/$defs/Unit"}},
        "$defs": {"Unit": {"properties": {"name": {"type": "string"}}}}}
    before = copy.deepcopy(schema)
    out = closed(schema)
    assert schema == before  # a copy: the request's tools are not changed
    p = out["properties"]
    assert out["additionalProperties"] is False and p["place"]["additionalProperties"] is False
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["maybe"]["anyOf"][0]["additionalProperties"] is False and p["maybe"]["anyOf"][1] == {"type": "null"}
    assert p["extra"]["additionalProperties"]["additionalProperties"] is False  # the values' schema, closed
    assert p["loose"] == {"type": "object", "additionalProperties": True}  # it says so itself: kept
    assert out["$defs"]["Unit"]["additionalProperties"] is False and p["ref"] == {"$ref": "#/$defs/Unit"}


def test_closed_leaves_open_what_other_schemas_extend() -> None:
    """``additionalProperties`` sees only its own schema's properties: a schema composed with others that name
    properties stays open at that level (closed, it would refuse their keys), its children are closed."""
    composed = {"type": "object", "properties": {"a": {"type": "object"}},
                "allOf": [{"properties": {"b": {"type": "string"}}}]}
    out = closed(composed)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert out["properties"]["a"]["additionalProperties"] is False
    refined = closed({"type": "object", "properties": {"a": {}, "b": {}}, "anyOf": [{"required": ["a"]},
                                                                                     {"required": ["b"]}]})
    assert refined["additionalProperties"] is False and refined["anyOf"] == [{"required": ["a"]}, {"required": ["b"]}]
    assert accepts(refined, '{"b":1}') and not accepts(refined, '{"b":1,"c":2}')
    negated = {"not": {"type": "object", "properties": {"a": {}}}}
    assert closed(negated) == negated  # closing inside a negation would widen what passes


def test_the_constraint_is_the_tools_schemas_exactly() -> None:
    fns = functions([WEATHER, TIME])
    named = constraint("named", "get_weather", fns)
    assert named["additionalProperties"] is False
    assert accepts(named, '{"city":"Paris"}') and not accepts(named, '{"city":"Paris","country":"FR"}')
    required = constraint("required", None, fns)
    assert "maxItems" not in required
    calls = required["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert all(c["additionalProperties"] is False and c["required"] == ["name", "parameters"] for c in calls)
    assert all(c["properties"]["parameters"]["additionalProperties"] is False for c in calls)
    assert accepts(required, '[{"name":"get_weather","parameters":{"city":"Paris"}}]')
    assert accepts(required, '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"A"}}]')
    for text in ('[{"name":"get_weather","parameters":{"city":"Paris","windSpeed":"1.5"}}]',  # a key of its own
                 '[{"name":"get_weather","parameters":{"zone":"UTC"}}]',  # another tool's parameters
                 '[{"name":"get_weather","parameters":{"city":"Paris"},"why":"asked"}]',  # the wrapper is closed
                 '[{"name":"get_forecast","parameters":{}}]'):  # a name not among the tools
        assert not accepts(required, text), text
    single = constraint("required", None, fns, parallel=False)
    assert single["maxItems"] == 1
    assert not accepts(single, '[{"name":"get_time","parameters":{}},{"name":"get_time","parameters":{}}]')


# --- through the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64")
    yield srv.client()
    assert srv.stop() == 0, srv.log()


MAX_TOKENS = 200
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_smollm2_calls_the_tool_with_only_its_keys(client, tool_choice: str | dict) -> None:  # noqa: ANN001
    """Greedy SmolLM2 and a tool whose schema states no additionalProperties: one call comes back, its
    arguments are JSON with no key outside the schema, well within max_tokens. (Old code: required rambled
    extra keys to max_tokens, finish_reason length, no call; named added a "country" key.)"""
    r = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                       max_tokens=MAX_TOKENS, temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message.content)
    assert r.usage.completion_tokens < MAX_TOKENS // 4 and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args, dict)
    assert set(args) <= set(WEATHER["function"]["parameters"]["properties"]) and "city" in args, args
