"""Tokenizers and texts for the tokenizer-cache tests: the shipped tiny model's, and small byte-level
BPE tokenizers trained here with each other pre-tokenizer pattern the cache supports."""

from __future__ import annotations

import random

from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from epp.tokenizer.cuts import GPT2_PATTERN, LLAMA3_PATTERN, O200K_PATTERN, QWEN2_PATTERN
from sim.models import TINY_MODEL_DIR

# "<think>" is a prefix of another added token: a text ending in it may continue into the longer one.
SPECIAL_TOKENS = [
    "<|user|>", "<|assistant|>", "<|end|>", "<s>", "<|endoftext|>", "<think>", "<think></think>"
]  # fmt: skip
# Pieces that stress pre-tokenizers: whitespace runs of every kind, contractions, digits, emoji
# (with joiners and skin tones), CJK, combining marks, Unicode spaces, and the added tokens.
PIECES = [
    " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u3000", "\u2028", "\x1c", "\x0b",
    "a", "Word", "CAPS", "x", "hello", "world", "'s", "'re", "'LL", "n't", "DON'T", "ſ",
    "0", "7", "123", "4567", "1,234.5", "½", "٣",
    ".", ",", "!?", "...", "()", "{}", "=>", "#", "//", "'", '"', "-", "_", "/", "\\",
    "é", "e\u0301", "naïve", "中", "文本", "テスト", "한국어", "😀", "👩‍💻", "👍🏽", "\u200b", "\ufeff",
    "def f(x):", "    return x", "<|", "|>", "<", ">",
    *SPECIAL_TOKENS,
]  # fmt: skip
CORPUS = [
    "The quick brown fox jumps over the lazy dog's back 12345 times.\n\n",
    "def handler(event, context):\n    return event['body']  # done\n\t\tpass\n",
    "中文文本 测试 😀 émigré naïve CAPS Word's DON'T 1,234,567 ½ ٣ テスト 한국어\n",
    "    if x == 3:\n        print('hello world')\n\n\n",
]


def texts(max_pieces: int = 40) -> st.SearchStrategy[str]:
    """Texts built from ``PIECES`` and arbitrary characters (no lone surrogates)."""
    piece = st.sampled_from(PIECES) | st.text(st.characters(exclude_categories=("Cs",)), max_size=3)
    return st.lists(piece, max_size=max_pieces).map("".join)


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))


def trained_tokenizer(pattern: str) -> Tokenizer:
    """A byte-level BPE tokenizer that splits with ``pattern`` then maps to bytes (as Llama 3's does)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    # The pieces mixed at random too, so that merges across their edges exist to be got wrong.
    rng = random.Random(0)
    mixed = ["".join(rng.choices(PIECES, k=200)) for _ in range(200)]
    tokenizer.train_from_iterator(CORPUS * 20 + mixed, trainer)
    return tokenizer


TOKENIZERS = {
    "tiny": tiny_tokenizer(),
    "gpt2-split": trained_tokenizer(GPT2_PATTERN),
    "llama3": trained_tokenizer(LLAMA3_PATTERN),
    "qwen2": trained_tokenizer(QWEN2_PATTERN),
    "o200k": trained_tokenizer(O200K_PATTERN),
}


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids
