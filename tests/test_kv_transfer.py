"""The PD transfer layer (runtime/kv_transfer, docs/pd.md): vLLM's ``kv_transfer_params`` and
``--kv-transfer-config`` parsed and refused with one line, the layout check, the release notifications and the
side-channel handshake (all pure); and, where NIXL is installed, real block reads between two processes on
127.0.0.1 over UCX's TCP transport, including a peer that dies or stalls (bounded: every wait has a timeout)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from omforge.contract import PagedLayout
from omforge.runtime.kv_transfer import (
    AgentMetadata,
    ClusterExtraMissing,
    HandshakeListener,
    HeartbeatNotif,
    KVLayoutMismatch,
    KVTransferConfigError,
    KVTransferError,
    KVTransferParamsError,
    KVTransferTimeout,
    NixlKVAgent,
    ReleaseNotif,
    check_layout,
    fetch_metadata,
    parse_kv_transfer_config,
    parse_kv_transfer_params,
    parse_notif,
    prefill_response_params,
    release_notif,
    side_channel_address,
)
from omforge.runtime.kv_transfer.nixl_agent import NIXL_MODULES, load_nixl

LAYOUT = PagedLayout(num_layers=2, kv_heads=2, head_dim=16, block_size=4)
NUM_BLOCKS = 8
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # UCX over TCP on the loopback device only


def nixl_importable() -> bool:
    try:
        load_nixl()
    except ClusterExtraMissing:
        return False
    return True


HAS_NIXL = nixl_importable()
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed (pip install .[cluster])")


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# --- --kv-transfer-config ------------------------------------------------------------------------------------


def test_config_takes_vllms_fields_and_defaults() -> None:
    cfg = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert cfg.is_kv_producer and cfg.is_kv_consumer and cfg.kv_buffer_device == "cpu"
    assert cfg.backends == ("UCX",) and cfg.lease_s == 30.0 and cfg.kv_load_failure_policy == "fail"
    assert uuid.UUID(cfg.engine_id)  # vLLM's default engine id: a fresh UUID
    cfg = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "d0",
                                    "kv_connector_extra_config": {"kv_lease_duration": 5, "backends": ["UCX"],
                                                                  "enforce_handshake_compat": False}})
    assert not cfg.is_kv_producer and cfg.is_kv_consumer and cfg.engine_id == "d0" and cfg.lease_s == 5.0
    assert cfg.kv_connector_extra_config["enforce_handshake_compat"] is False  # unread extra keys are kept


@pytest.mark.parametrize(("text", "names"), [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"', "not JSON"),
    ('["NixlConnector"]', "JSON object"),
    ('{"kv_connector": "NixlConnector", "kv_rol": "kv_both"}', "unknown field 'kv_rol'"),
    ('{"kv_role": "kv_both"}', "kv_connector: missing"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "kv_connector: 'LMCacheConnectorV1'"),
    ('{"kv_connector": "NixlConnector"}', "kv_role: required"),
    ('{"kv_connector": "NixlConnector", "kv_role": "both"}', "kv_role: 'both' is not one of"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"}', "kv_buffer_device"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0}', "kv_port"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": 7}', "engine_id"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}',
     "kv_load_failure_policy"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "enable_permute_local_kv": true}',
     "enable_permute_local_kv"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backends": []}}',
     "kv_connector_extra_config.backends"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"kv_lease_duration": -1}}', "kv_connector_extra_config.kv_lease_duration"),
])
def test_config_errors_are_one_line_naming_the_field(text: str, names: str) -> None:
    with pytest.raises(KVTransferConfigError) as e:
        parse_kv_transfer_config(text)
    assert one_line(e).startswith("--kv-transfer-config: ") and names in str(e.value), str(e.value)


def test_a_side_channel_port_in_use_is_one_line_naming_the_variable() -> None:
    """Issue 45: a second kv_both replica on one host died with a bare ``OSError: [Errno 98]`` traceback."""
    from omforge.runtime.kv_transfer.handshake import listen

    meta = AgentMetadata("p", b"meta", (0, 0, 0, 0), NUM_BLOCKS, 64, LAYOUT)
    with listen(meta, "127.0.0.1", 0) as first:
        with pytest.raises(KVTransferConfigError) as e:
            listen(meta, "127.0.0.1", first.address[1])
    assert one_line(e).startswith("VLLM_NIXL_SIDE_CHANNEL_PORT: port ") and "in use" in str(e.value)


def test_side_channel_address_reads_vllms_environment() -> None:
    assert side_channel_address({}) == ("localhost", 5600)
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert side_channel_address(env) == ("127.0.0.1", 5601)
    with pytest.raises(KVTransferConfigError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        side_channel_address({"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})


# --- kv_transfer_params ---------------------------------------------------------------------------------------


def test_prefill_leg_as_vllms_proxy_and_smg_send_it() -> None:
    assert parse_kv_transfer_params(None) is None and parse_kv_transfer_params({}) is None
    toy_proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    smg = json.loads('{"do_remote_decode":true,"do_remote_prefill":false}')
    for raw in (toy_proxy, smg):
        params = parse_kv_transfer_params(raw)
        assert params.is_prefill_leg and not params.is_decode_leg and not params.pulls_blocks


def test_prefill_response_round_trips_into_the_decode_leg() -> None:
    answer = prefill_response_params(engine_id="p0", request_id="cmpl-1", block_ids=[4, 9], host="127.0.0.1",
                                     port=5600, num_tokens=7, block_size=4)
    for name in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                 "remote_request_id", "remote_host", "remote_port", "tp_size"):
        assert name in answer  # vLLM NixlConnector's response keys
    decode = parse_kv_transfer_params(json.loads(json.dumps(answer)))  # relayed verbatim by the gateway
    assert decode.is_decode_leg and decode.pulls_blocks and decode.remote_block_ids == (4, 9)
    assert (decode.remote_engine_id, decode.remote_request_id, decode.remote_host, decode.remote_port) == \
        ("p0", "cmpl-1", "127.0.0.1", 5600)
    assert decode.remote_num_tokens == 7 and decode.remote_block_size == 4 and decode.tp_size == 1
    assert decode.extra["transfer_mode"] == "pull" and decode.to_dict() == answer
    nested = parse_kv_transfer_params({**answer, "remote_block_ids": [[4, 9]]})  # vLLM 0.33's one-group form
    assert nested.remote_block_ids == (4, 9)
    local = parse_kv_transfer_params({"do_remote_prefill": True, "remote_block_ids": []})
    assert local.is_decode_leg and not local.pulls_blocks  # nothing to read: prefill locally


GOOD_DECODE = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p0",
               "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600}


@pytest.mark.parametrize(("raw", "names"), [
    ([1, 2], "must be a JSON object"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both true"),
    ({"do_remote_decode": "yes"}, "do_remote_decode must be true or false"),
    ({**GOOD_DECODE, "remote_host": None}, "needs remote_host"),
    ({**GOOD_DECODE, "remote_engine_id": None}, "needs remote_engine_id"),
    ({**GOOD_DECODE, "remote_port": 70000}, "remote_port must be a whole number 1-65535"),
    ({**GOOD_DECODE, "remote_port": True}, "remote_port"),
    ({**GOOD_DECODE, "remote_block_ids": [1, True]}, "remote_block_ids must be a list"),
    ({**GOOD_DECODE, "remote_block_ids": [1, -2]}, "remote_block_ids must be a list"),
    ({**GOOD_DECODE, "remote_block_ids": [1, 1]}, "repeats"),
    ({**GOOD_DECODE, "remote_block_ids": [[1], [2]]}, "2 KV cache groups"),
    ({**GOOD_DECODE, "tp_size": 2}, "tp_size 2"),
    ({**GOOD_DECODE, "remote_request_id": ""}, "remote_request_id must be a non-empty string"),
])
def test_params_errors_are_one_line_naming_the_field(raw: object, names: str) -> None:
    with pytest.raises(KVTransferParamsError) as e:
        parse_kv_transfer_params(raw)
    assert one_line(e).startswith("kv_transfer_params: ") and names in str(e.value), str(e.value)


# --- layout and notifications ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "field"), [
    ({"block_size": 8}, "block_size"), ({"kv_dtype": "bfloat16"}, "kv_dtype"), ({"num_layers": 3}, "num_layers"),
    ({"kv_heads": 1}, "kv_heads"), ({"head_dim": 8}, "head_dim")])
def test_layout_mismatch_is_refused_naming_the_field(change: dict, field: str) -> None:
    check_layout(LAYOUT, replace(LAYOUT))
    with pytest.raises(KVLayoutMismatch) as e:
        check_layout(LAYOUT, replace(LAYOUT, **change), "p0")
    assert f"with p0: {field} " in one_line(e)


def test_int8_row_elems_count_in_the_layout() -> None:
    int8 = replace(LAYOUT, kv_dtype="int8")
    assert int8.row_elems == LAYOUT.head_dim + 4
    with pytest.raises(KVLayoutMismatch, match="kv_dtype"):
        check_layout(int8, LAYOUT)


def test_release_and_heartbeat_notifications() -> None:
    assert release_notif("cmpl-1:x") == b"cmpl-1:x:1"
    assert parse_notif(b"cmpl-1:x:1") == ReleaseNotif("cmpl-1:x", 1)  # the last colon splits, as in vLLM
    assert parse_notif(b"HB:a,b") == HeartbeatNotif(("a", "b"))
    assert parse_notif(b"garbage") is None and parse_notif(b"r:x") is None


# --- the handshake side channel (no NIXL needed) --------------------------------------------------------------

FAKE_META = AgentMetadata("p0", b"\x00agent-bytes\xff", (4096, 8192, 12288, 16384), NUM_BLOCKS, 512, LAYOUT, "m1")


def test_handshake_serves_metadata_and_checks_the_engine_id() -> None:
    with HandshakeListener(FAKE_META, "127.0.0.1", 0) as listener:
        host, port = listener.address
        assert fetch_metadata(host, port, timeout_s=2.0, expected_engine_id="p0") == FAKE_META
        with pytest.raises(KVTransferError, match="engine id mismatch") as e:
            fetch_metadata(host, port, timeout_s=2.0, expected_engine_id="p1")
        one_line(e)


def test_handshake_fails_fast_and_bounded() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="refused"):
        fetch_metadata("127.0.0.1", port, timeout_s=2.0)  # nobody listens
    with socket.socket() as mute:  # listens, never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        with pytest.raises(KVTransferTimeout, match="no answer within 0.5 s"):
            fetch_metadata("127.0.0.1", mute.getsockname()[1], timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0


def test_importing_needs_no_nixl_and_constructing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = ("import sys, omforge.runtime.kv_transfer; "
             "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('nixl')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    for name in NIXL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ClusterExtraMissing, match=r"pip install \.\[cluster\]") as e:
        NixlKVAgent("x", LAYOUT, pools(0.0))
    one_line(e)


# --- NIXL between two processes on 127.0.0.1 ------------------------------------------------------------------

PRODUCER = """
import select, sys, time
import numpy as np
from omforge.contract import PagedLayout
from omforge.runtime.kv_transfer import HandshakeListener, NixlKVAgent
layout = PagedLayout(num_layers=2, kv_heads=2, head_dim=16, block_size=4)
pools = [np.arange({n} * 4 * 2 * 16, dtype=np.float32).reshape({n}, 4, 2, 16) + 1000.0 * i for i in range(4)]
with NixlKVAgent("{engine}", layout, pools) as agent, HandshakeListener(agent.metadata(), "127.0.0.1", 0) as hs:
    print("KVT READY", hs.address[1], flush=True)
    end = time.monotonic() + 20.0  # never outlives the test, even if the parent dies
    while time.monotonic() < end and not select.select([sys.stdin], [], [], 0.01)[0]:
        for _, msg in agent.poll_notifs():
            print("KVT NOTIF", msg.decode(), flush=True)
