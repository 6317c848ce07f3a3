"""Calls into hivemind's DHT process from a thread of ours: bounded, and every failure one ordinary exception."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

DHT_CALL_FAILED = (Exception, asyncio.CancelledError, GeneratorExit)
"""What a future from hivemind's DHT process raises when the call failed there: its exception passes through as it
is, and a coroutine cancelled or closed in that process raises CancelledError or GeneratorExit in the caller, which
`except Exception` misses (a GeneratorExit from a read of this node's addresses once ended a daemon's heartbeat)."""


class DHTCallFailed(Exception):
    """A call into the DHT process got no answer: it timed out, failed there, or was cancelled or closed there."""


def dht_answer(future: Future[T], timeout_s: float, what: str) -> T:
    """The answer of a call into the DHT process (a `return_future=True` future), waited for at most `timeout_s`;
    DHTCallFailed naming `what` and why when there is none (on a timeout the call is cancelled)."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        future.cancel()
        raise DHTCallFailed(f"{what}: no answer within {timeout_s:g} s") from None
    except DHT_CALL_FAILED as e:
        raise DHTCallFailed(f"{what}: {e!r}") from None
