"""Reasoning output (issue 47 item 2): ``--reasoning-parser qwen3|deepseek_r1`` puts a model's thinking in
``reasoning_content`` and its answer in ``content``, streamed and not; ``thinking_token_budget`` forces ``</think>``
after N reasoning tokens, counted in ``usage.completion_tokens_details.reasoning_tokens``; stop strings, structured
output and tool calls apply to the answer alone; ``chat_template_kwargs: {"enable_thinking": false}`` leaves no
reasoning.

The model: random weights of a tiny Llama whose tokenizer is SmolLM2's with ``<think>`` and ``</think>`` added as
single tokens (non-special, as Qwen3's are), under a Qwen3-style chat template whose generation prompt opens the
thinking (``<think>\\n``, as Qwen3.5's does) or, with ``enable_thinking: false``, closes it at once. Random weights
write arbitrary text, so every expectation is the same model's greedy tokens computed in-process: with a budget of
N, the reasoning is the first N greedy tokens after the prompt, and the answer the greedy continuation of the prompt,
those N tokens and ``</think>``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from helpers import compile_bundle, write_recipe
from omforge import LLM, SamplingParams
from omforge.contract.manifest import TokenizerMeta
from omforge.runtime.engine_config import EngineConfigError
from omforge.runtime.reasoning import (
    ANSWER,
    MARKER,
    REASONING,
    Phase,
    ReasoningError,
    ReasoningParser,
    ReasoningSpec,
    ReasoningState,
    steer,
)
from omforge.runtime.tokenizer import TextTokenizer
from server_process import ServerProcess

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
N = 6  # the thinking budget of most requests
M = 12  # answer tokens asked for after the budget's N and </think>
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def think_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reasoning model's bundle; ``tok/base.json`` beside it is SmolLM2's tokenizer without the markers."""
    from tokenizers import AddedToken, Tokenizer

    from omforge.export.tokenizer_files import _convert_gguf_tokenizer
    from omforge.recipe import load_recipe

    root = tmp_path_factory.mktemp("think")
    tok_dir = root / "tok"
    tok_dir.mkdir()
    gguf = load_recipe(Path(__file__).parent.parent / "models" / "smollm2-135m.yaml").weights_path()
    _convert_gguf_tokenizer(gguf, tok_dir / "base.json")
    tok = Tokenizer.from_file(str(tok_dir / "base.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    recipe = write_recipe(root / "recipe.yaml", {
        "name": "tiny-think", "source": "random", "seed": 0, "tokenizer": str(tok_dir / "tokenizer.json"),
        "config": {"family": "llama", "vocab_size": tok.get_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "tie_word_embeddings": False, "eos_token_ids": [tok.token_to_id("<|im_end|>")]}},
        compile={"max_seq_len": 256})
    return compile_bundle(recipe, root / "bundle", root / "cache")


@pytest.fixture(scope="module")
def llm(think_bundle: Path):  # noqa: ANN201 - the model in-process, no reasoning parser: the expectations
    return LLM(think_bundle, num_kv_blocks=64)


@pytest.fixture(scope="module")
def server(think_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(think_bundle, "--reasoning-parser", "qwen3", "--num-kv-blocks", "64")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def prompt(llm: LLM, **template: object) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES, **template), add_special_tokens=False)


def greedy(llm: LLM, ids: list[int], n: int) -> list[int]:
    return llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0].token_ids


@pytest.fixture(scope="module")
def expected(llm: LLM) -> dict:
    """The thinking (N greedy tokens) and the answer (M greedy tokens after them and </think>), as ids and text."""
    ids = prompt(llm)
    end = llm.tokenizer.token_id("</think>")
    thought = greedy(llm, ids, N)
    answer = greedy(llm, ids + thought + [end], M)
    decode = llm.tokenizer.decode
    assert end not in thought and len(answer) == M  # the model's own: no early </think>, no EOS in the answer
    return {"ids": ids, "thought": thought, "answer": answer, "reasoning": decode(thought), "content": decode(answer),
            "raw": decode(thought + [end] + answer)}


