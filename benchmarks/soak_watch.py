"""What the soak watches beside its clients (benchmarks/soak.py): ``/health`` latency of every server and the
resident memory of every server's process group, sampled in a process of its own (so the clients' event loop never
delays a probe), and the servers' engine state from ``/metrics`` once the clients are done.

Contracts: every probe is bounded (``PROBE_TIMEOUT_S``; a probe that times out or answers other than 200 is recorded
as such); samples carry ``time.monotonic()`` (one clock for every process on the machine); :func:`engine_state`
reads only what ``/metrics`` exposes (see ``IDLE``), and :func:`settle` waits, bounded, until it is idle.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from serving_harness import http_get

PROBE_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 60.0
IDLE = ("omforge:num_requests_running", "omforge:num_requests_waiting", "omforge:num_requests_swapped",
        "omforge:kv_cache_used_blocks", "omforge:kv_transfer_held_blocks")
"""The gauges that must read 0 once nothing is in flight: sequences running, waiting, swapped out; KV blocks held
(by requests, by pins of the storage tier's writes, by held PD legs); and the held PD blocks on their own."""
LORA_INFO = "omforge:lora_requests_info"
"""Its labels name the adapters of running (pinned) and waiting requests: both empty when idle."""


def _probe(url: str) -> tuple[float, int]:
    """(seconds, status) of one GET; status 0 when nothing answered within ``PROBE_TIMEOUT_S``."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        status = 0
    return time.monotonic() - t0, status


def _group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in group ``pgid`` (MB), from /proc."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            total += int(Path(entry.path, "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # the process ended between the listing and the read
    return total / 1e6


def _watch(urls: dict[str, str], pgids: dict[str, int], out: str, ready: multiprocessing.Event,
           stop: multiprocessing.Event, health_every: float, rss_every: float) -> None:
    """The watcher process: one probing thread per server and one RSS sampler until ``stop`` (``ready`` once they
    run); then ``out`` (JSON)."""
    health: dict[str, list[tuple[float, float, int]]] = {name: [] for name in urls}
    rss: dict[str, list[tuple[float, float]]] = {name: [] for name in pgids}

    def probe(name: str) -> None:
        while not stop.is_set():
            t = time.monotonic()
            seconds, status = _probe(urls[name] + "/health")
            health[name].append((t, seconds, status))
            stop.wait(max(0.0, health_every - seconds))

    threads = [threading.Thread(target=probe, args=(n,), daemon=True) for n in urls]
    for th in threads:
        th.start()
    ready.set()
    while not stop.is_set():
        t = time.monotonic()
        for name, pgid in pgids.items():
            rss[name].append((t, _group_rss_mb(pgid)))
        stop.wait(rss_every)
    for th in threads:
        th.join(PROBE_TIMEOUT_S + 1)
    Path(out).write_text(json.dumps({"health": health, "rss": rss}))


@dataclass
class Samples:
    """``health``: per server (time, seconds, status); ``rss``: per server (time, MB)."""

    health: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    rss: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


class Watcher:
    """Starts the sampling process and waits (bounded) until it samples; :meth:`finish` stops it (bounded) and
    returns its samples."""

    def __init__(self, urls: dict[str, str], pgids: dict[str, int], out: Path, health_every: float = 0.5,
                 rss_every: float = 5.0):
        ctx = multiprocessing.get_context("spawn")
        self.out = out
        self.stop, ready = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_watch, args=(urls, pgids, str(out), ready, self.stop, health_every,
                                                     rss_every), daemon=True)
        self.proc.start()
        if not ready.wait(STARTUP_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError(f"the watcher process did not start within {STARTUP_TIMEOUT_S:g}s")

    def finish(self) -> Samples:
        self.stop.set()
        self.proc.join(PROBE_TIMEOUT_S + 15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise RuntimeError("the watcher process did not stop")
        data = json.loads(self.out.read_text())
        return Samples(data["health"], data["rss"])


def slope_mb_per_min(samples: list[tuple[float, float]], after: float) -> float | None:
    """Least-squares slope of (time, MB) after time ``after``, in MB per minute (None: under 3 samples)."""
    pts = [(t, mb) for t, mb in samples if t >= after]
    if len(pts) < 3:
        return None
    mt = sum(t for t, _ in pts) / len(pts)
    mm = sum(mb for _, mb in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60.0 * sum((t - mt) * (mb - mm) for t, mb in pts) / var if var > 0 else None


def engine_state(url: str) -> dict[str, float | str]:
    """The server's ``IDLE`` gauges it exposes, and the LoRA adapters of its running and waiting requests."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics: HTTP {status}: {text[:200]}")
    state: dict[str, float | str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in IDLE:
                state[s.name.removeprefix("omforge:")] = s.value
            elif s.name == LORA_INFO:
                state["lora_running"] = s.labels.get("running_lora_adapters", "")
                state["lora_waiting"] = s.labels.get("waiting_lora_adapters", "")
    return state


def is_idle(state: dict[str, float | str]) -> bool:
    return all(v == 0 or v == "" for v in state.values())


def settle(urls: dict[str, str], timeout: float) -> tuple[dict[str, dict[str, float | str]], float]:
    """Poll every server's state until all are idle or ``timeout`` s passed: (the last states, seconds taken)."""
    t0 = time.monotonic()
    while True:
        states = {name: engine_state(url) for name, url in urls.items()}
        if all(is_idle(s) for s in states.values()) or time.monotonic() - t0 > timeout:
            return states, time.monotonic() - t0
        time.sleep(0.5)
