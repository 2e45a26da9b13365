"""Multi-LoRA serving cost: the same streamed load with 0, 1, 4 and 16 adapters spread over the requests, omforge
against vLLM CPU with ``--enable-lora``, one engine at a time, one sitting.

  .venv/bin/python benchmarks/bench_lora.py --hf SMOLLM2_HF_DIR --plain BUNDLE --lora LORA_BUNDLE \\
      --vllm-python /work/peers/venv-vllm/bin/python --work /tmp/lora-bench --out results.jsonl

The adapters are random PEFT LoRAs (``init_lora_weights=False``, fixed seeds) of rank ``--rank`` on all seven
projections of the HF directory's model, written once under ``--work``. Request ``i`` asks for adapter
``i mod k`` (k = 0: the base model). Rows: omforge on a bundle compiled without LoRA (the baseline the ≤ 20 %
goal is measured against), the LoRA bundle with base requests and with k adapters; vLLM without LoRA and with
``--enable-lora --max-loras k``. Load: ``benchmarks/harness`` short-chat (128 → 128 tokens, EOS ignored), ``--num``
requests at ``--concurrency``; medians over ``--runs``. Every wait is bounded (start-up, each request, the run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_harness import ServeProcess, http_get, ms, pct, stop_group

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_STARTUP_S = 600.0


def make_adapters(hf_dir: Path, work: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT adapters of ``rank`` over ``hf_dir`` (made once; seeds 0 … count-1)."""
    paths = [work / f"adapter{i}" for i in range(count)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, path in enumerate(paths):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
        model = get_peft_model(base, config)
        with torch.no_grad():  # small B: the adapted model stays a language model, not noise
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        model.save_pretrained(path)
    return paths


class VllmProcess:
    """vLLM's OpenAI server on 127.0.0.1 (both cores bound, tcmalloc, as docs/peers.md)."""

    def __init__(self, python: str, hf_dir: Path, port: int, args: list[str], log_path: Path):
        venv = Path(python).parent.parent
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(venv / "lib/libiomp5.so"))
                   if Path(p).exists()]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "OMP_NUM_THREADS": "2", "LD_PRELOAD": ":".join(preload)}
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", "float32",
               "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), *args]
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def ready(self) -> str:
        deadline = time.monotonic() + VLLM_STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            if http_get(self.url + "/v1/models", timeout=5)[0] == 200:
                return self.url
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM not ready within {VLLM_STARTUP_S:.0f}s")

    def stop(self) -> int | None:
        return stop_group(self.proc, signal.SIGINT, 60)


async def load(url: str, requests: list[dict], models: list[str], concurrency: int, timeout: float,
               deadline: float, loadgen) -> dict:  # noqa: ANN001 - the shared loadgen module
    """The requests at ``concurrency``, request ``i`` on ``models[i % len(models)]``; throughput and latencies."""
    a = SimpleNamespace(base_url=url, token_ids=False, ignore_eos=True, eos_logit_bias=None, extra=None,
                        timeout=timeout)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int, req: dict) -> dict:
            async with sem:
                return await loadgen.one_request(session, a, req, models[i % len(models)])

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    res = [t.result() for t in tasks if t in done]
    ok = [r for r in res if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    return {"completed": len(ok), "errors": len(requests) - len(ok),
            "error_samples": sorted({r["error"] for r in res if not r["ok"]})[:3],
            "wall_s": round(wall, 2), "output_tok_s": round(sum(r["out_tokens"] for r in ok) / wall, 1),
            "ttft_ms_p50": ms(pct([r["ttft"] for r in ok], 50)), "ttft_ms_p99": ms(pct([r["ttft"] for r in ok], 99)),
            "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99))}


def measure(label: str, url: str, models: list[str], requests: list[dict], a: argparse.Namespace,
            loadgen) -> dict:  # noqa: ANN001
    asyncio.run(load(url, requests[:a.concurrency], models, a.concurrency, a.timeout, a.deadline, loadgen))  # warm
    runs = [asyncio.run(load(url, requests, models, a.concurrency, a.timeout, a.deadline, loadgen))
            for _ in range(a.runs)]
    row = {"label": label, "adapters": len(models) if models[0] != a.base_model else 0, "runs": runs,
           **{k: statistics.median(r[k] for r in runs) for k in ("output_tok_s", "itl_ms_p50", "itl_ms_p99",
                                                                  "ttft_ms_p50", "ttft_ms_p99")},
           "errors": sum(r["errors"] for r in runs), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, required=True, help="the HF directory (vLLM model, adapters base)")
    ap.add_argument("--plain", type=Path, help="omforge bundle compiled without LoRA (the baseline)")
    ap.add_argument("--lora", type=Path, help="omforge bundle compiled with compile.lora (max_loras ≥ the largest k)")
    ap.add_argument("--vllm-python", help="the python of a vLLM CPU venv (omit: no vLLM rows)")
    ap.add_argument("--work", type=Path, required=True, help="where the adapters are written (once)")
    ap.add_argument("--bench-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "bench")
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--deadline", type=float, default=900.0)
    ap.add_argument("--only", default="omforge,vllm")
    ap.add_argument("--out", help="append one JSON line per row here")
    a = ap.parse_args()
    sys.path.insert(0, str(a.bench_dir))
    import loadgen
    import workload

    ks = [int(k) for k in a.adapters.split(",")]
    a.work.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(a.hf, a.work, max(ks), a.rank)
    requests = workload.build(str(a.hf), "short-chat", a.num, 0, None, None, None)
    names = [f"a{i}" for i in range(max(ks))]
    modules = [f"{n}={p}" for n, p in zip(names, adapters)]
    engines = a.only.split(",")
    logs = a.work / "logs"
    logs.mkdir(exist_ok=True)

    def log(label: str) -> Path:
        return logs / f"{label.replace(' ', '_')}.log"

    servers = []  # (label, start, the adapter counts to measure on it)
    if "omforge" in engines:
        if a.plain is not None:
            servers.append(("omforge no-lora bundle", lambda label: ServeProcess(label, a.plain, [], log(label)), [0]))
        if a.lora is not None:
            servers.append(("omforge", lambda label: ServeProcess(
                label, a.lora, ["--lora-modules", *modules, "--max-loras", str(max(ks))], log(label)), [0, *ks]))
    if "vllm" in engines and a.vllm_python:
        servers.append(("vllm no-lora", lambda label: VllmProcess(a.vllm_python, a.hf, 8123, [], log(label)), [0]))
        servers.append(("vllm --enable-lora", lambda label: VllmProcess(
            a.vllm_python, a.hf, 8123, ["--enable-lora", "--max-loras", str(max(ks)), "--max-lora-rank", str(a.rank),
                                        "--lora-modules", *modules], log(label)), ks))
    for label, start, counts in servers:  # one engine at a time
        server = start(label)
        try:
            url = server.ready()
            a.base_model = json.loads(http_get(url + "/v1/models")[1])["data"][0]["id"]
            for k in counts:
                measure(f"{label} k={k}", url, names[:k] or [a.base_model], requests, a, loadgen)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
