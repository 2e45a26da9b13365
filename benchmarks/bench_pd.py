"""Prefill/decode disaggregation (issue 22 item 6), measured: PD against co-located serving on a mixed workload —
long prompts arriving while chat streams decode — with the same CPU in every setup, one setup at a time.

The workload (deterministic for ``--seed``; prompts from the shared harness's ``workload.PromptFactory``,
benchmarks/harness/workload.py, each an exact token count): ``--chat`` chat streams of ``--chat-tokens`` prompt tokens →
``--chat-out`` output tokens, kept at ``--concurrency`` in flight (a new one starts when one ends), and ``--long``
long prompts of ``--long-tokens`` tokens → ``--long-out`` output tokens, the j-th sent ``--long-start`` +
j × ``--long-interval`` seconds after the chat streams started, whatever is running. Every request is a streamed
/v1/completions, greedy, EOS ignored. Per request: TTFT (the first streamed text chunk) and the gaps between text
chunks (inter-token gaps; a chunk carries one step's text).

Setups (``--setups``, in the order given; each starts its servers fresh, warms every path with one chat-sized and
one long-sized request of their own, measures, then stops everything before the next):
  colocated  two ordinary replicas (``--threads`` each), the requests alternated between them client-side: chat
             stream i → replica i mod 2, long prompt j → replica j mod 2;
  pd         a prefill replica (``kv_producer``) and a decode replica (``kv_consumer``), ``--threads`` each, NIXL over
             UCX/TCP on 127.0.0.1; the script is the proxy, as vLLM's toy proxy is: the prefill leg (the request with
             ``max_tokens: 1``, ``stream: false``, ``kv_transfer_params: {"do_remote_decode": true, …}``), then the
             original request with the ``kv_transfer_params`` it answered, streamed from the decode replica. TTFT is
             what the proxy's client sees: from sending the prefill leg to the decode leg's first text;
  smg        the same two replicas behind SMG's PD mode (``smg launch --pd-disaggregation --prefill URL --decode URL
             --policy round_robin``), the client sending plain requests to the gateway; if SMG fails, its log says what.

Reported per setup: TTFT p50/p99 of chat and of long requests, inter-token gap p50/p99 of the chat streams (and of
the long ones), output tok/s over the run; for PD (from /metrics, the difference over the run) the decode replica's
``omforge:kv_transfer_read_{requests,blocks,bytes,seconds,failures}_total`` → transfer time and bytes per request,
the prefill replica's ``omforge:kv_transfer_released_total{reason}``, and the client-side prefill-leg time and
decode-leg TTFT; for every replica ``omforge:kv_cache_used_blocks`` (and ``kv_transfer_held_blocks``) after the run,
which must come back to 0 within the lease + 15 s (the exit code is 1 otherwise, or on any failed request).
Medians and linear-interpolated percentiles, not means.

    .venv/bin/python benchmarks/bench_pd.py [--bundle /tmp/b/smollm2] [--setups colocated,pd,smg]
        [--chat 16] [--chat-tokens 128] [--chat-out 128] [--concurrency 8] [--long 8] [--long-tokens 1536]
        [--long-out 32] [--long-interval 1.5] [--num-kv-blocks 160] [--threads 1] [--json OUT]

The bundle is built (``omforge compile models/smollm2-135m.yaml -o BUNDLE``) when it does not exist. The servers
run ``sys.executable -m omforge``: set PYTHONPATH to a frozen copy of the package to measure a fixed commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO / "benchmarks" / "harness"  # the peers' harness, carried in the tree
sys.path.insert(0, str(SHARED_BENCH))
sys.path.insert(0, str(REPO / "benchmarks"))
import workload  # noqa: E402 - the shared harness's prompt factory
from serving_harness import ServeProcess, http_get, ms, pct, recording_errors, scrape, stop_group, stream_completion  # noqa: E402

SETUPS = ("colocated", "pd", "smg")
GATEWAY_TIMEOUT_S = 60.0
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # as vLLM's toy proxy sends it
READ_SERIES = ("requests", "blocks", "bytes", "seconds", "failures")
DEFAULT_BUNDLE = Path("/tmp/b/smollm2")


@dataclass(frozen=True)
class Req:
    kind: str  # "chat" | "long" | "warmup"
    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    chat: list[Req]
    long: list[Req]
    warmup: list[Req]  # one chat-sized and one long-sized request, prompts of their own


@dataclass
class ReqResult:
    kind: str
    index: int
    sent_s: float = 0.0  # when it was sent, from the workload's start
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    gaps: list[float] = field(default_factory=list)  # between successive text chunks
    out_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    lane: str = ""  # the replica (co-located) or "pd"
    prefill_leg_s: float | None = None  # PD: the prefill leg's round trip
    decode_ttft: float | None = None  # PD: from sending the decode leg to its first text
    transfer_blocks: int | None = None  # PD: len(remote_block_ids) the prefill answered


@dataclass
class SetupResult:
    setup: str
    server_args: dict[str, list[str]] = field(default_factory=dict)
    wall_s: float = 0.0
    results: list[ReqResult] = field(default_factory=list)
    deltas: dict[str, dict[str, float]] = field(default_factory=dict)  # per server: counter differences
    idle: dict[str, dict] = field(default_factory=dict)  # per server: blocks after the run
    error: str | None = None
    logs: dict[str, str] = field(default_factory=dict)  # log tails of servers / the gateway on trouble


# ---------------------------------------------------------------- workload


def build_workload(bundle: Path, args: argparse.Namespace) -> Workload:
    """Every prompt round-trips through the tokenizer to its exact token count; one seeded RNG per prompt."""
    factory = workload.PromptFactory(workload._load_tokenizer(str(bundle)))

    def req(kind: str, index: int, n: int, out: int) -> Req:
        ids = factory.token_ids(random.Random(f"{args.seed}-pd-{kind}-{index}-{n}"), n)
        return Req(kind, index, factory.text(ids), n, out)

    return Workload([req("chat", i, args.chat_tokens, args.chat_out) for i in range(args.chat)],
                    [req("long", j, args.long_tokens, args.long_out) for j in range(args.long)],
                    [req("warmup", 0, args.chat_tokens, 8), req("warmup", 1, args.long_tokens, 2)])


def request_body(req: Req, model: str) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """``smg launch`` in PD mode over one prefill and one decode replica; ready when GET /workers lists both."""

    def __init__(self, prefill: str, decode: str, log_path: Path, log_level: str):
        smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
        if smg is None:
            raise RuntimeError("SMG is not installed (pip install '.[cluster]')")
        self.log_path, port = log_path, free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--pd-disaggregation", "--prefill", prefill, "--decode",
               decode, "--policy", "round_robin", "--worker-startup-check-interval", "1", "--log-level", log_level]
        self.cmd = cmd
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> None:
        deadline = time.monotonic() + GATEWAY_TIMEOUT_S
        while time.monotonic() < deadline:
            status, text = http_get(self.url + "/workers", timeout=2)
            if status == 200 and len(json.loads(text).get("workers", [])) >= 2:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"SMG did not list both workers within {GATEWAY_TIMEOUT_S:.0f}s:\n{self.log()[-3000:]}")

    def stop(self) -> int | None:
        return stop_group(self.proc, signal.SIGTERM, 15)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The ``*_total`` series that moved over the run (omforge:kv_transfer_* kept even when they did not)."""
    out = {}
    for key, value in sorted(after.items()):
        name = key.split("{", 1)[0]
        if name.endswith("_total"):
            d = value - before.get(key, 0.0)
            if d or name.startswith("omforge:kv_transfer_"):
                out[key] = d
    return out


