"""Typed parsing of plain mappings (TOML tables) and protobuf messages into frozen dataclasses.

Every error names the offending field, so a user can fix a config file from the message alone.
A dataclass field typed `dict[...]` maps to a JSON string in protobuf, in a field named `<name>_json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")


class FieldError(ValueError):
    """A value that does not fit its field; the message starts with the field's dotted path."""


def from_mapping(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build the dataclass `cls` from `data`, rejecting unknown fields and wrong types."""
    if not isinstance(data, Mapping):
        raise FieldError(f"{prefix.rstrip('.') or 'the document'} must be a table, got {_describe(data)}")
    known = {field.name for field in dataclasses.fields(cls) if field.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise FieldError(f"unknown field '{prefix}{unknown[0]}' (known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except FieldError:
        raise
    except (ValueError, TypeError) as e:
        where = f"in [{prefix.rstrip('.')}]: " if prefix else ""
        raise FieldError(f"{where}{e}") from None


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        return None if value is None else _coerce(options[0], value, path)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):  # type: ignore[arg-type]
            return value
        return from_mapping(hint, value, prefix=path + ".")  # type: ignore[arg-type]
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise FieldError(f"field '{path}' must be a list, got {_describe(value)}")
        item_type = typing.get_args(hint)[0]
        return tuple(_coerce(item_type, item, f"{path}[{i}]") for i, item in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise FieldError(f"field '{path}' must be a table, got {_describe(value)}")
        return dict(value)
    return _coerce_scalar(hint, value, path)


def _coerce_scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any double
            number = math.inf
        if not math.isfinite(number):
            raise FieldError(f"field '{path}' must be a finite number, got {str(value)[:40]}")
        return number
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and type(value) is hint:
        return value
    raise FieldError(f"field '{path}' must be {_TYPE_NAMES.get(hint, str(hint))}, got {_describe(value)}")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def to_message(obj: Any, message: Message) -> Message:
    """Fill the protobuf `message` from the dataclass `obj`, field by field of the same name."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            to_message(value, getattr(message, field.name))
        elif isinstance(value, dict):
            setattr(message, f"{field.name}_json", json.dumps(value, sort_keys=True))
        elif isinstance(value, tuple):
            getattr(message, field.name).extend(value)
        else:
            setattr(message, field.name, value)
    return message


def from_message(cls: type[T], message: Message) -> T:
    """Build the dataclass `cls` from a protobuf `message`; validation errors name the field."""
    hints = typing.get_type_hints(cls)
    data: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[field.name]
        optional = _optional_dataclass(hint)
        if optional is not None:
            has = message.HasField(field.name)  # type: ignore[attr-defined]
            data[field.name] = from_message(optional, getattr(message, field.name)) if has else None
        elif dataclasses.is_dataclass(hint):
            data[field.name] = from_message(hint, getattr(message, field.name))  # type: ignore[arg-type]
        elif typing.get_origin(hint) is dict or hint is dict:
            data[field.name] = _parse_json_object(getattr(message, f"{field.name}_json"), field.name)
        elif typing.get_origin(hint) is tuple:
            data[field.name] = list(getattr(message, field.name))
        elif _is_unset_optional(message, field.name):
            continue  # added after older nodes were released: what they leave unset takes the dataclass default
        else:
            data[field.name] = getattr(message, field.name)
    return from_mapping(cls, data)


def _optional_dataclass(hint: Any) -> Any:
    """The dataclass of a `Spec | None` hint (an `optional` message field in protobuf), else None."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    options = [option for option in typing.get_args(hint) if option is not type(None)]
    return options[0] if len(options) == 1 and dataclasses.is_dataclass(options[0]) else None


def _is_unset_optional(message: Message, name: str) -> bool:
    """Whether `name` is an `optional` scalar field of `message` (one with presence) that was not set."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    return descriptor.has_presence and not message.HasField(name)


def _parse_json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text, parse_constant=_refuse_constant) if text else {}
    except ValueError as e:  # json.JSONDecodeError, or _refuse_constant's
        raise FieldError(f"field '{name}' is not valid JSON: {e}") from None
    except RecursionError:
        raise FieldError(f"field '{name}' nests too deeply") from None
    if not isinstance(value, dict):
        raise FieldError(f"field '{name}' must be a JSON object")
    return value


def _refuse_constant(constant: str) -> Any:
    """json.loads takes NaN and Infinity, which JSON does not allow and no config needs."""
    raise ValueError(f"{constant} is not a JSON number")
