"""A soak with everything on (issue 64 item 9): Poisson arrivals above what the machine serves, against real servers
on 127.0.0.1 — a main server (SmolLM2-135M with three LoRA adapters beside the base, the host and storage KV
tiers on), a prefill/decode pair over NIXL that gets a fifth of the chat traffic as a PD router sends it, and an
embeddings server — then one table and the invariants.

    .venv/bin/python benchmarks/soak.py --minutes 60 [--rate 1.5] [--out FILE] [--work DIR] [--bundle PLAIN]

The traffic (benchmarks/soak_mix.py): chat and completions on the base and the three adapters, prompts 16–1,100
words, max_tokens 1–256, whole, streamed, or streamed and closed by the client mid-way, some n = 2, JSON mode
(response_format), required tool calls; embeddings. Sent with the official openai client, every wait bounded
(benchmarks/soak_client.py). The servers (benchmarks/soak_fleet.py) run with ``--threads 1`` each. The default
rate (1.5 req/s, the rate of issue 64's 10-minute soak) is above what a small machine serves; the table shows
offered against answered per minute.

Invariants (exit 1 and the failing ones printed): sent = ok + 429 + client-cancelled + the errors the servers
reported, by status; nothing lost (no outcome by the end + grace) or hung (no answer within the client's bound);
no late 503 (a 503 after ``late_fraction`` of the queue bound: admission should have answered 429 at once); no
malformed answer, connection failure, 5xx other than 503 or failure of the soak's own client; every server's
running / waiting / swapped sequences, KV blocks in use (pins of the storage tier included), held PD blocks and the
adapters of running / waiting requests (LoRA slot pins) back to 0 within the grace; every ``/health`` probe a 200
under 0.25 s; every server alive at the end. Stated, not asserted: each server's RSS slope after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_harness import pct, scrape
from soak_client import Endpoints, Outcome, send
from soak_fleet import Bundles, FleetOptions, build_bundles, make_adapters, start_fleet
from soak_mix import Mix, Plan, make_plan
from soak_watch import Samples, Watcher, is_idle, settle, slope_mb_per_min

COUNTERS = {  # what shows that every part ran: per server, the difference over the soak
    "main": ("omforge:generation_tokens_total", "omforge:prefix_cache_hits_total",
             "omforge:hicache_written_blocks_total{tier=storage}", "omforge:hicache_lookup_blocks_total{tier=storage}",
             "omforge:hicache_hit_blocks_total{tier=storage}",
             "omforge:hicache_loaded_blocks_total{tier=storage}", "omforge:lora_slot_loads_total",
             "omforge:lora_slot_evictions_total", "omforge:num_preemptions_total"),
    "prefill": ("omforge:kv_transfer_held_requests_total", "omforge:kv_transfer_released_total{reason=notified}",
                "omforge:kv_transfer_released_total{reason=expired}"),
    "decode": ("omforge:generation_tokens_total", "omforge:kv_transfer_read_requests_total",
               "omforge:kv_transfer_read_blocks_total", "omforge:kv_transfer_read_failures_total"),
    "embed": ("omforge:prompt_tokens_total",),
}
FAILING = ("malformed", "connection", "client error", "stream error")
"""Outcomes that are no clearly reported error (besides hung, lost and late 503s)."""


@dataclass(frozen=True)
class SoakConfig:
    """One soak: ``minutes`` of arrivals at ``rate`` per second; ``bound_s`` a request's whole wait (default: the
    queue bound + 240 s); ``grace_s`` how long the servers get to come back to idle after the clients (plus the PD
    lease); a 503 later than ``late_fraction`` of the queue bound is late; ``warmup_fraction`` of the run (at most
    2 minutes) is left out of the RSS slope."""

    minutes: float = 60.0
    rate: float = 1.5
    seed: int = 0
    bound_s: float | None = None
    grace_s: float = 60.0
    late_fraction: float = 0.75
    health_goal_s: float = 0.25
    health_every_s: float = 0.5
    rss_every_s: float = 5.0
    warmup_fraction: float = 0.25
    fleet: FleetOptions = FleetOptions()
    mix: Mix = Mix()

    @property
    def bound(self) -> float:
        return self.bound_s if self.bound_s is not None else self.fleet.max_queue_time + 240.0


@dataclass
class Report:
    """The soak's result; ``failures``: the invariants that failed, one line each (empty: all held)."""

    config: dict
    sent: int
    counts: dict[str, int]
    by_target: dict[str, dict[str, int]]
    health: dict[str, dict]
    rss: dict[str, dict]
    states: dict[str, dict]
    settle_s: float
    counters: dict[str, dict[str, float]]
    alive: dict[str, bool]
    phases: dict[str, float]  # seconds: servers' start, warm-up, clients (arrivals + the last answers), settle, stop
    examples: dict[str, list[str]] = field(default_factory=dict)
    # per outcome other than ok / client-cancelled / early 429: {minute of arrival: count}
    timeline: dict[str, dict[int, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def table(self) -> str:
        c = self.config
        minutes = max(c["minutes"], 1e-9)
        lines = [f"soak: {c['minutes']:g} min of arrivals at {c['rate']:g} req/s (seed {c['seed']}), queue bound "
                 f"{c['fleet']['max_queue_time']:g} s, client bound {c['bound']:g} s; servers: "
                 f"{', '.join(self.alive)}",
                 "seconds: " + ", ".join(f"{k} {v:g}" for k, v in self.phases.items()),
                 f"offered {self.sent / minutes:.1f}/min, answered ok {self.counts.get('ok', 0) / minutes:.1f}/min",
                 "", f"{'outcome':<28}{'count':>7}  " + "  ".join(f"{t:>10}" for t in self.by_target)]
        for name in ["sent", *sorted(self.counts, key=_order)]:
            count = self.sent if name == "sent" else self.counts[name]
            per = "  ".join(f"{(sum(v.values()) if name == 'sent' else v.get(name, 0)):>10}"
                            for v in self.by_target.values())
            lines.append(f"{name:<28}{count:>7}  {per}")
        lines += ["", f"{'server':<9}{'health max':>11}{'p99':>8}{'probes':>8}{'non-200':>8}"
                      f"{'RSS start':>11}{'end':>8}{'slope MB/min':>14}  state after {self.settle_s:.0f} s"]
        for name in self.alive:
            h, r = self.health.get(name, {}), self.rss.get(name, {})
            slope = r.get("slope_mb_per_min")
            state = ", ".join(f"{k}={v if isinstance(v, str) else int(v)}"
                              for k, v in self.states.get(name, {}).items())
            lines.append(f"{name:<9}{_s(h.get('max_s')):>11}{_s(h.get('p99_s')):>8}{h.get('probes', 0):>8}"
                         f"{h.get('non_200', 0):>8}{r.get('start_mb', 0):>10.0f}M{r.get('end_mb', 0):>7.0f}M"
                         f"{'n/a' if slope is None else f'{slope:+.1f}':>14}  {state}")
        lines.append("slowest /health probes (s after the start: seconds): " + "; ".join(
            f"{name} " + ", ".join(f"+{t:g}: {x:.3f}" for t, x in h.get("slowest", []))
            for name, h in self.health.items()))
        lines.append("")
        for name, values in self.counters.items():
            lines.append(f"{name}: " + ", ".join(f"{k.removeprefix('omforge:')} {v:g}" for k, v in values.items()))
        for name, texts in self.examples.items():
            lines.append(f"e.g. {name}: " + " | ".join(texts))
        for name, minutes in self.timeline.items():
            lines.append(f"{name} by minute of arrival: " + ", ".join(f"{m}: {n}" for m, n in sorted(minutes.items())))
        lines.append("")
        lines += [f"FAIL: {f}" for f in self.failures] or ["PASS: every invariant held"]
        return "\n".join(lines)


def _order(name: str) -> tuple[int, str]:
    first = ("ok", "client-cancelled", "http 429", "http 503 early", "http 503 late")
    return (first.index(name), name) if name in first else (len(first), name)


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}s"


async def drive(ends: Endpoints, plans: list[Plan], deadline_s: float) -> dict[int, Outcome]:
    """Send every plan at its time; their outcomes by index (a plan missing from the result is lost: no outcome
    within ``deadline_s``)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    results: dict[int, Outcome] = {}

    async def one(plan: Plan) -> None:
        await asyncio.sleep(max(0.0, plan.at - (loop.time() - t0)))
        results[plan.index] = await send(ends, plan)

    tasks = [asyncio.create_task(one(p)) for p in plans]
    if not tasks:
        return results
    _, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results


async def _warm(ends: Endpoints, targets: tuple[str, ...]) -> None:
    """One short request per target, side by side, before the soak (not counted); each must be ok."""
    plans = [Plan(0, 0.0, target, prompt="Say hello.", max_tokens=4, inputs=["hello world"]) for target in targets]
    for out in await asyncio.gather(*(send(ends, plan) for plan in plans)):
        if out.outcome != "ok":
            raise RuntimeError(f"warm-up {out.target}: {out.outcome} {out.code or ''} {out.detail}")


def _snapshot(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    return {name: scrape(url) for name, url in urls.items()}


def _classify(out: Outcome, late_s: float) -> str:
    if out.outcome == "http 503":
        return "http 503 late" if out.seconds >= late_s else "http 503 early"
    return out.outcome


def run_soak(cfg: SoakConfig, bundles: Bundles, work: Path) -> Report:
    """Start the fleet, warm it, run the plan, let it settle, stop it; the report (nothing raised for a failed
    invariant)."""
    work.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(work, bundles.lora)
    plans = make_plan(cfg.minutes * 60, cfg.rate, tuple(adapters), cfg.seed,
                      cfg.mix if cfg.fleet.pd else dataclasses.replace(cfg.mix, pd=0.0))
    phases: dict[str, float] = {}
    clock = [time.monotonic()]

    def phase(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - clock[0], 1)
        clock[0] = now

    fleet = start_fleet(bundles, adapters, work, cfg.fleet)
    phase("start")
    try:
        srv = fleet.servers
        urls = {name: s.url for name, s in srv.items()}
        ends = Endpoints(srv["main"].url + "/v1", fleet.model("main"), srv["embed"].url + "/v1", fleet.model("embed"),
                         cfg.bound, srv["prefill"].url + "/v1" if cfg.fleet.pd else None,
                         srv["decode"].url + "/v1" if cfg.fleet.pd else None)
        asyncio.run(_warm(ends, ("chat", "completion", "embed", *(("pd",) if cfg.fleet.pd else ()))))
        phase("warm")
        before = _snapshot(urls)
        watcher = Watcher(urls, {name: s.proc.pid for name, s in srv.items()}, work / "watch.json",
                          cfg.health_every_s, cfg.rss_every_s)
        t0 = time.monotonic()
        try:
            results = asyncio.run(drive(ends, plans, cfg.minutes * 60 + cfg.bound + 30))
            phase("clients")
            states, settle_s = settle(urls, cfg.grace_s + cfg.fleet.lease_s)
            phase("settle")
        finally:
            samples = watcher.finish()
        after = _snapshot(urls)
        alive = {name: s.proc.poll() is None for name, s in srv.items()}
    finally:
        fleet.stop()
        phase("stop")
    counters = {name: {k: after[name].get(k, 0) - before[name].get(k, 0) for k in keys}
                for name, keys in COUNTERS.items() if name in after}
    return _report(cfg, plans, results, samples, states, settle_s, counters, alive, t0, phases)


def _report(cfg: SoakConfig, plans: list[Plan], results: dict[int, Outcome], samples: Samples,
            states: dict[str, dict], settle_s: float, counters: dict[str, dict[str, float]], alive: dict[str, bool],
            t0: float, phases: dict[str, float]) -> Report:
    late_s = cfg.late_fraction * cfg.fleet.max_queue_time
    counts: collections.Counter[str] = collections.Counter()
    by_target: dict[str, collections.Counter[str]] = {}
    examples: dict[str, list[str]] = {}
    timeline: dict[str, collections.Counter[int]] = {}
    for plan in plans:
        out = results.get(plan.index)
        name = "lost" if out is None else _classify(out, late_s)
        counts[name] += 1
        if name not in ("ok", "client-cancelled", "http 429"):
            timeline.setdefault(name, collections.Counter())[int(plan.at // 60)] += 1
        by_target.setdefault(plan.target, collections.Counter())[name] += 1
        if out is not None and name not in ("ok", "client-cancelled") and len(examples.setdefault(name, [])) < 3:
            examples[name].append(f"#{plan.index} {plan.target} {out.seconds:.1f}s {out.code or ''} {out.detail}"[:200])
    health = {}
    for name, probes in samples.health.items():
        seconds = [s for t, s, _ in probes if t >= t0]
        slowest = sorted(((s, t) for t, s, _ in probes if t >= t0), reverse=True)[:3]
        health[name] = {"probes": len(seconds), "max_s": max(seconds, default=None), "p99_s": pct(seconds, 99),
                        "non_200": sum(1 for t, _, status in probes if t >= t0 and status != 200),
                        "slowest": [(round(t - t0, 1), round(s, 3)) for s, t in slowest]}  # (when, seconds)
    warm_end = t0 + min(120.0, cfg.warmup_fraction * cfg.minutes * 60)
    rss = {name: {"start_mb": pts[0][1] if pts else 0.0, "end_mb": pts[-1][1] if pts else 0.0,
                  "slope_mb_per_min": slope_mb_per_min([tuple(p) for p in pts], warm_end), "samples": len(pts)}
           for name, pts in samples.rss.items()}
    report = Report(config={**dataclasses.asdict(cfg), "bound": cfg.bound}, sent=len(plans), counts=dict(counts),
                    by_target={t: dict(c) for t, c in sorted(by_target.items())}, health=health, rss=rss,
                    states=states, settle_s=settle_s, counters=counters, alive=alive, phases=phases,
                    examples=examples, timeline={k: dict(v) for k, v in timeline.items()})
    report.failures = invariants(report, cfg)
    return report


def invariants(r: Report, cfg: SoakConfig) -> list[str]:
    """The invariants that failed, one line each."""
    fails = []
    if sum(r.counts.values()) != r.sent:
        fails.append(f"counts: the outcomes add up to {sum(r.counts.values())}, {r.sent} sent")
    for name, what in (("lost", "had no outcome by the end + grace"),
                       ("hung", f"had no answer within the client's {cfg.bound:g} s bound"),
                       ("http 503 late", f"ended in a 503 after ≥ {cfg.late_fraction * cfg.fleet.max_queue_time:g} s "
                                         "(admission should have answered 429 at once)")):
        if r.counts.get(name):
            fails.append(f"{name}: {r.counts[name]} requests {what}")
    bad = {k: v for k, v in r.counts.items()
           if k in FAILING or (k.startswith("http 5") and k not in ("http 503 early", "http 503 late"))}
    if bad:
        fails.append("answers that are no clearly reported error: " + ", ".join(f"{k} {v}" for k, v in bad.items()))
    busy = {name: s for name, s in r.states.items() if not is_idle(s)}
    if busy:
        fails.append(f"state not back to 0 after {r.settle_s:.0f} s: " + "; ".join(
            f"{name} " + ", ".join(f"{k}={v}" for k, v in s.items() if v not in (0, "")) for name, s in busy.items()))
    for name, h in r.health.items():
        if h["max_s"] is None or h["max_s"] >= cfg.health_goal_s or h["non_200"]:
            fails.append(f"/health of {name}: max {_s(h['max_s'])} over {h['probes']} probes, {h['non_200']} not "
                         f"200 (goal: every probe a 200 under {cfg.health_goal_s:g} s)")
    dead = [name for name, up in r.alive.items() if not up]
    if dead:
        fails.append(f"servers not running at the end: {', '.join(dead)}")
    return fails


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=60.0, help="minutes of arrivals (default 60)")
    p.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second (default 1.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    p.add_argument("--work", type=Path, default=Path("/tmp/omforge-soak"),
                   help="bundles, adapters, logs and the storage tier (default /tmp/omforge-soak)")
    p.add_argument("--bundle", type=Path, help="an existing plain SmolLM2-135M bundle to reuse")
    p.add_argument("--cache", type=Path, help="the stage cache for compiling (default: omforge's)")
    p.add_argument("--max-queue-time", type=float, default=60.0, help="every server's queue bound, s (default 60)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the main server's batch (default 16)")
    p.add_argument("--max-loras", type=int, default=2, help="adapters resident at once, of 4 slots (default 2)")
    p.add_argument("--kv-cache-space-gb", type=float, default=0.75, help="the main server's KV pool (default 0.75)")
    p.add_argument("--lease", type=float, default=30.0, help="the prefill replica's lease, s (default 30)")
    p.add_argument("--bound", type=float, help="a request's whole wait, s (default: queue bound + 240)")
    p.add_argument("--grace", type=float, default=60.0, help="seconds to come back to idle (default 60)")
    p.add_argument("--no-pd", action="store_true", help="no prefill/decode pair (NIXL not installed)")
    a = p.parse_args(argv)
    fleet = FleetOptions(max_queue_time=a.max_queue_time, max_num_seqs=a.max_num_seqs, max_loras=a.max_loras,
                         kv_cache_space=a.kv_cache_space_gb, lease_s=a.lease, pd=not a.no_pd)
    cfg = SoakConfig(minutes=a.minutes, rate=a.rate, seed=a.seed, bound_s=a.bound, grace_s=a.grace, fleet=fleet)
    bundles = build_bundles(a.work / "bundles", a.cache, a.bundle)
    report = run_soak(cfg, bundles, a.work)
    print(report.table(), flush=True)
    if a.out:
        a.out.write_text(json.dumps(dataclasses.asdict(report), indent=1, default=str))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
