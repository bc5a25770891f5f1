"""Step-time model and profile files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.engine import (
    DecodeTerms,
    FrontendTerms,
    IntakeTerms,
    PrefillTerms,
    ProfileError,
    StepCostModel,
    available_profiles,
    load_profile,
)
from sim.engine.cost_model import chunk_context_tokens
from sim.engine.profile import PROFILES_DIR, fitted_cpu_classes
from sim.host_cpu import HostCpu
from sim.real_vllm import BLOCK_SIZE, MAX_MODEL_LEN

AVX512 = frozenset({"avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq"})
AMX_CPU = HostCpu("Intel(R) Xeon(R) Processor", AVX512 | {"avx512_bf16", "amx_tile"})
AVX2_CPU = HostCpu("AMD EPYC Processor", frozenset({"avx", "avx2", "fma"}))


def test_default_profile_reproduces_dynamo_polynomial() -> None:
    cost = load_profile("default").cost
    # Dynamo mocker: prefill_ms = 4.209989e-7 T^2 + 1.518344e-2 T + 16.50142
    assert cost.step_time(1000, 0, 0, 0, 0.0) * 1000 == pytest.approx(32.1058589)
    assert cost.step_time(8192, 0, 0, 0, 0.0) * 1000 == pytest.approx(
        4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142
    )
    # decode_ms = -25.74 u^2 + 54.01 u + 5.74, whatever the batch
    assert cost.step_time(0, 0, 1, 100, 0.5) * 1000 == pytest.approx(26.31)
    assert cost.step_time(0, 0, 300, 900_000, 0.5) == cost.step_time(0, 0, 1, 100, 0.5)
    assert cost.step_time(0, 0, 8, 800, 1.0) * 1000 == pytest.approx(34.01)
    # A step mixing both takes their sum; an empty one none.
    assert cost.step_time(1000, 0, 8, 800, 0.5) * 1000 == pytest.approx(32.1058589 + 26.31)
    assert cost.step_time(0, 0, 0, 0, 0.3) == 0.0


def test_default_profile_documents_its_source_and_limits() -> None:
    profile = load_profile("default")
    assert "perf_model.rs" in profile.source
    assert profile.engine.block_size == 16
    assert 200_000 <= profile.engine.kv_capacity_tokens <= 1_000_000


def test_decode_floor_and_linear_terms() -> None:
    cost = StepCostModel(
        PrefillTerms(base=2.0),
        DecodeTerms(base=-10.0, per_seq=0.5, per_context_token=0.001, kv_fraction=4.0, min=1.5),
    )
    assert cost.step_time(0, 0, 2, 1000, 0.0) * 1000 == pytest.approx(1.5)  # floored
    assert cost.step_time(0, 0, 20, 5000, 0.5) * 1000 == pytest.approx(-10 + 10 + 5 + 2)


def test_shared_base_is_paid_once_and_prefill_attention_is_priced() -> None:
    cost = StepCostModel(
        PrefillTerms(per_token=0.01, per_context_token=0.001), DecodeTerms(per_seq=0.1), base=2.0
    )
    prefill_only = 2.0 + 0.01 * 100 + 0.001 * 5050
    assert cost.step_time(100, 5050, 0, 0, 0.0) * 1000 == pytest.approx(prefill_only)
    assert cost.step_time(0, 0, 4, 400, 0.0) * 1000 == pytest.approx(2.0 + 0.4)
    assert cost.step_time(100, 5050, 4, 400, 0.0) * 1000 == pytest.approx(prefill_only + 0.4)
    assert cost.step_time(0, 0, 0, 0, 0.0) == 0.0


def test_chunk_context_tokens_counts_attended_pairs() -> None:
    assert chunk_context_tokens(1, 0) == 1
    assert chunk_context_tokens(4, 0) == 1 + 2 + 3 + 4
    assert chunk_context_tokens(3, 10) == 11 + 12 + 13
    # Two short prompts cost less attention than one prompt of their combined length.
    assert 2 * chunk_context_tokens(500, 0) < chunk_context_tokens(1000, 0)


def test_frontend_delay() -> None:
    frontend = FrontendTerms(base=5.0, per_prompt_token=0.002, per_running_request=0.5)
    assert frontend.delay(1000, 0) == pytest.approx(0.007)
    assert frontend.delay(1000, 4) == pytest.approx(0.009)
    assert FrontendTerms().delay(10**6, 100) == 0.0


def test_intake_time_and_a_slower_engine_takes_requests_in_slower() -> None:
    intake = IntakeTerms(base=0.5, per_prompt_token=0.0002)
    assert intake.time(1000) == pytest.approx(0.0007)
    assert IntakeTerms().time(10**6) == 0.0
    cost = StepCostModel(PrefillTerms(per_token=0.01), DecodeTerms(min=1.0), intake=intake)
    assert cost.scaled(2.0).intake.time(1000) == pytest.approx(0.0014)


def test_shipped_profiles() -> None:
    assert available_profiles() == [
        "deepseek-v3-h200", "default", "instant", "llama-3.1-8b-a100", "llama-3.1-8b-h100", "tiny-cpu",
        "tiny-cpu-amx",
    ]  # fmt: skip
    assert fitted_cpu_classes() == {"tiny-cpu": ["amx"]}
    instant = load_profile("instant")
    assert instant.cost.step_time(8192, 0, 1024, 10**6, 1.0) < 0.001
    assert "overhead" in instant.description
    h100, a100 = load_profile("llama-3.1-8b-h100"), load_profile("llama-3.1-8b-a100")
    assert a100.engine == h100.engine and "A100-80" in a100.source
    # BLIS's fits: the A100 about 2.8-3x slower, prefill-heavy and decode-heavy steps alike
    for step in ((8192, 0, 0, 0, 0.0), (0, 0, 256, 10**5, 0.5)):
        assert 2.7 < a100.cost.step_time(*step) / h100.cost.step_time(*step) < 3.1


@pytest.mark.parametrize("isa", fitted_cpu_classes()["tiny-cpu"])
def test_each_tiny_cpu_profile_matches_the_real_vllm_replicas(isa: str) -> None:
    profile = load_profile(f"tiny-cpu-{isa}")
    assert profile.name == f"tiny-cpu-{isa}"
    assert f"ISA class {isa}" in profile.description
    engine = profile.engine
    assert (engine.block_size, engine.num_gpu_blocks, engine.max_model_len) == (
        BLOCK_SIZE,
        512,
        MAX_MODEL_LEN,
    )
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (128, 2048)  # vLLM's CPU defaults
    assert "lab/sim/fitting/fidelity.py" in profile.source
    # Plausible for a tiny model on a CPU: milliseconds per step, a frontend delay of milliseconds.
    assert 0.001 < profile.cost.step_time(0, 0, 1, 100, 0.0) < 0.05
    assert profile.cost.step_time(2000, 2001000, 0, 0, 0.0) > profile.cost.step_time(100, 5050, 0, 0, 0.0)
    assert 0.0 < profile.frontend.delay(1000, 0) < profile.frontend.delay(1000, 16) < 0.1


def test_tiny_cpu_is_the_profile_fitted_for_the_cpus_class() -> None:
    assert load_profile("tiny-cpu", AMX_CPU).name == "tiny-cpu-amx"
    # No fallback to another class's fit: vLLM is 3-5 times slower on AVX2.
    with pytest.raises(
        ProfileError,
        match=r"no tiny-cpu profile is fitted for this CPU, AMD EPYC Processor \(ISA class avx2\); "
        r"shipped: tiny-cpu-amx, .*`python -m sim.fitting.fidelity fit` \(it writes .*tiny-cpu-avx2\.yaml\)",
    ):
        load_profile("tiny-cpu", AVX2_CPU)
    # A class's profile by its own name loads anywhere, as any other shipped profile.
    assert load_profile("tiny-cpu-amx", AVX2_CPU).name == "tiny-cpu-amx"


def write_profile(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def valid_document() -> dict:
    return yaml.safe_load((PROFILES_DIR / "default.yaml").read_text())


def test_loads_the_optional_step_base_intake_and_frontend_terms(tmp_path: Path) -> None:
    document = valid_document()
    default = load_profile(write_profile(tmp_path, document))
    assert (default.frontend, default.cost.intake) == (FrontendTerms(), IntakeTerms())
    document["step_time_ms"]["base"] = 3
    document["step_time_ms"]["intake"] = {"base": 0.6, "per_prompt_token": 0.0003}
    document["step_time_ms"]["decode"]["min"] = 0
    document["frontend_ms"] = {"base": 4, "per_prompt_token": 0.01, "per_running_request": 0.2}
    profile = load_profile(write_profile(tmp_path, document))
    assert profile.cost.base == 3.0
    assert profile.cost.intake == IntakeTerms(base=0.6, per_prompt_token=0.0003)
    assert profile.frontend == FrontendTerms(base=4.0, per_prompt_token=0.01, per_running_request=0.2)


def test_loads_a_profile_by_path(tmp_path: Path) -> None:
    document = valid_document()
    document["name"] = "custom"
    document["engine"]["num_gpu_blocks"] = 100
    profile = load_profile(write_profile(tmp_path, document))
    assert (profile.name, profile.engine.num_gpu_blocks) == ("custom", 100)
    assert load_profile(str(tmp_path / "custom.yaml")).engine.num_gpu_blocks == 100


def test_unknown_profile_names_the_shipped_ones() -> None:
    with pytest.raises(
        ProfileError,
        match=r"deepseek-v3-h200, default, instant, llama-3\.1-8b-a100, llama-3\.1-8b-h100, tiny-cpu, "
        r"tiny-cpu-amx",
    ):
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("/nonexistent/profile.yaml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("source"), "lacks source"),
        (lambda d: d.update(extra=1), "unknown keys extra"),
        (lambda d: d["engine"].pop("num_gpu_blocks"), "engine lacks num_gpu_blocks"),
        (lambda d: d["engine"].update(block_size=0), "block_size must be a positive integer"),
        (lambda d: d["engine"].update(max_num_seqs="many"), "max_num_seqs must be a positive integer"),
        (lambda d: d["step_time_ms"]["prefill"].update(per_tok=1), "unknown terms per_tok"),
        (lambda d: d["step_time_ms"]["decode"].update(base="fast"), "decode.base must be a finite number"),
        (lambda d: d["step_time_ms"]["decode"].update(min=0), "decode.min must be > 0"),
        (lambda d: d["step_time_ms"]["prefill"].update(per_token=-1), "prefill terms must be >= 0"),
        (lambda d: d["step_time_ms"].pop("decode"), "step_time_ms lacks decode"),
        (lambda d: d.update(description=""), "description must be a non-empty string"),
        (lambda d: d["step_time_ms"].update(base=-1), "step_time_ms.base must be >= 0"),
        (lambda d: d["step_time_ms"]["prefill"].update(per_context_token=-1), "prefill terms must be >= 0"),
        (lambda d: d["step_time_ms"].update(intake={"base": -1}), "intake terms must be >= 0"),
        (lambda d: d["step_time_ms"].update(intake={"per_token": 1}), "intake has unknown terms per_token"),
        (lambda d: d.update(frontend_ms={"base": -1}), "frontend_ms terms must be >= 0"),
        (lambda d: d.update(frontend_ms={"per_running_request": -1}), "frontend_ms terms must be >= 0"),
        (lambda d: d.update(frontend_ms={"per_token": 1}), "frontend_ms has unknown terms per_token"),
    ],
)
def test_malformed_profiles_are_rejected(tmp_path: Path, edit, message: str) -> None:
    document = valid_document()
    edit(document)
    with pytest.raises(ProfileError, match=message):
        load_profile(write_profile(tmp_path, document))


def test_non_mapping_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="must be a mapping"):
        load_profile(write_profile(tmp_path, [1, 2]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(bad)


def test_published_gpu_profiles() -> None:
    """The fleet benchmark's profiles: plausible step times for their hardware, sources named."""
    llama = load_profile("llama-3.1-8b-h100")
    assert "BLIS" in llama.source and llama.engine.num_gpu_blocks == 29205
    # BLIS's fit: ~5.8 ms for a one-sequence decode step, ~147 ms for a full 8192-token prefill
    assert llama.cost.step_time(0, 0, 1, 1000, 0.1) == pytest.approx(0.005758704, rel=1e-6)
    assert llama.cost.step_time(8192, 0, 0, 0, 0.0) == pytest.approx(0.14707, rel=1e-4)
    deepseek = load_profile("deepseek-v3-h200")
    assert "2412.19437" in deepseek.source and deepseek.engine.block_size == 64
    # 64 sequences at 8k context decode at ~30 ms per token; 256 at 4k at ~43 ms
    assert deepseek.cost.step_time(0, 0, 64, 64 * 8192, 0.5) == pytest.approx(0.0298, rel=0.01)
    assert deepseek.cost.step_time(0, 0, 256, 256 * 4096, 0.9) == pytest.approx(0.0434, rel=0.01)
