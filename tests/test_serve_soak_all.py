"""The soak with everything on (issue 64 item 9), the suite's short version: benchmarks/soak.py's own code — the
fleet (SmolLM2-135M with three LoRA adapters and the storage KV tier, a PD pair over NIXL for a fifth of the chat
traffic, an embeddings server), the seeded Poisson plan, the openai clients, the watcher — for 30 s of arrivals
with a 10 s queue bound, prompts of 16–300 words and max_tokens 1–64 (the script's full ranges take minutes to
drain on two cores). Asserted: every invariant of the script (nothing lost or hung, the counts add up, no late 503,
every server back to idle, /health a 200 under 0.25 s throughout, every server alive), and that every part ran.
The PD pair is left out where NIXL is not installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from soak import SoakConfig, run_soak
from soak_fleet import FleetOptions, build_bundles
from soak_mix import Mix

HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None


@pytest.fixture(scope="module")
def report(smollm2_bundle: Path, smollm2_cache: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    work = tmp_path_factory.mktemp("soak")
    bundles = build_bundles(work / "bundles", smollm2_cache, smollm2_bundle)
    cfg = SoakConfig(minutes=0.5, rate=1.2, seed=180, bound_s=120.0, grace_s=20.0, rss_every_s=2.0,
                     fleet=FleetOptions(max_queue_time=10.0, lease_s=15.0, pd=HAS_NIXL),
                     mix=Mix(max_words=300, max_tokens=64))
    out = run_soak(cfg, bundles, work)
    print(out.table())
    return out


def test_the_soak_keeps_every_invariant(report) -> None:  # noqa: ANN001
    assert not report.failures, report.table()


def test_every_part_of_the_soak_ran(report) -> None:  # noqa: ANN001
    for target, counts in report.by_target.items():
        assert counts.get("ok", 0) + counts.get("client-cancelled", 0) > 0, (target, report.table())
    main = report.counters["main"]
    assert main["omforge:lora_slot_loads_total"] > 0, report.table()  # the adapters served
    assert main["omforge:hicache_written_blocks_total{tier=storage}"] > 0, report.table()  # the storage tier wrote
    if HAS_NIXL:
        assert report.counters["decode"]["omforge:kv_transfer_read_requests_total"] > 0, report.table()
