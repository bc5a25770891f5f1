"""What an EPP without the model's tokenizer sees of a simulated prompt (``epp.tokenizer.estimated``).

Simulated prompts are token ids without text, so each id is given a text of its own: a length
of 1 to ``2 * bytes_per_token - 1`` bytes (uniform; mean ``bytes_per_token`` when twice it is a
whole number) and bytes, both fixed by the id alone, so the same tokens always make the same
text. The prompt's text is its tokens' texts joined, and the router's ids are the EPP's
estimate of that text: one per 4 bytes, or, ``calibrated``, one per ``bytes_per_token`` (an EPP
that samples the model's tokenizer, ``epp.tokenizer.sampling``, once its ratio has settled).
``bytes_per_token`` is how the workload's real text relates to the real tokenizer (about 4 for
English prose under current vocabularies, less for code, more for scripts of several bytes a
character); 4, or a calibrated estimate, makes the estimated counts right on average, so only
the ids' misalignment with the engine's remains.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epp.tokenizer.estimated import BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN, estimated_ids
from sim.fleet.prompts import splitmix

_MAX_BYTES = 16
_U64 = np.uint64


class TokenText:
    """Estimated ids for prompts of synthetic token ids (see the module)."""

    def __init__(self, bytes_per_token: float, calibrated: bool = False) -> None:
        top = MAX_BYTES_PER_TOKEN if calibrated else (_MAX_BYTES + 1) / 2
        if not 1 <= bytes_per_token <= top:
            raise ValueError(f"bytes per token must be in [1, {top:g}], got {bytes_per_token}")
        self.spread = 2 * bytes_per_token - 1
        self.ratio = bytes_per_token if calibrated else BYTES_PER_TOKEN

    def text(self, tokens: Sequence[int]) -> bytes:
        """The text of ``tokens``: each token's bytes, joined."""
        ids = np.asarray(tokens, dtype=np.uint64)
        first = splitmix(ids)
        content = np.stack([first, splitmix(first)], axis=1).view(np.uint8).reshape(len(ids), _MAX_BYTES)
        uniform = (splitmix(first ^ _U64(0x5EED)) >> _U64(11)).astype(np.float64) / float(1 << 53)
        lengths = 1 + np.floor(uniform * self.spread).astype(np.int64)
        return content[np.arange(_MAX_BYTES)[None, :] < lengths[:, None]].tobytes()

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        """The ids an EPP estimating from the text routes ``tokens`` by."""
        return estimated_ids(self.text(tokens), self.ratio)
