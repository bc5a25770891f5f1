"""Prompts to token ids: the served model's tokenizer and chat template (``model``), fetched from
the Hub by the model the pool serves (``auto``), incrementally for prompts that extend earlier
ones (``cache``, at the safe cuts of ``cuts``), on one prompt in N (``sampling``), or estimated
from the text without a tokenizer (``estimated``)."""
