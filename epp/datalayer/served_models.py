"""An engine's context length and model, read out of its OpenAI ``GET /v1/models`` answer.

vLLM (and the simulator) list every served model name and LoRA adapter with its
``max_model_len``; adapters share their base model's, so an engine's context length is the
longest listed. Each entry's ``root`` is what the engine loaded: for a base model (``parent``
null) the Hugging Face repository or local path given to ``vllm serve``, for an adapter the
adapter's path.
"""

from __future__ import annotations

from typing import Any

import orjson

MODELS_PATH = "/v1/models"


class ModelsParseError(ValueError):
    """The answer lists no model with a ``max_model_len``."""


def _listed(body: bytes) -> list[dict[str, Any]]:
    """The answer's model entries (those that are objects)."""
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ModelsParseError(f"{MODELS_PATH} is not JSON: {exc}") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    return [m for m in (models if isinstance(models, list) else ()) if isinstance(m, dict)]


def parse_max_model_len(body: bytes) -> int:
    """The longest ``max_model_len`` of the listed models; :class:`ModelsParseError` if none."""
    lengths = [
        m["max_model_len"]
        for m in _listed(body)
        if type(m.get("max_model_len")) is int and m["max_model_len"] > 0
    ]
    if not lengths:
        raise ModelsParseError(f"{MODELS_PATH} lists no model with a max_model_len")
    return max(lengths)


def parse_model_root(body: bytes) -> str | None:
    """The base model the engine serves: the one ``root`` of the entries without a ``parent``
    (every served name of one engine shares it); None if there is none, or more than one."""
    roots = {
        m["root"]
        for m in _listed(body)
        if m.get("parent") is None and isinstance(m.get("root"), str) and m["root"]
    }
    return next(iter(roots)) if len(roots) == 1 else None