"""


def pools(fill: float) -> list[np.ndarray]:
    return [np.full((NUM_BLOCKS, LAYOUT.block_size, LAYOUT.kv_heads, LAYOUT.row_elems), fill, np.float32)
            for _ in range(2 * LAYOUT.num_layers)]


def expected_pool(i: int) -> np.ndarray:
    shape = (NUM_BLOCKS, LAYOUT.block_size, LAYOUT.kv_heads, LAYOUT.row_elems)
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000.0 * i


class Producer:
    """A prefill-side process: pools with a known pattern, a handshake listener; reports notifications."""

    def __init__(self) -> None:
        self.engine_id = f"p-{uuid.uuid4().hex[:6]}"
        self.proc = subprocess.Popen([sys.executable, "-c", PRODUCER.format(n=NUM_BLOCKS, engine=self.engine_id)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **UCX_ENV})
        self._buffer = b""
        self.port = int(self.line("KVT READY", timeout_s=20.0).split()[2])

    def line(self, prefix: str, timeout_s: float) -> str:
        """The next stdout line starting with ``prefix`` (NIXL logs to stdout too), within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                if raw.decode().startswith(prefix):
                    return raw.decode()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise AssertionError(f"no {prefix!r} from the producer within {timeout_s} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the producer exited (rc {self.proc.poll()}) before {prefix!r}")
            self._buffer += chunk

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture(scope="module")
def consumer() -> Iterator[tuple[NixlKVAgent, list[np.ndarray]]]:
    """The decode side: this process's agent over zeroed pools, shared by the tests below."""
    if not HAS_NIXL:
        pytest.skip("NIXL is not installed (pip install .[cluster])")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in UCX_ENV.items():
            mp.setenv(name, value)
        local = pools(0.0)
        agent = NixlKVAgent(f"d-{uuid.uuid4().hex[:6]}", LAYOUT, local)
        yield agent, local
        agent.close()


