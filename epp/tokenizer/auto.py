"""``--tokenizer-source auto``: the tokenizer of the model the pool says it serves.

The scraper reads each endpoint's ``GET /v1/models`` and the store keeps the base model's
``root`` (vLLM reports there what ``vllm serve`` was given: a Hugging Face repository, or a
local path). Once every endpoint that named one names the same, :class:`AutoTokenizer`
downloads that repository's tokenizer files from the Hub as the chart's ``hub`` source does
(``huggingface_hub``, the library behind ``hf download``; ``HF_TOKEN`` for gated or private
repositories, ``HF_ENDPOINT`` for a mirror) and hands the loaded tokenizer to ``on_loaded``.

Until then, and whenever it cannot (no egress, a gated model without a token, a repository
without ``tokenizer.json``, a local path), the EPP routes on estimated counts
(``epp.tokenizer.estimated``): ``llm_epp_tokenizer_estimated`` is 1, one warning says why and how to
supply the tokenizer, and the download is retried with backoff (quietly). Endpoints that name
different models are reported (a warning per change, ``llm_epp_tokenizer_served_models`` > 1),
never guessed between; a tokenizer already loaded stays until they agree again. When they agree
on a new model whose tokenizer cannot be had, the EPP goes back to estimates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from epp.tokenizer.estimated import EstimatedTokenizer
from epp.tokenizer.model import CHAT_TEMPLATE_FILE, TOKENIZER_FILES, PromptTokenizer

log = logging.getLogger(__name__)
SUPPLY_HINT = (
    "to supply it, give the EPP a Hugging Face token for gated models (chart: "
    "inferenceExtension.tokenizer.hub.tokenSecret) or name its source (inferenceExtension.tokenizer.source: "
    "configMap, secret, volume, image or hub; docs/operations.md, 'Deploy on Kubernetes')"
)


def download_from_hub(repo: str, endpoint: str | None = None, cache_dir: Path | None = None) -> Path:
    """The directory of ``repo``'s tokenizer files, downloaded from the Hub (``endpoint``: a
    mirror's URL; default ``HF_ENDPOINT`` or huggingface.co) into ``cache_dir`` (default: the
    Hugging Face cache under ``HF_HOME``)."""
    # Imported here: huggingface_hub's API takes a second or more to import, and only this source needs it.
    from huggingface_hub import snapshot_download

    patterns = [*TOKENIZER_FILES, CHAT_TEMPLATE_FILE]
    return Path(snapshot_download(repo, allow_patterns=patterns, endpoint=endpoint, cache_dir=cache_dir))


class TokenizerMetrics:
    def __init__(self, registry: CollectorRegistry, pool: str) -> None:
        self.estimated = Gauge(
            "llm_epp_tokenizer_estimated",
            "1 while token counts are estimated from the text (no tokenizer of the served model)",
            ["name"],
            registry=registry,
        ).labels(pool)
        self.served_models = Gauge(
            "llm_epp_tokenizer_served_models",
            "Distinct models the pool's endpoints name in /v1/models (over 1: they disagree)",
            ["name"],
            registry=registry,
        ).labels(pool)


class ServedModels(Protocol):
    """What the pool's endpoints serve (``epp.datalayer.endpoints.EndpointStore`` is one)."""

    def model_roots(self) -> dict[str, str]:
        """The model each endpoint serves, by endpoint name, for those that named one."""
        ...


class AutoTokenizer:
    """Follows the pool's model and loads its tokenizer (see the module)."""

    def __init__(
        self,
        store: ServedModels,
        metrics: TokenizerMetrics,
        on_loaded: Callable[[PromptTokenizer], None],
        load: Callable[[str], PromptTokenizer],
        clock: Callable[[], float],
        *,
        poll_s: float = 1.0,
        retry_s: tuple[float, float] = (10.0, 600.0),
    ) -> None:
        """``on_loaded`` takes the tokenizer to route with from now on (an estimating one if the
        pool moved to a model whose tokenizer cannot be had); ``load`` gives a model's tokenizer
        by its root, or raises, in a thread.
        ``retry_s``: the first and the longest wait after a failed load (doubling between)."""
        self.store, self.metrics, self.clock = store, metrics, clock
        self.on_loaded, self.load = on_loaded, load
        self.poll_s, self.retry_s = poll_s, retry_s
        self.loaded: str | None = None
        self._failing: str | None = None
        self._next_try = float("-inf")
        self._backoff = retry_s[0]
        self._disagreement: frozenset[str] = frozenset()
        metrics.estimated.set(1)

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.poll_s)

    async def step(self) -> None:
        """Look at what the endpoints serve once, and load that model's tokenizer if it is due."""
        roots = self.store.model_roots()
        models = frozenset(roots.values())
        self.metrics.served_models.set(len(models))
        if len(models) > 1:
            self._report_disagreement(roots)
            return
        self._disagreement = frozenset()
        if not models or (root := next(iter(models))) == self.loaded:
            return
        if root == self._failing and self.clock() < self._next_try:
            return
        try:
            tokenizer = await asyncio.to_thread(self.load, root)
        except Exception as exc:  # whatever the Hub or the files do wrong, the EPP estimates on
            self._failed(root, exc)
            return
        self.on_loaded(tokenizer)
        self.loaded, self._failing, self._backoff = root, None, self.retry_s[0]
        self.metrics.estimated.set(0 if tokenizer.exact else 1)
        log.info(
            "tokenizer of %s loaded from the Hugging Face Hub: token counts are %s",
            root,
            "exact" if tokenizer.exact else "estimated, calibrated on the prompts it tokenizes",
        )

    def _failed(self, root: str, exc: Exception) -> None:
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if self.loaded is not None:  # the pool moved on from the loaded model: it no longer fits
            self.on_loaded(EstimatedTokenizer())
            self.loaded = None
            self.metrics.estimated.set(1)
        if self._failing != root:
            self._backoff = self.retry_s[0]
            log.warning(
                "no tokenizer for %s (%s): token counts are estimated from the text, 4 bytes a token, "
                "until it loads (retried with backoff); %s",
                root,
                why,
                SUPPLY_HINT,
            )
        else:
            log.debug("tokenizer for %s still unavailable: %s", root, why)
        self._failing = root
        self._next_try = self.clock() + self._backoff
        self._backoff = min(self._backoff * 2, self.retry_s[1])

    def _report_disagreement(self, roots: dict[str, str]) -> None:
        models = frozenset(roots.values())
        if models == self._disagreement:
            return
        self._disagreement = models
        by_model = {m: sorted(n for n, r in roots.items() if r == m) for m in sorted(models)}
        log.warning(
            "the pool's endpoints serve different models, so no one tokenizer fits them; %s: %s",
            "keeping " + self.loaded if self.loaded else "estimating token counts",
            "; ".join(f"{m}: {', '.join(names)}" for m, names in by_model.items()),
        )
