"""The one wait that a stopping node cuts short (crowdtrain/rpc/service.py `result_unless_stopping`): RPC calls to
peers and state downloads wait on a future through it, so a Ctrl-C ends them within STOP_CHECK_S instead of at a
peer's deadline, while a future that completes, or a deadline that passes, ends the wait as before."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from crowdtrain.rpc.service import STOP_CHECK_S, NodeStopping, result_unless_stopping

STOP_AT_S = 0.3
LATE_S = 5.0
"""Slack for a loaded machine; without the stop, the waits below last 60 s."""


def test_a_stop_ends_the_wait_for_a_future_that_never_completes_within_a_check() -> None:
    stop, pending = threading.Event(), Future()
    timer = threading.Timer(STOP_AT_S, stop.set)
    started = time.monotonic()
    timer.start()
    with pytest.raises(NodeStopping, match="a state download was cut short"):
        result_unless_stopping(pending, 60.0, stop, "a state download")
    assert STOP_AT_S <= time.monotonic() - started < STOP_AT_S + LATE_S
    assert not pending.done(), "the future is left to its owner"


def test_a_node_already_stopping_does_not_wait_at_all() -> None:
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    with pytest.raises(NodeStopping):
        result_unless_stopping(Future(), None, stop, "a call")
    assert time.monotonic() - started < STOP_CHECK_S


def test_a_result_or_a_deadline_ends_the_wait_as_without_a_stop() -> None:
    stop, answered = threading.Event(), Future()
    threading.Timer(STOP_AT_S, answered.set_result, args=("state",)).start()
    assert result_unless_stopping(answered, 60.0, stop, "a call") == "state"
    for event in (stop, None):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            result_unless_stopping(Future(), STOP_AT_S, event, "a call")
        assert STOP_AT_S <= time.monotonic() - started < STOP_AT_S + LATE_S
