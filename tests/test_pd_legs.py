"""PD legs that cannot mix up KV (issue 64 items 1-3 and 7's expiry): a decode leg reads only its own prompt's
blocks, a prefill replica holds only a leg whose one hand-off is answered, LoRA and prompt logprobs are refused on
the legs that cannot serve them, and the hand-off carries the lease's end, which the decode side goes by.

Three levels, each where the defect lives: the schedulers of a prefill and a decode replica over the FAKE NIXL
fabric (tests/fake_nixl.py; a read of the wrong blocks shows up when the fake step reads every scheduled context
back), the engine's intake with a real PD connector, and a prefill and a decode replica of the SmolLM2 bundle over
real NIXL through the official openai client (skipped without NIXL). Each test failed at b95eeba."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_nixl import Fabric, FakeAgent
from test_scheduler import FakeStep, make, step

from omforge.contract import PagedLayout
from omforge.contract.manifest import ModelConfig
from omforge.runtime.input_processor import InputProcessor, IntakeLimits
from omforge.runtime.kv_transfer.config import parse_kv_transfer_config
from omforge.runtime.kv_transfer.connector import PDConnector
from omforge.runtime.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from omforge.runtime.request import Request
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError
from omforge.runtime.scheduler import Scheduler

BS = 4
LEASE_S = 30.0


def replica(fabric: Fabric, role: str, engine_id: str, lease_s: float = LEASE_S) -> tuple[Scheduler, FakeStep,
                                                                                          PDConnector]:
    s, fake = make(32, BS, caching=True, events=True)
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                                       "kv_connector_extra_config": {"kv_lease_duration": lease_s}})
    layout = PagedLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=BS)
    pd = PDConnector(config, FakeAgent(fabric, engine_id, layout, [fake.pool]), BS, "127.0.0.1", 1,
                     clock=fabric.clock)
    s.connectors = [pd]
    return s, fake, pd


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7 + i * 5) % 40 for i in range(n)]


def group(rid: str, tokens: list[int], params: SamplingParams, kv: KVTransferParams | None,
          arrival: float = 0.0) -> Request:
    """A request of ``params.n`` sequences as the engine adds it: the leader, its followers in ``followers``."""
    leader = Request(rid, tokens, params, kv_transfer=kv, arrival_time=arrival)
    for i in range(1, params.n):
        follower = Request(f"{rid}-{i}", tokens, params, kv_transfer=kv, arrival_time=arrival, parent=leader,
                           index=i)
        leader.followers.append(follower)
    return leader


def run(s: Scheduler, fake: FakeStep, *reqs: Request, steps: int = 60) -> None:
    """Add ``reqs`` and step until none is in a queue (held blocks may remain), within a bound."""
    for req in reqs:
        s.add(req)
    for _ in range(steps):
        if not (s.waiting or s.running or s.loading):
            return
        step(s, fake)
        s.kv.check_invariants()
    raise AssertionError("not finished within the step bound")


def prefill(s: Scheduler, fake: FakeStep, tokens: list[int], rid: str = "p", n: int = 1) -> dict:
    leg = group(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True, n=n),
                KVTransferParams(do_remote_decode=True))
    run(s, fake, leg)
    assert leg.finish_reason == "length" and leg.kv_transfer_out is not None
    return leg.kv_transfer_out


# --- the schedulers over the fake fabric -----------------------------------------------------------------------


@pytest.mark.parametrize("other", [prompt(13, 1), prompt(10, 1)], ids=["same-length", "shorter"])
def test_a_decode_leg_never_reads_another_prompts_blocks(other: list[int]) -> None:
    """A decode leg whose prompt is not the one its hand-off names (what a list of prompts sharing one
    ``kv_transfer_params`` made): no read, its prompt computed here (at b95eeba it read the other prompt's blocks,
    and the fake step's read-back of its context failed)."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    answer = prefill(p, pf, prompt(13))
    leg = group("d", other, SamplingParams(max_tokens=4, ignore_eos=True), parse_kv_transfer_params(answer))
    run(d, df, leg)
    assert not fabric.reads and leg.finish_reason == "length" and not leg.error
    assert len(leg.output_token_ids) == 4


def test_a_decode_leg_asking_prompt_logprobs_is_computed_here() -> None:
    """Prompt logprobs need the prompt's logits, which a read does not give: the leg is not offered to the
    connector (at b95eeba it was read, and its prompt logprobs came back as [None])."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    leg = group("d", tokens, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1),
                parse_kv_transfer_params(prefill(p, pf, tokens)))
    run(d, df, leg)
    assert not fabric.reads and leg.finish_reason == "length"


def test_an_n_2_prefill_leg_holds_one_leg_which_the_decode_leg_releases() -> None:
    """Only the hand-off of an n > 1 prefill leg's first sequence is answered: its followers hold nothing (at
    b95eeba each sequence held the prompt's blocks for the lease, one hand-off answered)."""
    fabric = Fabric()
    p, pf, pd = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    answer = prefill(p, pf, tokens, n=2)
    assert list(p.held) == ["p"] and pd.stats.held_requests == 1 and pd.stats.held_blocks == 4
    leg = group("d", tokens, SamplingParams(max_tokens=3, ignore_eos=True, n=2), parse_kv_transfer_params(answer))
    follower = leg.followers[0]
    run(d, df, leg)
    assert len(fabric.reads) == 1 and follower.output_token_ids == leg.output_token_ids and not follower.error
    for _ in range(3):  # the read's notification frees the held blocks
        step(p, pf)
    assert not p.held and p.kv.stats().num_used == 0


def test_the_hand_off_carries_the_leases_end_and_the_decode_side_goes_by_it() -> None:
    """The prefill side's lease (10 s) is shorter than the decode side's own (30 s): the hand-off's
    ``remote_blocks_expiry_time`` (wall-clock seconds) says so, and a leg that arrives 8.5 s later is not read
    (1.5 s left, less than the margin); at b95eeba the field was None and the decode side assumed its own 30 s
    lease from the leg's arrival, and read blocks the prefill side frees 1.5 s later."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0", lease_s=10.0)
    d, df, _ = replica(fabric, "kv_consumer", "decode-0", lease_s=30.0)
    tokens = prompt(13)
    answer = prefill(p, pf, tokens)
    wall = time.time() - time.monotonic() + fabric.now  # the fabric's clock is the monotonic one here
    assert answer["remote_blocks_expiry_time"] == pytest.approx(wall + 10.0, abs=0.5)
    fabric.now = 8.5
    late = group("late", tokens, SamplingParams(max_tokens=2, ignore_eos=True), parse_kv_transfer_params(answer),
                 arrival=fabric.now)
    run(d, df, late)
    assert not fabric.reads and late.error and "remote_blocks_expiry_time" in late.error
    fabric.now = 0.0  # in time: read
    on_time = group("ok", tokens, SamplingParams(max_tokens=2, ignore_eos=True),
                    parse_kv_transfer_params(prefill(p, pf, tokens, rid="p2")), arrival=fabric.now)
    run(d, df, on_time)
    assert len(fabric.reads) == 1 and not on_time.error


# --- the engine's intake with a real PD connector -------------------------------------------------------------

MODEL = ModelConfig("llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=128, eos_token_ids=(2,))


def intake(fabric: Fabric, role: str) -> InputProcessor:
    """The intake of a replica of a bundle with adapter slots, in PD role ``role``."""
    _, _, pd = replica(fabric, role, role)
    limits = IntakeLimits(MODEL, 64, BS, 8, has_lora=True, supports_prompt_logits=True)
    return InputProcessor(limits, None, lambda: 32, 32, pd)


def answer_for(tokens: list[int]) -> dict:
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    return prefill(p, pf, tokens)


def refused(processor: InputProcessor, tokens: list[int], params: SamplingParams,
            lora: str | None = None) -> SamplingParamsError:
    with pytest.raises(SamplingParamsError) as e:
        processor.check(tokens, params, lora)
    assert "\n" not in str(e.value)
    return e.value


def test_an_adapter_request_is_refused_on_both_legs_naming_the_adapter() -> None:
    """SMG's prefill leg carries no kv_transfer_params, yet a kv_producer runs it as a held leg: an adapter request
    there is a 400 naming ``model`` (at b95eeba it ran and its blocks were held; only the decode leg was refused).
    The decode leg with kv_transfer_params is refused too; a consumer serves an adapter request that is no leg."""
    fabric = Fabric()
    producer, consumer = intake(fabric, "kv_producer"), intake(fabric, "kv_consumer")
    tokens = prompt(9)
    e = refused(producer, tokens, SamplingParams(max_tokens=2), lora="a")
    assert e.param == "model" and "'a'" in str(e) and "kv_producer" in str(e)
    decode = SamplingParams(max_tokens=2, kv_transfer_params=answer_for(tokens))
    e = refused(consumer, tokens, decode, lora="a")
    assert e.param == "kv_transfer_params" and "'a'" in str(e)
    assert consumer.check(tokens, SamplingParams(max_tokens=2), "a").kv_transfer is None


def test_prompt_logprobs_are_refused_on_a_leg_sent_with_kv_transfer_params() -> None:
    """A decode leg reads its prompt's KV and has no prompt logits (at b95eeba it answered ``[None]`` for them);
    its prefill leg is refused the same, so that no blocks are held for a decode leg that would be refused."""
    fabric = Fabric()
    producer, consumer = intake(fabric, "kv_producer"), intake(fabric, "kv_consumer")
    tokens = prompt(9)
    decode = SamplingParams(max_tokens=2, prompt_logprobs=1, kv_transfer_params=answer_for(tokens))
    assert refused(consumer, tokens, decode).param == "prompt_logprobs"
    prefill_leg = SamplingParams(max_tokens=1, prompt_logprobs=0, kv_transfer_params={"do_remote_decode": True})
    assert refused(producer, tokens, prefill_leg).param == "prompt_logprobs"
    local = SamplingParams(max_tokens=2, prompt_logprobs=1, kv_transfer_params={"do_remote_prefill": True,
                                                                                 "remote_block_ids": []})
    assert consumer.check(tokens, local).kv_transfer.is_decode_leg  # nothing to read: computed here


@pytest.mark.parametrize(("other", "words"), [(prompt(13, 1), "omforge_prompt_hash does not match"),
                                              (prompt(12), "remote_num_tokens is 13 but this prompt has 12")])
def test_a_decode_leg_of_another_prompt_is_refused_naming_the_field(other: list[int], words: str) -> None:
    """At b95eeba it was accepted, and read the other prompt's KV."""
    consumer = intake(Fabric(), "kv_consumer")
    answer = answer_for(prompt(13))
    e = refused(consumer, other, SamplingParams(max_tokens=2, kv_transfer_params=answer))
    assert e.param == "kv_transfer_params" and words in str(e)
    assert consumer.check(prompt(13), SamplingParams(max_tokens=2, kv_transfer_params=answer)).kv_transfer


# --- a prefill and a decode replica over real NIXL ------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(smollm2_bundle: Path):  # noqa: ANN201
    pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install '.[cluster]')")
    from test_pd import replica as server_replica

    prefill_server = server_replica(smollm2_bundle, "kv_producer", "prefill-legs")
    decode_server = server_replica(smollm2_bundle, "kv_consumer", "decode-legs")
    yield prefill_server, decode_server
    prefill_server.stop()
    decode_server.stop()


