"""Prefill/decode disaggregation over NIXL on 127.0.0.1 (docs/pd.md): a prefill replica and a decode replica of
the SmolLM2 bundle driven as vLLM's proxies and SMG's vLLM PD mode drive them — the prefill leg with
``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``, then the decode leg with the
``kv_transfer_params`` the prefill answered — through the official openai client. Greedy output equal to one
server's (the offline engine on the same bundle, so no replica's prefix cache is warmed by the reference),
streamed and not; the decode replica's metrics show the blocks it read — every block of a prompt it has not seen,
only the last one of a prompt its prefix cache holds; and the faults: a decode side
that never reads (the prefill frees its held blocks at the lease's end), a prefill replica killed before the
decode leg (an error, nothing hangs), a client gone during the prefill leg — every replica's blocks back to idle.
Skipped without NIXL (``pip install '.[cluster]'``)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import openai
import pytest

from server_process import ServerProcess

nixl = pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install '.[cluster]')")

UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
LEASE_S = 4
MODEL = "smollm2-135m"
PROMPTS = [f"Question {i}: " + " ".join(["the river ran past the old mill and the town"] * (3 + 4 * i))
           for i in range(10)]
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # vLLM's toy proxy sends these


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(bundle: Path, role: str, engine_id: str) -> ServerProcess:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
              "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
    env = {**UCX, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return ServerProcess(bundle, "--num-kv-blocks", "96", "--threads", "1", "--kv-transfer-config",
                         json.dumps(config), env=env)


@pytest.fixture(scope="module")
def want(smollm2_bundle: Path) -> list[str]:
    """One server's greedy answers to PROMPTS (16 tokens), from the offline engine on the same bundle."""
    from omforge import LLM, SamplingParams

    llm = LLM(smollm2_bundle)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    finally:
        llm.close()
    return [o.text for o in outs]


@pytest.fixture(scope="module")
def replicas(smollm2_bundle: Path):  # noqa: ANN201
    prefill = replica(smollm2_bundle, "kv_producer", "prefill-0")
    decode = replica(smollm2_bundle, "kv_consumer", "decode-0")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def prefill_leg(server: ServerProcess, prompt: str, engine: str = "prefill-0", **kwargs: object) -> dict:
    first = server.client(**kwargs).completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                                        extra_body={"kv_transfer_params": PREFILL_LEG})
    params = first.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_engine_id"] == engine and params["remote_block_ids"]
    return params


def decode_leg(server: ServerProcess, prompt: str, params: dict, stream: bool) -> str:
    client = server.client()
    body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"kv_transfer_params": params})
    if not stream:
        return client.completions.create(**body).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **body) if c.choices)


def idle(server: ServerProcess) -> None:
    """Every block back in the pool (no request, nothing held), within a bound."""
    server.wait_for_metric("omforge:kv_cache_used_blocks", lambda v: v == 0, timeout=LEASE_S + 10)


def test_pd_gives_one_servers_greedy_output_and_the_decode_side_reads_the_blocks(replicas, want) -> None:  # noqa: ANN001
    """First pass: the decode replica has seen none of the prompts and reads every block of each; second pass,
    the same prompts: its prefix cache holds all their full blocks, so it reads only each prompt's last block."""
    prefill, decode = replicas
    for rnd in range(2):
        before = decode.metrics().get("omforge:kv_transfer_read_blocks_total", 0)
        blocks = 0
        for i, prompt in enumerate(PROMPTS):
            params = prefill_leg(prefill, prompt)
            blocks += len(params["remote_block_ids"])
            assert decode_leg(decode, prompt, params, stream=i % 2 == 1) == want[i], (rnd, i)
        read = decode.metrics()["omforge:kv_transfer_read_blocks_total"] - before
        assert read == (blocks if rnd == 0 else len(PROMPTS)), (rnd, read, blocks)
        assert blocks > 2 * len(PROMPTS)  # multi-block prompts: the first pass moved whole prompts
    got = decode.metrics()
    assert got["omforge:kv_transfer_read_requests_total"] == 2 * len(PROMPTS)
    assert prefill.wait_for_metric("omforge:kv_transfer_released_total{reason=notified}",
                                   lambda v: v == 2 * len(PROMPTS), timeout=10)
    idle(prefill)
    idle(decode)


