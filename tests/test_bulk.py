"""The admission of bulk answers (crowdtrain/rpc/bulk.py): limits in all, per peer and in bytes, refused at once;
a grant ends with its answer, or by itself once a hung answer's deadline and grace passed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crowdtrain.rpc.bulk import GRACE_S, BulkGate, BulkLimits, within_time


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock, **limits: float) -> BulkGate:
    defaults = {"max_answers": 3, "max_answers_per_peer": 2, "max_bytes": 100, "answer_time_s": 10.0}
    return BulkGate(BulkLimits(**{**defaults, **limits}), clock)  # type: ignore[arg-type]


def test_answers_past_the_limits_are_refused_at_once_each_for_its_reason() -> None:
    answers = gate(Clock())
    first, second = answers.admit("a", 10), answers.admit("a", 10)
    assert first is not None and second is not None
    assert answers.admit("a", 10) is None, "a third answer to one peer"
    third = answers.admit("b", 10)
    assert third is not None
    assert answers.admit("c", 10) is None, "a fourth answer in all"
    assert answers.refusals == {"peer": 1, "answers": 1}
    third.release()
    assert answers.admit("c", 81) is None, "20 bytes held: 81 more would pass the budget"
    assert answers.admit("c", 101) is None, "one answer over the whole budget"
    assert answers.refusals == {"peer": 1, "answers": 1, "bytes": 1, "size": 1}
    assert answers.admit("c", 80) is not None
    assert answers.num_answers == 3 and answers.bytes_held == 100


def test_a_grant_ends_with_its_block_once_and_a_hung_one_ends_by_itself_after_its_grace() -> None:
    clock = Clock()
    answers = gate(clock, max_answers=1)
    with answers.admit("a", 50) as grant:
        assert answers.admit("b", 1) is None
        assert not grant.expired()
    grant.release()  # again: nothing
    assert answers.num_answers == 0 and answers.bytes_held == 0
    hung = answers.admit("a", 50)
    assert hung is not None
    clock.now += 10.0
    assert hung.expired(), "past its answer time: the service cuts it short"
    assert answers.admit("b", 1) is None, "still held until the grace period passed"
    clock.now += GRACE_S
    late = answers.admit("b", 1)
    assert late is not None, "a hung answer holds its slot no longer than its time and the grace"
    hung.release()  # the hung handler ends at last: the later grant stays counted
    assert answers.num_answers == 1


@pytest.mark.parametrize("name", ["max_answers", "max_answers_per_peer", "max_bytes", "answer_time_s"])
def test_limits_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        BulkLimits(**{name: 0})  # type: ignore[arg-type]


def test_an_answer_ends_once_its_grant_has_run_out_of_time(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    grant = gate(clock).admit("a", 1)
    assert grant is not None

    async def messages() -> AsyncIterator[int]:
        for number in range(5):
            yield number
            clock.now += 4.0  # the answer's time is 10 s

    async def served() -> list[int]:
        return [message async for message in within_time(grant, messages(), "an answer")]

    assert asyncio.run(served()) == [0, 1, 2]
    assert "an answer ran past its 10 s: cut short" in caplog.text