@pytest.fixture
def producer() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.stop()


@needs_nixl
def test_blocks_read_between_two_processes(consumer: tuple, producer: Producer) -> None:
    agent, local = consumer
    for pool in local:
        pool.fill(0.0)
    meta = fetch_metadata("127.0.0.1", producer.port, timeout_s=5.0, expected_engine_id=producer.engine_id)
    with pytest.raises(KVLayoutMismatch, match="block_size 8 there, 4 here"):
        agent.add_peer(replace(meta, layout=replace(LAYOUT, block_size=8)))
    peer = agent.add_peer(meta)
    stats = agent.read_blocks(peer, [1, 3, 5], [0, 2, 4], timeout_s=10.0, notif_msg=release_notif("req-1"))
    assert stats.num_blocks == 3 and stats.bytes == 3 * 4 * agent.block_len
    for i, pool in enumerate(local):
        assert np.array_equal(pool[[0, 2, 4]], expected_pool(i)[[1, 3, 5]]), f"pool {i}"
        assert not pool[[1, 3, 5, 6, 7]].any(), f"pool {i}: a block that was not read changed"
    assert producer.line("KVT NOTIF", timeout_s=5.0) == "KVT NOTIF req-1:1"  # the READ's completion notification
    agent.notify(peer, release_notif("req-2"))  # nothing to read (a full prefix hit): a standalone notification
    assert producer.line("KVT NOTIF", timeout_s=5.0) == "KVT NOTIF req-2:1"
    with pytest.raises(ValueError, match="remote block ids must lie in"):
        agent.read_blocks(peer, [NUM_BLOCKS], [0], timeout_s=1.0)
    agent.remove_peer(peer.engine_id)


