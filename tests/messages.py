"""Protobuf messages in tests: setting a field by name, and reading a stream of them as a peer that stops reading."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any


def set_field(message: Any, name: str, value: Any) -> None:
    """Set `message.name` to `value`; a list replaces a repeated field's items (protobuf refuses to assign one)."""
    if isinstance(value, list):
        del getattr(message, name)[:]
        getattr(message, name).extend(value)
    else:
        setattr(message, name, value)


async def read_first_then_stall(answers: AsyncIterator[Any], reading: threading.Event, stall_s: float) -> None:
    """Read the first of a stream's `answers`, set `reading`, then read nothing more for `stall_s` (or until
    cancelled): what a peer that stops reading holds of its server. The stream is closed at the end."""
    try:
        await anext(answers)
        reading.set()
        await asyncio.sleep(stall_s)
    finally:
        await answers.aclose()  # type: ignore[attr-defined]
