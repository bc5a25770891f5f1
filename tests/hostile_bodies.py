"""Hostile and malformed request bodies, shared by the parser, stream and gateway tests.

``HOSTILE`` holds the cases that once made the EPP answer 500 (issue 10): lone surrogates,
integers past Python's 4,300-digit limit, nesting deeper than the recursion limit. The
strategies generate arbitrary JSON (lone surrogates included) shaped like OpenAI requests,
and raw bytes around it.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

BIG_INT = "9" * 5000


def nested(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


HOSTILE: dict[str, tuple[str, bytes]] = {
    "lone surrogate in prompt": ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}'),
    "lone surrogate in a prompt list": ("/v1/completions", b'{"model": "tiny", "prompt": ["a", "\\udfff"]}'),
    "lone surrogate in chat content": (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
    ),
    "lone surrogate in chat role": (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "\\ud800", "content": "hi"}]}',
    ),
    "surrogate bytes (CESU-8) in prompt": ("/v1/completions", b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'),
    "5,000-digit max_tokens": (
        "/v1/completions",
        f'{{"model": "tiny", "prompt": "hi", "max_tokens": {BIG_INT}}}'.encode(),
    ),
    "5,000-digit unknown field": (
        "/v1/completions",
        f'{{"model": "tiny", "prompt": "hi", "seed": {BIG_INT}}}'.encode(),
    ),
    "5,000-digit token id": ("/v1/completions", f'{{"model": "tiny", "prompt": [{BIG_INT}]}}'.encode()),
    "nested 1,100 deep in prompt": (
        "/v1/completions",
        f'{{"model": "tiny", "prompt": {nested(1100)}}}'.encode(),
    ),
    "nested 1,100 deep in chat content": (
        "/v1/chat/completions",
        f'{{"model": "tiny", "messages": [{{"role": "user", "content": {nested(1100)}}}]}}'.encode(),
    ),
}
# Deep, but within orjson's limit: routed like any other request (vLLM 0.32 itself answers 400 to it:
# its json.loads stops near Python's recursion limit of 1,000).
DEEP_BUT_VALID = (
    "/v1/chat/completions",
    f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi", "x": {nested(1020)}}}]}}'.encode(),
)

# Raw JSON spliced in where a value goes: what json.dumps cannot write, or writes only as a string.
FRAGMENTS = [
    BIG_INT,
    "-" + BIG_INT,
    nested(1100),
    nested(999),
    "NaN",
    "-Infinity",
    "1e999",
    "1" * 30,
    '"\\ud800"',
]
_FRAGMENT = st.sampled_from([f"\x00{i}\x00" for i in range(len(FRAGMENTS))])
# Text with lone surrogates: json.dumps escapes them ("\ud800") as a client's encoder might.
TEXT = st.lists(
    st.sampled_from(["a", " ", "\n", "é", "\ud800", "\udfff"]) | st.characters(), max_size=12
).map("".join)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT | _FRAGMENT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=16,
)


def mostly(typed: st.SearchStrategy) -> st.SearchStrategy:
    """``typed`` four times in five, else any JSON: a body that passes the type checks gets as far
    as the tokenizer, where the hostile text matters."""
    return st.sampled_from([typed] * 4 + [JSON]).flatmap(lambda strategy: strategy)


MESSAGE = mostly(
    st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "system", "assistant"]) | TEXT)},
        optional={
            "content": mostly(TEXT | st.lists(mostly(st.fixed_dictionaries({"text": TEXT})), max_size=3))
        },
    )
)
# Values vLLM's lax field types coerce ("16" and 1.0 are 16 and 1 tokens, "true" and 1 a stream),
# or refuse ("x", 1.5, 2).
LAX_INTS = st.sampled_from(["16", 1.0, True, False, None, " 7 ", "1.5", 1.5, "x"])
LAX_BOOLS = st.sampled_from([None, 0, 1, 2, "true", "no", "on", "x", 1.0])
REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "tiny", None, "", 5]),
        "prompt": mostly(
            TEXT
            | st.lists(TEXT, min_size=1, max_size=3)
            | st.lists(st.integers(-5, 5000) | st.booleans() | st.sampled_from(["5", 2.0]), max_size=4)
            | st.lists(st.lists(st.integers(0, 5000), max_size=3), min_size=1, max_size=3)
        ),
        "messages": mostly(st.lists(MESSAGE, min_size=1, max_size=3)),
        "max_tokens": mostly(st.integers(-2, 10**30) | LAX_INTS),
        "max_completion_tokens": mostly(st.integers(-2, 100) | LAX_INTS),
        "stream": mostly(st.booleans() | LAX_BOOLS),
        "cache_salt": mostly(TEXT),
    },
)


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """A JSON body shaped like a request (or any JSON value), as ASCII escapes or raw UTF-8 (lone
    surrogates as CESU-8 bytes; sometimes after a BOM, or in UTF-16 or UTF-32), with raw fragments
    spliced in; sometimes cut short or spliced with junk; or raw bytes."""
    kind = draw(st.sampled_from(["request", "request", "request", "value", "mangled", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    value = (
        draw(JSON) if kind == "value" else {**draw(REQUEST), **draw(st.dictionaries(TEXT, JSON, max_size=2))}
    )
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    for i, fragment in enumerate(FRAGMENTS):
        text = text.replace(json.dumps(f"\x00{i}\x00"), fragment)
    body = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:  # what Python's json reads too: a BOM, UTF-16 or UTF-32
        body = draw(
            st.sampled_from(
                [
                    lambda t: b"\xef\xbb\xbf" + t.encode("utf-8", "surrogatepass"),
                    lambda t: t.encode("utf-16", "surrogatepass"),
                    lambda t: t.encode("utf-32-le", "surrogatepass"),
                ]
            )
        )(text)
    if kind == "mangled":
        start = draw(st.integers(0, len(body)))
        end = draw(st.integers(start, len(body)))
        body = body[:start] + draw(st.binary(max_size=8)) + body[end:]
    return body


PATHS = st.sampled_from(
    ["/v1/completions", "/v1/chat/completions"] * 3 + ["/v1/embeddings", "/v1/models", "/"]
)