@needs_nixl
def test_peer_killed_before_the_read_fails_bounded(consumer: tuple, producer: Producer) -> None:
    agent, _ = consumer
    peer = agent.add_peer(fetch_metadata("127.0.0.1", producer.port, timeout_s=5.0))
    producer.stop()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        agent.read_blocks(peer, [1, 2], [1, 2], timeout_s=3.0)
    assert time.monotonic() - t0 < 5.0 and e.value.handle_released, str(e.value)
    assert peer.engine_id in one_line(e)
    agent.remove_peer(peer.engine_id)


@needs_nixl
def test_peer_stalled_then_killed_while_reading(consumer: tuple, producer: Producer) -> None:
    agent, _ = consumer
    peer = agent.add_peer(fetch_metadata("127.0.0.1", producer.port, timeout_s=5.0))
    os.kill(producer.proc.pid, signal.SIGSTOP)  # alive but silent: the read cannot finish
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="did not finish within 1.5 s") as e:
        agent.read_blocks(peer, [0, 1], [0, 1], timeout_s=1.5)
    assert 1.5 <= time.monotonic() - t0 < 4.0 and e.value.handle_released
    pending = agent.start_read(peer, [2, 3], [2, 3])
    threading.Timer(0.2, producer.proc.kill).start()  # dies with the read in flight
    deadline = time.monotonic() + 10.0
    with pytest.raises(KVTransferError, match="failed") as e:
        while not pending.poll():
            assert time.monotonic() < deadline, "the read of a dead peer never ended"
            time.sleep(0.005)
    assert e.value.handle_released
    agent.remove_peer(peer.engine_id)


@needs_nixl
def test_an_idle_agent_leaves_the_cpu_alone(consumer: tuple) -> None:
    """nixl-cu12 1.5.1's own UCX progress thread spins a core with nothing to do (1.0 CPU-s/s); ours sleeps
    between progress calls, so this whole process stays far below that while idle and while active."""
    agent, _ = consumer
    for active in (False, True):
        agent.set_active(active)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        assert used < 0.4, f"{used:.2f} CPU-s/s with the agent {'active' if active else 'idle'}"
    agent.set_active(False)


