"""HiCache (issue 23), measured: a multi-turn chat workload against ``omforge serve`` with the prefix cache's
storage tier off, on, and on again after a restart that keeps only the storage directory.

The workload: ``--conversations`` conversations of ``--turns`` turns. Turn 1 is ``--first-tokens`` tokens of
common words (the shared harness's ``workload.PromptFactory``, benchmarks/harness/workload.py: exact token counts);
each later turn re-sends the whole history — the previous prompt's text, the model's answer, and a new user
message of ``--user-tokens`` tokens — as a text prompt to /v1/completions (streamed, greedy, EOS ignored,
``--max-tokens`` per answer). ``--concurrency`` conversations run at a time (their start order shuffled by
``--seed``), each one's turns strictly one after another, so between two turns of a conversation the others'
turns run. The KV pool is sized small (``--num-kv-blocks``; by default about ``--pool-fraction`` of the tokens
the concurrent conversations' final histories hold) so that histories are evicted between turns.

Modes (``--modes``; exact first, then one server at a time in the order given):
  off           the plain server (tiers off) with the small pool;
  on            the same plus ``--enable-hierarchical-cache --hicache-storage-backend file`` on a fresh directory;
  restart-warm  a new server on the same storage directory (nothing else carried over), the same workload;
  off-again     the plain server once more, same settings: a control, the greedy answers that differ between two
                off runs (batching differs with timing) against those that differ between off and on;
  exact         offline, no server (``omforge.runtime.engine.LLMEngine``): ``--exact-conversations`` conversations
                of ``--turns`` turns (``--exact-max-tokens`` per answer) with token-id histories (previous
                prompt ids + answer ids + new user ids), run strictly one request at a time, turn 1 of every
                conversation, then turn 2, … (so every batch is one request's chunks or decode, the same in every
                run), three times: (a) a pool big enough never to evict, tiers off; (b) a small pool (histories
                evicted between turns) with the storage tier on; (c) the small pool, tiers off. Each answer of (b)
                and (c) compared with (a)'s token for token and by its tokens' logprobs (bit for bit): (a) = (b)
                if tier KV is bit-exact (same hits, chunks, batches and bytes); (c) recomputes evicted prefixes
                in other chunks, so its logprobs may move and its tokens differ on near-ties. Prefill tokens of
                each, storage blocks loaded / written of (b).

Per mode: client TTFT (first streamed text chunk) p50/p99 over all turns and p50 over turns >= 2, per-turn
TTFT p50, latency p50, output tok/s, wall time; from /metrics (difference over the run) prefill tokens computed,
prompt tokens, prefix-cache hits and every ``omforge:hicache_*`` series; whether each (conversation, turn) answer
equals mode off's. Ratios on/off (prefill tokens, TTFT p50) and restart-warm/on (TTFT p50). Medians, not means.

    .venv/bin/python benchmarks/bench_hicache.py --bundle BUNDLE [--conversations 32] [--turns 6]
        [--concurrency 8] [--modes off,on,restart-warm,off-again,exact] [--num-kv-blocks N] [--threads T]
        [--serve-arg=--max-num-seqs --serve-arg=8] [--exact-conversations 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO / "benchmarks" / "harness"  # the peers' harness, carried in the tree
sys.path.insert(0, str(SHARED_BENCH))
sys.path.insert(0, str(REPO / "benchmarks"))
import workload  # noqa: E402 - the shared harness's prompt factory
from serving_harness import ServeProcess, ms, pct, recording_errors, scrape, stream_completion  # noqa: E402

MODES = ("off", "on", "restart-warm", "off-again", "exact")
SERVER_MODES = ("off", "on", "restart-warm", "off-again")
HICACHE_PREFIX = "omforge:hicache_"
ENGINE_SERIES = ("omforge:prefill_tokens_total", "omforge:prompt_tokens_total", "omforge:prefix_cache_hits_total",
                 "omforge:prefix_cache_queries_total", "omforge:num_preemptions_total")


@dataclass(frozen=True)
class Conversation:
    """``first``: turn 1's text; ``users[t]``: the user message added at turn ``t + 2``."""

    index: int
    first: str
    users: list[str]


