"""Engine profiles: a step-time model plus the engine limits it was measured with.

A profile is a YAML file::

    name: default
    description: what hardware and model it stands for
    source: the publication the coefficients come from
    engine:                      # defaults for EngineConfig; every key required
      block_size: 16
      num_gpu_blocks: 27000
      max_num_seqs: 256
      max_num_batched_tokens: 8192
      max_model_len: 32768
    step_time_ms:                # terms of cost_model.StepCostModel; omitted terms are 0
      base: ...                  # optional: paid once by every step
      prefill: {base: ..., per_token: ..., per_token_sq: ..., per_context_token: ...}
      decode: {base: ..., per_seq: ..., per_context_token: ...,
               kv_fraction: ..., kv_fraction_sq: ..., min: ...}
    frontend_ms:                 # optional: cost_model.FrontendTerms, latency outside the steps
      base: ...
      per_prompt_token: ...
      per_running_request: ...

Shipped profiles live in ``profiles/`` and are loaded by name; any other file by path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from sim.engine.config import EngineConfig, EngineConfigError
from sim.engine.cost_model import DecodeTerms, FrontendTerms, PrefillTerms, StepCostModel

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
_ENGINE_KEYS = ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


class ProfileError(ValueError):
    """A profile cannot be found or is malformed."""


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    source: str
    engine: EngineConfig
    cost: StepCostModel
    frontend: FrontendTerms


def available_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a shipped profile by name (``"default"``) or any profile file by path."""
    path = _resolve(name_or_path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    try:
        return _parse(document)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None


def _resolve(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text)
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist")
        return path
    path = PROFILES_DIR / f"{text}.yaml"
    if not path.is_file():
        raise ProfileError(f"unknown profile {text!r}; shipped profiles: {', '.join(available_profiles())}")
    return path


def _parse(document: Any) -> Profile:
    top = _mapping(
        document,
        "the document",
        required=("name", "description", "source", "engine", "step_time_ms"),
        optional=("frontend_ms",),
    )
    for key in ("name", "description", "source"):
        if not isinstance(top[key], str) or not top[key].strip():
            raise ProfileError(f"{key} must be a non-empty string")
    engine_section = _mapping(top["engine"], "engine", required=_ENGINE_KEYS)
    try:
        engine = EngineConfig(**engine_section)
    except EngineConfigError as exc:
        raise ProfileError(f"engine: {exc}") from None
    steps = _mapping(top["step_time_ms"], "step_time_ms", required=("prefill", "decode"), optional=("base",))
    base = _number(steps.get("base", 0.0), "step_time_ms.base")
    prefill = PrefillTerms(**_terms(steps["prefill"], "step_time_ms.prefill", PrefillTerms))
    decode = DecodeTerms(**_terms(steps["decode"], "step_time_ms.decode", DecodeTerms))
    frontend = FrontendTerms(**_terms(top.get("frontend_ms", {}), "frontend_ms", FrontendTerms))
    # A step that does work must take time, or the real-time server would spin.
    if base < 0:
        raise ProfileError("step_time_ms.base must be >= 0")
    if (
        min(prefill.base, prefill.per_token, prefill.per_token_sq, prefill.per_context_token) < 0
        or base + prefill.base + prefill.per_token <= 0
    ):
        raise ProfileError("step_time_ms.prefill terms must be >= 0 with base + prefill base + per_token > 0")
    if decode.min < 0 or base + decode.min <= 0:
        raise ProfileError("step_time_ms.decode.min must be > 0 (or >= 0 with step_time_ms.base > 0)")
    if min(frontend.base, frontend.per_prompt_token, frontend.per_running_request) < 0:
        raise ProfileError("frontend_ms terms must be >= 0")
    return Profile(
        name=top["name"],
        description=top["description"].strip(),
        source=top["source"].strip(),
        engine=engine,
        cost=StepCostModel(prefill=prefill, decode=decode, base=base),
        frontend=frontend,
    )


def _mapping(
    value: Any, where: str, *, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a mapping")
    missing = [key for key in required if key not in value]
    unknown = [key for key in value if key not in required and key not in optional]
    if missing:
        raise ProfileError(f"{where} lacks {', '.join(missing)}")
    if unknown:
        raise ProfileError(f"{where} has unknown keys {', '.join(map(str, unknown))}")
    return value


def _terms(value: Any, where: str, terms_class: type) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a mapping")
    known = {field.name for field in fields(terms_class)}
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ProfileError(
            f"{where} has unknown terms {', '.join(map(str, unknown))}; known: {sorted(known)}"
        )
    return {key: _number(number, f"{where}.{key}") for key, number in value.items()}


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    return float(value)