@needs_nixl
def test_a_decode_leg_older_than_the_lease_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its prefill side may have freed and reused the blocks: the read is refused before any peer is contacted
    (the port below answers nothing), reported by get_finished like any failed read."""
    from omforge.runtime.kv_transfer.connector import PDConnector
    from omforge.runtime.request import Request
    from omforge.runtime.sampling_params import SamplingParams

    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                       "kv_connector_extra_config": {"kv_lease_duration": 10}})
    connector = PDConnector.start(config, LAYOUT, pools(0.0), "")
    try:
        params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "p-gone",
                                           "remote_request_id": "r-1", "remote_host": "127.0.0.1",
                                           "remote_port": 9, "remote_block_ids": [0, 1]})
        leg = Request("k", list(range(3, 10)), SamplingParams(max_tokens=1), kv_transfer=params,
                      arrival_time=time.monotonic() - 9.0)
        connector.update_state_after_alloc(leg, [0, 1], 7)
        (job,) = connector.get_finished().loads
        assert job.num_loaded_blocks == 0 and "lease" in job.error and not job.retired, job.error
        assert connector.stats.read_failures == 1 and not connector.busy()
    finally:
        connector.close()


def pd_leg(rid: str, producer: Producer, block_ids: list[int], arrival: float) -> object:
    """A decode leg of a 7-token prompt (two blocks of 4) reading ``block_ids`` from ``producer``."""
    from omforge.runtime.request import Request
    from omforge.runtime.sampling_params import SamplingParams

    params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": producer.engine_id,
                                       "remote_request_id": rid, "remote_host": "127.0.0.1",
                                       "remote_port": producer.port, "remote_block_ids": block_ids})
    return Request(rid, list(range(3, 10)), SamplingParams(max_tokens=1), kv_transfer=params, arrival_time=arrival)


def pd_loads(connector: object, n: int) -> dict:
    """The next ``n`` finished reads by request id, within 10 s."""
    loads, deadline = {}, time.monotonic() + 10.0
    while len(loads) < n and time.monotonic() < deadline:
        loads.update((job.request_id, job) for job in connector.get_finished().loads)
        time.sleep(0.005)
    assert len(loads) == n, loads
    return loads


@needs_nixl
def test_one_bad_read_leaves_the_other_reads_from_that_peer_alone(consumer: tuple, producer: Producer) -> None:
    """Issue 45 defect 5 on real NIXL: a decode leg whose block ids the peer's pool lacks fails alone; the read
    posted just before it from the same prefill engine, not yet polled, still lands (the peer was removed on any
    failure at f2437b2, and its other in-flight reads failed NIXL_ERR_NOT_FOUND)."""
    from omforge.runtime.kv_transfer.connector import PDConnector

    agent, local = consumer
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    connector = PDConnector(config, agent, LAYOUT.block_size, "127.0.0.1", 0)
    good, bad = pd_leg("good", producer, [3, 4], time.monotonic()), \
        pd_leg("bad", producer, [5, NUM_BLOCKS + 5], time.monotonic())
    connector.update_state_after_alloc(good, [0, 1], 7)
    connector.update_state_after_alloc(bad, [2, 3], 7)
    loads = pd_loads(connector, 2)
    assert loads["bad"].error and "remote block ids" in loads["bad"].error
    assert loads["good"].error is None and loads["good"].num_loaded_blocks == 2
    for i, pool in enumerate(local):
        assert np.array_equal(pool[[0, 1]], expected_pool(i)[[3, 4]])


@needs_nixl
def test_a_read_seen_done_past_the_prefill_sides_lease_is_refused(consumer: tuple, producer: Producer) -> None:
    """Issue 45 defect 4 on real NIXL: the leg arrived at 0 s, its read starts at 27.5 s of the 30 s lease and is
    seen done at 31.0 s, after the prefill side may have freed the blocks: refused (accepted at f2437b2)."""
    from omforge.runtime.kv_transfer.connector import PDConnector

    agent, _ = consumer
    now = [27.5]
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    connector = PDConnector(config, agent, LAYOUT.block_size, "127.0.0.1", 0, clock=lambda: now[0])
    leg = pd_leg("late", producer, [1, 2], 0.0)
    connector.update_state_after_alloc(leg, [4, 5], 7)
    assert connector.busy()
    now[0] = 31.0
    (load,) = pd_loads(connector, 1).values()
    assert load.num_loaded_blocks == 0 and "lease" in load.error, load
