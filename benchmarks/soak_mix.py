"""The soak's traffic (benchmarks/soak.py): one seeded list of planned requests with Poisson arrivals.

Each :class:`Plan` is one client request: chat or a completion on the main server (the base model or one of the
adapters), a chat through the prefill/decode pair (a fifth of the chat traffic; base model, n = 1, as a PD router
sends it), or embeddings on the pooling server. Prompts are 16–``max_words`` words (a prefix of one of a few seeded
documents, so prompts share prefixes and the prefix cache and the storage tier see hits, then a question of its
own); ``max_tokens`` 1–``max_tokens``; whole, streamed, or streamed and closed by the client after a few chunks;
some n = 2, JSON mode or a required tool call. The same seed gives the same plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TARGETS = ("chat", "completion", "pd", "embed")
"""Where a request goes: chat / completion on the main server, chat through the PD pair, embeddings."""
MODES = ("whole", "stream", "cancel")
WORDS = ("lighthouse harbor storm keeper lamp ship rocks night wave sailor gull fog bell tide rope cliff salt "
         "lantern map compass anchor beacon coast reef river mill town bridge market baker bread winter spring "
         "garden letter window station train engine signal copper wire river valley orchard apple ladder roof "
         "village school teacher lesson chalk story ember forest path stone wall gate key door candle shadow").split()
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
NUM_DOCUMENTS = 6


@dataclass(frozen=True)
class Mix:
    """The shares of the traffic. ``pd`` is a share of all requests: a fifth of the chat traffic by default
    (chat + pd = 0.75, pd = 0.15)."""

    chat: float = 0.60
    completion: float = 0.15
    pd: float = 0.15
    embed: float = 0.10
    stream: float = 0.30
    cancel: float = 0.15
    n2: float = 0.15
    json_mode: float = 0.12
    tools: float = 0.10
    min_words: int = 16
    max_words: int = 1100
    max_tokens: int = 256


@dataclass(frozen=True)
class Plan:
    """One planned request; ``at``: seconds after the soak's start; ``model``: None for the base model or an
    adapter's name; ``cancel_after``: the client closes the stream after this many chunks (mode cancel)."""

    index: int
    at: float
    target: str
    mode: str = "whole"
    model: str | None = None
    prompt: str = ""
    max_tokens: int = 16
    n: int = 1
    json_mode: bool = False
    tools: bool = False
    cancel_after: int = 0
    inputs: list[str] = field(default_factory=list)  # embeddings


def documents(seed: int, words: int) -> list[list[str]]:
    """The shared documents whose prefixes start the prompts (seeded)."""
    rng = random.Random(f"docs-{seed}")
    return [[rng.choice(WORDS) for _ in range(words)] for _ in range(NUM_DOCUMENTS)]


def make_plan(seconds: float, rate: float, adapters: tuple[str, ...], seed: int = 0, mix: Mix = Mix()) -> list[Plan]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; every request drawn from ``mix`` (seeded)."""
    if rate <= 0 or seconds <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} req/s for {seconds} s")
    rng = random.Random(seed)
    docs = documents(seed, mix.max_words)
    models = (None, *adapters)
    plans: list[Plan] = []
    t = rng.expovariate(rate)
    while t < seconds:
        i = len(plans)
        target = rng.choices(TARGETS, (mix.chat, mix.completion, mix.pd, mix.embed))[0]
        if target == "embed":
            inputs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
                      for _ in range(rng.randint(1, 8))]
            plans.append(Plan(i, t, target, inputs=inputs))
        else:
            words = rng.randint(mix.min_words, mix.max_words)
            lead = docs[rng.randrange(NUM_DOCUMENTS)][:max(0, words - 10)]
            question = f"Question {i}: what does the {rng.choice(WORDS)} say about the {rng.choice(WORDS)}?"
            u = rng.random()
            mode = "stream" if u < mix.stream else "cancel" if u < mix.stream + mix.cancel else "whole"
            json_mode = rng.random() < mix.json_mode
            tools = target != "completion" and not json_mode and rng.random() < mix.tools
            plans.append(Plan(i, t, target, mode, None if target == "pd" else rng.choice(models),
                              " ".join(lead) + ". " + question, rng.randint(1, mix.max_tokens),
                              n=2 if target != "pd" and rng.random() < mix.n2 else 1, json_mode=json_mode,
                              tools=tools, cancel_after=rng.randint(1, 8) if mode == "cancel" else 0))
        t += rng.expovariate(rate)
    return plans