def held(server: object) -> float:
    return server.metrics().get("omforge:kv_transfer_held_requests_total", 0)


def test_a_list_of_prompts_with_kv_transfer_params_is_a_400_on_both_legs(replicas) -> None:  # noqa: ANN001
    """One hand-off names one prompt's blocks: at b95eeba a decode leg of two prompts read them for both (the
    second prompt's answer came from the first one's KV), and a prefill leg of two held both for one hand-off."""
    import openai
    from test_pd import MODEL as NAME
    from test_pd import PREFILL_LEG, PROMPTS, prefill_leg

    prefill_server, decode_server = replicas
    params = prefill_leg(prefill_server, PROMPTS[1], engine="prefill-legs")
    before = held(prefill_server)
    for server, kv in ((decode_server, params), (prefill_server, PREFILL_LEG)):
        with pytest.raises(openai.BadRequestError) as e:
            server.client().completions.create(model=NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=4,
                                               temperature=0, extra_body={"kv_transfer_params": kv})
        assert e.value.body["param"] == "kv_transfer_params" and "one prompt" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a decode leg of another prompt
        decode_server.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                                  extra_body={"kv_transfer_params": params})
    assert e.value.body["param"] == "kv_transfer_params" and "remote_num_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a streamed prefill leg: its hand-off has nowhere to go
        list(prefill_server.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=1, stream=True,
                                                        extra_body={"kv_transfer_params": PREFILL_LEG}))
    assert e.value.body["param"] == "kv_transfer_params"
    assert held(prefill_server) == before


