"""Replica sync through a real nats-server (started here on free loopback ports): convergence,
refused messages, heartbeat expiry, snapshot on join, NATS restarts, auth (token, user/password,
nkey, and JWT ``.creds`` in operator mode), and mutual TLS."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgpack
import nats
import nkeys
import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoints import EndpointStore
from epp.load.peer_totals import PeerTotals
from epp.load.token_load import EndpointLoad
from epp.settings import EppSettings
from epp.sync.metrics import SyncMetrics
from epp.sync.nats_auth import connect_options
from epp.sync.nats_transport import NatsSyncTransport
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from sim.certs import write_local_pki
from tests.epp.sync_replicas import ENDPOINTS, EppReplica, Nats
from tests.support import eventually

pytestmark = pytest.mark.integration
TUNING = SyncTuning(progress_interval_s=0.02, heartbeat_interval_s=0.1, peer_timeout_s=0.8)
ROOT = "llm-epp-test.pool"


class SyncedReplica(EppReplica):
    transport: NatsSyncTransport
    registry: CollectorRegistry


def replica(name: str, url: str, **options) -> SyncedReplica:
    sync = ReplicaSyncState(
        name,
        SyncTargets(token_load=PeerTotals()),
        clock=time.monotonic,
        wall_clock=time.time,
        tuning=TUNING,
    )
    r = SyncedReplica(sync)
    r.registry = CollectorRegistry()
    metrics = SyncMetrics(r.registry, "pool", EndpointStore(), sync, None)
    r.transport = NatsSyncTransport(sync, [url], ROOT, connect_options=options, metrics=metrics)
    return r


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., SyncedReplica]]:
    """Start replicas (closed at the end of the test)."""
    replicas: list[SyncedReplica] = []

    async def start(name: str, url: str, **options) -> SyncedReplica:
        r = replica(name, url, **options)
        await r.transport.start()
        replicas.append(r)
        return r

    yield start
    for r in replicas:
        await r.transport.close()


def converged(dst: EppReplica, *srcs: EppReplica) -> Callable[[], bool]:
    def check() -> bool:
        for e in ENDPOINTS:
            expected = EndpointLoad()
            for src in srcs:
                expected = expected + src.own.load(e)
            if dst.peers_load.load(e) != expected:
                return False
        return True

    return check


def connected(*replicas: SyncedReplica) -> Callable[[], bool]:
    return lambda: all(r.transport.connected for r in replicas)


def peers_of(r: EppReplica, *names: str) -> Callable[[], bool]:
    return lambda: sorted(r.sync.peers) == sorted(names)


async def test_two_replicas_converge_on_token_load_and_refuse_what_they_cannot_read(
    nats_server: Nats, started
) -> None:
    wiretap = await nats.connect(nats_server.url)
    tapped: list[bytes] = []

    async def tap(msg) -> None:
        tapped.append(msg.data)

    await wiretap.subscribe(f"{ROOT}.events", cb=tap)
    a = await started("a", nats_server.url)
    b = await started("b", nats_server.url)
    await eventually(connected(a, b))
    await eventually(peers_of(a, "b"))
    await eventually(peers_of(b, "a"))
    keys = [a.route(e, 100 * (i + 1), 30, 20) for i, e in enumerate(ENDPOINTS)]
    b_key = b.route("a", 77, 0, 5)
    a.first_token(keys[0])
    a.progress(keys[0], 12)
    await eventually(converged(b, a))
    await eventually(converged(a, b))
    assert b.peers_load.load("a").decode_tokens == 112
    a.release(keys[1])
    b.release(b_key)
    await eventually(converged(b, a))
    await eventually(converged(a, b))
    assert a.peers_load.in_flight() == 0
    assert b.registry.get_sample_value("llm_epp_sync_lag_seconds_count") > 0
    assert b.registry.get_sample_value("llm_epp_sync_connected") == 1
    assert b.registry.get_sample_value("llm_epp_sync_peers_alive") == 1
    applied = b.registry.get_sample_value("llm_epp_sync_deltas_applied_total", {"kind": "totals"})
    assert applied >= 4  # each endpoint's totals, at least once, and a's release

    # Replays of a's messages, and a message of another schema version, sent by a bare client.
    a_deltas = [m for m in tapped if msgpack.unpackb(m)[1:3] == [1, "a"]]
    assert a_deltas
    for data in a_deltas:
        await wiretap.publish(f"{ROOT}.events", data)
    totals = [6, "a", 1, 5, 0, 5, 5, None, b""]
    future = msgpack.packb([5, 1, "a", a.sync.incarnation, 99, time.time(), [totals]])
    await wiretap.publish(f"{ROOT}.events", future)
    await wiretap.flush()
    await eventually(lambda: b.sync.stats.dropped["version"] == 1)
    await wiretap.close()
    assert b.sync.stats.dropped["duplicate"] == sum(len(msgpack.unpackb(m)[6]) for m in a_deltas)
    assert b.registry.get_sample_value("llm_epp_sync_deltas_dropped_total", {"reason": "version"}) == 1
    assert converged(b, a)()
    assert b.registry.get_sample_value("llm_epp_sync_deltas_applied_total", {"kind": "totals"}) == applied


async def test_a_dead_peers_bookings_leave_after_the_heartbeat_timeout(nats_server: Nats, started) -> None:
    a = await started("a", nats_server.url)
    b = await started("b", nats_server.url)
    await eventually(connected(a, b))
    a.route("a", 500, 0, 10)
    await eventually(converged(b, a))
    await a.transport.close()  # a dies with its booking open
    assert b.peers_load.load("a").requests == 1
    await eventually(lambda: b.peers_load.in_flight() == 0)
    assert b.sync.stats.expired_peers == 1 and b.sync.peers == []


async def test_a_replica_that_joins_late_converges_with_a_snapshot(nats_server: Nats, started) -> None:
    a = await started("a", nats_server.url)
    await eventually(connected(a))
    keys = [a.route(e, 64, 0, 8) for e in ENDPOINTS]
    a.first_token(keys[2])
    a.release(keys[0])
    await asyncio.sleep(0.2)  # published before b exists
    b = await started("b", nats_server.url)
    await eventually(converged(b, a))
    assert b.sync.stats.snapshots["installed"] >= 1 and a.sync.stats.snapshots["served"] >= 1


async def test_routing_goes_on_through_a_nats_outage_and_resyncs_after(nats_server: Nats, started) -> None:
    a = await started("a", nats_server.url)
    b = await started("b", nats_server.url)
    await eventually(connected(a, b))
    kept = a.route("a", 100, 0, 10)
    gone = a.route("b", 200, 0, 10)
    await eventually(converged(b, a))
    nats_server.stop()
    await eventually(lambda: not a.transport.connected and not b.transport.connected)
    a.release(gone)  # lost: nobody is connected
    a.first_token(kept)
    new = a.route("c", 300, 0, 10)
    await asyncio.sleep(2 * TUNING.peer_timeout_s)
    # b still routes on the last it knew of a: nothing expired during the outage.
    assert b.peers_load.load("b").requests == 1 and b.sync.peers == ["a"]
    assert b.registry.get_sample_value("llm_epp_sync_connected") == 0
    nats_server.start()
    await eventually(connected(a, b))
    await eventually(converged(b, a))
    assert b.peers_load.load("c").requests == 1 and b.peers_load.load("b") == EndpointLoad()
    assert b.sync.stats.snapshots["installed"] >= 1  # the release of "gone" was lost: a snapshot repaired it
    assert a.sync.stats.dropped["unsent"] >= 3
    a.release(kept)
    a.release(new)
    await eventually(lambda: b.peers_load.in_flight() == 0)


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path, ("--auth", "s3cret-token"))
    server.start()
    yield server
    server.stop()


def settings_with(**fields) -> EppSettings:
    return EppSettings(endpoints_file=Path("endpoints.yaml"), tokenizer_dir=Path("."), **fields)


async def test_token_auth_connects_and_a_wrong_token_is_refused(
    token_server: Nats, tmp_path: Path, started
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    good = connect_options(settings_with(sync_nats_url=[token_server.url], sync_nats_token_file=token_file))
    assert good == {"token": "s3cret-token"}
    from_env = connect_options(
        settings_with(sync_nats_url=[token_server.url]), {"LLM_EPP_SYNC_NATS_TOKEN": "x"}
    )
    assert from_env == {"token": "x"}
    a = await started("a", token_server.url, **good)
    b = await started("b", token_server.url, **good)
    intruder = await started("intruder", token_server.url, token="wrong")
    await eventually(connected(a, b))
    # The server refuses each retry either with its -ERR or by resetting the socket first; the
    # refusal's own words come within a few 0.5 s retries.
    await eventually(
        lambda: "authorization violation" in (intruder.transport.last_error or "").lower(),
        what="the intruder's authorization violation",
    )
    assert not intruder.transport.connected
    a.route("a", 40, 0, 4)
    intruder.route("b", 999, 0, 4)
    await eventually(converged(b, a))
    await asyncio.sleep(0.3)
    assert b.peers_load.load("b") == EndpointLoad() and sorted(b.sync.peers) == ["a"]


async def test_user_password_and_nkey_auth(tmp_path: Path, started) -> None:
    seed = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(seed).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    config = tmp_path / "nats.conf"
    config.write_text(
        f'authorization {{ users = [ {{user: "epp", password: "pw"}}, {{nkey: "{public}"}} ] }}\n'
    )
    server = Nats(tmp_path, ("--config", str(config)))
    server.start()
    try:
        password_file = tmp_path / "password"
        password_file.write_text("pw")
        user = connect_options(
            settings_with(
                sync_nats_url=[server.url], sync_nats_user="epp", sync_nats_password_file=password_file
            )
        )
        nkey = connect_options(settings_with(sync_nats_url=[server.url], sync_nats_nkey_seed_file=seed_file))
        a = await started("a", server.url, **user)
        b = await started("b", server.url, **nkey)
        other_seed = nkeys.encode_seed(bytes(range(1, 33)), nkeys.PREFIX_BYTE_USER)
        (tmp_path / "other.nk").write_bytes(other_seed)
        wrong_password = await started("wrong-password", server.url, user="epp", password="nope")
        unknown_nkey = await started("unknown-nkey", server.url, nkeys_seed=str(tmp_path / "other.nk"))
        await eventually(connected(a, b))
        a.route("c", 10, 0, 1)
        await eventually(converged(b, a))
        for refused in (wrong_password, unknown_nkey):
            # The server sends -ERR and closes; a client may read the reset before the -ERR on one
            # attempt, so the refusal is judged by the reason its retries come to report.
            await eventually(
                lambda r=refused: "authorization violation" in (r.transport.last_error or "").lower()
            )
            assert not refused.transport.connected
    finally:
        server.stop()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(signer: bytes, subject: bytes, kind: str, name: str, **nats_fields: object) -> str:
    """A NATS v2 JWT: ``subject``'s claims of ``kind``, signed by the ``signer`` seed's key."""
    issuer = nkeys.from_seed(signer)
    claims = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": nkeys.from_seed(subject).public_key.decode(),
        "nats": {"type": kind, "version": 2, **nats_fields},
    }
    claims["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()).decode().rstrip("=")
    )
    header = json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()
    signing_input = f"{_b64(header)}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


def _creds(path: Path, account: bytes, seed_index: int) -> Path:
    """A user ``.creds`` file (JWT and seed, in nsc's layout) for a user of ``account``."""
    user = nkeys.encode_seed(bytes([seed_index] * 32), nkeys.PREFIX_BYTE_USER)
    token = _jwt(account, user, "user", path.stem, pub={}, sub={}, **UNLIMITED)
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.decode()}\n------END USER NKEY SEED------\n"
    )
    return path


