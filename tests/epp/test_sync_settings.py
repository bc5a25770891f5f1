"""The EPP's sync flags: what they accept, what they refuse, and how secrets are read."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from epp.main import parse_args
from epp.settings import EppSettings

BASE = ["--endpoints-file", "endpoints.yaml", "--tokenizer-dir", "."]


def test_sync_flags_map_onto_the_settings() -> None:
    settings, _ = parse_args(
        [*BASE, "--sync-nats-url", "nats://a:4222,nats://b:4222", "--sync-nats-url", "tls://c:4222",
         "--replica-id", "epp-1", "--sync-pool", "pool_a", "--sync-heartbeat-interval-s", "0.2",
         "--sync-peer-timeout-s", "1"]
    )  # fmt: skip
    assert settings.sync_nats_url == ["nats://a:4222", "nats://b:4222", "tls://c:4222"]
    assert (settings.replica_id, settings.sync_pool, settings.sync_peer_timeout_s) == ("epp-1", "pool_a", 1.0)
    assert settings.sync_share_scrapes  # on by default with sync
    off, _ = parse_args([*BASE, "--sync-nats-url", "nats://a:4222", "--no-sync-share-scrapes"])
    assert not off.sync_share_scrapes


def test_leader_election_and_active_active_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(
            [*BASE, "--endpoint-source", "kubernetes", "--ha-enable-leader-election",
             "--sync-nats-url", "nats://nats:4222"]
        )  # fmt: skip
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replica_id": "epp.1"}, "--replica-id"),
        ({"sync_pool": "a b"}, "--sync-pool"),
        ({"sync_subject_prefix": "llm-epp."}, "--sync-subject-prefix"),
        ({"sync_heartbeat_interval_s": 2.0, "sync_peer_timeout_s": 3.0}, "twice"),
        ({"sync_nats_user": "u", "sync_nats_token_file": Path("t")}, "one NATS auth"),
        ({"sync_nats_password_file": Path("p")}, "needs --sync-nats-user"),
        ({"sync_nats_tls_cert_file": Path("c")}, "go together"),
    ],
)
def test_inconsistent_sync_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EppSettings(
            endpoints_file=Path("e.yaml"), tokenizer_dir=Path("."), sync_nats_url=["nats://x:1"], **fields
        )


def test_secrets_have_no_command_line_flag() -> None:
    flags = set(EppSettings.model_fields)
    assert not {"sync_nats_token", "sync_nats_password", "sync_nats_nkey_seed"} & flags
