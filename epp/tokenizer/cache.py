"""Incremental tokenization: when a prompt extends one the EPP has seen, tokenize only the new part.

Each turn of a conversation repeats the previous turn's rendered prompt and adds to it. The cache
keeps, per recent prompt, its UTF-8 text and token ids; a new prompt is looked up by the longest
cached text it starts with, and its ids are that text's ids up to a safe cut
(``epp.tokenizer.cuts``) followed by the tokenization of the rest. The result is the same as
tokenizing the whole prompt, by construction, and it is checked as it is made: the rest is
tokenized from ``OVERLAP_TOKENS`` tokens before the cut, and those tokens must come out as
cached, else the whole prompt is tokenized (a *fallback*). New text is tokenized in pieces cut at
word cuts (``epp.tokenizer.cuts.word_pieces``), which gives the same ids for less CPU. With
``verify`` every reused or pieced result is also compared with a full tokenization (tests run the
EPP so), and mismatches are counted.

Lookup: each text is named by chained xxh3 hashes of its leading chunks (256 and 512 bytes, then
every ``CHUNK_BYTES``, then the rest); an index maps each chunk hash to the most recently used
entry holding that prefix. A new text hashes its own chunks (as it must to be stored), walks the index
while the chunks match, and one byte comparison with the entry found gives the exact length of
text they share; a hash collision only costs a miss. An entry's last chunk is usually partial, and
a longer text is not hashed at that end: so where the walk stops, the entries whose last chunk
follows the prefix found are checked as well (else a session whose prompt ended in the chunk where
it parts from another's, sharing a system prompt, would find only that prefix). Texts under
``FIRST_CHUNK_BYTES`` bypass the cache. An entry whose text the new one extends is replaced by the
new one.

Memory is bounded by an estimate (text, ids, index keys and the block-hash chains remembered
with each entry, see ``epp.kvcache.block_chains``); the least recently used entries go first.
Thread-safe: a request parsed in a worker thread may race one parsed on the event loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from xxhash import xxh3_64_intdigest

from epp.kvcache.block_chains import BlockChains, Chains, TokenIds
from epp.tokenizer.cuts import CutPoints, UnsupportedTokenizer, cut_points, word_pieces

log = logging.getLogger(__name__)
FIRST_CHUNK_BYTES = 256
CHUNK_BYTES = 1024
OVERLAP_TOKENS = 8
# Memory estimates: an entry's fixed part, one token id (a tuple slot and an int object), one key.
ENTRY_BYTES = 256
TOKEN_BYTES = 36
KEY_BYTES = 100
# Entries ending in one chunk after a shared prefix that a lookup checks, latest first: a bound
# on its cost when many sessions share a system prompt (missing one only costs reuse).
MAX_TAIL_CANDIDATES = 16


class TooLongToInline(Exception):
    """The text a call would tokenize is longer than its caller lets it tokenize in place (see
    ``max_chars``): nothing was tokenized, stored or counted, so the call can be made again where
    a long tokenization does no harm (a worker thread)."""


def check_inline(chars: int, max_chars: int | None) -> None:
    """Raise :class:`TooLongToInline` if ``chars`` characters are over ``max_chars`` (None: no limit)."""
    if max_chars is not None and chars > max_chars:
        raise TooLongToInline(f"{chars} characters to tokenize, over {max_chars}")


def chunk_bounds(length: int) -> list[int]:
    """Ends of the chunks a text of ``length`` bytes is named by: 256, 512, every 1 KiB, and its end."""
    bounds = [b for b in (FIRST_CHUNK_BYTES, 2 * FIRST_CHUNK_BYTES) if b <= length]
    bounds.extend(range(CHUNK_BYTES, length + 1, CHUNK_BYTES))
    if bounds and bounds[-1] < length:
        bounds.append(length)
    return bounds


def chunk_keys(data: bytes) -> list[int]:
    """Key *k* names ``data[:chunk_bounds(len(data))[k]]`` (a hash chained over its chunks)."""
    view, keys, key, start = memoryview(data), [], 0, 0
    for end in chunk_bounds(len(data)):
        key = xxh3_64_intdigest(view[start:end], key)
        keys.append(key)
        start = end
    return keys


def agreed_length(a: bytes, b: bytes, known: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that it is at least ``known``."""
    lo, hi = known, min(len(a), len(b))
    if a[lo:hi] == b[lo:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False, slots=True)
