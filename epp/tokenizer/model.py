"""The model's tokenizer and chat template, as the engine applies them.

Prefix matching only works if the router turns a request into exactly the token ids the
engine will see. vLLM renders chat messages with the Jinja chat template from
``tokenizer_config.json`` (in a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, as ``transformers`` does), then tokenizes without adding special
tokens; completion prompts are tokenized as given. This module does the same, so it is
shared by the simulated engine and the EPP. The EPP also keeps a cache of recent prompts'
ids (``epp.tokenizer.cache``), so a prompt that extends one it has seen is tokenized only
where it is new.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from epp.tokenizer.cache import TokenizerCache, check_inline

# Tokenization releases the GIL while Rust works (~0.7 µs per token here), so callers tokenize
# texts longer than this in a worker thread, where a long prompt does not stall the event loop.
GIL_FREE_CHARS = 16_384


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


def flatten_content(content: Any) -> str:
    """Reduce OpenAI message content (a string or a list of parts) to text.

    vLLM joins the text parts with newlines for templates that expect string content.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ChatTemplateError("message content parts must be text")
        return "\n".join(texts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


def normalise_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their content as text (:func:`flatten_content`), as chat templates take
    them; :class:`ChatTemplateError` for an empty conversation or a message without a role."""
    if not messages:
        raise ChatTemplateError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    normalised = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError("each message needs a string 'role'")
        normalised.append({**message, "content": flatten_content(message.get("content"))})
    return normalised


class PromptTokenizer(Protocol):
    """What the EPP needs of a tokenizer: the served model's (:class:`ModelTokenizer`), or token
    counts estimated from the text (``epp.tokenizer.estimated``) while it has none."""

    exact: bool
    """Whether the ids are the engine's (False: estimated; no length limit is enforced on them)."""
    cache: TokenizerCache | None

    @property
    def max_chars_per_token(self) -> int: ...

    def encode(self, text: str, max_chars: int | None = None) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


def _raise_exception(message: str) -> None:
    """The templates' way to refuse a conversation (``transformers`` defines it too)."""
    raise TemplateError(message)


CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""The files a model directory must hold (the chat template may be a third)."""


def chat_template(model_dir: Path, config: dict[str, Any]) -> str:
    """The model's chat template: ``chat_template.jinja`` beside the tokenizer where the model
    ships one (newer Hugging Face repositories do, and ``transformers`` prefers it), else
    ``chat_template`` in ``tokenizer_config.json`` (a string, or named templates of which the EPP
    renders ``default``, as ``transformers`` does). :class:`FileNotFoundError` if it has neither."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    raise FileNotFoundError(
        f"{model_dir} has no chat template: add its {CHAT_TEMPLATE_FILE}, or a 'chat_template' "
        "string in tokenizer_config.json"
    )


class ModelTokenizer:
    """Tokenizer + chat template of one model directory (``tokenizer.json``, ``tokenizer_config.json``)."""

    exact = True

    def __init__(self, model_dir: Path | str, cache_bytes: int = 0, verify_cache: bool = False) -> None:
        """``cache_bytes`` > 0 keeps that much of recent prompts' ids to reuse (see
        ``epp.tokenizer.cache``); ``verify_cache`` checks every reuse against a full tokenization."""
        model_dir = Path(model_dir)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(chat_template(model_dir, config))
        self.eos_token_id: int = self._tokenizer.token_to_id(config["eos_token"])
        self.model_max_length: int = int(config.get("model_max_length", 2048))
        self.cache: TokenizerCache | None = None
        if cache_bytes > 0:
            self.cache = TokenizerCache.for_tokenizer(
                self._tokenizer, self._encode_whole, cache_bytes, verify_cache
            )

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @cached_property
    def max_chars_per_token(self) -> int:
        """The longest vocabulary entry, in characters: vLLM's bound on the text one token covers."""
        return max(map(len, self._tokenizer.get_vocab()))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        """The ids of ``text``. ``epp.tokenizer.cache.TooLongToInline`` if more than ``max_chars``
        characters of it would be tokenized (the cache's reused part aside; None: no limit)."""
        if self.cache is not None:
            return self.cache.encode(text, max_chars)
        check_inline(len(text), max_chars)
        return self._encode_whole(text)

    def _encode_whole(self, text: str) -> list[int]:
        # The batch call releases the GIL, and its fast form skips the offsets, which nothing here
        # reads: a quarter less CPU than ``encode``, with the same ids.
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        normalised = normalise_messages(messages)
        try:
            return self._template.render(messages=normalised, add_generation_prompt=add_generation_prompt)
        except Exception as exc:
            # The template is the model's and fixed: whatever fails while it renders (its own
            # refusal, a missing key, a wrong type, nesting too deep) is these messages not fitting it.
            raise ChatTemplateError(str(exc) if isinstance(exc, TemplateError) else repr(exc)) from None

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