async def test_jwt_credentials_auth_in_operator_mode(tmp_path: Path, started) -> None:
    """The server trusts one operator and knows one account (memory resolver); replicas with
    that account's users' ``.creds`` sync, a user of an account the server does not know is refused."""
    operator = nkeys.encode_seed(bytes([1] * 32), nkeys.PREFIX_BYTE_OPERATOR)
    account = nkeys.encode_seed(bytes([2] * 32), nkeys.PREFIX_BYTE_ACCOUNT)
    stranger = nkeys.encode_seed(bytes([3] * 32), nkeys.PREFIX_BYTE_ACCOUNT)
    limits = {**UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1}
    account_jwt = _jwt(operator, account, "account", "epp", limits=limits)
    config = tmp_path / "nats.conf"
    config.write_text(
        f'operator: "{_jwt(operator, operator, "operator", "op")}"\n'
        "resolver: MEMORY\n"
        f'resolver_preload: {{ {nkeys.from_seed(account).public_key.decode()}: "{account_jwt}" }}\n'
    )
    server = Nats(tmp_path, ("--config", str(config)))
    server.start()
    try:
        a_creds = _creds(tmp_path / "a.creds", account, 10)
        options = connect_options(
            settings_with(sync_nats_url=[server.url], sync_nats_credentials_file=a_creds)
        )
        assert options == {"user_credentials": str(a_creds)}
        a = await started("a", server.url, **options)
        b = await started("b", server.url, user_credentials=str(_creds(tmp_path / "b.creds", account, 11)))
        intruder = await started(
            "intruder", server.url, user_credentials=str(_creds(tmp_path / "x.creds", stranger, 12))
        )
        await eventually(connected(a, b))
        a.route("c", 10, 0, 1)
        await eventually(converged(b, a))
        await eventually(lambda: "authorization violation" in (intruder.transport.last_error or "").lower())
        assert not intruder.transport.connected
    finally:
        server.stop()


