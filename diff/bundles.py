"""``omforge diff BUNDLE_A BUNDLE_B``: two compiled bundles of one model run side by side — what a compile choice
that is not a graph rewrite (the weight precision, the KV cache dtype, the paged-attention lowering) does to the
model's outputs.

For each prompt (chat prompts through the bundle's template; seeded random tokens for a bundle without a
tokenizer), A's greedy continuation of
``max_tokens`` tokens is teacher-forced through both bundles' step graphs (a prefill, then one decode per
token), and at every step the logits are compared: max abs drift and top-1 agreement. Then both bundles
generate freely (greedy, batched, EOS ignored) and the identical prefix of their outputs is counted: the
figure users feel (how soon a bf16 or int8 KV cache changes the text).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omforge.contract import cdiv
from omforge.contract.manifest import MANIFEST, Weights, load_manifest
from omforge.diff.types import BundleDiff, PromptDrift
from omforge.errors import OmforgeError

CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a compiler does in one sentence.",
    "List three fruits that are red.", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What does a CPU cache do?", "Write one sentence about autumn.", "Why is the sky blue?",
    "Name two planets with rings.", "What is 12 times 12?", "Suggest a name for a black cat.",
    "How do plants make food?", "Translate 'good morning' into Spanish.", "What is a prime number?",
    "Describe a rainbow in ten words.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Give a tip for learning to code.", "What is the largest ocean on Earth?",
]


def is_bundle(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def diff_bundles(a: Path, b: Path, prompts: list[str] | None = None, max_tokens: int = 64) -> BundleDiff:
    """Compare bundles ``a`` (reference) and ``b`` of the same model on ``prompts`` (default :data:`CHAT_PROMPTS`)."""
    from omforge.runtime.llm import LLM
    from omforge.runtime.sampling_params import SamplingParams
    from omforge.runtime.step import SeqWork

    ma, mb = load_manifest(a, verify=False), load_manifest(b, verify=False)
    for path, m in ((a, ma), (b, mb)):
        if m.pooling is not None:
            raise OmforgeError(f"{path}: a pooling bundle (task {m.task}); omforge diff compares generate bundles' "
                               "tokens")
    if ma.model.config != mb.model.config:
        raise OmforgeError(f"{b}: not a bundle of the same model as {a} (model configs differ)")
    llms = [LLM(a), LLM(b)]
    tok = llms[0].tokenizer
    prompts = prompts or CHAT_PROMPTS
    if tok is None:  # a bundle without a tokenizer (random-weight test models): seeded random prompts instead
        rng = np.random.default_rng(0)
        vocab = ma.model.config.vocab_size
        ids = [rng.integers(3, vocab, int(rng.integers(16, 48))).tolist() for _ in prompts]
        prompts = [f"random tokens #{i}" for i in range(len(ids))]
    else:
        chat = bool(tok.chat_template)
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]) if chat else p,
                          add_special_tokens=not chat) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate(ids, params, use_tqdm=False)] for llm in llms]
    bs = llms[0].engine.block_size
    result = []
    for prompt, p_ids, out_a, out_b in zip(prompts, ids, *outs):
        table = list(range(cdiv(len(p_ids) + max_tokens, bs)))
        logits = []
        for llm in llms:  # teacher-forced: A's tokens through both step graphs
            ex = llm.engine.executor
            steps = [ex.execute([SeqWork(p_ids, 0, table)])[0]]
            for i, t in enumerate(out_a[:-1]):
                steps.append(ex.execute([SeqWork([t], len(p_ids) + i, table)])[0])
            logits.append(np.stack(steps))
        la, lb = logits
        same = next((i for i, (x, y) in enumerate(zip(out_a, out_b)) if x != y), len(out_a))
        result.append(PromptDrift(prompt, len(la), float(np.abs(la - lb).max()),
                                  float((la.argmax(-1) == lb.argmax(-1)).mean()), same))
    return BundleDiff(str(a), str(b), (ma.kv.dtype, mb.kv.dtype), (ma.paged_attention, mb.paged_attention),
                      max_tokens, result, (_weights(ma.weights), _weights(mb.weights)))


def _weights(w: Weights) -> str:
    """``compile.weights`` and, when quantized, the activation type (bundles from before it: the accuracy level)."""
    if w.activations is not None:
        return f"{w.precision} ({w.activations} activations)"
    return w.precision + (f" (accuracy level {w.accuracy_level})" if w.accuracy_level is not None else "")


def render_text(d: BundleDiff) -> str:
    lines = [f"A {d.a}: weights {d.weights[0]}, KV {d.kv_dtypes[0]}, paged attention {d.paged_attention[0]}",
             f"B {d.b}: weights {d.weights[1]}, KV {d.kv_dtypes[1]}, paged attention {d.paged_attention[1]}",
             f"{len(d.prompts)} prompts, {d.max_tokens} greedy tokens each (A's tokens teacher-forced through both)",
             "",
             f"{'prompt':44s} {'max |Δlogit|':>12s} {'top-1 agree':>11s} {'same prefix':>11s}"]
    for p in d.prompts:
        lines.append(f"{p.prompt[:44]:44s} {p.max_abs:12.3g} {p.top1_agreement:11.1%} "
                     f"{p.identical_prefix:>7d}/{d.max_tokens}")
    lines += ["", f"max |Δlogit| {d.max_abs:.3g}; identical {d.max_tokens}-token outputs: "
                  f"{d.identical_outputs:.0%} of prompts"]
    return "\n".join(lines)
