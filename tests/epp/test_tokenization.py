from __future__ import annotations

import pytest

from epp.tokenization import GIL_FREE_CHARS, ChatTemplateError, ModelTokenizer, flatten_content

TOKENIZER = ModelTokenizer()


def test_long_texts_take_the_gil_free_path_with_identical_ids() -> None:
    text = "def handler(event, context):\n    return event['body']\n" * (GIL_FREE_CHARS // 40)
    assert len(text) > GIL_FREE_CHARS
    direct = TOKENIZER._tokenizer.encode(text, add_special_tokens=False).ids
    assert TOKENIZER.encode(text) == direct


def test_chat_template_matches_vllm_rendering() -> None:
    # vLLM 0.32's /tokenize for these messages returned exactly these ids.
    assert TOKENIZER.encode_chat([{"role": "user", "content": "Hi"}]) == [5, 206, 47, 80, 7, 206, 6, 206]
    rendered = TOKENIZER.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert rendered == "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"


def test_content_parts_are_joined_with_newlines() -> None:
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    assert flatten_content(None) == ""
    with pytest.raises(ChatTemplateError):
        flatten_content([{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ChatTemplateError):
        TOKENIZER.render_chat([])


def test_decode_skips_special_tokens() -> None:
    ids = TOKENIZER.encode("hello world")
    assert TOKENIZER.decode([5, *ids, 7]) == "hello world"
