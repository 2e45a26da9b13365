"""`omforge serve`: the OpenAI endpoints through the official `openai` client against a real server on 127.0.0.1,
checked against the offline engine on the same bundle (greedy outputs must be the same tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_process import ServerProcess

KEY = "sk-test-omforge"
PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "256", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # noqa: ANN201
    return server.client()


@pytest.fixture(scope="module")
def offline(smollm2_bundle: Path):  # noqa: ANN201
    from omforge import LLM

    return LLM(smollm2_bundle, num_kv_blocks=64)


def offline_greedy(offline, prompt, max_tokens: int) -> tuple[str, list[int]]:  # noqa: ANN001
    from omforge import SamplingParams

    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
    return out.text, out.token_ids


def chat_prompt_ids(offline, messages: list[dict]) -> list[int]:  # noqa: ANN001
    tok = offline.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_models_lists_the_bundle(client) -> None:  # noqa: ANN001
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_health_and_metrics_need_no_key(server: ServerProcess) -> None:
    assert server.get("/health") == (200, '{"status":"ok"}')
    status, text = server.get("/metrics")
    assert status == 200 and "omforge:num_requests_running" in text


def test_completion_is_the_offline_engines_greedy_output(client, offline) -> None:  # noqa: ANN001
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True},
                                  **GREEDY)
    text, ids = offline_greedy(offline, PROMPT, 24)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(offline.tokenizer.encode(PROMPT)), 24, len(offline.tokenizer.encode(PROMPT)) + 24)


def test_completion_stream_concatenates_to_the_whole_response(client) -> None:  # noqa: ANN001
    args = dict(model="smollm2-135m", prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert len(text_chunks) > 5  # streamed token by token, not in one piece
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    no_usage = list(client.completions.create(**args, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_chat_completion_uses_the_bundles_template(client, offline) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_completion_tokens=16, **GREEDY)
    ids = chat_prompt_ids(offline, messages)
    text, _ = offline_greedy(offline, ids, 16)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    assert text.startswith(msg.content) and msg.content  # greedy: same tokens (it may stop at EOS earlier)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_sends_role_then_deltas_then_usage(client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Count to five."}]
    args = dict(model="smollm2-135m", messages=messages, max_tokens=12, **GREEDY)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_content_parts_are_joined_like_a_string(client) -> None:  # noqa: ANN001
    a = client.chat.completions.create(messages=[{"role": "user", "content": "Hi there"}], model="smollm2-135m",
                                       max_tokens=6, **GREEDY)
    b = client.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
                                       model="smollm2-135m", max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_seed_makes_sampling_reproducible(client) -> None:  # noqa: ANN001
    args = dict(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    a = client.completions.create(**args, seed=1234).choices[0].text
    b = client.completions.create(**args, seed=1234).choices[0].text
    c = client.completions.create(**args, seed=4321).choices[0].text
    assert a == b
    assert a != c  # 16 tokens at temperature 1: two seeds agreeing would be a broken seed


def test_n_returns_n_choices(client) -> None:  # noqa: ANN001
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=5,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    stream = list(client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, n=2, temperature=1.0, seed=3, stream=True))
    assert {c.choices[0].index for c in stream if c.choices} == {0, 1}
    assert sum(1 for c in stream if c.choices and c.choices[0].finish_reason) == 2


def test_several_prompts_in_one_completion(client, offline) -> None:  # noqa: ANN001
    prompts = [PROMPT, "Paris is the capital of"]
    r = client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=6, extra_body={"ignore_eos": True},
                                  **GREEDY)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        offline_greedy(offline, p, 6)[0] for p in prompts]


def test_token_id_prompt_and_echo(client, offline) -> None:  # noqa: ANN001
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_ends_the_output_before_it(client) -> None:  # noqa: ANN001
    free = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    word = free.split()[2]
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, stop=[word], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(word)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=24, stop=word, stream=True, **GREEDY))
    assert streamed == r.choices[0].text


def test_logprobs_on_both_endpoints(client) -> None:  # noqa: ANN001
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the chosen token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    c = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)


def test_penalties_and_logit_bias_change_the_output(client, offline) -> None:  # noqa: ANN001
    plain = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    text, ids = offline_greedy(offline, PROMPT, 24)
    assert plain.choices[0].text == text
    banned = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=1, logprobs=0, **GREEDY,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != offline.tokenizer.decode(ids[:1])
    penalized = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, presence_penalty=2.0,
                                          frequency_penalty=2.0, user="tester", extra_body={"ignore_eos": True},
                                          **GREEDY)
    assert penalized.choices[0].text != plain.choices[0].text


def test_repeated_prompt_reports_cached_tokens(client) -> None:  # noqa: ANN001
    prompt = " ".join(f"item{i}" for i in range(120))  # > 2 blocks of 64 tokens
    first = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens > 128
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 64 == 0 and cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_assistant_turn_with_null_content_is_rendered_empty(client, offline) -> None:  # noqa: ANN001
    """OpenAI allows ``content: null`` on an assistant turn; it renders as the empty string."""
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_completion_tokens=4, **GREEDY)
    empty = [{**m, "content": m["content"] or ""} for m in messages]
    assert r.usage.prompt_tokens == len(chat_prompt_ids(offline, empty))


def test_tokenize_and_detokenize_as_vllm_serves_them(server: ServerProcess, client, offline) -> None:  # noqa: ANN001
    import json
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(server.url + path, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    tok = offline.tokenizer
    got = post("/tokenize", {"prompt": "The capital of France is"})
    assert got["tokens"] == tok.encode("The capital of France is") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = post("/tokenize", {"messages": messages})
    assert chat["tokens"] == chat_prompt_ids(offline, messages)
    assert post("/detokenize", {"tokens": got["tokens"]})["prompt"] == "The capital of France is"


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, offline) -> None:  # noqa: ANN001
    """What evaluation harnesses send (lm-eval's loglikelihood): the prompt back with a logprob per token (the
    first null), equal to the engine's own prompt logprobs, and no completion."""
    from omforge import SamplingParams

    text = "The capital of France is Paris"
    ids = offline.tokenizer.encode(text)
    want = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == offline.tokenizer.decode(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-5)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    stream = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=0, echo=True, logprobs=2,
                                       stream=True)
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    first = next(ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs)
    assert first.token_logprobs == lp.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_logprobs_with_a_completion_and_vllm_prompt_logprobs(client, offline) -> None:  # noqa: ANN001
    text = "Once upon a time"
    n_prompt = len(offline.tokenizer.encode(text))
    r = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=4, echo=True, logprobs=0,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None
    assert r.choices[0].text.startswith(text) and r.usage.completion_tokens == 4
    assert lp.text_offset[n_prompt] == len("".join(lp.tokens[:n_prompt]))

    v = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 1})
    pl = v.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == n_prompt and pl[0] is None
    for entry, logprob in zip(pl[1:], lp.token_logprobs[1:n_prompt]):
        mine = [d for d in entry.values() if d["logprob"] == pytest.approx(logprob, abs=1e-5)]
        assert mine and all({"logprob", "rank", "decoded_token"} <= set(d) for d in entry.values())
