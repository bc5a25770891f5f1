"""KV events over ZMQ: vLLM 0.32's framing, seq numbers, replay, endpoints, and the server's flag."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from epp.kvcache.block_hash import chain_hashes, external_hash
from sim.kv_events import END_SEQ, KVEventPublisher, KVEventsConfig, offset_endpoint, publisher_binds
from sim.openai_serving import ServedModel
from sim.processes import free_port
from sim.server import build_parser, main, settings_from_args
from tests.kv_event_subscriber import Subscriber, decode, replay

from .conftest import running_replica

STORED = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 1, 7],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
CLEARED = {"type": "AllBlocksCleared"}


def enabled(**fields: object) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, **fields)


def publisher(config: KVEventsConfig) -> contextlib.closing[KVEventPublisher]:
    return contextlib.closing(KVEventPublisher(config))


@contextlib.asynccontextmanager
async def serving_replay(instance: KVEventPublisher) -> AsyncIterator[None]:
    task = asyncio.create_task(instance.serve_replay())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_config_has_vllms_keys_defaults_and_strictness() -> None:
    # As vLLM 0.32 reports its config on /kv_event_sources (checked live).
    assert KVEventsConfig().model_dump() == {
        "enable_kv_cache_events": False,
        "publisher": "null",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
    }
    assert enabled().publisher == "zmq" and enabled().publishes
    assert not enabled(publisher="null").publishes
    with pytest.raises(ValueError, match="Extra inputs"):
        KVEventsConfig.model_validate_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="invalid KV events endpoint"):
        enabled(endpoint="udp://*:5557")
    with pytest.raises(ValueError):
        KVEventPublisher(KVEventsConfig())


def test_replica_endpoints_are_offset_like_data_parallel_ranks() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("ipc:///run/kv.sock", 2) == "ipc:///run/kv.sock_dp2"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint(None, 1) is None
    config = enabled(endpoint="tcp://*:6000", replay_endpoint="tcp://*:7000").for_replica(2)
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:6002", "tcp://*:7002")


def test_who_binds() -> None:
    assert publisher_binds("tcp://*:5557") and publisher_binds("tcp://[::]:5557")
    assert publisher_binds("ipc:///tmp/kv.sock") and publisher_binds("inproc://kv")
    assert not publisher_binds("tcp://127.0.0.1:5557")


def test_batches_on_the_wire(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    with publisher(enabled(endpoint=endpoint, topic="kv")) as instance:
        subscriber = Subscriber(endpoint, topic=b"kv")
        subscriber.prime(lambda _: instance.publish([CLEARED]))
        instance.publish([STORED, REMOVED])
        instance.publish([])  # a step without events sends nothing
        instance.publish([CLEARED])
        topic, seq, payload = subscriber.receive_frames()
        assert topic == b"kv" and len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload, strict_map_key=False)
        assert isinstance(ts, float) and rank == 0
        assert events == [STORED, REMOVED]
        assert [list(event) for event in events] == [list(STORED), list(REMOVED)]  # field order too
        second = subscriber.receive()
        assert (second.seq, second.events) == (int.from_bytes(seq, "big") + 1, [CLEARED])
        assert subscriber.pending() == []
        subscriber.close()


def test_an_explicit_host_makes_the_publisher_connect() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(endpoint, bind=True)
    with publisher(enabled(endpoint=endpoint)) as instance:
        subscriber.prime(lambda _: instance.publish([CLEARED]))
        instance.publish([REMOVED])
        assert subscriber.receive().events == [REMOVED]
    subscriber.close()


def test_port_zero_reports_the_port_bound() -> None:
    with publisher(enabled(endpoint="tcp://*:0")) as instance:
        host, _, port = instance.config.endpoint.rpartition(":")
        assert host == "tcp://0.0.0.0" and int(port) > 0
        subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
        subscriber.prime(lambda _: instance.publish([CLEARED]))
        subscriber.close()


def test_a_busy_endpoint_fails_at_start() -> None:
    endpoint = f"tcp://*:{free_port()}"
    with publisher(enabled(endpoint=endpoint)), pytest.raises(zmq.ZMQError):
        KVEventPublisher(enabled(endpoint=endpoint))


async def test_replay_streams_the_buffered_batches_then_the_end_marker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    config = enabled(endpoint=endpoint, replay_endpoint=replay_endpoint, buffer_steps=3, topic="t")
    with publisher(config) as instance:
        async with serving_replay(instance):
            for index in range(5):
                instance.publish([{**REMOVED, "block_hashes": [index]}])
            answer = await asyncio.to_thread(replay, replay_endpoint, 0)
            *batches, end = answer
            # Seqs count from 0; the buffer keeps the last buffer_steps batches.
            assert [decode(frames).seq for frames in batches] == [2, 3, 4]
            assert [decode(frames).events[0]["block_hashes"] for frames in batches] == [[2], [3], [4]]
            assert all(frames[0] == b"t" for frames in batches)
            assert end == [b"", END_SEQ, b""]
            assert [decode(f).seq for f in (await asyncio.to_thread(replay, replay_endpoint, 4))[:-1]] == [4]
            assert await asyncio.to_thread(replay, replay_endpoint, 9) == [[b"", END_SEQ, b""]]

            # A malformed request is ignored (vLLM logs it too); the next one is answered.
            dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            dealer.connect(replay_endpoint)
            await dealer.send_multipart([b"", b"x", b"y"])
            await dealer.send_multipart([b"", (4).to_bytes(8, "big")])
            assert (await dealer.recv_multipart())[2] == (4).to_bytes(8, "big")
            assert (await dealer.recv_multipart())[2] == END_SEQ
            dealer.close(linger=0)
            assert "malformed KV events replay request of 4 frames" in caplog.text


def test_kv_events_flag() -> None:
    flag = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/kv.sock"}'
    settings = settings_from_args(build_parser().parse_args(["--kv-events-config", flag]))
    assert settings.kv_events == enabled(endpoint="ipc:///tmp/kv.sock")
    assert settings_from_args(build_parser().parse_args([])).kv_events == KVEventsConfig()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("{not json", "invalid KV events config: JSON"),
        ('{"enable_kv_cache_events": true, "topics": "x"}', "topics: Extra inputs"),
        ('{"enable_kv_cache_events": true, "endpoint": "kv.sock"}', "invalid KV events endpoint"),
    ],
)
def test_kv_events_flag_errors(flag: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-events-config", flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_busy_kv_events_endpoint_is_a_command_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"tcp://*:{free_port()}"
    with publisher(enabled(endpoint=endpoint)), pytest.raises(SystemExit) as exit_info:
        main(["--kv-events-config", enabled(endpoint=endpoint).model_dump_json()])
    assert exit_info.value.code == 2
    assert "cannot open the KV events endpoint" in capsys.readouterr().err


async def test_server_publishes_one_batch_per_step_and_clears_on_reset(
    served_model: ServedModel, tmp_path: Path
) -> None:
    config = enabled(endpoint=f"ipc://{tmp_path}/kv.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    async with (
        running_replica(served_model, kv_events=config, index=1) as (_, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        # Replica 1 of a server publishes on the endpoints offset for it, and says so.
        endpoint, replay_endpoint = f"{config.endpoint}_dp1", f"{config.replay_endpoint}_dp1"
        sources = (await http.get("/kv_event_sources")).json()
        assert sources == {
            "0": {**config.model_dump(), "endpoint": endpoint, "replay_endpoint": replay_endpoint}
        }

        def trigger(attempt: int) -> None:
            httpx.post(f"{url}/v1/completions", json={"prompt": [5 + attempt] * 40, "max_tokens": 1})

        subscriber = Subscriber(endpoint)
        await asyncio.to_thread(subscriber.prime, trigger)

        tokens = list(range(300, 370))  # 2 full blocks of 32
        await http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 3})
        (batch,) = await asyncio.to_thread(subscriber.pending)
        (stored,) = batch.events
        assert stored["block_hashes"] == [external_hash(d) for d in chain_hashes(tokens, 32)]
        assert stored["token_ids"] == tokens[:64] and stored["parent_block_hash"] is None

        # The reset is published with the next step, in the same batch as that step's blocks.
        assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
        assert await asyncio.to_thread(subscriber.pending) == []
        await http.post("/v1/completions", json={"prompt": tokens[:40], "max_tokens": 1})
        (after_reset,) = await asyncio.to_thread(subscriber.pending)
        assert [event["type"] for event in after_reset.events] == ["AllBlocksCleared", "BlockStored"]
        assert after_reset.seq == batch.seq + 1

        replayed = await asyncio.to_thread(replay, replay_endpoint, batch.seq)
        assert [decode(frames) for frames in replayed[:-1]] == [batch, after_reset]
        subscriber.close()


async def test_no_publisher_unless_enabled(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (replica, url), httpx.AsyncClient(base_url=url) as http:
        assert replica.kv_events is None and not replica.engine.config.enable_kv_events
        assert (await http.get("/kv_event_sources")).json() == {}
