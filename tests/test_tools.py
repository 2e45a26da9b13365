"""Tool calls (serve/tools.py): the three families' formats parsed, streaming held back from where a call may
start, and a round trip through the official openai client against a tiny Qwen2 model whose chat template
renders tools Hermes-style (named, required and — with the output forced into the format — auto, streamed
and not), then the tool's answer rendered back through the template. SmolLM2's template has no tool format:
auto is a 400, required still works (the output is constrained JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from helpers import compile_bundle, make_tiny_hf_dir, write_recipe
from omforge.serve.tools import (
    StreamSplitter,
    ToolError,
    choice_mode,
    constraint,
    detect_format,
    functions,
    parse,
)
from server_process import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools: <tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# --- the formats -------------------------------------------------------------------------------------------

def test_each_family_format_parses_into_calls() -> None:
    content, calls = parse("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, calls = parse("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                          '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"zone": "UTC"}
    content, calls = parse("mistral", 'ok [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]')
    assert content == "ok" and calls[0].name == "get_time"
    for fmt, text in (("hermes", "<tool_call>{not json}</tool_call>"), ("llama3_json", "{\"name\": 1}"),
                      ("mistral", "[TOOL_CALLS] nope"), ("llama3_json", "Plain answer.")):
        assert parse(fmt, text) == (text, [])  # not a well-formed call: it stays content


def test_streaming_holds_back_from_where_a_call_may_start() -> None:
    s = StreamSplitter("hermes")
    sent = [s.feed(piece) for piece in ("Let me ", "check. <tool", "_call>\n{\"name\": \"get_time\", ",
                                        "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>")]
    assert "".join(sent) == "Let me check. " and sent[1] == "check. "  # "<tool" waited for the rest
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = StreamSplitter("hermes")
    assert plain.feed("a < b") == "a < b" and plain.finish() == ("", [])
    llama = StreamSplitter("llama3_json")
    assert llama.feed("{\"name\"") == "" and llama.feed(": \"get_time\", \"parameters\": {}}") == ""
    assert [c.name for c in llama.finish()[1]] == ["get_time"]


def test_detect_choice_and_constraint() -> None:
    assert detect_format(HERMES_TEMPLATE) == "hermes" and detect_format("{{ messages }}") is None
    assert detect_format("[TOOL_CALLS]") == "mistral" and detect_format("<|python_tag|>") == "llama3_json"
    fns = functions([WEATHER, TIME])
    assert choice_mode(None, fns) == ("auto", None)
    assert choice_mode({"type": "function", "function": {"name": "get_time"}}, fns) == ("named", "get_time")
    assert constraint("named", "get_time", fns) == {**TIME["function"]["parameters"],
                                                     "x-guidance": {"whitespace_flexible": False}}
    required = constraint("required", None, fns)
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    for bad, param in (([{"type": "function"}], "tools[0]"), ([{"type": "retrieval", "function": {"name": "x"}}],
                                                                  "tools[0]")):
        with pytest.raises(ToolError) as e:
            functions(bad)
        assert e.value.param == param
    with pytest.raises(ToolError, match="not in tools"):
        choice_mode({"type": "function", "function": {"name": "nope"}}, fns)


# --- through the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("tools")
    hf = make_tiny_hf_dir(root / "hf", "qwen2")
    (hf / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    recipe = write_recipe(root / "recipe.yaml", {"name": "tiny-qwen-tools", "source": "hf", "path": "hf"},
                          compile={"max_seq_len": 512})
    bundle = compile_bundle(recipe, root / "bundle", root / "cache")
    srv = ServerProcess(bundle, "--num-kv-blocks", "64")
    yield srv, bundle
    assert srv.stop() == 0, srv.log()


MESSAGES = [{"role": "user", "content": "weather in oslo?"}]


def test_named_function_round_trip(qwen_server) -> None:  # noqa: ANN001
    srv, bundle = qwen_server
    client = srv.client()
    r = client.chat.completions.create(model="tiny-qwen-tools", messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=120, temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12

    # the tool's answer goes back; the template renders the call and the response into the next prompt
    follow = [*MESSAGES, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "rainy, 7 degrees"}]
    r2 = client.chat.completions.create(model="tiny-qwen-tools", messages=follow, tools=[WEATHER, TIME],
                                        max_tokens=8, temperature=0.0)
    assert r2.choices[0].finish_reason in ("stop", "length")
    from omforge import LLM

    tok = LLM(bundle).tokenizer
    conv = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "rainy, 7 degrees"}]
    text = tok.apply_chat_template(conv, tools=[WEATHER, TIME])
    assert "<tool_response>rainy, 7 degrees</tool_response>" in text and '"arguments": {"city"' in text
    assert r2.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_required_streams_delta_tool_calls(qwen_server) -> None:  # noqa: ANN001
    srv, _ = qwen_server
    stream = srv.client().chat.completions.create(model="tiny-qwen-tools", messages=MESSAGES, tools=[WEATHER, TIME],
                                                  tool_choice="required", max_tokens=200, temperature=0.0,
                                                  stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and all(tc.function.name in ("get_weather", "get_time") for tc in calls)
    for tc in calls:
        json.loads(tc.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_format(qwen_server, stream: bool) -> None:  # noqa: ANN001
    """A random tiny model will not call a tool by itself: its output is forced into the Hermes format with a
    grammar, and ``auto`` must find the call in the text (streamed: held back, then delta.tool_calls)."""
    srv, _ = qwen_server
    grammar = ('start: "Checking. <tool_call>\\n" %json{"x-guidance": {"whitespace_flexible": false}, '
               '"type": "object", "required": ["name", "arguments"], '
               '"properties": {"name": {"const": "get_time"}, "arguments": ' + json.dumps(
                   TIME["function"]["parameters"]) + '}} "\\n</tool_call>"')
    r = srv.client().chat.completions.create(model="tiny-qwen-tools", messages=MESSAGES, tools=[WEATHER, TIME],
                                             max_tokens=200, temperature=0.0, stream=stream,
                                             extra_body={"structured_outputs": {"grammar": grammar}})
    if stream:
        chunks = [c for c in r if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, \
            r.choices[0].finish_reason
    assert (content or "").strip() == "Checking.", (content, calls, finish)
    assert [c.function.name for c in calls] == ["get_time"] and finish == "tool_calls"
    assert set(json.loads(calls[0].function.arguments)) == {"zone"}


def test_a_template_without_tool_calls(smollm2_bundle: Path) -> None:
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64")
    try:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, tools=[WEATHER], max_tokens=4)
        assert e.value.body["param"] == "tools" and "--tool-call-parser" in e.value.body["message"]
        r = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, tools=[WEATHER],
                                           tool_choice="required", max_tokens=80, temperature=0.0)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, tools=[WEATHER], max_tokens=4,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
        assert e.value.body["param"] == "tool_choice"
    finally:
        assert srv.stop() == 0, srv.log()
