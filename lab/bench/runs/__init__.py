"""The benchmarks, one module each: what ``llm-epp-bench`` runs (``bench.cli``), and what runs
as ``python -m bench.runs.NAME``."""
