"""Prefix-cache-aware routing, measured: two omforge replicas behind SMG (``scripts/cluster.sh``), the gateway's
``cache_aware`` policy against ``round_robin`` on the same requests, in one sitting.

The workload: two families of prompts, each a long shared prefix (a "system prompt" of about ``--prefix-tokens``
tokens, different from its first word) and a short distinct question, the families interleaved in a seeded random
order (a fixed alternation would line up with round robin over two replicas and hide what it does). Every prompt of
a family has the same token count and the two families' counts differ, so each replica's ``/metrics`` counters —
requests finished and prompt tokens — say how many of each family it served (two equations, two unknowns). Per
policy, a fresh cluster (empty prefix caches): per replica the requests of each family and the prefix-cache hits
and queries (blocks); client-side TTFT (streamed, through the gateway) and throughput.

Usage: .venv/bin/python benchmarks/bench_routing.py BUNDLE [--requests 32] [--prefix-tokens 600]
       [--concurrency 4] [--max-tokens 16] [--json OUT] [-- omforge serve args…]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
CLUSTER_START_TIMEOUT_S = 300.0
WORDS = ("harbour ledger cargo berth tide pilot crane manifest customs vessel anchor quay dock freight permit "
         "inspection schedule tariff container voyage crew signal beacon channel dredge mooring bollard hull "
         "keel draft ballast storm warning clearance invoice broker agent shipment pallet forklift warehouse "
         "gate badge escort night shift weekend holiday overtime safety helmet vest radio ladder").split()
HEADERS = ("You are the assistant of the Lisbon harbour office. Answer from these standing orders only.",
           "You are the help desk of a mountain railway. Quote the operating rules below when you answer.")


@dataclass(frozen=True)
class Workload:
    """The requests, in the order they are sent: ``prompts[i]`` of family ``families[i]``; every prompt of family
    ``f`` is ``lengths[f]`` tokens long (as the server tokenizes it)."""

    prompts: list[str]
    families: list[int]
    lengths: tuple[int, int]
    max_tokens: int


@dataclass(frozen=True)
class ReplicaResult:
    url: str
    requests: int
    per_family: tuple[int, int]
    prefix_queries: int  # full blocks looked up in the prefix cache
    prefix_hits: int  # … found there
    prefill_tokens: int  # prompt tokens computed (hits excluded)


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    replicas: list[ReplicaResult]
    wall_s: float
    output_tokens: int
    ttft_ms_p50: float
    ttft_ms_p99: float
    errors: int

    @property
    def hits(self) -> int:
        return sum(r.prefix_hits for r in self.replicas)

    def concentrated(self) -> bool:
        """Each family served by one replica alone."""
        return all(sum(r.per_family[f] > 0 for r in self.replicas) == 1 for f in (0, 1))


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict, timeout: float = 30.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def counters(replica: str) -> dict[str, float]:
    """The replica's running totals this benchmark reads (omforge: names, summed over labels)."""
    want = {"omforge:request_success": "requests", "omforge:prompt_tokens": "prompt_tokens",
            "omforge:prefix_cache_queries": "queries", "omforge:prefix_cache_hits": "hits",
            "omforge:prefill_tokens": "prefill"}
    out = dict.fromkeys(want.values(), 0.0)
    for family in text_string_to_metric_families(_get(replica + "/metrics").decode()):
        if family.name in want:
            out[want[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def build_workload(replica: str, num_requests: int, prefix_tokens: int, max_tokens: int, seed: int) -> Workload:
    """Two prefixes of about ``prefix_tokens`` tokens (family 1's a few words longer, so the counts differ) and,
    per family, the first questions whose whole prompt has the family's most common length (the server's own
    /tokenize counts them); the families shuffled together with ``seed``."""
    def count(text: str) -> int:
        return _post(replica + "/tokenize", {"prompt": text})["count"]

    rng = random.Random(seed)
    per_family = num_requests // 2
    chosen: list[list[str]] = []
    lengths: list[int] = []
    for f, header in enumerate(HEADERS):
        words = [rng.choice(WORDS) for _ in range(prefix_tokens * 2)]
        n = int(prefix_tokens * 0.75) + 6 * f
        while count(header + " " + " ".join(words[:n])) < prefix_tokens + 6 * f and n < len(words):
            n += 8
        prefix = header + " " + " ".join(words[:n]) + "\n"
        candidates = [prefix + f"Question {i}: what do the orders say about the {rng.choice(WORDS)}?"
                      for i in range(per_family * 4)]
        counts = [count(c) for c in candidates]
        length = Counter(counts).most_common(1)[0][0]
        picked = [c for c, k in zip(candidates, counts) if k == length][:per_family]
        if len(picked) < per_family:
            raise SystemExit(f"bench_routing: only {len(picked)} prompts of {length} tokens for family {f}")
        chosen.append(picked)
        lengths.append(length)
    if lengths[0] == lengths[1]:
        raise SystemExit("bench_routing: the two families have the same prompt length; change --prefix-tokens")
    order = [0] * per_family + [1] * per_family
    rng.shuffle(order)
    next_of = [iter(chosen[0]), iter(chosen[1])]
    return Workload([next(next_of[f]) for f in order], order, (lengths[0], lengths[1]), max_tokens)


class Cluster:
    """``scripts/cluster.sh BUNDLE --replicas 2 --policy POLICY -- SERVE_ARGS`` in its own process group; the
    replica and gateway URLs are read from its output (bounded wait); :meth:`stop` drains it, then kills."""

    def __init__(self, bundle: Path, policy: str, serve_args: list[str], replicas: int = 2):
        cmd = ["bash", str(REPO / "scripts" / "cluster.sh"), str(bundle), "--replicas", str(replicas),
               "--policy", policy, "--", *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.replicas: list[str] = []
        self.gateway = ""
        deadline = time.monotonic() + CLUSTER_START_TIMEOUT_S
        while time.monotonic() < deadline and not self.gateway:
            if self.proc.poll() is not None:
                raise RuntimeError("scripts/cluster.sh exited:\n" + "".join(self.lines))
            time.sleep(0.2)
            text = "".join(self.lines)
            self.replicas = re.findall(r"^replica \d+: (http://\S+)", text, re.M)
            m = re.search(r"^gateway: (http://\S+)/v1", text, re.M)
            self.gateway = m.group(1) if m else ""
        if not self.gateway:
            self.stop()
            raise RuntimeError(f"the cluster did not start in {CLUSTER_START_TIMEOUT_S:.0f}s:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group is left (a replica that did not drain)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


async def drive(gateway: str, model: str, workload: Workload, concurrency: int,
                timeout: float) -> tuple[list[float], int, int, float]:
    """Send every request through the gateway (streamed completions, greedy, EOS ignored), at most
    ``concurrency`` at once, in order; returns the TTFTs (s), output tokens, errors and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = errors = 0

    async def one(prompt: str) -> None:
        nonlocal tokens, errors
        async with gate:
            t0 = time.perf_counter()
            first = None
            try:
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=workload.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            except openai.APIError:
                errors += 1
                return
            if first is not None:
                ttfts.append(first)

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(one(p) for p in workload.prompts)), timeout)
    wall = time.perf_counter() - t0
    await client.close()
    return ttfts, tokens, errors, wall


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1] if len(xs) > 1 else xs[0]


def run_policy(bundle: Path, policy: str, workload: Workload | None, *, num_requests: int, prefix_tokens: int,
               max_tokens: int, concurrency: int, serve_args: list[str], seed: int = 7,
               timeout: float = 600.0) -> tuple[PolicyResult, Workload]:
    """One sitting of one policy on a fresh two-replica cluster; builds the workload on first use (pass it back
    for the next policy, so both get the same requests)."""
    cluster = Cluster(bundle, policy, serve_args)
    try:
        first = cluster.replicas[0]
        if workload is None:
            workload = build_workload(first, num_requests, prefix_tokens, max_tokens, seed)
        model = json.loads(_get(first + "/v1/models"))["data"][0]["id"]
        before = [counters(r) for r in cluster.replicas]
        ttfts, tokens, errors, wall = asyncio.run(drive(cluster.gateway, model, workload, concurrency, timeout))
        after = [counters(r) for r in cluster.replicas]
    finally:
        cluster.stop()
    (la, lb), replicas = workload.lengths, []
    for url, b, a in zip(cluster.replicas, before, after):
        d = {k: round(a[k] - b[k]) for k in a}
        n_a = (d["prompt_tokens"] - d["requests"] * lb) // (la - lb)  # n = nA + nB, T = nA*la + nB*lb
        replicas.append(ReplicaResult(url, d["requests"], (n_a, d["requests"] - n_a), d["queries"], d["hits"],
                                      d["prefill"]))
    result = PolicyResult(policy, replicas, wall, tokens, 1e3 * _quantile(ttfts, 0.5), 1e3 * _quantile(ttfts, 0.99),
                          errors)
    return result, workload


def table(results: list[PolicyResult], workload: Workload, concurrency: int) -> str:
    n = len(workload.prompts)
    lines = [f"{n} requests: families of {workload.lengths[0]} and {workload.lengths[1]}-token prompts, "
             f"{workload.max_tokens} tokens out each, concurrency {concurrency}",
             "",
             "| policy | replica | requests (family A / B) | prefix-cache hits / queries (blocks) | prefill tokens "
             "computed | output tok/s | TTFT p50 / p99 (ms) | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for i, rep in enumerate(r.replicas):
            rate = f"{r.output_tokens / r.wall_s:.1f}" if i == 0 else ""
            ttft = f"{r.ttft_ms_p50:.0f} / {r.ttft_ms_p99:.0f}" if i == 0 else ""
            lines.append(f"| {r.policy if i == 0 else ''} | {i + 1} | {rep.requests} ({rep.per_family[0]} / "
                         f"{rep.per_family[1]}) | {rep.prefix_hits} / {rep.prefix_queries} | {rep.prefill_tokens} | "
                         f"{rate} | {ttft} | {r.errors if i == 0 else ''} |")
        lines.append(f"| {r.policy} | all | {sum(x.requests for x in r.replicas)} | {r.hits} / "
                     f"{sum(x.prefix_queries for x in r.replicas)} | {sum(x.prefill_tokens for x in r.replicas)} | "
                     f"| | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    workload, results = None, []
    for policy in args.policies:
        result, workload = run_policy(args.bundle, policy, workload, num_requests=args.requests,
                                      prefix_tokens=args.prefix_tokens, max_tokens=args.max_tokens,
                                      concurrency=args.concurrency, serve_args=serve_args, seed=args.seed)
        results.append(result)
        print(f"{policy}: {result.hits} hits, concentrated={result.concentrated()}, "
              f"{result.output_tokens / result.wall_s:.1f} tok/s", file=sys.stderr, flush=True)
    assert workload is not None
    print(table(results, workload, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