def wait_idle(url: str, timeout: float) -> dict:
    """Poll /metrics until ``omforge:kv_cache_used_blocks`` (and ``kv_transfer_held_blocks`` where served) are 0,
    at most ``timeout`` s; returns the last values, the wait and whether idle was reached."""
    t0 = time.monotonic()
    used = held = None
    while True:
        m = scrape(url)
        used = m.get("omforge:kv_cache_used_blocks")
        held = m.get("omforge:kv_transfer_held_blocks", 0.0)
        if used == 0 and held == 0:
            return {"used_blocks": used, "held_blocks": held, "waited_s": round(time.monotonic() - t0, 2),
                    "idle": True}
        if time.monotonic() - t0 > timeout:
            return {"used_blocks": used, "held_blocks": held, "waited_s": round(time.monotonic() - t0, 2),
                    "idle": False}
        time.sleep(0.25)


# ---------------------------------------------------------------- client


async def stream_leg(session: aiohttp.ClientSession, url: str, body: dict, timeout: float, rec: ReqResult,
                     t0: float) -> None:
    """A streamed /v1/completions into ``rec`` (TTFT from ``t0``, gaps, usage, text) or ``rec.error``."""
    got = await stream_completion(session, url, body, timeout, t0)
    rec.ok, rec.error, rec.ttft, rec.latency, rec.gaps = got.ok, got.error, got.ttft, got.latency, got.gaps
    rec.text, rec.out_tokens, rec.prompt_tokens = got.text, got.out_tokens, got.prompt_tokens


