from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from epp.tokenizer.model import (
    CHAT_TEMPLATE_FILE,
    GIL_FREE_CHARS,
    ChatTemplateError,
    ModelTokenizer,
    flatten_content,
)
from sim.models import TINY_MODEL_DIR

TOKENIZER = ModelTokenizer(TINY_MODEL_DIR)


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


def tokenizer_with_template(tmp_path: Path, template: str) -> ModelTokenizer:
    config = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", tmp_path)
    return ModelTokenizer(tmp_path)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (  # the templates' own refusal, as transformers provides it
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}"
            "{% endif %}{{ messages[0]['content'] }}",
            "Conversation must start with user",
        ),
        ("{{ messages[0]['tool_calls'][0]['name'] }}", "has no attribute"),
        ("{{ messages[0]['content'] ~ (messages[0]['name'] + 1) }}", "TypeError"),
        ("{{ messages[0] }}", "RecursionError"),
    ],
)
def test_messages_the_template_cannot_render_are_template_errors(
    tmp_path: Path, template: str, message: str
) -> None:
    tokenizer = tokenizer_with_template(tmp_path, template)
    deep: list = []
    for _ in range(995):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer.render_chat([{"role": "system", "content": "x", "name": "n", "nested": deep}])


def test_the_longest_vocabulary_entry_bounds_the_characters_of_a_token() -> None:
    assert TOKENIZER.max_chars_per_token == 37  # vLLM's max_chars_per_token for the tiny model


def _model_dir(tmp_path: Path, config_changes: dict[str, object], template_file: str | None) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / CHAT_TEMPLATE_FILE).write_text(template_file)
    return tmp_path


MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_chat_template_file_beside_the_tokenizer_is_used(tmp_path: Path) -> None:
    tokenizer = ModelTokenizer(_model_dir(tmp_path, {"chat_template": None}, "<{{ messages[0].content }}>"))
    assert tokenizer.render_chat(MESSAGES) == "<hi>"


def test_named_chat_templates_render_the_default_one(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "D{{ messages|length }}"},
    ]
    assert ModelTokenizer(_model_dir(tmp_path, {"chat_template": named}, None)).render_chat(MESSAGES) == "D1"


def test_a_model_without_a_chat_template_is_refused_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no chat template"):
        ModelTokenizer(_model_dir(tmp_path, {"chat_template": None}, None))
