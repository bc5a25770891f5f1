"""vLLM 0.32's wording of refused request bodies, shared by the EPP and the simulator.

Two kinds of refusal, both 400:

- a request-body validation failure (pydantic's errors, FastAPI's ``json_invalid``): type
  ``"Bad Request"``, a count then each error as a dict with its ``loc`` joined by dots, the
  first error's ``loc`` as ``param``;
- a check of vLLM's own (``VLLMValidationError``): type ``"BadRequestError"``, the message then
  ``(parameter=..., value=...)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

VALIDATION_ERROR_TYPE = "Bad Request"
_MAX_REPORTED_ERRORS = 10
_MAX_INPUT_CHARS = 200
# pydantic names union branches and wrappers in ``loc``; vLLM drops them from ``param``.
_INTERNAL_LOC = re.compile(r"[\[\]{}()]|^(str|int|float|bool|bytes|list|dict|tuple|set|none|union|nullable)$")


def validation_error_text(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """The message and ``param`` vLLM answers for these request-body validation errors (each as
    ``pydantic.ValidationError.errors()`` gives it, ``loc`` starting with ``"body"``)."""
    if not errors:
        return "Validation error", None
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    lines += [f"  {_describe_error(error)}" for error in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    return "\n".join(lines), join_loc(errors[0].get("loc", ()))


def json_invalid_error(position: int, reason: str) -> dict[str, Any]:
    """FastAPI's validation error for a body that is not JSON (``json.JSONDecodeError``'s
    ``pos`` and ``msg``)."""
    return {
        "type": "json_invalid",
        "loc": ("body", position),
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": reason},
    }


def with_parameter(message: str, parameter: str | None = None, value: Any = None) -> str:
    """A ``VLLMValidationError``'s message: the text, then ``(parameter=..., value=...)``."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt_refusal(salt: object) -> str | None:
    """vLLM's refusal of a ``cache_salt`` (a ``VLLMValidationError`` on ``cache_salt``), or None if
    it is fine: absent, or a non-empty string of at most 128 characters without ``@``, ``/``,
    ``\\`` or NUL."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        return (
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL."
        )
    return None


def _describe_error(error: dict[str, Any]) -> str:
    described = dict(error)
    if "input" in described:
        described["input"] = _summarize_input(described["input"])
    if "loc" in described:
        described["loc"] = join_loc(described["loc"])
    return str(described)


def _summarize_input(value: Any) -> str:
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    text = str(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def join_loc(loc: Sequence[Any]) -> str:
    """A pydantic ``loc`` as vLLM writes it: dotted, without union-branch and wrapper names."""
    parts = [str(part) for part in loc if not _INTERNAL_LOC.search(str(part))]
    return ".".join(parts or map(str, loc))
