"""The fleet simulator's view of an EPP without the model's tokenizer (``sim.fleet.estimated``):
texts fixed by the tokens, counts by the bytes a token, shared prefixes still shared."""

from __future__ import annotations

import pytest

from epp.tokenizer.estimated import BYTES_PER_TOKEN
from sim.fleet.estimated import TokenText
from sim.fleet.prompts import synthetic_tokens


@pytest.mark.parametrize("bytes_per_token", [3.0, 4.0, 5.0])
def test_the_text_averages_the_bytes_a_token_asked_for(bytes_per_token: float) -> None:
    tokens = synthetic_tokens(7, 20_000).tolist()
    text = TokenText(bytes_per_token)
    assert len(text.text(tokens)) / len(tokens) == pytest.approx(bytes_per_token, rel=0.02)
    estimated = len(text(tokens))
    assert estimated == pytest.approx(len(tokens) * bytes_per_token / BYTES_PER_TOKEN, rel=0.02)


@pytest.mark.parametrize("bytes_per_token", [2.5, 3.0, 5.0])
def test_calibrated_the_estimate_counts_the_tokens(bytes_per_token: float) -> None:
    tokens = synthetic_tokens(11, 20_000).tolist()
    assert len(TokenText(bytes_per_token, calibrated=True)(tokens)) == pytest.approx(len(tokens), rel=0.02)


def test_prompts_that_share_tokens_share_estimated_ids() -> None:
    text = TokenText(4.0)
    shared = synthetic_tokens(1, 500).tolist()
    a = text(shared + synthetic_tokens(2, 300).tolist())
    b = text(shared + synthetic_tokens(3, 300).tolist())
    common = len(text.text(shared)) // BYTES_PER_TOKEN
    assert a[:common] == b[:common] and a[common + 1 :] != b[common + 1 :]
    assert text(shared) == TokenText(4.0)(shared)  # fixed by the tokens alone


def test_bytes_a_token_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenText(0.5)
