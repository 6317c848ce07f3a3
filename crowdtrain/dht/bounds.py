"""The bounds a record's fields carry in the proto (`[(bound) = {min: …, max: …, max_count: …}]`), checked in one
pass before a reader uses anything: every float finite, each bounded number within its range, each bounded string
or repeated field within its count, every message field in turn. A field added to a record with its bound in
crowdtrain.proto is checked here with no code of its own.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from crowdtrain import proto
from crowdtrain.proto import crowdtrain_pb2

_FLOATS = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
_NUMBERS = (
    *_FLOATS,
    FieldDescriptor.CPPTYPE_INT32,
    FieldDescriptor.CPPTYPE_INT64,
    FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64,
)


class OutOfBoundsError(ValueError):
    """A field outside its bound; the message names the field's path, e.g. `training.compute_utilisation`."""


def field_bound(field: FieldDescriptor) -> proto.FieldBound | None:
    """The bound `field` carries in crowdtrain.proto, or None."""
    return _bounds(field.containing_type).get(field.name)


def bound_max(message_type: type[Message], name: str) -> float:
    """The `max` of a field's bound (a number a constant elsewhere can be taken from, so it is written once)."""
    bound = field_bound(message_type.DESCRIPTOR.fields_by_name[name])
    if bound is None or not bound.HasField("max"):
        raise KeyError(f"{message_type.DESCRIPTOR.name}.{name} has no max in crowdtrain.proto")
    return bound.max


def bound_count(message_type: type[Message], name: str) -> int:
    """The `max_count` of a field's bound."""
    bound = field_bound(message_type.DESCRIPTOR.fields_by_name[name])
    if bound is None or not bound.HasField("max_count"):
        raise KeyError(f"{message_type.DESCRIPTOR.name}.{name} has no max_count in crowdtrain.proto")
    return bound.max_count


def check_bounds(message: Message, prefix: str = "") -> None:
    """Raise OutOfBoundsError at the first field of `message` (and of its message fields) outside its bound."""
    bounds = _bounds(message.DESCRIPTOR)
    for field in message.DESCRIPTOR.fields:
        path, bound = prefix + field.name, bounds.get(field.name)
        value: Any = getattr(message, field.name)
        repeated = field.is_repeated
        if repeated and bound is not None and bound.HasField("max_count") and len(value) > bound.max_count:
            raise OutOfBoundsError(f"{len(value)} {path}, over the {bound.max_count} cap")
        for item in value if repeated else (value,):
            _check_value(field, item, path, bound)


def _check_value(field: FieldDescriptor, value: Any, path: str, bound: proto.FieldBound | None) -> None:
    if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        check_bounds(value, path + ".")
    elif field.cpp_type in _NUMBERS:
        if field.cpp_type in _FLOATS and not math.isfinite(value):
            raise OutOfBoundsError(f"an invalid {path}: {value}")
        if bound is not None and (
            (bound.HasField("min") and value < bound.min) or (bound.HasField("max") and value > bound.max)
        ):
            raise OutOfBoundsError(f"an invalid {path}: {value}")
    elif field.cpp_type == FieldDescriptor.CPPTYPE_STRING and bound is not None and bound.HasField("max_count"):
        if len(value) > bound.max_count:
            raise OutOfBoundsError(f"a {path} longer than {bound.max_count} characters")


@functools.cache
def _bounds(descriptor: Descriptor) -> dict[str, proto.FieldBound]:
    bounds = {}
    for field in descriptor.fields:
        options = field.GetOptions()
        if options.HasExtension(crowdtrain_pb2.bound):
            bounds[field.name] = options.Extensions[crowdtrain_pb2.bound]
    return bounds
