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
      intake: {base: ..., per_prompt_token: ...}   # optional: engine time per new request
    frontend_ms:                 # optional: cost_model.FrontendTerms, latency outside the steps
      base: ...
      per_prompt_token: ...
      per_running_request: ...

Shipped profiles live in ``profiles/`` and are loaded by name; any other file by path.

A profile measured on a CPU (the ``tiny-cpu`` fit of real vLLM's CPU build) holds only for CPUs
of its ISA class (``sim.host_cpu.ISA_CLASSES``): vLLM runs other kernels elsewhere, 3-5 times
slower on AVX2 than with AVX-512 and AMX. Such profiles are shipped one per fitted class, as
``NAME-CLASS.yaml``, and ``NAME`` alone loads the one for this machine's class. Where none was
fitted for it, loading ``NAME`` fails, saying how to fit one here (``python -m sim.fitting.fidelity
fit``), rather than fall back to another class's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from sim.engine.config import EngineConfig, EngineConfigError
from sim.engine.cost_model import DecodeTerms, FrontendTerms, IntakeTerms, PrefillTerms, StepCostModel
from sim.host_cpu import ISA_CLASSES, HostCpu, host_cpu

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
    """Shipped profile names: each file's, and each per-CPU-class name (``tiny-cpu``)."""
    return sorted({path.stem for path in PROFILES_DIR.glob("*.yaml")} | set(fitted_cpu_classes()))


def fitted_cpu_classes() -> dict[str, list[str]]:
    """The ISA classes each per-CPU-class profile name is shipped for, e.g. ``{"tiny-cpu": ["amx"]}``."""
    fitted: dict[str, list[str]] = {}
    for path in sorted(PROFILES_DIR.glob("*.yaml")):
        for isa in ISA_CLASSES:
            if path.stem.endswith(f"-{isa}"):
                fitted.setdefault(path.stem.removesuffix(f"-{isa}"), []).append(isa)
    return fitted


def cpu_class_profile(name: str, cpu: HostCpu) -> str:
    """The shipped profile of per-CPU-class ``name`` for ``cpu``'s class; ProfileError if none."""
    fitted = fitted_cpu_classes().get(name, [])
    if cpu.isa not in fitted:
        raise ProfileError(
            f"no {name} profile is fitted for this CPU, {cpu.describe()}; shipped: "
            f"{', '.join(f'{name}-{isa}' for isa in fitted) or 'none'}, which do not hold here (vLLM "
            f"runs other kernels on other CPU classes). Fit one on this machine with `python -m "
            f"sim.fitting.fidelity fit` (it writes {PROFILES_DIR / f'{name}-{cpu.isa}.yaml'}), or name a "
            "profile explicitly."
        )
    return f"{name}-{cpu.isa}"


def load_profile(name_or_path: str | Path, cpu: HostCpu | None = None) -> Profile:
    """Load a shipped profile by name (``"default"``) or any profile file by path. A per-CPU-class
    name (``"tiny-cpu"``) loads the profile fitted for ``cpu``'s class (default: this machine's)."""
    path = _resolve(name_or_path, cpu)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    try:
        return _parse(document)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None


def _resolve(name_or_path: str | Path, cpu: HostCpu | None) -> Path:
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text)
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist")
        return path
    if text in fitted_cpu_classes():
        text = cpu_class_profile(text, cpu or host_cpu())
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
    steps = _mapping(
        top["step_time_ms"], "step_time_ms", required=("prefill", "decode"), optional=("base", "intake")
    )
    base = _number(steps.get("base", 0.0), "step_time_ms.base")
    prefill = PrefillTerms(**_terms(steps["prefill"], "step_time_ms.prefill", PrefillTerms))
    decode = DecodeTerms(**_terms(steps["decode"], "step_time_ms.decode", DecodeTerms))
    intake = IntakeTerms(**_terms(steps.get("intake", {}), "step_time_ms.intake", IntakeTerms))
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
    if min(intake.base, intake.per_prompt_token) < 0:
        raise ProfileError("step_time_ms.intake terms must be >= 0")
    if min(frontend.base, frontend.per_prompt_token, frontend.per_running_request) < 0:
        raise ProfileError("frontend_ms terms must be >= 0")
    return Profile(
        name=top["name"],
        description=top["description"].strip(),
        source=top["source"].strip(),
        engine=engine,
        cost=StepCostModel(prefill=prefill, decode=decode, base=base, intake=intake),
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
