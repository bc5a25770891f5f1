"""Plugin registry: kebab-case type name → plugin class.

Plugin modules register themselves on import (``epp.plugin_types`` imports them all). A plugin
may also be registered as the default producer of a data key, so a configuration that uses
a consumer without naming a producer still works: the framework creates the producer.
"""

from __future__ import annotations

from typing import Any, TypeVar

from epp.scheduling.framework import DataKey, Plugin

P = TypeVar("P", bound=type[Plugin])

_TYPES: dict[str, type[Plugin]] = {}
_DEFAULT_PRODUCERS: dict[DataKey[Any], str] = {}


class UnknownPluginType(KeyError):
    def __init__(self, type_name: str) -> None:
        known = ", ".join(sorted(_TYPES))
        super().__init__(f"unknown plugin type {type_name!r}; known types: {known}")


def register(cls: P) -> P:
    """Class decorator: make ``cls`` available under ``cls.type_name``."""
    existing = _TYPES.get(cls.type_name)
    if existing is not None and existing is not cls:
        raise ValueError(f"plugin type {cls.type_name!r} registered twice")
    _TYPES[cls.type_name] = cls
    return cls


def register_default_producer(cls: P) -> P:
    """Like :func:`register`, and make ``cls`` the producer created for each key it produces."""
    register(cls)
    for key in cls.produces:
        _DEFAULT_PRODUCERS[key] = cls.type_name
    return cls


def plugin_types() -> dict[str, type[Plugin]]:
    """Every registered plugin type by its name (kebab-case), in name order."""
    return dict(sorted(_TYPES.items()))


def plugin_class(type_name: str) -> type[Plugin]:
    try:
        return _TYPES[type_name]
    except KeyError:
        raise UnknownPluginType(type_name) from None


def default_producer_type(key: DataKey[Any]) -> str | None:
    return _DEFAULT_PRODUCERS.get(key)
