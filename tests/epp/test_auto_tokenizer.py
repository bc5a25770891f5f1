"""``--tokenizer-source auto``: the model the pool's /v1/models names, its tokenizer from the Hub
(tests/helm/fake_hub.py stands in for it), estimates while it cannot be had, and endpoints that
disagree reported rather than guessed between."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.served_models import parse_model_root
from epp.scheduling.types import Endpoint
from epp.tokenizer.auto import AutoTokenizer, TokenizerMetrics, download_from_hub
from epp.tokenizer.estimated import EstimatedTokenizer
from epp.tokenizer.model import TOKENIZER_FILES, ModelTokenizer, PromptTokenizer
from sim.models import TINY_MODEL_DIR
from sim.openai_api import models_response
from tests.epp.factories import FakeClock
from tests.helm import fake_hub

REPO = "acme/tiny-chat"


def test_the_served_model_is_the_base_models_root() -> None:
    listing = models_response("tiny", REPO, 2048, created=1)
    base = listing["data"][0]
    adapter = {**base, "id": "tiny-lora", "root": "/adapters/lora", "parent": "tiny"}
    alias = {**base, "id": "tiny-alias"}
    body = json.dumps({**listing, "data": [base, adapter, alias]}).encode()
    assert parse_model_root(body) == REPO


@pytest.mark.parametrize(
    "data",
    [[], [{"id": "x"}], [{"root": ""}], [{"root": "a/b", "parent": None}, {"root": "c/d", "parent": None}]],
)
def test_no_single_base_model_is_no_root(data: list[dict[str, object]]) -> None:
    assert parse_model_root(json.dumps({"data": data}).encode()) is None


class Pool:
    """An AutoTokenizer over a store of named endpoints, with a fake clock and a scripted loader."""

    def __init__(self, *roots: str | None) -> None:
        self.store = EndpointStore()
        self.store.replace([Endpoint(f"e{i}", "10.0.0.1", 8000 + i) for i in range(len(roots))])
        for i, root in enumerate(roots):
            self.store.record_model_root(f"e{i}", root)
        self.registry = CollectorRegistry()
        self.clock = FakeClock()
        self.loads: list[str] = []
        self.failures = 0
        self.used: list[PromptTokenizer] = []
        self.auto = AutoTokenizer(
            self.store,
            TokenizerMetrics(self.registry, "pool"),
            self.used.append,
            self._load,
            self.clock,
            retry_s=(10.0, 40.0),
        )

    def _load(self, root: str) -> ModelTokenizer:
        self.loads.append(root)
        if self.failures:
            self.failures -= 1
            raise OSError("huggingface.co unreachable")
        return ModelTokenizer(TINY_MODEL_DIR)

    def gauge(self, name: str) -> float | None:
        return self.registry.get_sample_value(name, {"name": "pool"})


async def test_the_agreed_models_tokenizer_is_loaded_once() -> None:
    pool = Pool(REPO, REPO, None)  # the third has not answered /v1/models yet
    assert pool.gauge("llm_epp_tokenizer_estimated") == 1
    await pool.auto.step()
    await pool.auto.step()
    assert pool.loads == [REPO] and len(pool.used) == 1
    assert pool.gauge("llm_epp_tokenizer_estimated") == 0
    assert pool.gauge("llm_epp_tokenizer_served_models") == 1


async def test_nothing_is_loaded_before_an_endpoint_names_its_model() -> None:
    pool = Pool(None)
    await pool.auto.step()
    assert pool.loads == [] and pool.gauge("llm_epp_tokenizer_estimated") == 1


async def test_a_failed_load_estimates_says_so_once_and_retries_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = Pool(REPO)
    pool.failures = 3
    with caplog.at_level(logging.INFO, logger="epp.tokenizer.auto"):
        await pool.auto.step()
        for wait in (10.0, 20.0, 40.0):
            pool.clock.advance(wait - 0.5)
            await pool.auto.step()  # not due yet
            pool.clock.advance(0.5)
            await pool.auto.step()
    assert pool.loads == [REPO] * 4 and len(pool.used) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert REPO in warnings[0] and "estimated" in warnings[0] and "tokenSecret" in warnings[0]
    assert pool.gauge("llm_epp_tokenizer_estimated") == 0


async def test_endpoints_that_disagree_are_reported_not_guessed(caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool(REPO, "other/model", REPO)
    with caplog.at_level(logging.WARNING, logger="epp.tokenizer.auto"):
        await pool.auto.step()
        await pool.auto.step()
    assert pool.loads == []
    assert pool.gauge("llm_epp_tokenizer_served_models") == 2
    assert pool.gauge("llm_epp_tokenizer_estimated") == 1
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"{REPO}: e0, e2" in warning and "other/model: e1" in warning
    pool.store.record_model_root("e1", REPO)  # the odd one out is rolled to the pool's model
    await pool.auto.step()
    assert pool.loads == [REPO] and pool.gauge("llm_epp_tokenizer_served_models") == 1


async def test_a_new_model_for_the_whole_pool_is_loaded_in_turn() -> None:
    pool = Pool(REPO)
    await pool.auto.step()
    pool.store.record_model_root("e0", "acme/next")
    await pool.auto.step()
    assert pool.loads == [REPO, "acme/next"] and len(pool.used) == 2


def test_the_hub_download_gives_a_directory_the_epp_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    with fake_hub.serve(TINY_MODEL_DIR) as hub:
        directory = download_from_hub(REPO, endpoint=hub.url, cache_dir=tmp_path)
    tokenizer = ModelTokenizer(directory)
    assert tokenizer.encode("Hello world") == ModelTokenizer(TINY_MODEL_DIR).encode("Hello world")
    downloads = [(path, auth) for path, auth in hub.requests if path.startswith(f"/{REPO}/resolve/")]
    assert set(TOKENIZER_FILES) <= {path.rsplit("/", 1)[1] for path, _ in downloads}
    assert {auth for _, auth in downloads} == {"Bearer hf_test_token"}


async def test_a_new_model_without_a_tokenizer_goes_back_to_estimates() -> None:
    pool = Pool(REPO)
    await pool.auto.step()
    pool.store.record_model_root("e0", "acme/private")
    pool.failures = 1
    await pool.auto.step()
    assert isinstance(pool.used[-1], EstimatedTokenizer)  # the old model's ids would be wrong
    assert pool.gauge("llm_epp_tokenizer_estimated") == 1
