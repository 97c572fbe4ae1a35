"""Readers of the case format's fields: each takes a field of a JSON object, checks its type
and range, and names the field's path in the :class:`LayoutError` it raises (a user's file is
data: a bad field is a one-line error, never an exception from deeper in)."""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 1 << 24


class LayoutError(ValueError):
    """An impossible layout or case: ``field`` names where, the message says why."""

    def __init__(self, field_path: str, reason: str):
        self.field = field_path
        self.reason = reason
        super().__init__(f"{field_path}: {reason}")


def take(obj: Any, path: str, allowed: set[str]) -> dict:
    if not isinstance(obj, dict):
        raise LayoutError(path or "<top>", f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise LayoutError(f"{path}.{unknown[0]}" if path else unknown[0],
                          f"unknown field (allowed: {', '.join(sorted(allowed))})")
    return obj


def integer(obj: dict, key: str, path: str, *, default: Any = ..., lo: int = 1,
         hi: int = MAX_TOKENS, optional: bool = False) -> Any:
    where = f"{path}.{key}" if path else key
    if key not in obj or (optional and obj[key] is None):
        if default is ...:
            raise LayoutError(where, "required")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(where, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise LayoutError(where, f"must be between {lo} and {hi}, got {value}")
    return value


def boolean(obj: dict, key: str, path: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise LayoutError(f"{path}.{key}" if path else key, f"expected true or false, got {value!r}")
    return value


def choice(obj: dict, key: str, path: str, choices: tuple[str, ...], default: Any = ...) -> Any:
    where = f"{path}.{key}" if path else key
    if key not in obj:
        if default is ...:
            raise LayoutError(where, f"required (one of {', '.join(choices)})")
        return default
    value = obj[key]
    if value not in choices:
        raise LayoutError(where, f"must be one of {', '.join(choices)}, got {value!r}")
    return value