def chat(client: openai.OpenAI, **kwargs: object):  # noqa: ANN201
    extra = kwargs.pop("extra_body", {})
    budget = kwargs.pop("budget", N)
    return client.chat.completions.create(model="tiny-think", messages=MESSAGES, temperature=0,
                                          extra_body={"thinking_token_budget": budget, **extra}, **kwargs)


def streamed(client: openai.OpenAI, **kwargs: object) -> tuple[list[tuple[str, str]], str | None, object]:
    """(the (field, text) deltas in order, the finish reason, the usage) of a streamed chat."""
    deltas, finish, usage = [], None, None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            thought = getattr(choice.delta, "reasoning_content", None)
            if thought:
                deltas.append(("reasoning", thought))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
    return deltas, finish, usage


# --- the parsers on token streams -----------------------------------------------------------------------------

S, E, A, B, C = 100, 101, 7, 8, 9  # the markers and three other tokens


@pytest.mark.parametrize(("phase", "tokens", "channels", "reasoning"), [
    (Phase.THINKING, [A, B, E, C, S, A], [REASONING, REASONING, MARKER, ANSWER, ANSWER, ANSWER], 2),
    (Phase.UNDECIDED, [S, A, E, B], [MARKER, REASONING, MARKER, ANSWER], 1),
    (Phase.UNDECIDED, [A, S, B, E], [ANSWER] * 4, 0),  # qwen3: an output that opens no thinking is all answer
    (Phase.UNDECIDED, [E, A], [ANSWER, ANSWER], 0),  # a close without an open is text
    (Phase.ANSWER, [S, A, E], [ANSWER] * 3, 0),  # enable_thinking false: a later <think> is text too
    (Phase.THINKING, [A, S, B], [REASONING] * 3, 3),  # deepseek_r1 without </think>: all reasoning
])
def test_channels_of_a_token_stream(phase: Phase, tokens: list[int], channels: list[str], reasoning: int) -> None:
    state = ReasoningState(ReasoningSpec(S, E, phase))
    assert [state.observe(t) for t in tokens] == channels
    assert state.num_tokens == reasoning


def test_a_spent_budget_allows_only_the_end_marker_and_an_undecided_grammar_the_start() -> None:
    import numpy as np

    spent = ReasoningState(ReasoningSpec(S, E, Phase.THINKING, budget=1))
    assert not spent.must_end and spent.observe(A) == REASONING and spent.must_end
    undecided = ReasoningState(ReasoningSpec(S, E, Phase.UNDECIDED, budget=1))
    grammar = (np.array([1]), np.zeros((1, 128), np.uint8))
    grammar[1][0, A] = 1
    rows, mask = steer([spent, undecided, None], grammar, 128)
    assert rows.tolist() == [1, 0]
    assert np.flatnonzero(mask[0]).tolist() == [A, S] and np.flatnonzero(mask[1]).tolist() == [E]
    assert steer([None, ReasoningState(ReasoningSpec(S, E, Phase.THINKING))], None, 128) is None


@pytest.mark.parametrize(("parser", "template", "phase"), [
    ("qwen3", {}, Phase.THINKING), ("deepseek_r1", {}, Phase.THINKING),  # the template's <think>\n
    ("qwen3", {"enable_thinking": False}, Phase.ANSWER), ("deepseek_r1", {"enable_thinking": False}, Phase.ANSWER),
    ("qwen3", {"add_generation_prompt": False}, Phase.UNDECIDED),  # nothing at the end: the parser's default
    ("deepseek_r1", {"add_generation_prompt": False}, Phase.THINKING),
])
def test_the_prompts_end_says_where_the_output_starts(llm: LLM, parser: str, template: dict, phase: Phase) -> None:
    reasoning = ReasoningParser(parser, llm.tokenizer, default_budget=5)
    spec = reasoning.spec(prompt(llm, **template))
    assert spec.phase is phase and spec.budget == 5
    assert reasoning.spec(prompt(llm, **template), 0).budget == 0
    # a marker of an earlier turn is not the template's: the parser's default
    earlier = prompt(llm, enable_thinking=False) + llm.tokenizer.encode("4<|im_end|>\n", add_special_tokens=False)
    assert reasoning.spec(earlier).phase is (Phase.UNDECIDED if parser == "qwen3" else Phase.THINKING)