async def test_mutual_tls_connects_and_refuses_clients_without_a_trusted_certificate(
    tmp_path: Path, started
) -> None:
    pki = write_local_pki(tmp_path / "pki")  # the server certificate names 127.0.0.1
    config = tmp_path / "nats.conf"
    config.write_text(
        f'tls {{ cert_file: "{pki.server_cert_file}", key_file: "{pki.server_key_file}", '
        f'ca_file: "{pki.ca_file}", verify: true, timeout: 2 }}\n'
    )
    server = Nats(tmp_path, ("--config", str(config)))
    server.start()
    url = server.url.replace("nats://", "tls://")
    try:
        mtls = connect_options(
            settings_with(
                sync_nats_url=[url],
                sync_nats_tls_ca_file=pki.ca_file,
                sync_nats_tls_cert_file=pki.client_cert_file,
                sync_nats_tls_key_file=pki.client_key_file,
            )
        )
        a = await started("a", url, **mtls)
        b = await started("b", url, **mtls)
        await eventually(connected(a, b))
        a.route("c", 10, 0, 1)
        await eventually(converged(b, a))

        # Trusts the server but shows no certificate: the server refuses it.
        no_cert = connect_options(settings_with(sync_nats_url=[url], sync_nats_tls_ca_file=pki.ca_file))
        anonymous = await started("anonymous", url, **no_cert)
        # Shows a certificate of another CA, and does not trust the server's: refused both ways.
        other = write_local_pki(tmp_path / "other-pki")
        stranger = await started(
            "stranger",
            url,
            **connect_options(
                settings_with(
                    sync_nats_url=[url],
                    sync_nats_tls_ca_file=other.ca_file,
                    sync_nats_tls_cert_file=other.client_cert_file,
                    sync_nats_tls_key_file=other.client_key_file,
                )
            ),
        )
        await eventually(lambda: anonymous.transport.last_error is not None)
        await eventually(lambda: stranger.transport.last_error is not None)
        # TLS 1.3 ends the client's handshake before the server checks the client's certificate,
        # so the refusal reaches it as the server's alert or as the connection cut under its
        # first write, whichever comes first; either way it never connects (below).
        refusals = ("certificate required", "broken pipe", "connection reset")
        assert any(reason in anonymous.transport.last_error.lower() for reason in refusals)
        assert "certificate verify failed" in stranger.transport.last_error.lower()
        assert not anonymous.transport.connected and not stranger.transport.connected
        anonymous.route("a", 999, 0, 4)
        stranger.route("b", 999, 0, 4)
        a.route("a", 20, 0, 2)
        await eventually(converged(b, a))
        assert sorted(b.sync.peers) == ["a"]
    finally:
        server.stop()
