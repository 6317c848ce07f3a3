"""What a SPES node gathers with its averaging round, and each member's value parsed for ownership.

Every member of an averaged round sees the same gathered values, so ownership computed from them agrees. They are
relayed by the round's leader and untrusted: each field is checked, and one that is missing or malformed reads as
what a node of an older version would mean (no cap, median compute, dialable). A leader that forges them can make
a member look slow, full or undialable, and so keep experts from it (as a forged capacity of 0 already could); it
can't make an undialable node own experts the others fetch in vain, beyond what that node claimed itself.
"""

from __future__ import annotations

from typing import Any

RATE, CAPACITY, DIALABLE = 3, 4, 5
"""Indices in a SPES member's gathered list, after DiLoCo's round, proposed H and θ₀ digest."""


def spes_gathered(diloco: list[Any], rate: float, capacity: int | None, dialable: bool) -> list[Any]:
    """DiLoCo's gathered values, then this node's samples/s in the round, how many experts it can train (-1: not
    known) and whether peers can dial it (an owner serves its experts to every other node)."""
    return [*diloco, rate, -1 if capacity is None else capacity, dialable]


def gathered_rate(value: Any) -> float:
    """The samples/s a member gathered; 0 (counted as the median) if not a number."""
    rate = _field(value, RATE)
    return float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else 0.0


def gathered_capacity(value: Any, num_units: int) -> int | None:
    """How many experts a member said it can train; None (no cap) if it did not say, or said something other than
    an integer in 0..num_units."""
    capacity = _field(value, CAPACITY)
    valid = isinstance(capacity, int) and not isinstance(capacity, bool) and 0 <= capacity <= num_units
    return capacity if valid else None


def gathered_dialable(value: Any) -> bool:
    """Whether peers can dial a member: False only where it said exactly False (an older node says nothing, and
    was given experts as if dialable)."""
    return _field(value, DIALABLE) is not False


def _field(value: Any, index: int) -> Any:
    return value[index] if isinstance(value, list | tuple) and len(value) > index else None
