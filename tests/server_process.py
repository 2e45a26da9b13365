"""A real ``omforge serve`` process on 127.0.0.1 for the server tests, with bounded waits everywhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 180.0


class ServerProcess:
    """``omforge serve BUNDLE --port 0 ARGS…`` in its own process group; ``url`` is read from its startup line."""

    def __init__(self, bundle: Path, *args: str, api_key: str | None = None, env: dict[str, str] | None = None):
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="omforge-serve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "omforge", "serve", str(bundle), "--port", "0", "--host", "127.0.0.1", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)/v1", self.log())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"omforge serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"omforge serve did not start within {STARTUP_TIMEOUT_S:.0f}s:\n{self.log()}")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs: object):  # noqa: ANN201 - openai.OpenAI
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", self.api_key or "unused"),
                             max_retries=0, timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def async_client(self, **kwargs: object):  # noqa: ANN201 - openai.AsyncOpenAI
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{label=value,…}": value}`` (labels sorted, model_name dropped)."""
        status, text = self.get("/metrics")
        assert status == 200, text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0) -> float:  # noqa: ANN001
        """Poll ``/metrics`` until ``predicate(value of name)``; returns the value (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.1)
        raise AssertionError(f"{name} stayed at {value} for {timeout:.0f}s")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait (bounded), then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