def test_a_kv_producer_holds_only_a_leg_whose_hand_off_it_answers(replicas) -> None:  # noqa: ANN001
    """A request without kv_transfer_params (SMG's prefill leg) is a held leg on a kv_producer only where its one
    hand-off is answered: a list of prompts, a streamed request and one asking prompt logprobs run plain (nothing
    held, no hand-off: the decode side prefills itself); an n = 2 leg holds one. At b95eeba each prompt and each
    sequence was held for the lease while at most one hand-off was answered. The hand-off's
    ``remote_blocks_expiry_time`` is the lease's end in wall-clock seconds (None at b95eeba)."""
    from test_pd import LEASE_S, PROMPTS, idle
    from test_pd import MODEL as NAME

    prefill_server, _ = replicas
    client = prefill_server.client()
    before = held(prefill_server)
    many = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=1, temperature=0)
    assert len(many.choices) == 3 and "kv_transfer_params" not in (many.model_extra or {})
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=1, stream=True))
    assert chunks
    scored = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=1, echo=True, logprobs=0)
    assert scored.choices[0].logprobs is not None and "kv_transfer_params" not in (scored.model_extra or {})
    assert held(prefill_server) == before
    t0 = time.time()
    two = client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=1, n=2, temperature=0)
    hand_off = two.model_extra["kv_transfer_params"]
    assert len(two.choices) == 2 and held(prefill_server) == before + 1
    assert t0 + LEASE_S - 1 <= hand_off["remote_blocks_expiry_time"] <= time.time() + LEASE_S + 1
    assert hand_off["remote_num_tokens"] == two.usage.prompt_tokens and hand_off["omforge_prompt_hash"]
    idle(prefill_server)  # the lease frees the one held leg
