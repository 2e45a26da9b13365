"""Replicas behind a gateway (docs/cluster.md): what SMG reads from a worker (``/v1/loads``, ``/version``),
``scripts/cluster.sh`` (two replicas and SMG on 127.0.0.1), SMG's ``cache_aware`` routing
against ``round_robin`` on two interleaved prefix families (benchmarks/bench_routing.py, small), and the
Kubernetes manifests against Kubernetes' own schemas. The tests that need SMG skip without it
(``pip install '.[cluster]'``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from server_process import ServerProcess

KEY = "sk-test-cluster"
SMG = shutil.which("smg", path=str(REPO / ".venv" / "bin")) or shutil.which("smg")
needs_smg = pytest.mark.skipif(SMG is None, reason="SMG is not installed (pip install '.[cluster]')")
LOAD_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
               "max_total_num_tokens", "token_usage", "cache_hit_rate", "max_running_requests"}


def bench_routing():  # noqa: ANN201 - the benchmark's module (its cluster and workload code is what is tested)
    spec = importlib.util.spec_from_file_location("bench_routing", REPO / "benchmarks" / "bench_routing.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)  # registered first: its dataclasses resolve their annotations through it
    return module


def get_json(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(smollm2_bundle: Path):  # noqa: ANN201
    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "128", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_loads_report_the_engine_and_version_answers_as_vllm_does(server: ServerProcess,
                                                                   smollm2_bundle: Path) -> None:
    from omforge.contract.manifest import load_manifest

    block = load_manifest(smollm2_bundle).kv.paged_layout.block_size
    assert get_json(server.url + "/v1/loads")[0] == 401  # /v1/ routes need the key; /version and /metrics do not
    status, idle = get_json(server.url + "/v1/loads?include=core,disagg,queues,memory", KEY)  # SMG's query
    assert status == 200 and idle["dp_rank_count"] == 1 and len(idle["loads"]) == 1
    rank = idle["loads"][0]
    assert set(rank) == LOAD_FIELDS
    assert rank["max_total_num_tokens"] == 128 * block and rank["num_used_tokens"] == 0
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["token_usage"]) == (0, 0, 0.0)
    assert rank["max_running_requests"] == 64  # the recipe's max_num_seqs
    status, version = get_json(server.url + "/version")
    assert status == 200 and set(version) == {"version"} and version["version"]

    client = server.client()
    prefix = "Standing orders of the harbour office: " + "every vessel reports its cargo at the quay. " * 20
    seen: list[dict] = []
    stream = client.completions.create(model="smollm2-135m", prompt=prefix + "First question?", max_tokens=48,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 8:  # mid-stream: the request is running and holds blocks
            seen.append(get_json(server.url + "/v1/loads", KEY)[1]["loads"][0])
    assert seen and seen[0]["num_running_reqs"] == 1 and seen[0]["num_used_tokens"] > 0
    assert seen[0]["token_usage"] == seen[0]["num_used_tokens"] / seen[0]["max_total_num_tokens"]
    client.completions.create(model="smollm2-135m", prompt=prefix + "Second question?", max_tokens=2, temperature=0)
    metrics = server.metrics()
    after = get_json(server.url + "/v1/loads", KEY)[1]["loads"][0]
    assert after["num_running_reqs"] == 0 and after["cache_hit_rate"] > 0  # the second prompt reused the prefix
    assert after["cache_hit_rate"] == pytest.approx(metrics["omforge:prefix_cache_hit_rate"])
    assert after["token_usage"] == metrics["omforge:kv_cache_usage_perc"]
    assert "vllm:" not in server.get("/metrics")[1]  # SMG >= 1.13 reads /v1/loads, not vLLM's gauge names


@needs_smg
def test_cluster_sh_serves_two_replicas_behind_smg_and_stops_them(smollm2_bundle: Path) -> None:
    """SMG registers both replicas as vLLM-compatible (from /version) and reads their load from /v1/loads; it
    answers through the openai client with what a replica answers directly; the script's stop leaves no replica
    listening."""
    import openai

    from omforge.contract.manifest import load_manifest

    cluster = bench_routing().Cluster(smollm2_bundle, "cache_aware", ["--num-kv-blocks", "128"])
    try:
        assert len(cluster.replicas) == 2
        status, workers = get_json(cluster.gateway + "/workers")
        assert status == 200
        listed = {w["url"]: w for w in workers["workers"]}
        assert set(listed) == set(cluster.replicas)
        assert {w.get("runtime_type") for w in listed.values()} == {"vllm"}, workers
        block = 128 * load_manifest(smollm2_bundle).kv.paged_layout.block_size
        deadline, polled = time.monotonic() + 30, set()  # SMG polls every --load-monitor-interval (10 s)
        while time.monotonic() < deadline and polled != {block}:
            time.sleep(1)
            polled = {w.get("engine_load", {}).get("loads", [{}])[0].get("max_total_num_tokens")
                      for w in get_json(cluster.gateway + "/workers")[1]["workers"]}
        assert polled == {block}, polled  # only /v1/loads reports the pool's size in tokens
        kwargs = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0,
                  "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        via = openai.OpenAI(base_url=cluster.gateway + "/v1", api_key="unused", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=cluster.replicas[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = via.chat.completions.create(**kwargs).choices[0].message.content
        assert answer and answer == direct.chat.completions.create(**kwargs).choices[0].message.content
        chunks = [c.choices[0].delta.content or "" for c in via.chat.completions.create(**kwargs, stream=True)
                  if c.choices]
        assert "".join(chunks) == answer
    finally:
        cluster.stop()
    for url in cluster.replicas:
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=5)


@needs_smg
def test_cache_aware_keeps_each_prefix_family_on_one_replica_and_hits_more_than_round_robin(
        smollm2_bundle: Path) -> None:
    """The same 12 interleaved requests of two prefix families under both policies, each on a fresh pair of
    replicas: cache_aware serves each family from one replica and finds more prefix blocks cached."""
    bench = bench_routing()
    results, workload = {}, None
    for policy in ("cache_aware", "round_robin"):
        results[policy], workload = bench.run_policy(
            smollm2_bundle, policy, workload, num_requests=12, prefix_tokens=320, max_tokens=4, concurrency=2,
            serve_args=["--num-kv-blocks", "128"], timeout=300)
    aware, rr = results["cache_aware"], results["round_robin"]
    for r in (aware, rr):
        assert r.errors == 0 and sum(x.requests for x in r.replicas) == 12, r
        assert [sum(x.per_family[f] for x in r.replicas) for f in (0, 1)] == [6, 6], r
    assert aware.concentrated(), aware
    assert not rr.concentrated(), rr  # the seeded interleaving does not line up with round robin
    assert aware.hits > rr.hits, (aware, rr)


def test_kubernetes_manifests_validate_against_the_kubernetes_schemas() -> None:
    """deploy/kubernetes/ under kubernetes-validate's strict schemas (no unknown field), and SMG's discovery flags
    select the omforge pods on their port, with the RBAC to watch them."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra's kubernetes-validate")
    docs = [d for f in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    worker = kinds["Deployment", "omforge-worker"]["spec"]["template"]
    assert worker["metadata"]["labels"] == {"app": "omforge", "role": "worker"}
    smg = kinds["Deployment", "smg"]["spec"]["template"]["spec"]
    args = smg["containers"][0]["args"]
    assert "--service-discovery" in args
    rest = args[args.index("--selector") + 1:]
    labels = rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]
    selector = dict(a.split("=", 1) for a in labels)
    assert selector.items() <= worker["metadata"]["labels"].items()
    port = int(args[args.index("--service-discovery-port") + 1])
    assert port == worker["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert "--host" in worker["spec"]["containers"][0]["args"]  # omforge binds 127.0.0.1 unless told otherwise
    assert smg["serviceAccountName"] == "smg"
    rule = kinds["Role", "smg-pod-discovery"]["rules"][0]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    binding = kinds["RoleBinding", "smg-pod-discovery"]
    assert binding["subjects"][0]["name"] == "smg" and binding["roleRef"]["name"] == "smg-pod-discovery"