async def prefill_leg(session: aiohttp.ClientSession, url: str, body: dict, timeout: float) -> dict:
    """vLLM's toy proxy's first leg: the request with ``max_tokens: 1``, not streamed, ``do_remote_decode``;
    returns the response's top-level ``kv_transfer_params``."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_LEG)
    async with session.post(url + "/v1/completions", json=leg,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"prefill leg: HTTP {resp.status}: {text[:300]}")
    params = json.loads(text).get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill leg answered no kv_transfer_params: {text[:300]}")
    return params


class Target(Protocol):
    lanes: int  # warm-up requests per request: one per replica a client request can land on

    async def send(self, session: aiohttp.ClientSession, req: Req, rec: ReqResult, timeout: float) -> None: ...


@dataclass
class RoundRobin:
    """Co-located: request ``index`` of each kind to replica ``index mod len(urls)``."""

    urls: list[str]
    model: str
    lanes: int = 2

    async def send(self, session: aiohttp.ClientSession, req: Req, rec: ReqResult, timeout: float) -> None:
        rec.lane = self.urls[req.index % len(self.urls)]
        await stream_leg(session, rec.lane, request_body(req, self.model), timeout, rec, time.perf_counter())


@dataclass
class PDProxy:
    """The script as vLLM's toy proxy: the prefill leg, then the decode leg with its ``kv_transfer_params``."""

    prefill: str
    decode: str
    model: str
    lanes: int = 1

    async def send(self, session: aiohttp.ClientSession, req: Req, rec: ReqResult, timeout: float) -> None:
        rec.lane = "pd"
        t0 = time.perf_counter()
        body = request_body(req, self.model)
        params = await prefill_leg(session, self.prefill, body, timeout)
        rec.prefill_leg_s = time.perf_counter() - t0
        rec.transfer_blocks = len(params.get("remote_block_ids") or [])
        body["kv_transfer_params"] = params
        await stream_leg(session, self.decode, body, timeout, rec, t0)
        if rec.ttft is not None:
            rec.decode_ttft = rec.ttft - rec.prefill_leg_s


@dataclass
class Direct:
    """One URL (the gateway): plain requests."""

    url: str
    model: str
    lanes: int = 1

    async def send(self, session: aiohttp.ClientSession, req: Req, rec: ReqResult, timeout: float) -> None:
        rec.lane = self.url
        await stream_leg(session, self.url, request_body(req, self.model), timeout, rec, time.perf_counter())


async def run_one(session: aiohttp.ClientSession, target: Target, req: Req, timeout: float,
                  t_start: float) -> ReqResult:
    rec = ReqResult(req.kind, req.index, sent_s=time.perf_counter() - t_start)
    await recording_errors(rec, target.send(session, req, rec, timeout))
    return rec


async def warm(target: Target, reqs: list[Req], timeout: float) -> list[str]:
    """Each warm-up request once per lane, one at a time; returns the errors."""
    errors = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for req in reqs:
            for lane in range(target.lanes):
                rec = await run_one(session, target, Req(req.kind, lane, req.prompt, req.prompt_tokens,
                                                         req.max_tokens), timeout, time.perf_counter())
                if not rec.ok:
                    errors.append(f"warm-up {req.prompt_tokens} tokens: {rec.error}")
    return errors


