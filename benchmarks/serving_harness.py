"""What the serving benchmarks share (bench_hicache.py, bench_pd.py): an ``omforge serve`` process on 127.0.0.1, its
``/metrics`` as a dict, one streamed /v1/completions read chunk by chunk, and percentiles.

Contracts: every wait is bounded (start-up, stop, each request's timeout); a server runs in its own process group
and :meth:`ServeProcess.stop` ends the whole group (SIGINT, a bounded wait, then SIGKILL); percentiles are
linear-interpolated, never means.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def http_get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    """(status, body); status 0 with the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,…}": value}`` (labels sorted, model_name dropped)."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics: HTTP {status}: {text[:200]}")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def stop_group(proc: subprocess.Popen, sig: int, timeout: float) -> int | None:
    """``sig`` to the process group, a bounded wait, then SIGKILL to the group (whatever is left of it)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"  pid {proc.pid} did not stop within {timeout:.0f}s: killed", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    return proc.returncode


class ServeProcess:
    """``python -m omforge serve BUNDLE --port 0 ARGS`` on 127.0.0.1 in its own session, started at once (the
    interpreter's own ``omforge``: PYTHONPATH picks a frozen copy); :meth:`ready` waits, bounded, for the startup
    line's URL and a 200 from /health."""

    def __init__(self, name: str, bundle: Path, server_args: list[str], log_path: Path,
                 env: dict[str, str] | None = None):
        self.name, self.log_path, self.url = name, log_path, ""
        cmd = [sys.executable, "-m", "omforge", "serve", str(bundle), "--host", "127.0.0.1", "--port", "0",
               *server_args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and not self.url:
            m = re.search(r"listening on (http://\S+)/v1", self.log())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: omforge serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-3000:]}")
            else:
                time.sleep(0.2)
        while time.monotonic() < deadline:
            if self.url and http_get(self.url + "/health")[0] == 200:
                return self.url
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name}: not healthy within {STARTUP_TIMEOUT_S:.0f}s:\n{self.log()[-3000:]}")

    def stop(self) -> int | None:
        return stop_group(self.proc, signal.SIGINT, STOP_TIMEOUT_S)


@dataclass
class Streamed:
    """One streamed completion as the client saw it; times from the ``t0`` given to :func:`stream_completion`."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # the first chunk carrying text
    latency: float | None = None  # the end of the stream
    gaps: list[float] = field(default_factory=list)  # between successive text chunks (one step's text each)
    text: str = ""
    out_tokens: int = 0  # from the usage chunk
    prompt_tokens: int = 0


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict, timeout: float,
                            t0: float | None = None) -> Streamed:
    """POST a streamed /v1/completions (``body`` should ask for ``stream_options.include_usage``) and read it one
    SSE line at a time, bounded by ``timeout``. A non-200 answer or an error event is ``Streamed.error``."""
    t0 = time.perf_counter() if t0 is None else t0
    out = Streamed()
    times: list[float] = []
    texts: list[str] = []
    async with session.post(url + "/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return out
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                out.error = str(msg["error"])[:300]
                return out
            if msg.get("usage"):
                out.out_tokens = msg["usage"].get("completion_tokens") or 0
                out.prompt_tokens = msg["usage"].get("prompt_tokens") or 0
            choices = msg.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
                texts.append(choices[0]["text"])
    out.latency = time.perf_counter() - t0
    out.text = "".join(texts)
    if not times:
        out.error = "no text streamed"
        return out
    out.ttft = times[0] - t0
    out.gaps = [b - a for a, b in zip(times, times[1:])]
    out.ok = True
    return out


async def recording_errors(rec: object, work: Awaitable[None]) -> None:
    """Await ``work``; an exception becomes ``rec.error`` (a failed request is recorded, not fatal), a
    cancellation (the run's deadline) is recorded and re-raised."""
    try:
        await work
    except asyncio.CancelledError:
        rec.error = "cancelled at the deadline"
        raise
    except Exception as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]


def pct(xs: list[float], p: float) -> float | None:
    """The ``p``-th percentile, linear between the closest ranks; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)
