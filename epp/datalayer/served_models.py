"""An engine's context length, read out of its OpenAI ``GET /v1/models`` answer.

vLLM (and the simulator) list every served model name and LoRA adapter with its
``max_model_len``; adapters share their base model's, so an engine's context length is the
longest listed.
"""

from __future__ import annotations

import orjson

MODELS_PATH = "/v1/models"


class ModelsParseError(ValueError):
    """The answer lists no model with a ``max_model_len``."""


def parse_max_model_len(body: bytes) -> int:
    """The longest ``max_model_len`` of the listed models; :class:`ModelsParseError` if none."""
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ModelsParseError(f"{MODELS_PATH} is not JSON: {exc}") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    lengths = [
        m["max_model_len"]
        for m in (models if isinstance(models, list) else ())
        if isinstance(m, dict) and type(m.get("max_model_len")) is int and m["max_model_len"] > 0
    ]
    if not lengths:
        raise ModelsParseError(f"{MODELS_PATH} lists no model with a max_model_len")
    return max(lengths)
