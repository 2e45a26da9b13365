"""The engine's per-step trace (OMFORGE_STEP_TRACE): one line per model step with its tokens and times, adding up
to what the engine ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step_trace import ENV


def test_one_line_per_model_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "bundle", tmp_path / "cache")
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(trace))
    prompts = [list(range(3, 40)), list(range(50, 61)), [7, 8, 9]]  # 37 + 11 + 3 prompt tokens
    with LLM(bundle, max_num_batched_tokens=16) as llm:  # chunked: 51 prompt tokens over several steps
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        steps = llm.engine.stats.steps
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == steps > 4
    assert sum(s["prefill"] for s in lines) == 37 + 11 + 3
    assert sum(s["decode"] for s in lines) == 3 * 4  # each request's first token comes from its prefill
    assert all(s["prefill"] + s["decode"] <= 16 and 0 < s["model_s"] <= s["s"] for s in lines)
    assert all(a["t"] + a["s"] <= b["t"] + 1e-3 for a, b in zip(lines, lines[1:]))  # in order, not overlapping
    assert lines[-1]["running"] == lines[-1]["waiting"] == 0