@dataclass
class TurnResult:
    conv: int
    turn: int
    ok: bool = False
    ttft: float | None = None
    latency: float | None = None
    out_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class ModeResult:
    mode: str
    server_args: list[str]
    wall_s: float
    turns: list[TurnResult]
    engine: dict[str, float] = field(default_factory=dict)  # ENGINE_SERIES, difference over the run
    hicache: dict[str, float] = field(default_factory=dict)  # counters: difference; gauges: value at the end
    log: str = ""


# ---------------------------------------------------------------- workload


def build_conversations(bundle: Path, args: argparse.Namespace) -> list[Conversation]:
    """Deterministic for a seed: every text round-trips through the tokenizer to its exact token count."""
    factory = workload.PromptFactory(workload._load_tokenizer(str(bundle)))

    def text(tag: str, n: int) -> str:
        return factory.text(factory.token_ids(random.Random(f"{args.seed}-{tag}"), n))

    return [Conversation(i, text(f"conv{i}-turn1", args.first_tokens),
                         [text(f"conv{i}-turn{t}", args.user_tokens) for t in range(2, args.turns + 1)])
            for i in range(args.conversations)]


def final_history_tokens(args: argparse.Namespace, max_tokens: int | None = None) -> int:
    """Tokens a conversation holds after its last turn (about: answers re-tokenized may merge at the seams), with
    ``max_tokens`` (default ``--max-tokens``) per answer."""
    answer = args.max_tokens if max_tokens is None else max_tokens
    return args.first_tokens + (args.turns - 1) * (args.user_tokens + answer) + answer


def pool_blocks(args: argparse.Namespace, block_size: int) -> tuple[int, str]:
    """``--num-kv-blocks``, or ``--pool-fraction`` of the concurrent conversations' final histories (at least
    two of the longest requests); with a line saying how it compares."""
    per_conv = math.ceil(final_history_tokens(args) / block_size)
    active = min(args.concurrency, args.conversations)
    wanted = active * per_conv
    n = args.num_kv_blocks or max(math.ceil(wanted * args.pool_fraction), 2 * per_conv + 1)
    return n, (f"KV pool {n} blocks x {block_size} = {n * block_size} tokens; the {active} concurrent "
               f"conversations' final histories need {wanted} blocks ({wanted * block_size} tokens): "
               f"{n / wanted:.0%} of them")


# ---------------------------------------------------------------- server


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(ENGINE_SERIES differences, hicache series: ``*_total`` differences, other series' end values)."""
    engine = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in ENGINE_SERIES}
    hicache = {}
    for key, value in sorted(after.items()):
        if key.startswith(HICACHE_PREFIX):
            counter = key.split("{", 1)[0].endswith("_total")
            hicache[key] = value - before.get(key, 0.0) if counter else value
    return engine, hicache


# ---------------------------------------------------------------- client


async def one_turn(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                   timeout: float, conv: int, turn: int) -> TurnResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    rec = TurnResult(conv, turn)

    async def turn_stream() -> None:
        got = await stream_completion(session, url, body, timeout)
        rec.ok, rec.error, rec.ttft, rec.latency = got.ok, got.error, got.ttft, got.latency
        rec.out_tokens, rec.prompt_tokens, rec.text = got.out_tokens, got.prompt_tokens, got.text

    await recording_errors(rec, turn_stream())
    return rec


async def run_conversation(session: aiohttp.ClientSession, url: str, model: str, conv: Conversation,
                           args: argparse.Namespace, out: list[TurnResult]) -> None:
    """The turns one after another; each prompt = the previous prompt + its answer + the next user message."""
    prompt = conv.first
    for turn in range(1, args.turns + 1):
        rec = await one_turn(session, url, model, prompt, args.max_tokens, args.timeout, conv.index, turn)
        out.append(rec)
        if not rec.ok or turn == args.turns:
            return
        prompt = prompt + rec.text + conv.users[turn - 1]


