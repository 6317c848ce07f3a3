"""Admission for answers that move bulk data to a peer: taken before a byte of the answer is built or buffered,
refused at once (busy) rather than queued, and bounded in time.

An answer asks for a grant of the bytes it will hold in memory at once. The grant is refused when the answers in
progress are at the total limit or at the asker's own, or when its bytes would take the answers' memory past the
budget; a refused asker asks again later (each service says how). A grant ends with its answer (`release`, or
leaving its `with` block) or, should the handler hang on a peer that stopped reading, by itself a grace period
after its deadline: a peer can hold a slot no longer than that, however it behaves.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

GRACE_S = 10.0
"""A grant whose answer outlived its deadline by this much no longer counts against the limits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BulkLimits:
    """What one service's bulk answers may take of this node at once."""

    max_answers: int = 8
    """Answers in progress at once, to all peers together."""
    max_answers_per_peer: int = 2
    """Answers in progress at once to one peer."""
    max_bytes: int = 64 * 2**20
    """Bytes all answers in progress may hold in memory at once."""
    answer_time_s: float = 120.0
    """Seconds an answer may take from its grant: past them it is cut short."""

    def __post_init__(self) -> None:
        for name in ("max_answers", "max_answers_per_peer", "max_bytes", "answer_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class Grant:
    """One admitted answer's hold on the limits, until `release`."""

    gate: BulkGate
    peer: str
    num_bytes: int
    deadline: float
    """The gate's clock reading past which the answer is cut short (`expired`)."""
    released: bool = field(default=False)

    def expired(self) -> bool:
        """Whether the answer ran past its time: the service stops sending and ends it."""
        return self.gate.clock() >= self.deadline

    def release(self) -> None:
        """Give the grant's slot and bytes back (once; later calls do nothing)."""
        self.gate._release(self)

    def __enter__(self) -> Grant:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


class BulkGate:
    """One service's admission of bulk answers under its `BulkLimits`; thread-safe."""

    def __init__(self, limits: BulkLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._lock = threading.Lock()
        self._grants: list[Grant] = []
        self.refusals: collections.Counter[str] = collections.Counter()
        """Answers refused so far, by reason: `answers`, `peer`, `bytes` or `size` (one answer over the budget)."""

    def admit(self, peer: str, num_bytes: int) -> Grant | None:
        """A grant for an answer to `peer` that holds `num_bytes` in memory at once; None when it must wait (busy)."""
        with self._lock:
            self._forget_hung()
            reason = self._refusal(peer, num_bytes)
            if reason is not None:
                self.refusals[reason] += 1
                return None
            grant = Grant(self, peer, num_bytes, self.clock() + self.limits.answer_time_s)
            self._grants.append(grant)
            return grant

    @property
    def num_answers(self) -> int:
        """Answers in progress now."""
        with self._lock:
            self._forget_hung()
            return len(self._grants)

    @property
    def bytes_held(self) -> int:
        """Bytes the answers in progress hold now, by their grants."""
        with self._lock:
            self._forget_hung()
            return sum(grant.num_bytes for grant in self._grants)

    def _refusal(self, peer: str, num_bytes: int) -> str | None:
        limits = self.limits
        if num_bytes > limits.max_bytes:
            return "size"
        if len(self._grants) >= limits.max_answers:
            return "answers"
        if sum(grant.peer == peer for grant in self._grants) >= limits.max_answers_per_peer:
            return "peer"
        if sum(grant.num_bytes for grant in self._grants) + num_bytes > limits.max_bytes:
            return "bytes"
        return None

    def _forget_hung(self) -> None:
        now = self.clock()
        for grant in [grant for grant in self._grants if now >= grant.deadline + GRACE_S]:
            grant.released = True
            self._grants.remove(grant)

    def _release(self, grant: Grant) -> None:
        with self._lock:
            if not grant.released:
                grant.released = True
                self._grants.remove(grant)


async def within_time(grant: Grant, messages: AsyncIterator[T], what: str) -> AsyncIterator[T]:
    """`messages` until they end or the grant's time runs out (one warning naming `what`, then the answer ends)."""
    async for message in messages:
        if grant.expired():
            logger.warning(f"{what} ran past its {grant.gate.limits.answer_time_s:g} s: cut short")
            return
        yield message
