"""The fidelity benchmark's machine-dependent parts: which profile it compares with on which CPU,
the profile it writes, and a report that names the CPU (no real vLLM needed)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from bench.fidelity import (
    FidelitySettings,
    choose_profile,
    level_rates,
    markdown_report,
    profile_path_for,
    profile_text,
)
from sim.engine import ProfileError, load_profile
from sim.host_cpu import HostCpu

AVX512 = frozenset({"avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq"})
AMX_CPU = HostCpu("Intel(R) Xeon(R) Processor", AVX512 | {"avx512_bf16", "amx_tile"})
AVX2_CPU = HostCpu("AMD EPYC Processor", frozenset({"avx", "avx2", "fma"}))


class Fits:
    """Stands in for ``fit`` (which measures real vLLM for minutes): writes a copy of the shipped
    profile where asked and remembers the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, HostCpu]] = []

    def __call__(self, path: Path, cpu: HostCpu) -> None:
        self.calls.append((path, cpu))
        shipped = load_profile("tiny-cpu-amx")
        path.write_text(
            profile_text(shipped.cost, shipped.frontend, shipped.engine, cpu, header=["a test fit"])
        )


def test_a_cpu_of_a_fitted_class_is_compared_with_the_shipped_profile(tmp_path: Path) -> None:
    fits = Fits()
    assert choose_profile(FidelitySettings(), AMX_CPU, tmp_path, fits) == ("tiny-cpu", False)
    assert fits.calls == []


def test_a_cpu_of_another_class_gets_a_profile_fitted_here_first(tmp_path: Path) -> None:
    fits = Fits()
    chosen, fitted_here = choose_profile(FidelitySettings(), AVX2_CPU, tmp_path / "results", fits)
    assert (chosen, fitted_here) == (tmp_path / "results" / "tiny-cpu-avx2.yaml", True)
    assert fits.calls == [(chosen, AVX2_CPU)]
    profile = load_profile(chosen)
    assert profile.name == "tiny-cpu-avx2"
    assert "AMD EPYC Processor (ISA class avx2)" in profile.description
    assert "on AMD EPYC Processor" in profile.source


def test_refit_fits_even_where_a_profile_is_shipped(tmp_path: Path) -> None:
    fits = Fits()
    chosen, fitted_here = choose_profile(FidelitySettings(refit=True), AMX_CPU, tmp_path, fits)
    assert (chosen, fitted_here, len(fits.calls)) == (tmp_path / "tiny-cpu-amx.yaml", True, 1)


def test_a_named_profile_that_does_not_exist_is_an_error_not_a_fit(tmp_path: Path) -> None:
    fits = Fits()
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        choose_profile(FidelitySettings(profile="nope"), AVX2_CPU, tmp_path, fits)
    assert fits.calls == []


def test_the_fitted_profile_goes_where_its_class_is_shipped() -> None:
    assert profile_path_for(AMX_CPU).name == "tiny-cpu-amx.yaml"
    assert profile_path_for(AVX2_CPU, Path("results")) == Path("results/tiny-cpu-avx2.yaml")
    assert load_profile(profile_path_for(AMX_CPU)).name == "tiny-cpu-amx"


def test_load_levels_are_fractions_of_the_measured_capacity() -> None:
    settings = FidelitySettings()
    assert level_rates(settings, 20.0) == [("light", 3.0), ("medium", 8.0), ("near saturation", 14.0)]
    assert level_rates(settings, 6.0) == [("light", 0.9), ("medium", 2.4), ("near saturation", 4.2)]


def level(name: str, rate: float) -> dict[str, object]:
    arm = {
        "ttft_ms": {"p50": 30.0, "p90": 60.0},
        "tpot_ms": {"p50": 4.0, "p90": 6.0},
        "cpu_busy_before_pct": 3.0,
        "load_average": [0.5, 1.0],
        "engine_cpu_wait_pct": 2.0,
    }
    errors = {f"{metric}_{q}": 0.0 for metric in ("ttft", "tpot") for q in ("p50", "p90")}
    return {"level": name, "rate_rps": rate, "requests": 50, "vllm": arm, "vllm_attempts": [2.0],
            "sim": arm, "sim_vs_vllm_pct": errors}  # fmt: skip


@pytest.mark.parametrize("fitted_here", [True, False])
def test_the_report_names_the_cpu_its_class_and_the_profiles_origin(fitted_here: bool) -> None:
    data = {
        "machine": {"cpus": 2, "python": "3.11.7", "date": "2026-12-01", "cpu_model": AVX2_CPU.model,
                    "isa": AVX2_CPU.isa},
        "settings": asdict(FidelitySettings()),
        "capacity_rps": 5.0,
        "levels": [level("light", 1.0), level("medium", 2.8), level("near saturation", 4.5)],
        "profile": {"name": "tiny-cpu-avx2", "fitted_here": fitted_here},
    }  # fmt: skip
    report = markdown_report(data)
    assert "Machine: 2 CPUs, AMD EPYC Processor (ISA class avx2)" in report
    origin = "fitted on this machine for this run" if fitted_here else "shipped for ISA class avx2"
    assert f"Profile `tiny-cpu-avx2`: {origin}" in report
    assert "0.15, 0.4, 0.7 of real vLLM's capacity here (5.0 req/s" in report
    assert "| near saturation (4.5 req/s) | TTFT p50 | 30.0 | 30.0 | +0.0% |" in report