async def run_workload(url: str, convs: list[Conversation], args: argparse.Namespace,
                       budget_s: float) -> tuple[float, list[TurnResult], dict[str, float]]:
    """``--concurrency`` workers take conversations in the seeded order; all cancelled after ``budget_s``.
    Returns (wall seconds, the turns, /metrics after the warm-up request and before the workload)."""
    order = list(range(len(convs)))
    random.Random(args.seed).shuffle(order)
    todo = deque(order)
    results: list[TurnResult] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        await one_turn(session, url, model, warmup_prompt(args), 4, args.timeout, -1, 0)  # not in the results

        async def worker() -> None:
            while todo:  # bounded: every pass takes one conversation off
                await run_conversation(session, url, model, convs[todo.popleft()], args, results)

        before = scrape(url)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(min(args.concurrency, len(convs)))]
        _, pending = await asyncio.wait(tasks, timeout=max(budget_s, 1.0))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    if pending:
        print(f"  deadline: {len(pending)} worker(s) cancelled after {budget_s:.0f}s", flush=True)
    results.sort(key=lambda r: (r.conv, r.turn))
    return wall, results, before


def warmup_prompt(args: argparse.Namespace) -> str:
    """Shorter than a block: the warm-up request leaves no full block in any cache."""
    return " ".join(["the"] * 16) + f" warm up {args.seed}"


# ---------------------------------------------------------------- modes


def server_args(mode: str, args: argparse.Namespace, blocks: int, storage: Path) -> list[str]:
    out = ["--num-kv-blocks", str(blocks), "--log-level", "warning"]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if mode not in ("off", "off-again"):
        out += ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir",
                str(storage), "--hicache-storage-size", f"{args.storage_gb:g}"]
    return out + args.serve_arg


def run_mode(mode: str, bundle: Path, convs: list[Conversation], args: argparse.Namespace, blocks: int,
             storage: Path, workdir: Path, budget_s: float) -> ModeResult:
    sargs = server_args(mode, args, blocks, storage)
    log_path = workdir / f"serve-{mode}.log"
    print(f"\n== {mode}: omforge serve {' '.join(sargs)}  (log {log_path})", flush=True)
    server = ServeProcess(mode, bundle, sargs, log_path)
    try:
        server.ready()
        wall, turns, before = asyncio.run(run_workload(server.url, convs, args, budget_s))
        time.sleep(0.5)  # the engine thread's last step's counters
        engine, hicache = metric_deltas(before, scrape(server.url))
    finally:
        code = server.stop()
    log = server.log()
    if code not in (0, None) or "Traceback" in log:
        print(f"  server exit code {code}; log tail:\n{log[-2000:]}", flush=True)
    return ModeResult(mode, sargs, wall, turns, engine, hicache, log)


# ---------------------------------------------------------------- exact: offline, token ids, one request at a time


@dataclass
class ExactRun:
    """One engine's pass over the exactness workload: every (conversation, turn)'s answer token ids."""

    label: str
    num_kv_blocks: int
    tiers: bool
    seconds: float = 0.0
    answers: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    logprobs: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # each answer token's logprob
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    hicache: dict[str, float] = field(default_factory=dict)