def test_a_tokenizer_without_the_markers_is_refused_in_one_line(think_bundle: Path) -> None:
    base = TextTokenizer(think_bundle.parent / "tok" / "base.json", TokenizerMeta())
    with pytest.raises(ReasoningError, match="reasoning_parser qwen3: the tokenizer has no single token '<think>'"):
        ReasoningParser("qwen3", base)
    with pytest.raises(EngineConfigError, match="'o1' is not one of qwen3, deepseek_r1"):
        LLM(think_bundle, num_kv_blocks=64, reasoning_parser="o1")


def test_deepseek_r1_starts_in_the_thinking_and_the_default_budget_ends_it(llm: LLM, think_bundle: Path) -> None:
    """No marker at the prompt's end: deepseek_r1 reads the output as thinking; the engine's ``reasoning_budget``
    is the budget of a request that gives none."""
    ids = prompt(llm, add_generation_prompt=False)
    thought = greedy(llm, ids, 4)
    with LLM(think_bundle, num_kv_blocks=64, reasoning_parser="deepseek_r1", reasoning_budget=4) as r1:
        spec = r1.engine.reasoning.spec(ids)
        out = r1.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, reasoning=spec), use_tqdm=False)[0]
    assert out.token_ids[:5] == thought + [llm.tokenizer.token_id("</think>")]
    assert out.reasoning_text == llm.tokenizer.decode(thought) and out.num_reasoning_tokens == 4
    assert out.text == llm.tokenizer.decode(out.token_ids[5:])


# --- the server, through the openai client -------------------------------------------------------------------


def test_the_budget_ends_the_thinking_and_the_answer_follows(client: openai.OpenAI, expected: dict) -> None:
    r = chat(client, max_tokens=N + 1 + M)
    message = r.choices[0].message
    assert message.reasoning_content == expected["reasoning"]
    assert message.content == expected["content"]
    assert expected["raw"] == message.reasoning_content + "</think>" + message.content  # the markers are no text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N + 1 + M  # max_tokens counts the thinking and the marker too
    assert r.usage.completion_tokens_details.reasoning_tokens == N


def test_streamed_thinking_comes_first_then_the_answer(client: openai.OpenAI, expected: dict) -> None:
    deltas, finish, usage = streamed(client, max_tokens=N + 1 + M)
    fields = [f for f, _ in deltas]
    assert fields == sorted(fields, key=["reasoning", "content"].index)  # every reasoning delta before any content
    assert "".join(t for f, t in deltas if f == "reasoning") == expected["reasoning"]
    assert "".join(t for f, t in deltas if f == "content") == expected["content"]
    assert not any("think>" in t for _, t in deltas)
    assert finish == "length" and usage.completion_tokens_details.reasoning_tokens == N


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_inside_the_thinking_leaves_no_answer(client: openai.OpenAI, expected: dict, llm: LLM,
                                                        stream: bool) -> None:
    if stream:
        deltas, finish, usage = streamed(client, max_tokens=3)
        reasoning = "".join(t for f, t in deltas if f == "reasoning")
        content = "".join(t for f, t in deltas if f == "content") or None
    else:
        r = chat(client, max_tokens=3)
        reasoning, content, finish, usage = (r.choices[0].message.reasoning_content, r.choices[0].message.content,
                                             r.choices[0].finish_reason, r.usage)
    assert reasoning == llm.tokenizer.decode(expected["thought"][:3])
    assert content is None and finish == "length"
    assert usage.completion_tokens == 3 and usage.completion_tokens_details.reasoning_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_apply_to_the_answer_alone(client: openai.OpenAI, expected: dict, llm: LLM,
                                                stream: bool) -> None:
    in_thought = llm.tokenizer.decode(expected["thought"][2:4])
    in_answer = llm.tokenizer.decode(expected["answer"][3:5])
    assert in_thought in expected["reasoning"] and in_thought not in expected["content"]
    assert in_answer not in expected["reasoning"] and in_answer in expected["content"]
    stop = [in_thought, in_answer]
    if stream:
        deltas, finish, _ = streamed(client, max_tokens=N + 1 + M, stop=stop)
        reasoning = "".join(t for f, t in deltas if f == "reasoning")
        content = "".join(t for f, t in deltas if f == "content")
    else:
        r = chat(client, max_tokens=N + 1 + M, stop=stop)
        reasoning, content, finish = r.choices[0].message.reasoning_content, r.choices[0].message.content, \
            r.choices[0].finish_reason
    assert reasoning == expected["reasoning"]  # its stop string did not end the thinking
    assert content == expected["content"][:expected["content"].index(in_answer)] and finish == "stop"


