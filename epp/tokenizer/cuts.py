"""Where a text can be cut so that tokenizing both pieces gives the ids of the whole.

A byte-level BPE tokenizer (``tokenizers``) turns a text into ids in stages: it finds the added
tokens (``<|end|>``, ...) in the raw text, leftmost-longest; it splits each stretch between them
into words with a regex pre-tokenizer; it maps each word to bytes and merges each word's bytes
with BPE on its own. So ``ids(T) == ids(T[:c]) + ids(T[c:])`` holds at two kinds of cut ``c``:

*Word cuts*: ``T[c]`` is a space and ``T[c-1]`` is not whitespace. In every supported pattern
(``KNOWN_PATTERNS``: GPT-2's, cl100k/Llama 3's, Qwen 2's, o200k's) each alternative is a run of
one character class, optionally after one leading character; a space can only be that leading
character or part of a whitespace run. So (1) no word contains ``T[c-1]`` and ``T[c]``: ``c`` is
a word boundary whatever surrounds it; (2) for a word starting before ``c``, every alternative
decides the same whether ``T[c]`` is a space or the end of the text: a class run that reaches
``c`` stops there either way (the classes that hold a space only lead a match or run over
whitespace, and the whitespace before ``c`` ends at ``c-1``), and the lookahead ``(?!\\S)`` only
follows whitespace runs; (3) no pattern looks behind, so the words from ``c`` on depend on
``T[c:]`` alone. Added tokens must not hold a space (and must not strip whitespace or match
single words), so none spans the cut.

*Added-token cuts*: the end of an added token the tokenizer matched in ``T``. The stretches
between added tokens are pre-tokenized separately, and a leftmost-longest match depends only on
the text from where it starts. In a text ``T'`` that agrees with ``T`` on its first ``n`` bytes,
every match starting at least ``max_added_bytes`` before ``n`` is the same as in ``T``, so the
cut holds in ``T'`` too when the token starts that early (see :meth:`CutPoints.is_added_cut`).

Word cuts also make tokenizing a long text cheaper: :func:`word_pieces` cuts it every
``PIECE_CHARS`` or so, and the pieces' ids, joined, are the whole text's (each cut is a word cut of
the piece it falls in too, since the rule reads only the two characters around it). ``tokenizers``
spends most of a long text's time allocating per-byte alignment vectors as large as the text;
pieces of about 1 KiB keep them in cache, for a fifth less CPU than one call on 26k tokens.

No other configuration is assumed safe: a normalizer (NFC composes across characters, ``Prepend``
and ``Strip`` act on stretch edges), a prefix space, other pre-tokenizers or patterns, BPE dropout,
truncation or padding, and vocabularies that are not byte-level all make
:func:`cut_points` raise :class:`UnsupportedTokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_PATTERNS = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, O200K_PATTERN})
_SPACE = 0x20
# Characters per piece that :func:`word_pieces` aims at (measured best at 1-2 KiB on 26k tokens).
PIECE_CHARS = 1024
# ASCII bytes Python counts as whitespace (a superset of the regex engines' ``\s``).
_ASCII_SPACES = frozenset(b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")


class UnsupportedTokenizer(ValueError):
    """The tokenizer's configuration is not one whose cut points are known to be safe."""


@dataclass(frozen=True, slots=True)
class CutPoints:
    """The safe cuts of one tokenizer, and the byte length of each of its tokens."""

    token_bytes: tuple[int, ...]
    """UTF-8 bytes of text each token id stands for (byte-level vocabularies only)."""
    added: dict[int, bytes]
    """Added token id → its content, UTF-8."""
    max_added_bytes: int

    def is_word_cut(self, data: bytes, pos: int) -> bool:
        """``data[pos]`` is a space and the character before it is not whitespace."""
        if pos < 1 or pos >= len(data) or data[pos] != _SPACE:
            return False
        last = data[pos - 1]
        if last < 0x80:
            return last not in _ASCII_SPACES
        start = pos - 1
        while start > 0 and pos - start < 4 and 0x80 <= data[start] < 0xC0:
            start -= 1
        try:
            char = data[start:pos].decode()
        except UnicodeDecodeError:
            return False
        # Python's isspace() holds for every Unicode White_Space character (what ``\s`` means).
        return not char.isspace()

    def is_added_cut(self, data: bytes, pos: int, token_id: int, agreed: int) -> bool:
        """The added token ``token_id``, ending at ``pos`` in a tokenization of ``data``, ends a
        cut in every text that agrees with ``data`` on its first ``agreed`` bytes."""
        content = self.added.get(token_id)
        if content is None:
            return False
        start = pos - len(content)
        return start >= 0 and start + self.max_added_bytes <= agreed and data[start:pos] == content