def exact_conversations(bundle: Path, args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """(turn 1's token ids, the user messages' token ids) per conversation: the serving workload's token counts and
    seeds, kept as ids (no text round trip, so a history is exactly the ids the engine saw and produced)."""
    factory = workload.PromptFactory(workload._load_tokenizer(str(bundle)))

    def ids(tag: str, n: int) -> list[int]:
        return factory.token_ids(random.Random(f"{args.seed}-exact-{tag}"), n)

    return [(ids(f"conv{i}-turn1", args.first_tokens),
             [ids(f"conv{i}-turn{t}", args.user_tokens) for t in range(2, args.turns + 1)])
            for i in range(args.exact_conversations)]


def exact_pools(args: argparse.Namespace, block_size: int) -> tuple[int, int, str]:
    """(big pool: every conversation's final history plus one more and a margin, so nothing is ever evicted;
    small pool: ``--exact-small-blocks`` or two final histories + 1, so histories are evicted between turns)."""
    per_conv = math.ceil(final_history_tokens(args, args.exact_max_tokens) / block_size)
    total = args.exact_conversations * per_conv
    big = total + per_conv + 8
    small = args.exact_small_blocks or 2 * per_conv + 1
    return big, small, (f"final history {per_conv} blocks per conversation, {total} for all "
                        f"{args.exact_conversations}; big pool {big} blocks, small pool {small} ({small / total:.0%})")


def generate_one(engine: object, prompt: list[int], params: object, request_id: str,
                 max_steps: int) -> tuple[list[int], list[float]]:
    """One request alone in the engine, stepped until it and the tiers' I/O are done (queued writes too, so the
    next request finds them); at most ``max_steps`` steps (idle ones wait for the tier's workers). Returns its
    token ids and each one's logprob (float32 logits: equal bits only if every input bit was equal)."""
    engine.add_request(prompt, params, request_id=request_id)
    out = None
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                out = o
    else:
        raise RuntimeError(f"{request_id}: not finished after {max_steps} steps")
    if out is None:
        raise RuntimeError(f"{request_id}: the engine finished without an output")
    return list(out.token_ids), [e.logprob for e in out.logprobs]


def run_exact_engine(run: ExactRun, bundle: Path, convs: list[tuple[list[int], list[list[int]]]],
                     args: argparse.Namespace, storage: Path | None) -> ExactRun:
    """Turn 1 of every conversation, then turn 2 of every one, …, strictly one request at a time; each history is
    the previous prompt's ids + the answer's ids + the next user message's ids."""
    from omforge.runtime.engine import LLMEngine
    from omforge.runtime.sampling_params import SamplingParams

    overrides: dict = {"num_kv_blocks": run.num_kv_blocks}
    if args.threads:
        overrides["threads"] = args.threads
    if storage is not None:
        overrides.update(enable_hierarchical_cache=True, hicache_storage_backend="file",
                         hicache_storage_dir=str(storage), hicache_storage_size_gb=args.storage_gb)
    t0 = time.perf_counter()
    engine = LLMEngine(bundle, **overrides)
    try:
        params = SamplingParams(max_tokens=args.exact_max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        histories = [first for first, _ in convs]
        max_steps = 4 * final_history_tokens(args, args.exact_max_tokens) + 2000  # idle waits of 0.05 s included
        for turn in range(1, args.turns + 1):
            for i, (_, users) in enumerate(convs):
                answer, logprobs = generate_one(engine, histories[i], params, f"{run.label}-c{i}-t{turn}",
                                                max_steps)
                run.answers[(i, turn)], run.logprobs[(i, turn)] = answer, logprobs
                if turn < args.turns:
                    histories[i] = histories[i] + answer + users[turn - 1]
        run.prefill_tokens, run.prompt_tokens = engine.stats.prefill_tokens, engine.stats.prompt_tokens
        run.steps = engine.stats.steps
        if engine.hicache is not None:
            st = engine.hicache.stats()
            tier = st.tiers["storage"]
            run.hicache = {"lookup_blocks": tier.lookups, "hit_blocks": tier.hits,
                           "loaded_blocks": tier.loaded_blocks, "written_blocks": tier.written_blocks,
                           "queue_drops": tier.queue_drops, "bad_blocks": sum(tier.bad_blocks.values()),
                           "tier_blocks": tier.blocks, "loads_taken": st.loads_taken,
                           "loads_skipped": st.loads_skipped}
    finally:
        engine.close()
    run.seconds = time.perf_counter() - t0
    return run


def compare_exact(run: ExactRun, ref: ExactRun) -> dict:
    """Answers equal to ``ref``'s token for token; per differing answer its first differing position; of the
    equal answers, how many have every token's logprob bit-equal to ``ref``'s, and the largest difference."""
    differ = {}
    for key, tokens in sorted(run.answers.items()):
        other = ref.answers.get(key)
        if other is not None and other != tokens:
            differ[key] = next((k for k, (a, b) in enumerate(zip(tokens, other)) if a != b),
                               min(len(tokens), len(other)))
    first_per_conv: dict[int, tuple[int, int]] = {}
    for (conv, turn), pos in differ.items():
        first_per_conv.setdefault(conv, (turn, pos))
    same = [k for k in run.answers if k in ref.answers and k not in differ]
    gaps = [abs(a - b) for k in same for a, b in zip(run.logprobs[k], ref.logprobs[k])]
    return {"compared": sum(k in ref.answers for k in run.answers), "identical": len(run.answers) - len(differ),
            "logprobs_bit_equal": sum(run.logprobs[k] == ref.logprobs[k] for k in same),
            "max_abs_logprob_diff": max(gaps, default=0.0),
            "differ": len(differ), "first_differing_turn_and_token_per_conv": first_per_conv}


def exact_summary(run: ExactRun, ref: ExactRun | None) -> dict:
    out = {"label": run.label, "num_kv_blocks": run.num_kv_blocks, "tiers": run.tiers,
           "seconds": round(run.seconds, 1), "answers": len(run.answers), "prefill_tokens": run.prefill_tokens,
           "prompt_tokens": run.prompt_tokens, "steps": run.steps, "hicache": run.hicache}
    if ref is not None and ref is not run:
        out["vs_" + ref.label] = compare_exact(run, ref)
    return out


def run_exact(args: argparse.Namespace, workdir: Path) -> dict:
    """(a) big pool, tiers off; (b) small pool, storage tier on (a fresh directory); (c) small pool, tiers off."""
    bundle = args.bundle.resolve()
    convs = exact_conversations(bundle, args)
    big, small, line = exact_pools(args, block_size_of(bundle))
    print(f"\n== exact: {len(convs)} conversations x {args.turns} turns, one request at a time (turn-major), "
          f"token-id histories, greedy, {args.exact_max_tokens} tokens per answer\n  {line}", flush=True)
    storage = workdir / "exact-storage"
    storage.mkdir(parents=True, exist_ok=True)
    runs = [ExactRun("a-big-off", big, False), ExactRun("b-small-storage", small, True),
            ExactRun("c-small-off", small, False)]
    summaries = []
    try:
        for run in runs:
            run_exact_engine(run, bundle, convs, args, storage if run.tiers else None)
            s = exact_summary(run, runs[0])
            summaries.append(s)
            vs = s.get("vs_a-big-off")
            same = (f", {vs['identical']} of {vs['compared']} answers identical to (a), {vs['logprobs_bit_equal']} "
                    f"of them with bit-equal logprobs (largest difference {vs['max_abs_logprob_diff']:.3g})"
                    if vs else "")
            print(f"  {run.label}: pool {run.num_kv_blocks}, {run.seconds:.1f} s, prefill tokens "
                  f"{run.prefill_tokens} of {run.prompt_tokens} prompt tokens{same}"
                  f"{', ' + str(run.hicache) if run.hicache else ''}", flush=True)
            if vs and vs["differ"]:
                print(f"    first (turn, token) differing per conversation: "
                      f"{vs['first_differing_turn_and_token_per_conv']}", flush=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return {"pools": line, "runs": summaries,
            "answers": {r.label: {f"{c},{t}": ids for (c, t), ids in r.answers.items()} for r in runs}}


def hicache_flags_exist() -> bool:
    out = subprocess.run([sys.executable, "-m", "omforge", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    return "--enable-hierarchical-cache" in out.stdout


# ---------------------------------------------------------------- report


def summarize(res: ModeResult, reference: ModeResult | None, args: argparse.Namespace) -> dict:
    ok = [t for t in res.turns if t.ok]
    ttft = [t.ttft for t in ok]
    out_tokens = sum(t.out_tokens for t in ok)
    by_turn = {n: ms(statistics.median([t.ttft for t in ok if t.turn == n]))
               for n in range(1, args.turns + 1) if any(t.turn == n for t in ok)}
    summary = {
        "mode": res.mode, "turns_ok": len(ok), "errors": len(res.turns) - len(ok),
        "turns_not_run": args.conversations * args.turns - len(res.turns),  # after a failed turn, or the deadline
        "error_samples": sorted({t.error for t in res.turns if t.error})[:3],
        "wall_s": round(res.wall_s, 2), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / res.wall_s, 1) if res.wall_s else None,
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
        "ttft_ms_p50_turn2plus": ms(pct([t.ttft for t in ok if t.turn >= 2], 50)),
        "ttft_ms_p50_by_turn": by_turn,
        "latency_s_p50": round(pct([t.latency for t in ok], 50) or 0.0, 3),
        "client_prompt_tokens": sum(t.prompt_tokens for t in ok),
        "engine": res.engine, "hicache": res.hicache,
    }
    if reference is not None and reference is not res:
        ref = {(t.conv, t.turn): t.text for t in reference.turns if t.ok}
        differ = [(t.conv, t.turn) for t in ok if (t.conv, t.turn) in ref and ref[(t.conv, t.turn)] != t.text]
        compared = sum((t.conv, t.turn) in ref for t in ok)
        summary["outputs_vs"] = reference.mode
        summary["outputs_compared"], summary["outputs_differ"] = compared, len(differ)
        summary["outputs_differ_first"] = differ[:5]
    return summary


def pairwise_differ(results: dict[str, ModeResult]) -> dict[str, str]:
    """``"a vs b": "differing of compared"`` for every pair of modes (the (conversation, turn)s both answered)."""
    texts = {m: {(t.conv, t.turn): t.text for t in r.turns if t.ok} for m, r in results.items()}
    out = {}
    modes = list(results)
    for i, a in enumerate(modes):
        for b in modes[i + 1:]:
            both = texts[a].keys() & texts[b].keys()
            out[f"{a} vs {b}"] = f"{sum(texts[a][k] != texts[b][k] for k in both)} of {len(both)}"
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(s: dict[str, dict]) -> dict[str, float | None]:
    def get(mode: str, key: str) -> float | None:
        if mode not in s:
            return None
        return s[mode]["engine"].get(key) if key.startswith("omforge:") else s[mode].get(key)

    prefill = "omforge:prefill_tokens_total"
    return {"prefill_tokens on/off": ratio(get("on", prefill), get("off", prefill)),
            "ttft_p50 on/off": ratio(get("on", "ttft_ms_p50"), get("off", "ttft_ms_p50")),
            "ttft_p50_turn2plus on/off": ratio(get("on", "ttft_ms_p50_turn2plus"),
                                               get("off", "ttft_ms_p50_turn2plus")),
            "prefill_tokens restart-warm/on": ratio(get("restart-warm", prefill), get("on", prefill)),
            "ttft_p50 restart-warm/on": ratio(get("restart-warm", "ttft_ms_p50"), get("on", "ttft_ms_p50")),
            "ttft_p50 restart-warm/off": ratio(get("restart-warm", "ttft_ms_p50"), get("off", "ttft_ms_p50")),
            "ttft_p50 off-again/off": ratio(get("off-again", "ttft_ms_p50"), get("off", "ttft_ms_p50")),
            "prefill_tokens off-again/off": ratio(get("off-again", prefill), get("off", prefill))}


def print_summary(s: dict) -> None:
    print(f"  {s['turns_ok']} turns ok, {s['errors']} errors {s['error_samples'] or ''}, {s['turns_not_run']} not run")
    print(f"  TTFT ms p50 {s['ttft_ms_p50']}  p99 {s['ttft_ms_p99']}  p50 turns>=2 {s['ttft_ms_p50_turn2plus']}"
          f"  by turn {s['ttft_ms_p50_by_turn']}")
    print(f"  wall {s['wall_s']} s  output {s['output_tokens']} tok = {s['output_tok_s']} tok/s  latency p50 "
          f"{s['latency_s_p50']} s  prompt tokens (usage) {s['client_prompt_tokens']}")
    for key, value in s["engine"].items():
        print(f"  {key} {value:g}")
    for key, value in s["hicache"].items():
        print(f"  {key} {value:g}")
    if not s["hicache"]:
        print("  (no omforge:hicache_* series)")
    if "outputs_vs" in s:
        same = "identical" if s["outputs_differ"] == 0 else \
            f"{s['outputs_differ']} differ, first {s['outputs_differ_first']}"
        print(f"  greedy outputs vs {s['outputs_vs']}: {s['outputs_compared']} compared, {same}")
    sys.stdout.flush()


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, type=Path, help="an ort bundle (omforge compile's output)")
    ap.add_argument("--modes", default="off,on,restart-warm,off-again",
                    help=f"comma-separated from {MODES}: exact first, then the servers in the order given")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    ap.add_argument("--first-tokens", type=int, default=450, help="turn 1's prompt tokens")
    ap.add_argument("--user-tokens", type=int, default=200, help="tokens of each later user message")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (EOS ignored)")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="the KV pool (default: --pool-fraction)")
    ap.add_argument("--pool-fraction", type=float, default=1 / 3,
                    help="default pool: this fraction of the concurrent conversations' final histories")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads of the server")
    ap.add_argument("--storage-gb", type=float, default=4.0, help="--hicache-storage-size of modes on/warm")
    ap.add_argument("--storage-dir", type=Path, default=None,
                    help="the storage directory (default a fresh one, removed at the end)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more omforge serve argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s")
    ap.add_argument("--deadline", type=float, default=3600.0, help="whole benchmark limit, s")
    ap.add_argument("--json", type=Path, default=None, help="write summaries and every turn here")
    ap.add_argument("--exact-conversations", type=int, default=8, help="mode exact: conversations (--turns each)")
    ap.add_argument("--exact-max-tokens", type=int, default=32,
                    help="mode exact: tokens per answer (decode runs one sequence at a time here: 8 x 6 turns x 64 "
                         "tokens took ~5.5 min for the three runs on 2 cores, x 32 about 3.5)")
    ap.add_argument("--exact-small-blocks", type=int, default=None,
                    help="mode exact: the small pool of (b) and (c) (default two final histories + 1)")
    args = ap.parse_args()
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if len(set(args.mode_list)) != len(args.mode_list):
        ap.error("a mode named twice; for a second off run use off-again")
    if "restart-warm" in args.mode_list and "on" not in args.mode_list and args.storage_dir is None:
        ap.error("restart-warm without on needs --storage-dir holding an earlier run's blocks")
    return args


def block_size_of(bundle: Path) -> int:
    return int(json.loads((bundle / "manifest.json").read_text())["kv"]["block_size"])


def run_all(args: argparse.Namespace, storage: Path, workdir: Path) -> dict:
    t_end = time.monotonic() + args.deadline
    report: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if "exact" in args.mode_list:
        report["exact"] = run_exact(args, workdir)
    if any(m in SERVER_MODES for m in args.mode_list):
        report.update(run_servers(args, storage, workdir, t_end))
    return report


def run_servers(args: argparse.Namespace, storage: Path, workdir: Path, t_end: float) -> dict:
    bundle = args.bundle.resolve()
    convs = build_conversations(bundle, args)
    blocks, pool_line = pool_blocks(args, block_size_of(bundle))
    print(f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at a time; turn 1 "
          f"{args.first_tokens} tokens, +{args.user_tokens} user +{args.max_tokens} answer per turn; final history "
          f"~{final_history_tokens(args)} tokens\n{pool_line}\nstorage {storage}", flush=True)
    results: dict[str, ModeResult] = {}
    for mode in [m for m in args.mode_list if m in SERVER_MODES]:
        budget = t_end - time.monotonic()
        if budget < 10:
            print(f"\n== {mode}: skipped, the deadline is reached", flush=True)
            continue
        results[mode] = run_mode(mode, bundle, convs, args, blocks, storage, workdir, budget)
        reference = results.get("off") or next(iter(results.values()))
        print_summary(summarize(results[mode], reference, args))
    reference = results.get("off") or next(iter(results.values()), None)
    summaries = {m: summarize(r, reference, args) for m, r in results.items()}
    rat = ratios(summaries)
    print("\nratios: " + ", ".join(f"{k} {v}" for k, v in rat.items() if v is not None), flush=True)
    pairs = pairwise_differ(results)
    print("greedy answers differing, per pair of modes: " + ", ".join(f"{k} {v}" for k, v in pairs.items()),
          flush=True)
    return {"num_kv_blocks": blocks, "pool": pool_line, "summaries": summaries, "ratios": rat,
            "pairwise_differ": pairs,
            "turns": {m: [asdict(t) for t in r.turns] for m, r in results.items()},
            "server_args": {m: r.server_args for m, r in results.items()}}


def main() -> int:
    args = parse_args()
    if any(m in ("on", "restart-warm") for m in args.mode_list) and not hicache_flags_exist():
        print("bench_hicache: omforge serve has no --enable-hierarchical-cache yet; run --modes off", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="bench-hicache-"))
    storage = args.storage_dir or workdir / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    try:
        report = run_all(args, storage, workdir)
    finally:
        if args.storage_dir is None:
            shutil.rmtree(storage, ignore_errors=True)
    print(f"server logs in {workdir}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    errors = sum(s["errors"] + s["turns_not_run"] for s in report.get("summaries", {}).values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
