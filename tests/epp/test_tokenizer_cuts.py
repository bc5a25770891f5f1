"""Cut points: the two sides of a cut tokenize to the ids of the whole text, for every supported
tokenizer; configurations whose cuts are not known are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from epp.tokenizer.cuts import UnsupportedTokenizer, cut_points, word_pieces
from tests.epp.tokenizers_under_test import TOKENIZERS, encode, texts, tiny_tokenizer


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(text=texts())
def test_every_cut_splits_the_tokenization(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    cuts = cut_points(tokenizer)
    data, whole = text.encode(), encode(tokenizer, text)
    assert sum(cuts.token_bytes[i] for i in whole) == len(data)
    pos = 0
    boundaries = []
    for token_id in whole:
        pos += cuts.token_bytes[token_id]
        boundaries.append((pos, token_id))
    word_cuts = [p for p in range(len(data)) if cuts.is_word_cut(data, p)]
    added_cuts = [p for p, t in boundaries if cuts.is_added_cut(data, p, t, len(data))]
    for cut in word_cuts + added_cuts:
        assert encode(tokenizer, data[:cut].decode()) + encode(tokenizer, data[cut:].decode()) == whole


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(text=texts(), every=st.integers(0, 12))
def test_pieces_cut_at_word_cuts_tokenize_as_the_whole_text(name: str, text: str, every: int) -> None:
    tokenizer = TOKENIZERS[name]
    cuts = cut_points(tokenizer)
    pieces = word_pieces(text, every)
    assert "".join(pieces) == text and all(pieces[1:])
    data, ends = text.encode(), 0
    for piece in pieces[:-1]:
        ends += len(piece.encode())
        assert cuts.is_word_cut(data, ends)
    assert [i for piece in pieces for i in encode(tokenizer, piece)] == encode(tokenizer, text)


def test_pieces_are_cut_at_the_first_word_cut_past_each_stretch() -> None:
    text = "ab  cd\t ef gh ij"
    assert word_pieces(text, 2) == ["ab", "  cd\t ef", " gh", " ij"]  # never after whitespace
    assert word_pieces(text, 100) == [text]
    assert word_pieces("x" * 50, 4) == ["x" * 50]


def test_word_cuts_are_spaces_after_non_whitespace() -> None:
    cuts = cut_points(tiny_tokenizer())
    data = "a b  c\t d\u00a0 é 中 \u3000 x".encode()
    found = [data[:p].decode() for p in range(len(data)) if cuts.is_word_cut(data, p)]
    assert found == ["a", "a b", "a b  c\t d\u00a0 é", "a b  c\t d\u00a0 é 中"]


def test_an_added_token_ends_a_cut_only_far_enough_from_where_texts_differ() -> None:
    tokenizer = tiny_tokenizer()
    cuts = cut_points(tokenizer)
    data = b"hi<|end|>\nmore"
    end_id = tokenizer.token_to_id("<|end|>")
    assert cuts.max_added_bytes == len("<|assistant|>")
    assert cuts.is_added_cut(data, 9, end_id, agreed=2 + cuts.max_added_bytes)
    assert not cuts.is_added_cut(data, 9, end_id, agreed=1 + cuts.max_added_bytes)
    assert not cuts.is_added_cut(data, 8, end_id, agreed=len(data))  # not where the token ends
    assert not cuts.is_added_cut(data, 9, tokenizer.token_to_id("<|user|>"), agreed=len(data))


def _variant(change: dict[str, Any]) -> Tokenizer:
    config = json.loads(tiny_tokenizer().to_str())
    for path, value in change.items():
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[leaf] = value
    return Tokenizer.from_str(json.dumps(config))


UNSUPPORTED = {
    "normalizer": {"normalizer": {"type": "NFC"}},
    "prefix space": {"pre_tokenizer.add_prefix_space": True},
    "metaspace": {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
    "unknown pattern": {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\w+|\W"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
    },
    "dropout": {"model.dropout": 0.1},
    "truncation": {
        "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    },
    "stripping added token": {"added_tokens.5.lstrip": True},
    "added token with a space": {"added_tokens.5.content": "<|user |>"},
    "post-processor": {"post_processor": {"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}},
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_configurations_it_cannot_reason_about_are_refused(name: str) -> None:
    with pytest.raises(UnsupportedTokenizer):
        cut_points(_variant(UNSUPPORTED[name]))