def word_pieces(text: str, every: int = PIECE_CHARS) -> list[str]:
    """``text`` cut at the first word cut at or after every ``every`` characters from the last cut
    (a space whose preceding character is not whitespace, as :meth:`CutPoints.is_word_cut` says of
    the UTF-8 bytes); the pieces join to ``text``. A text without such a cut is one piece."""
    pieces, start, find, every = [], 0, text.find, max(1, every)  # each piece at least 1 long
    while len(text) - start > every:
        cut = find(" ", start + every)
        while cut != -1 and text[cut - 1].isspace():
            cut = find(" ", cut + 1)
        if cut == -1:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def cut_points(tokenizer: Tokenizer) -> CutPoints:
    """The cut points of ``tokenizer``; raises :class:`UnsupportedTokenizer` saying why not."""
    config = json.loads(tokenizer.to_str())
    for part in ("normalizer", "truncation", "padding"):
        if config.get(part) is not None:
            raise UnsupportedTokenizer(f"a {part} is configured")
    _check_pre_tokenizer(config.get("pre_tokenizer"))
    _check_post_processor(config.get("post_processor"))
    model = config["model"]
    if model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix"):
        raise UnsupportedTokenizer("the model is not plain BPE")
    if model.get("end_of_word_suffix"):
        raise UnsupportedTokenizer("the model is not plain BPE")
    added = _added_tokens(config["added_tokens"])
    return CutPoints(_token_bytes(tokenizer, added), added, max(map(len, added.values()), default=0))


def _check_pre_tokenizer(pre: dict[str, Any] | None) -> None:
    if pre is None:
        raise UnsupportedTokenizer("there is no pre-tokenizer")
    if pre["type"] == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return
    if pre["type"] == "Sequence" and len(steps := pre["pretokenizers"]) == 2:
        split, byte_level = steps
        if (
            split["type"] == "Split"
            and split["pattern"].get("Regex") in KNOWN_PATTERNS
            and split["behavior"] == "Isolated"
            and not split["invert"]
            and byte_level["type"] == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")
        ):
            return
    raise UnsupportedTokenizer(f"pre-tokenizer {json.dumps(pre)} is not a known byte-level split")


def _check_post_processor(post: dict[str, Any] | None) -> None:
    """Post-processors that add nothing when special tokens are not added (the EPP never adds them)."""
    if post is None or post["type"] in ("ByteLevel", "TemplateProcessing"):
        return
    if post["type"] == "Sequence":
        for step in post["processors"]:
            _check_post_processor(step)
        return
    raise UnsupportedTokenizer(f"post-processor {post['type']} is not known")


def _added_tokens(tokens: list[dict[str, Any]]) -> dict[int, bytes]:
    added = {}
    for token in tokens:
        content = token["content"]
        if token["lstrip"] or token["rstrip"] or token["single_word"]:
            raise UnsupportedTokenizer(f"added token {content!r} strips whitespace or matches single words")
        if any(c.isspace() for c in content) or not content:
            raise UnsupportedTokenizer(f"added token {content!r} holds whitespace")
        added[token["id"]] = content.encode()
    return added


def _token_bytes(tokenizer: Tokenizer, added: dict[int, bytes]) -> tuple[int, ...]:
    """Bytes per token id: a byte-level vocabulary spells each byte as one character."""
    alphabet = set(ByteLevel.alphabet())
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if not alphabet <= vocab.keys():
        # A byte missing from the vocabulary would come out as the unknown token, of no fixed length.
        raise UnsupportedTokenizer("the vocabulary does not hold every byte")
    lengths = [0] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, token_id in vocab.items():
        if token_id in added:
            continue
        if not set(token) <= alphabet:
            raise UnsupportedTokenizer(f"vocabulary entry {token!r} is not byte-level")
        lengths[token_id] = len(token)
    for token_id, content in added.items():
        lengths[token_id] = len(content)
    return tuple(lengths)
