"""The catch-up hold's pure logic: announcements parsed and bounded, who is waited for, the hold budget."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from crowdtrain.state.catch_up import (
    HOLD_MAX_S,
    HOLD_SHARE,
    Announcement,
    HoldBudget,
    parse_announcements,
    progress_epochs,
    still_downloading,
)

NOW = 1000.0


def entries(values: dict[Any, Any]) -> dict[Any, Any]:
    return {subkey: SimpleNamespace(value=value) for subkey, value in values.items()}


def test_announcements_are_parsed_with_deadlines_bounded_and_garbage_left_out() -> None:
    parsed = parse_announcements(
        entries(
            {
                b"a": {"until": NOW + 30, "done": False},
                b"far": {"until": NOW + 1e9},  # a deadline past any hold: counted as HOLD_MAX_S from now
                b"done": {"until": NOW + 30, "done": True},
                b"loaded": {"until": NOW + 30, "loaded": 7},
                b"badloaded": {"until": NOW + 30, "loaded": True},
                b"nan": {"until": math.nan},
                b"inf": {"until": math.inf},
                b"bool": {"until": True},
                b"text": {"until": "later"},
                b"list": [NOW + 30],
                b"none": None,
            }
        ),
        NOW,
    )
    assert parsed == {
        b"a": Announcement(until=NOW + 30),
        b"far": Announcement(until=NOW + HOLD_MAX_S),
        b"done": Announcement(until=NOW + 30),  # fields of other versions are ignored
        b"loaded": Announcement(until=NOW + 30, loaded=7),
        b"badloaded": Announcement(until=NOW + 30),
    }
    assert parse_announcements("garbage", NOW) == {} and parse_announcements(None, NOW) == {}


def test_progress_epochs_keep_integer_epochs_only() -> None:
    records = entries({b"a": {"epoch": 7}, b"b": {"epoch": 7.5}, b"c": {"epoch": True}, b"d": "x", b"e": {}})
    assert progress_epochs(records) == {b"a": 7} and progress_epochs(None) == {}


@pytest.mark.parametrize(
    ("announcement", "epochs", "waited_for"),
    [
        (Announcement(until=NOW + 30), {}, True),  # a joiner has no progress record before its first download
        (Announcement(until=NOW + 30), {b"peer": 9}, True),  # behind this node's epoch 10
        (Announcement(until=NOW + 30), {b"peer": 10}, False),  # it has the state of this node's epoch
        (Announcement(until=NOW + 30, loaded=10), {}, True),  # loaded: its progress record is not here yet
        (Announcement(until=NOW + 30, loaded=12), {b"peer": 9}, True),  # loaded one ahead, record not here yet
        (Announcement(until=NOW + 30, loaded=9), {b"peer": 9}, False),  # in step since: behind in a round, no hold
        (Announcement(until=NOW + 30, loaded=9), {b"peer": 8}, True),  # the epoch it loaded is not reported yet
        (Announcement(until=NOW - 1), {}, False),  # past its deadline
    ],
)
def test_who_a_node_at_epoch_10_holds_for(announcement: Announcement, epochs: dict, waited_for: bool) -> None:
    announcements = {b"peer": announcement, b"own": Announcement(until=NOW + 30)}
    assert still_downloading(announcements, epochs, 10, NOW, own_key=b"own") == ([b"peer"] if waited_for else [])


def test_the_budget_holds_at_most_hold_max_and_refills_at_the_share_of_time() -> None:
    budget = HoldBudget()
    assert budget.available(0.0) == HOLD_MAX_S
    budget.spend(HOLD_MAX_S, 0.0)
    assert budget.available(0.0) == 0.0
    assert budget.available(100.0) == pytest.approx(100.0 * HOLD_SHARE)
    assert budget.available(1e9) == HOLD_MAX_S, "never more than one longest hold"
    budget.spend(-5.0, 1e9)
    assert budget.available(1e9) == HOLD_MAX_S, "a negative time spends nothing"


def test_any_number_of_announcers_cost_at_most_the_share_of_time_in_the_long_run() -> None:
    # An attacker announcing without end, from as many identities as it likes: a node holds every step it can.
    budget, now, held = HoldBudget(), 0.0, 0.0
    while now < 10_000.0:
        allowance = budget.available(now)
        budget.spend(allowance, now + allowance)
        held += allowance
        now += allowance + 1.0  # one second of training between holds
    assert held <= HOLD_MAX_S + HOLD_SHARE * now * 1.01
