from __future__ import annotations

from pathlib import Path

import pytest

from epp.datalayer.engine_metrics import MetricsParseError, parse_engine_metrics

SCRAPE = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "metrics_full.txt").read_bytes()


def test_reads_a_real_vllm_scrape() -> None:
    m = parse_engine_metrics(SCRAPE, now=5.0)
    assert (m.waiting, m.running, m.kv_cache_usage) == (0, 0, 0.0)
    assert (m.block_size, m.num_gpu_blocks, m.updated_at) == (32, 512, 5.0)


def test_values_labels_and_data_parallel_engines() -> None:
    text = (
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_waiting{engine="1",model_name="m"} 4\n'
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
        b"vllm:num_requests_running 2 1700000000000\n"
        b'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        b'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
    )
    m = parse_engine_metrics(text, now=0.0)
    assert (m.waiting, m.running, m.kv_cache_usage) == (7, 2, 0.5)
    assert m.block_size is None


def test_legacy_kv_metric_name() -> None:
    text = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.4\n"
    assert parse_engine_metrics(text, now=0.0).kv_cache_usage == 0.4


@pytest.mark.parametrize(
    "text",
    [b"", b"not prometheus at all", b"vllm:num_requests_waiting 1\nvllm:num_requests_running NaN\n"],
)
def test_missing_metrics_are_an_error(text: bytes) -> None:
    with pytest.raises(MetricsParseError):
        parse_engine_metrics(text, now=0.0)