class _Entry:
    data: bytes
    ids: list[int]
    keys: list[int]
    nbytes: int
    chains: Chains = field(default_factory=dict)
    live: bool = True


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int
    """Prompts whose ids were (partly) taken from the cache."""
    misses: int
    """Prompts no cached text shares a chunk with."""
    fallbacks: int
    """Prompts that share text with a cached one but were tokenized whole: no verified cut."""
    cut_failures: int
    """Cuts whose overlap did not tokenize as cached (each also a fallback): a bug if ever counted."""
    tokens_reused: int
    verified: int
    """Reused or pieced results compared with a full tokenization (``verify`` only)."""
    mismatches: int
    entries: int
    bytes: int


@dataclass(slots=True)
class _Counts:
    hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    cut_failures: int = 0
    tokens_reused: int = 0
    verified: int = 0
    mismatches: int = 0


class TokenizerCache:
    """Token ids of recent prompts, for one tokenizer whose cuts are known (:func:`for_tokenizer`)."""

    def __init__(
        self,
        cuts: CutPoints,
        encode: Callable[[str], list[int]],
        capacity_bytes: int,
        verify: bool = False,
    ) -> None:
        self._cuts = cuts
        self._encode = encode
        self.capacity_bytes = capacity_bytes
        self.verify = verify
        self._lock = threading.Lock()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._index: dict[int, _Entry] = {}
        # Key of each entry's text up to its last chunk → the entries with that text, oldest first.
        self._tails: dict[int, dict[_Entry, None]] = {}
        self._bytes = 0
        self._counts = _Counts()

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Tokenizer,
        encode: Callable[[str], list[int]],
        capacity_bytes: int,
        verify: bool = False,
    ) -> TokenizerCache | None:
        """A cache for ``tokenizer`` (``encode`` tokenizes a whole text), or None if its cuts are unknown."""
        try:
            cuts = cut_points(tokenizer)
        except UnsupportedTokenizer as exc:
            log.warning("tokenizer cache off, every prompt is tokenized whole: %s", exc)
            return None
        return cls(cuts, encode, capacity_bytes, verify)

    def stats(self) -> CacheStats:
        with self._lock:
            c = self._counts
            return CacheStats(
                c.hits,
                c.misses,
                c.fallbacks,
                c.cut_failures,
                c.tokens_reused,
                c.verified,
                c.mismatches,
                len(self._lru),
                self._bytes,
            )

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, max_chars: int | None = None) -> TokenIds:
        """The ids of ``text``, equal to the tokenizer's, with the block chains known for them.
        :class:`TooLongToInline` if more than ``max_chars`` characters of it would be tokenized
        (None: no limit), including the full tokenization ``verify`` makes of a reused result."""
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate: the tokenizer decides what to make of it
            check_inline(len(text), max_chars)
            return TokenIds(self._encode(text))
        if len(data) < FIRST_CHUNK_BYTES:
            check_inline(len(text), max_chars)
            return TokenIds(self._encode(text))
        if self.verify:
            check_inline(len(text), max_chars)
        keys = chunk_keys(data)
        found = self._find(data, keys)
        if found is None:
            check_inline(len(text), max_chars)
            self._count(misses=1)
            return self._store(data, keys, self._tokenize(text, checked=True))
        entry, agreed = found
        if agreed == len(data) == len(entry.data):
            ids, reused, shared = TokenIds(entry.ids), len(entry.ids), len(entry.ids)
        elif (spliced := self._splice(data, entry, agreed, max_chars)) is not None:
            ids, reused, shared = spliced
        else:
            check_inline(len(text), max_chars)
            self._count(fallbacks=1)
            return self._store(data, keys, self._tokenize(text, checked=True))
        if self.verify and not self._verified(text, ids):
            return self._store(data, keys, TokenIds(self._encode(text)))
        self._count(hits=1, tokens_reused=reused)
        if agreed < len(data):
            return self._store(data, keys, ids, entry, shared, replaces=agreed == len(entry.data))
        # The entry's own text, or a prefix of it, which the entry stands for.
        self._claim(entry)
        own = entry.chains if len(data) == len(entry.data) else None
        ids.block_chains = BlockChains(entry.chains, shared, own, self._grower(entry))
        return ids

    def _splice(
        self, data: bytes, entry: _Entry, agreed: int, max_chars: int | None
    ) -> tuple[TokenIds, int, int] | None:
        """``entry``'s ids up to a cut within the ``agreed`` bytes, then ``data`` tokenized from
        there: (ids, tokens reused, tokens shared with the entry), or None if no cut is verified.
        :class:`TooLongToInline` if the text from the cut is over ``max_chars``."""
        cuts = self._cuts_back(data, entry, agreed)
        _, last = next(cuts)
        pos, index = next((cut for cut in cuts if last - cut[1] >= OVERLAP_TOKENS), (0, 0))
        if index == 0:
            return None
        rest = data[pos:].decode()
        check_inline(len(rest), max_chars)
        tail = self._tokenize(rest)
        overlap = entry.ids[index:last]
        if tail[: len(overlap)] != overlap:
            self._count(cut_failures=1)
            log.warning("tokenizer cache: a cut at byte %d did not verify; tokenizing the whole prompt", pos)
            return None
        shared = index + _common_length(tail, entry.ids[index : index + len(tail)])
        ids = TokenIds(entry.ids)  # one copy; the few ids past the cut are dropped next
        del ids[index:]
        ids.extend(tail)
        return ids, index, shared

    def _tokenize(self, text: str, checked: bool = False) -> TokenIds:
        """The ids of ``text``, tokenized piece by piece between word cuts (the whole text's ids).
        ``checked``: with ``verify``, compare them with one call on the whole text (a result no
        later check covers)."""
        pieces = word_pieces(text)
        if len(pieces) == 1:
            return TokenIds(self._encode(text))
        ids = TokenIds()
        for piece in pieces:
            ids.extend(self._encode(piece))
        if checked and self.verify and not self._verified(text, ids):
            return TokenIds(self._encode(text))
        return ids

    def _cuts_back(self, data: bytes, entry: _Entry, agreed: int) -> Iterator[tuple[int, int]]:
        """Cuts (byte offset, token index) of ``entry``'s ids that hold in ``data`` as well, last
        first, ending with the start of the text. ``data`` and the entry agree on ``agreed`` bytes."""
        cuts, ids, lengths = self._cuts, entry.ids, self._cuts.token_bytes
        pos = len(entry.data)
        for index in range(len(ids) - 1, 0, -1):
            pos -= lengths[ids[index]]
            if pos >= agreed:
                continue
            if cuts.is_word_cut(data, pos) or cuts.is_added_cut(data, pos, ids[index - 1], agreed):
                yield pos, index
        yield 0, 0

    def _verified(self, text: str, ids: list[int]) -> bool:
        """Whether ``ids`` are those of a full tokenization of ``text`` (counted)."""
        full = self._encode(text)
        if full == ids:
            self._count(verified=1)
            return True
        self._count(verified=1, mismatches=1, fallbacks=1)
        log.error("tokenizer cache: reused ids differ from a full tokenization (%d, %d)", len(ids), len(full))
        return False

    # ------------------------------------------------------------------ the store

    def _find(self, data: bytes, keys: list[int]) -> tuple[_Entry, int] | None:
        """The entry sharing the most leading chunks with ``data`` (or, past them, the whole text
        of one that ends in ``data``'s next chunk), and how many bytes they share."""
        with self._lock:
            depth = 0
            while depth < len(keys) and keys[depth] in self._index:
                depth += 1
            if depth == 0:
                return None
            entry, bound = self._index[keys[depth - 1]], chunk_bounds(len(data))[depth - 1]
            if (ended := self._ending_in(data, keys[depth - 1], bound)) is not None:
                entry, bound = ended, len(ended.data)
            self._lru.move_to_end(entry)
        if entry.data[:bound] != data[:bound]:
            return None  # a hash collision
        return entry, agreed_length(data, entry.data, bound)

    def _ending_in(self, data: bytes, prefix_key: int, start: int) -> _Entry | None:
        """The latest entry whose text ``data`` extends and that ends in the chunk after ``start``,
        where ``prefix_key`` names ``data[:start]``. The index cannot name it: ``data`` is not hashed
        at its end. (Sessions sharing a system prompt each end there before their first full chunk.)"""
        view = memoryview(data)
        for entry in itertools.islice(reversed(self._tails.get(prefix_key, {})), MAX_TAIL_CANDIDATES):
            end = len(entry.data)
            if start < end <= len(data) and xxh3_64_intdigest(view[start:end], prefix_key) == entry.keys[-1]:
                return entry
        return None

    def _store(
        self,
        data: bytes,
        keys: list[int],
        ids: TokenIds,
        source: _Entry | None = None,
        shared: int = 0,
        *,
        replaces: bool = False,
    ) -> TokenIds:
        """Keep ``ids`` for ``data`` (instead of ``source`` if it ``replaces`` it) and give them the
        chains of ``source``'s first ``shared`` tokens."""
        nbytes = ENTRY_BYTES + len(data) + TOKEN_BYTES * len(ids) + KEY_BYTES * len(keys)
        # A plain list (a slice of TokenIds is one) copies three times faster than a tuple of a
        # subclass, and hits copy it back fast; entries' ids are never handed out or changed.
        entry = _Entry(data, ids[:], keys, nbytes)
        with self._lock:
            if source is not None and replaces and source.live:
                self._lru.pop(source, None)
                self._drop(source)
            if entry.nbytes <= self.capacity_bytes:
                self._lru[entry] = None
                self._bytes += entry.nbytes
                for key in keys:
                    self._index[key] = entry
                if len(keys) > 1:
                    self._tails.setdefault(keys[-2], {})[entry] = None
                self._evict()
            else:
                entry.live = False
        inherited = source.chains if source is not None else None
        own = entry.chains if entry.live else None
        ids.block_chains = BlockChains(inherited, shared, own, self._grower(entry))
        return ids

    def _claim(self, entry: _Entry) -> None:
        """Point ``entry``'s keys at it, as the most recently used entry holding those chunks."""
        with self._lock:
            if entry.live:
                for key in entry.keys:
                    self._index[key] = entry

    def _grower(self, entry: _Entry) -> Callable[[int], None]:
        def grew(nbytes: int) -> None:
            with self._lock:
                if entry.live:
                    entry.nbytes += nbytes
                    self._bytes += nbytes
                    self._evict()

        return grew

    def _evict(self) -> None:
        while self._bytes > self.capacity_bytes and self._lru:
            entry, _ = self._lru.popitem(last=False)
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        entry.live = False
        self._bytes -= entry.nbytes
        for key in entry.keys:
            if self._index.get(key) is entry:
                del self._index[key]
        if len(entry.keys) > 1 and (tails := self._tails.get(entry.keys[-2])) is not None:
            tails.pop(entry, None)
            if not tails:
                del self._tails[entry.keys[-2]]

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._counts, name, getattr(self._counts, name) + value)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` have in common."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same