async def run_workload(target: Target, wl: Workload, args: argparse.Namespace) -> tuple[float, list[ReqResult]]:
    """``--concurrency`` chat workers take the chat streams in order; each long prompt is sent at its time.
    Everything still running at ``--deadline`` is cancelled (and missing from the results)."""
    todo = deque(wl.chat)
    results: list[ReqResult] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t_start = time.perf_counter()

        async def chat_worker() -> None:
            while todo:  # bounded: every pass takes one off
                results.append(await run_one(session, target, todo.popleft(), args.timeout, t_start))

        async def long_arrival(req: Req, at: float) -> None:
            await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
            results.append(await run_one(session, target, req, args.timeout, t_start))

        tasks = [chat_worker() for _ in range(args.concurrency)]
        tasks += [long_arrival(r, args.long_start + j * args.long_interval) for j, r in enumerate(wl.long)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), args.deadline)
        except TimeoutError:
            print(f"  the {args.deadline:.0f}s deadline passed: the requests still running were cancelled", flush=True)
        wall = time.perf_counter() - t_start
    return wall, results


# ---------------------------------------------------------------- setups


def replica_args(args: argparse.Namespace, role: str | None, engine_id: str) -> tuple[list[str], dict[str, str]]:
    """(omforge serve arguments, extra environment) of one replica; ``role`` None: an ordinary replica."""
    serve_args = ["--threads", str(args.threads), "--num-kv-blocks", str(args.num_kv_blocks), *args.serve_arg]
    if role is None:
        return serve_args, {}
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
              "kv_connector_extra_config": {"kv_lease_duration": args.lease}}
    env = {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return [*serve_args, "--kv-transfer-config", json.dumps(config)], env


def start_servers(setup: str, bundle: Path, args: argparse.Namespace, workdir: Path,
                  res: SetupResult) -> dict[str, ServeProcess]:
    roles = ({"replica-0": None, "replica-1": None} if setup == "colocated"
             else {"prefill": "kv_producer", "decode": "kv_consumer"})
    servers = {}
    for name, role in roles.items():
        serve_args, env = replica_args(args, role, f"{setup}-{name}")
        res.server_args[name] = serve_args
        servers[name] = ServeProcess(name, bundle, serve_args, workdir / f"{setup}-{name}.log", env)
    for server in servers.values():  # started together, waited for one by one (bounded)
        server.ready()
    return servers


def make_target(setup: str, servers: dict[str, ServeProcess], gateway: Gateway | None) -> Target:
    first = next(iter(servers.values())).url
    model = json.loads(http_get(first + "/v1/models")[1])["data"][0]["id"]
    if setup == "colocated":
        return RoundRobin([s.url for s in servers.values()], model)
    if setup == "pd":
        return PDProxy(servers["prefill"].url, servers["decode"].url, model)
    assert gateway is not None
    return Direct(gateway.url, model)


def run_setup(setup: str, bundle: Path, wl: Workload, args: argparse.Namespace, workdir: Path) -> SetupResult:
    """Fresh servers (and gateway), warm-up, the workload, /metrics before and after, the idle check, stop."""
    res = SetupResult(setup)
    servers: dict[str, ServeProcess] = {}
    gateway = None
    try:
        servers = start_servers(setup, bundle, args, workdir, res)
        if setup == "smg":
            gateway = Gateway(servers["prefill"].url, servers["decode"].url, workdir / "smg.log", args.smg_log_level)
            res.server_args["smg"] = gateway.cmd[1:]
            gateway.ready()
        target = make_target(setup, servers, gateway)
        t0 = time.monotonic()
        warm_errors = asyncio.run(warm(target, wl.warmup, args.timeout))
        print(f"  warm-up {time.monotonic() - t0:.1f}s{': ' + '; '.join(warm_errors) if warm_errors else ''}",
              flush=True)
        before = {n: scrape(s.url) for n, s in servers.items()}
        res.wall_s, res.results = asyncio.run(run_workload(target, wl, args))
        after = {n: scrape(s.url) for n, s in servers.items()}
        res.deltas = {n: counter_deltas(before[n], after[n]) for n in servers}
        res.idle = {n: wait_idle(s.url, args.lease + 15) for n, s in servers.items()}
        if warm_errors and not any(r.ok for r in res.results):
            res.error = "; ".join(warm_errors)
    except Exception as e:  # a setup that fails is reported with its logs, the others still run
        res.error = f"{type(e).__name__}: {e}"[:3000]
    finally:
        if gateway is not None:
            gateway.stop()
            res.logs["smg"] = gateway.log()[-6000:]
        for name, server in servers.items():
            server.stop()
            if res.error or not all(i.get("idle") for i in res.idle.values()):
                res.logs[name] = server.log()[-4000:]
    return res


# ---------------------------------------------------------------- report


def kind_summary(recs: list[ReqResult], wanted: int) -> dict:
    ok = [r for r in recs if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    out = {"ok": len(ok), "errors": len(recs) - len(ok), "not_run": wanted - len(recs),
           "ttft_ms_p50": ms(pct([r.ttft for r in ok], 50)), "ttft_ms_p99": ms(pct([r.ttft for r in ok], 99)),
           "itl_ms_p50": ms(pct(gaps, 50)), "itl_ms_p99": ms(pct(gaps, 99)),
           "itl_ms_max": ms(max(gaps, default=None)), "gaps": len(gaps),
           "latency_s_p50": round(pct([r.latency for r in ok], 50) or 0.0, 3),
           "output_tokens": sum(r.out_tokens for r in ok)}
    if any(r.prefill_leg_s is not None for r in ok):
        out["prefill_leg_ms_p50"] = ms(pct([r.prefill_leg_s for r in ok if r.prefill_leg_s is not None], 50))
        out["decode_leg_ttft_ms_p50"] = ms(pct([r.decode_ttft for r in ok if r.decode_ttft is not None], 50))
        out["decode_leg_ttft_ms_p99"] = ms(pct([r.decode_ttft for r in ok if r.decode_ttft is not None], 99))
        out["remote_blocks_per_request"] = pct([float(r.transfer_blocks or 0) for r in ok], 50)
    return out


def transfer_summary(res: SetupResult) -> dict:
    """The decode replica's reads and the prefill replica's releases over the run (PD setups)."""
    dec, pre = res.deltas.get("decode", {}), res.deltas.get("prefill", {})
    read = {s: dec.get(f"omforge:kv_transfer_read_{s}_total", 0.0) for s in READ_SERIES}
    n = read["requests"]
    released = {k.split("reason=", 1)[1].rstrip("}"): v for k, v in pre.items()
                if k.startswith("omforge:kv_transfer_released_total{")}
    return {"read": read, "ms_per_read": round(1000 * read["seconds"] / n, 2) if n else None,
            "mb_per_read": round(read["bytes"] / n / 1e6, 2) if n else None,
            "blocks_per_read": round(read["blocks"] / n, 2) if n else None,
            "gb_per_s": round(read["bytes"] / read["seconds"] / 1e9, 3) if read["seconds"] else None,
            "held_requests": pre.get("omforge:kv_transfer_held_requests_total", 0.0),
            "released": released}


def summarize(res: SetupResult, args: argparse.Namespace, reference: SetupResult | None) -> dict:
    chat = [r for r in res.results if r.kind == "chat"]
    long = [r for r in res.results if r.kind == "long"]
    ok = [r for r in res.results if r.ok]
    chat_end = max((r.sent_s + (r.latency or 0.0) for r in chat if r.ok), default=0.0)
    out_tokens = sum(r.out_tokens for r in ok)
    s = {"setup": res.setup, "error": res.error, "wall_s": round(res.wall_s, 2), "output_tokens": out_tokens,
         "output_tok_s": round(out_tokens / res.wall_s, 1) if res.wall_s else None,
         "chat_streams_end_s": round(chat_end, 2),
         "long_sent_during_chat": sum(r.sent_s < chat_end for r in long),
         "chat": kind_summary(chat, args.chat), "long": kind_summary(long, args.long),
         "error_samples": sorted({r.error for r in res.results if r.error})[:3],
         "idle": res.idle, "idle_ok": bool(res.idle) and all(i["idle"] for i in res.idle.values())}
    if res.setup != "colocated":
        s["transfer"] = transfer_summary(res)
    if reference is not None and reference is not res:
        ref = {(r.kind, r.index): r.text for r in reference.results if r.ok}
        both = [r for r in ok if (r.kind, r.index) in ref]
        s["outputs_vs"] = reference.setup
        s["outputs_identical"] = f"{sum(ref[(r.kind, r.index)] == r.text for r in both)} of {len(both)}"
    return s


def print_summary(s: dict) -> None:
    if s["error"]:
        print(f"  SETUP FAILED: {s['error'][:1500]}")
    for kind in ("chat", "long"):
        k = s[kind]
        pd = (f"  prefill leg p50 {k['prefill_leg_ms_p50']} ms, decode-leg TTFT p50/p99 {k['decode_leg_ttft_ms_p50']}"
              f"/{k['decode_leg_ttft_ms_p99']} ms, {k['remote_blocks_per_request']} blocks"
              if "prefill_leg_ms_p50" in k else "")
        print(f"  {kind}: {k['ok']} ok, {k['errors']} errors, {k['not_run']} not run; TTFT p50/p99 "
              f"{k['ttft_ms_p50']}/{k['ttft_ms_p99']} ms; ITL p50/p99/max {k['itl_ms_p50']}/{k['itl_ms_p99']}/"
              f"{k['itl_ms_max']} ms over {k['gaps']} gaps; {k['output_tokens']} tokens{pd}")
    print(f"  wall {s['wall_s']} s, {s['output_tokens']} output tokens = {s['output_tok_s']} tok/s; chat streams "
          f"ended at {s['chat_streams_end_s']} s, {s['long_sent_during_chat']} long prompts sent before that")
    if "transfer" in s:
        t = s["transfer"]
        print(f"  KV reads {t['read']}: {t['ms_per_read']} ms, {t['mb_per_read']} MB, {t['blocks_per_read']} blocks "
              f"per read ({t['gb_per_s']} GB/s); prefill held {t['held_requests']:g}, released {t['released']}")
    print(f"  after the run: {s['idle']} -> {'idle' if s['idle_ok'] else 'NOT IDLE'}")
    if s["error_samples"]:
        print(f"  errors: {s['error_samples']}")
    if "outputs_vs" in s:
        print(f"  greedy outputs identical to {s['outputs_vs']}: {s['outputs_identical']}")
    sys.stdout.flush()


def table(summaries: dict[str, dict]) -> str:
    rows = ["| setup | chat TTFT p50 / p99 ms | long TTFT p50 / p99 ms | chat ITL p50 / p99 ms | output tok/s | "
            "KV read per request ms / MB | idle after |", "|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        c, g = s["chat"], s["long"]
        t = s.get("transfer")
        kv = f"{t['ms_per_read']} / {t['mb_per_read']}" if t else "—"
        rows.append(f"| {name} | {c['ttft_ms_p50']} / {c['ttft_ms_p99']} | {g['ttft_ms_p50']} / {g['ttft_ms_p99']} | "
                    f"{c['itl_ms_p50']} / {c['itl_ms_p99']} | {s['output_tok_s']} | {kv} | "
                    f"{'yes' if s['idle_ok'] else 'NO'} |")
    return "\n".join(rows)


def verdict(summaries: dict[str, dict]) -> dict[str, str]:
    """Issue 22's acceptance line, per PD setup: chat inter-token p99 below co-located's."""
    base = summaries.get("colocated", {}).get("chat", {}).get("itl_ms_p99")
    out = {}
    for name in ("pd", "smg"):
        got = summaries.get(name, {}).get("chat", {}).get("itl_ms_p99")
        if base is None or got is None:
            out[name] = "not measured"
        else:
            word = "better" if got < base else "NOT better"
            out[name] = f"chat ITL p99 {got} ms vs co-located {base} ms: {word} ({got / base:.2f}x)"
    return out


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="an ort bundle (built when missing)")
    ap.add_argument("--setups", default="colocated,pd,smg", help=f"comma-separated from {SETUPS}, run in order")
    ap.add_argument("--chat", type=int, default=16, help="chat streams")
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--chat-out", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8, help="chat streams in flight")
    ap.add_argument("--long", type=int, default=8, help="long prompts")
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--long-out", type=int, default=32)
    ap.add_argument("--long-start", type=float, default=1.5, help="s after the start: the first long prompt")
    ap.add_argument("--long-interval", type=float, default=1.5, help="s between long prompts")
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="per replica")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per replica")
    ap.add_argument("--lease", type=float, default=30.0, help="kv_lease_duration of the PD replicas, s")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more omforge serve argument (all)")
    ap.add_argument("--smg-log-level", default="info", choices=("debug", "info", "warn", "error"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s")
    ap.add_argument("--deadline", type=float, default=900.0, help="per-setup workload limit, s")
    ap.add_argument("--json", type=Path, default=None, help="write summaries and every request here")
    args = ap.parse_args()
    args.setup_list = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = [x for x in args.setup_list if x not in SETUPS]
    if bad or len(set(args.setup_list)) != len(args.setup_list):
        ap.error(f"--setups: each of {SETUPS} at most once, got {args.setup_list}")
    return args


def ensure_bundle(bundle: Path) -> Path:
    if not (bundle / "manifest.json").exists():
        print(f"building {bundle} from models/smollm2-135m.yaml", flush=True)
        subprocess.run([sys.executable, "-m", "omforge", "compile", str(REPO / "models" / "smollm2-135m.yaml"),
                        "-o", str(bundle)], check=True, timeout=3600)
    return bundle.resolve()


def provenance() -> dict[str, str]:
    """Which omforge the servers import (PYTHONPATH may point at a frozen copy) and the checkout's HEAD."""
    mod = subprocess.run([sys.executable, "-c", "import omforge; print(omforge.__file__)"], capture_output=True,
                         text=True, timeout=120).stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    return {"omforge_module": mod, "checkout_head": head, "pythonpath": os.environ.get("PYTHONPATH", "")}


def main() -> int:
    args = parse_args()
    bundle = ensure_bundle(args.bundle)
    wl = build_workload(bundle, args)
    prov = provenance()
    print(f"omforge from {prov['omforge_module']} (checkout HEAD {prov['checkout_head']})\n"
          f"{args.chat} chat streams {args.chat_tokens} -> {args.chat_out} tokens at concurrency {args.concurrency}; "
          f"{args.long} long prompts {args.long_tokens} -> {args.long_out}, the first at {args.long_start:g}s, one "
          f"every {args.long_interval:g}s; --threads {args.threads} and --num-kv-blocks {args.num_kv_blocks} per "
          f"replica", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    results: dict[str, SetupResult] = {}
    summaries: dict[str, dict] = {}
    for setup in args.setup_list:
        print(f"\n== {setup}", flush=True)
        t0 = time.monotonic()
        results[setup] = run_setup(setup, bundle, wl, args, workdir)
        reference = results.get("colocated") or next(iter(results.values()))
        summaries[setup] = summarize(results[setup], args, reference)
        print_summary(summaries[setup])
        print(f"  ({time.monotonic() - t0:.0f}s with start-up and stop)", flush=True)
    print("\n" + table(summaries))
    verdicts = verdict(summaries)
    for name, line in verdicts.items():
        if name in summaries:
            print(f"{name}: {line}")
    print(f"server logs in {workdir}")
    if args.json:
        report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "provenance": prov, "summaries": summaries, "verdict": verdicts,
                  "setups": {n: asdict(r) for n, r in results.items()}}
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    bad = [n for n, s in summaries.items() if s["error"] or not s["idle_ok"] or s["chat"]["errors"]
           or s["long"]["errors"] or s["chat"]["not_run"] or s["long"]["not_run"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
