"""The tiny random-weight Llama (``tiny/``, built by ``build_tiny``) that the simulator serves,
and whose tokenizer the local stack, the benchmarks and the tests give the EPP."""

from pathlib import Path

TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny"