def test_a_decode_side_that_never_reads_costs_the_held_blocks_for_the_lease_only(replicas) -> None:  # noqa: ANN001
    prefill, _ = replicas
    before = prefill.metrics().get("omforge:kv_transfer_released_total{reason=expired}", 0)
    params = prefill_leg(prefill, PROMPTS[5])
    prefill.wait_for_metric("omforge:kv_transfer_held_blocks", lambda v: v == len(params["remote_block_ids"]))
    t0 = time.monotonic()
    prefill.wait_for_metric("omforge:kv_transfer_released_total{reason=expired}", lambda v: v == before + 1,
                            timeout=LEASE_S + 10)
    assert time.monotonic() - t0 >= LEASE_S - 1.5  # held for the lease, not less
    idle(prefill)


def test_a_client_gone_during_the_prefill_leg_holds_nothing(replicas) -> None:  # noqa: ANN001
    prefill, _ = replicas
    held = prefill.metrics().get("omforge:kv_transfer_held_requests_total", 0)
    with pytest.raises(openai.APITimeoutError):
        prefill_leg(prefill, " ".join(["a long prompt of many words"] * 250), timeout=0.05)
    time.sleep(1.0)
    idle(prefill)
    assert prefill.metrics().get("omforge:kv_transfer_held_requests_total", 0) == held


def test_a_prefill_replica_killed_before_the_decode_leg_is_an_error_not_a_hang(smollm2_bundle: Path,
                                                                                replicas) -> None:  # noqa: ANN001
    _, decode = replicas
    doomed = replica(smollm2_bundle, "kv_producer", "prefill-doomed")  # its own engine id: a new peer
    try:
        params = prefill_leg(doomed, PROMPTS[3], engine="prefill-doomed")
    finally:
        doomed.kill()
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="KV transfer|kv_transfer"):
        decode_leg(decode, PROMPTS[3], params, stream=False)
    assert time.monotonic() - t0 < LEASE_S + 10
    assert decode.metrics()["omforge:kv_transfer_read_failures_total"] >= 1
    idle(decode)
    assert decode_leg(decode, PROMPTS[0], {}, stream=False)  # the replica still serves


def test_bad_kv_transfer_params_are_a_400_naming_the_field(replicas) -> None:  # noqa: ANN001
    prefill, decode = replicas
    with pytest.raises(openai.BadRequestError, match="prefill leg"):
        decode.client().completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(openai.BadRequestError, match="remote_host"):
        decode.client().completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={
            "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
                                   "remote_request_id": "r", "remote_port": 5600}})


@pytest.fixture
def gateway(replicas):  # noqa: ANN001, ANN201
    """SMG in its PD mode over the two replicas, on 127.0.0.1."""
    yield from smg_pd(*replicas)