def test_enable_thinking_false_leaves_no_reasoning(client: openai.OpenAI, llm: LLM) -> None:
    ids = prompt(llm, enable_thinking=False)
    assert llm.tokenizer.decode(ids).endswith("<think>\n\n</think>\n\n")
    r = chat(client, max_tokens=M, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    assert message.reasoning_content is None and message.content == llm.tokenizer.decode(greedy(llm, ids, M))
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_structured_output_starts_after_the_thinking(client: openai.OpenAI, expected: dict) -> None:
    """The thinking is the model's free greedy text; the answer, and only it, matches the regex."""
    assert not re.fullmatch(r"[0-9]+", expected["reasoning"].strip())  # a grammar from the start would show
    r = chat(client, max_tokens=40, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    message = r.choices[0].message
    assert message.reasoning_content == expected["reasoning"]
    assert re.fullmatch("[0-9]{3}", message.content) and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == N + 1 + 3 + 1  # the thinking, </think>, three digits, EOS


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_is_read_from_the_answer(client: openai.OpenAI, expected: dict, stream: bool) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    ask = {"max_tokens": 60, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        reasoning, calls, finish = "", [], None
        for chunk in chat(client, stream=True, **ask):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
    else:
        r = chat(client, **ask)
        reasoning, calls, finish = (r.choices[0].message.reasoning_content, r.choices[0].message.tool_calls,
                                    r.choices[0].finish_reason)
    assert reasoning == expected["reasoning"]
    assert [c.function.name for c in calls] == ["get_weather"] and finish == "tool_calls"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")


def test_a_negative_budget_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, budget=-1)
    assert exc.value.body["param"] == "thinking_token_budget"


def test_without_a_parser_the_thinking_stays_in_the_content(think_bundle: Path, llm: LLM) -> None:
    """The same request to a server without ``--reasoning-parser``: no reasoning_content, the markers are text
    of the content, and a thinking budget is a 400 (nothing could end the thinking)."""
    srv = ServerProcess(think_bundle, "--num-kv-blocks", "64")
    try:
        plain = srv.client()
        r = plain.chat.completions.create(model="tiny-think", messages=MESSAGES, temperature=0, max_tokens=N + 1 + M)
        message = r.choices[0].message
        assert getattr(message, "reasoning_content", None) is None
        assert message.content == llm.tokenizer.decode(greedy(llm, prompt(llm), N + 1 + M))
        assert r.usage.completion_tokens_details is None
        with pytest.raises(openai.BadRequestError) as exc:
            chat(plain, budget=4)
        assert exc.value.body["param"] == "thinking_token_budget"
        assert "needs a reasoning parser" in exc.value.body["message"]
    finally:
        assert srv.stop() == 0, srv.log()
