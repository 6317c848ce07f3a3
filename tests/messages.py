"""Protobuf messages in tests: setting a field, a repeated one included, by name."""

from __future__ import annotations

from typing import Any


def set_field(message: Any, name: str, value: Any) -> None:
    """Set `message.name` to `value`; a list replaces a repeated field's items (protobuf refuses to assign one)."""
    if isinstance(value, list):
        del getattr(message, name)[:]
        getattr(message, name).extend(value)
    else:
        setattr(message, name, value)