def smg_pd(prefill: ServerProcess, decode: ServerProcess):  # noqa: ANN201 - a generator of the gateway's URL
    """SMG's PD mode (``--backend vllm``: vLLM's sequential handoff) over one prefill and one decode replica; it
    treats them as vLLM workers (/version)."""
    import shutil
    import subprocess
    import urllib.request

    from helpers import REPO

    smg = shutil.which("smg", path=str(REPO / ".venv" / "bin")) or shutil.which("smg")
    if smg is None:
        pytest.skip("SMG is not installed (pip install '.[cluster]')")
    port = free_port()
    proc = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
                             "127.0.0.1", "--prometheus-port", str(free_port()), "--pd-disaggregation", "--prefill",
                             prefill.url, "--decode", decode.url, "--policy", "round_robin", "--backend", "vllm",
                             "--worker-startup-check-interval", "1", "--log-level", "warn"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                    if len(json.load(r).get("workers", [])) >= 2:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            time.sleep(0.5)
        else:
            raise AssertionError("SMG did not register both replicas within 60 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_smg_drives_pd_with_one_servers_greedy_output(replicas, gateway: str, want: list[str]) -> None:  # noqa: ANN001
    """Ten prompts through SMG's PD mode, streamed and not: one server's greedy text, the KV read over NIXL."""
    prefill, decode = replicas
    reads = decode.metrics().get("omforge:kv_transfer_read_requests_total", 0)
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i, prompt in enumerate(PROMPTS):
        body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        got = ("".join(c.choices[0].text for c in client.completions.create(stream=True, **body) if c.choices)
               if i % 2 else client.completions.create(**body).choices[0].text)
        assert got == want[i], i
    assert decode.metrics()["omforge:kv_transfer_read_requests_total"] == reads + len(PROMPTS)  # over NIXL
    idle(prefill)
    idle(decode)


def test_through_smg_a_dead_decode_replica_is_an_error_and_the_prefill_frees_at_the_lease(
        smollm2_bundle: Path, replicas) -> None:  # noqa: ANN001
    prefill, _ = replicas
    doomed = replica(smollm2_bundle, "kv_consumer", "decode-doomed")
    gen = smg_pd(prefill, doomed)
    url = next(gen)
    try:
        doomed.kill()  # after SMG registered it: the prefill leg runs, the decode leg finds nobody
        before = prefill.metrics()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):
            client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0)
        assert time.monotonic() - t0 < 60
        held = prefill.metrics().get("omforge:kv_transfer_held_requests_total", 0)
        if held > before.get("omforge:kv_transfer_held_requests_total", 0):  # SMG ran the prefill leg first
            prefill.wait_for_metric("omforge:kv_transfer_released_total{reason=expired}",
                                    lambda v: v > before.get("omforge:kv_transfer_released_total{reason=expired}", 0),
                                    timeout=LEASE_S + 10)
        idle(prefill)
    finally:
        gen.close()


def test_a_decode_sides_heartbeats_renew_the_lease(replicas) -> None:  # noqa: ANN001
    """vLLM 0.33's decode side renews a held request's lease with ``HB:<id>`` while it waits to read: sent here
    from a bare NIXL agent of this process (one block per pool: a peer's pool size may differ), the prefill
    replica keeps the blocks past the lease, then frees them one lease after the last heartbeat."""
    from omforge.contract import PagedLayout
    from omforge.runtime.kv_transfer import NixlKVAgent, fetch_metadata

    prefill, _ = replicas
    params = prefill_leg(prefill, PROMPTS[4])
    meta = fetch_metadata(params["remote_host"], params["remote_port"], timeout_s=5.0,
                          expected_engine_id=params["remote_engine_id"])
    layout: PagedLayout = meta.layout
    shape = (1, layout.block_size, layout.kv_heads, layout.row_elems)
    before = prefill.metrics().get("omforge:kv_transfer_released_total{reason=expired}", 0)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in UCX.items():
            mp.setenv(name, value)
        with NixlKVAgent("hb-test", layout, [np.zeros(shape, np.float32) for _ in range(2 * layout.num_layers)]) \
                as agent:
            peer = agent.add_peer(meta)
            end = time.monotonic() + 2 * LEASE_S
            while time.monotonic() < end:  # bounded: two leases of heartbeats, one a second
                agent.notify(peer, f"HB:{params['remote_request_id']}".encode())
                time.sleep(1.0)
            assert prefill.metrics()["omforge:kv_transfer_held_blocks"] == len(params["remote_block_ids"])
            assert prefill.metrics()["omforge:kv_transfer_heartbeats_total"] >= LEASE_S
            t0 = time.monotonic()
            prefill.wait_for_metric("omforge:kv_transfer_released_total{reason=expired}", lambda v: v == before + 1,
                                    timeout=LEASE_S + 10)
            assert time.monotonic() - t0 >= LEASE_S - 2.0  # a whole lease after the last heartbeat
    idle(prefill)
