"""The soak's servers (benchmarks/soak.py): the SmolLM2-135M bundles it needs, three PEFT adapters, and the fleet of
``omforge serve`` processes on 127.0.0.1.

Bundles, compiled from models/smollm2-135m.yaml with the same ``model`` section (one export, from the stage cache):
``plain`` (the recipe as it is: the PD pair), ``lora`` (``compile.lora``: the main server) and ``embed`` (``task:
embed``: the embeddings server). A bundle directory that already holds a manifest is reused. Adapters: random PEFT
LoRA directories (rank 8, all seven projections, small B so the adapted model stays a language model), shaped from
the bundle's model config, written once. Servers: ``main`` (the LoRA bundle with the adapters given at startup
through ``--lora-modules``, the host and storage KV tiers on), ``prefill`` + ``decode`` (NIXL over UCX/TCP on
127.0.0.1, a short lease), ``embed``. Every wait is bounded (compile, start-up, stop).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from serving_harness import ServeProcess, http_get

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "models" / "smollm2-135m.yaml"
COMPILE_TIMEOUT_S = 3600
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
ADAPTERS = ("soak-a", "soak-b", "soak-c")
LORA_SLOTS = 4  # the LoRA bundle's compile.lora.max_loras
LORA_RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Bundles:
    plain: Path
    lora: Path
    embed: Path


def _variant(work: Path, name: str, change: dict) -> Path:
    """models/smollm2-135m.yaml with ``change`` merged into its top-level sections, written to ``work``."""
    recipe = yaml.safe_load(RECIPE.read_text())
    for key, value in change.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def compile_bundle(recipe: Path, out: Path, cache: Path | None) -> Path:
    """``omforge compile recipe -o out`` (``OMFORGE_CACHE_DIR`` = ``cache`` when given), unless ``out`` holds a
    manifest."""
    if not (out / "manifest.json").is_file():
        print(f"compiling {out} from {recipe.name}", flush=True)
        env = {**os.environ, **({"OMFORGE_CACHE_DIR": str(cache)} if cache else {})}
        subprocess.run([sys.executable, "-m", "omforge", "compile", str(recipe), "-o", str(out)], check=True,
                       timeout=COMPILE_TIMEOUT_S, env=env, stdout=subprocess.DEVNULL)
    return out.resolve()


def build_bundles(work: Path, cache: Path | None = None, plain: Path | None = None) -> Bundles:
    """The three bundles under ``work`` (``plain``: an existing plain bundle to reuse), one after another (the
    first makes the export the others reuse)."""
    work.mkdir(parents=True, exist_ok=True)
    lora = _variant(work, "soak-lora", {"compile": {"lora": {"max_loras": LORA_SLOTS, "max_rank": LORA_RANK}}})
    embed = _variant(work, "soak-embed", {"task": "embed", "pooling": {"normalize": True, "append_eos": True}})
    plain = plain.resolve() if plain else compile_bundle(RECIPE, work / "plain", cache)
    return Bundles(plain, compile_bundle(lora, work / "lora", cache), compile_bundle(embed, work / "embed", cache))


def make_adapters(work: Path, bundle: Path, names: tuple[str, ...] = ADAPTERS) -> dict[str, Path]:
    """``{name: PEFT directory}``: random rank-8 adapters over every projection of ``bundle``'s model (seeded by
    position; made once)."""
    from safetensors.numpy import save_file

    cfg = json.loads((bundle / "manifest.json").read_text())["model"]["config"]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out = {}
    for seed, name in enumerate(names):
        path = work / "adapters" / name
        out[name] = path
        if (path / "adapter_model.safetensors").is_file():
            continue
        rng = np.random.default_rng(seed)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for target, (n_in, n_out) in shapes.items():
                block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{target}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((LORA_RANK, n_in)) / np.sqrt(n_in)).astype(
                    np.float32)
                tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((n_out, LORA_RANK))).astype(np.float32)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": list(TARGETS),
             "bias": "none"}))
    return out


@dataclass(frozen=True)
class FleetOptions:
    """The servers' settings: ``max_queue_time`` s the queue bound of every server; ``max_num_seqs`` and
    ``kv_cache_space`` GiB the main server's batch and pool (each PD replica gets half the pool); ``max_loras``
    adapters resident at once (of the bundle's 4 slots; fewer than the three adapters + traffic makes them
    compete for slots); ``lease_s`` the prefill replica's hold on blocks nobody reads; ``pd`` False: no PD pair."""

    max_queue_time: float = 60.0
    max_num_seqs: int = 16
    kv_cache_space: float = 0.75
    max_loras: int = 2
    lease_s: float = 30.0
    pd: bool = True
    threads: int = 1


@dataclass
class Fleet:
    """The running servers by role (``main``, ``embed``, and ``prefill`` + ``decode`` with a PD pair)."""

    servers: dict[str, ServeProcess] = field(default_factory=dict)

    def model(self, role: str) -> str:
        """The served model's name (``/v1/models``' first entry)."""
        status, text = http_get(self.servers[role].url + "/v1/models")
        if status != 200:
            raise RuntimeError(f"{role}: /v1/models answered {status}: {text[:200]}")
        return json.loads(text)["data"][0]["id"]

    def stop(self) -> dict[str, int | None]:
        """Stop every server, side by side (each bounded); their exit codes."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.servers))) as pool:
            codes = {role: pool.submit(srv.stop) for role, srv in self.servers.items()}
            return {role: code.result() for role, code in codes.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pd_replica(role: str, engine_id: str, lease_s: float) -> tuple[list[str], dict[str, str]]:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
              "kv_connector_extra_config": {"kv_lease_duration": lease_s}}
    env = {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
    return ["--kv-transfer-config", json.dumps(config)], env


def start_fleet(bundles: Bundles, adapters: dict[str, Path], work: Path, opts: FleetOptions) -> Fleet:
    """Start every server at once and wait (bounded) until each answers /health; on a failure stop them all."""
    common = ["--threads", str(opts.threads), "--max-queue-time", f"{opts.max_queue_time:g}"]
    store = work / "kv-store"
    store.mkdir(parents=True, exist_ok=True)
    main = [*common, "--max-num-seqs", str(opts.max_num_seqs), "--kv-cache-space-gb", f"{opts.kv_cache_space:g}",
            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()), "--max-loras", str(opts.max_loras),
            "--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-storage-backend", "file",
            "--hicache-storage-dir", str(store), "--hicache-storage-size", "2"]
    specs: dict[str, tuple[Path, list[str], dict[str, str]]] = {
        "main": (bundles.lora, main, {}),
        "embed": (bundles.embed, [*common, "--max-num-seqs", "16"], {})}
    if opts.pd:
        replica = [*common, "--max-num-seqs", str(opts.max_num_seqs), "--kv-cache-space-gb",
                   f"{opts.kv_cache_space / 2:g}"]
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            args, env = _pd_replica(kv_role, f"soak-{role}", opts.lease_s)
            specs[role] = (bundles.plain, [*replica, *args], env)
    fleet = Fleet()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for role, (bundle, args, env) in specs.items():
            fleet.servers[role] = ServeProcess(role, bundle, args, logs / f"{role}.log", env)
        for srv in fleet.servers.values():
            srv.ready()
    except BaseException:
        fleet.stop()
        raise
    return fleet
