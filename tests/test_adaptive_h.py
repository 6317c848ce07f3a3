"""Adaptive H for DiLoCo: the proposal from measurements, and the agreement every member of a group reaches."""

from __future__ import annotations

import math

import pytest

from crowdtrain.modes.diloco.adaptive_h import SYNC_BUDGET, agreed_round_batches, proposed_round_batches


def test_a_peer_proposes_the_smallest_h_whose_compute_hides_its_allreduce_within_the_budget() -> None:
    # 2 s of all-reduce at 1 s per global batch: the round must compute 2 / 0.05 = 40 s, 40 global batches
    assert proposed_round_batches(2.0, 1.0, low=1, high=500) == 40
    assert 2.0 <= SYNC_BUDGET * 40 * 1.0  # the budget holds at the proposal
    assert proposed_round_batches(2.0, 1.0, low=1, high=16) == 16  # a slow link: as large as allowed
    assert proposed_round_batches(0.01, 1.0, low=4, high=500) == 4  # a fast link: as small as allowed
    assert proposed_round_batches(2.0, 0.0, low=2, high=9) == 2  # no measurement yet
    assert proposed_round_batches(math.nan, 1.0, low=2, high=9) == 2
    assert proposed_round_batches(math.inf, 1.0, low=2, high=9) == 9


@pytest.mark.parametrize(
    ("proposals", "expected"),
    [
        ([5, 9], 5),
        ([5, 9, 7], 7),
        ([5, 9, 10**9], 5),  # out of bounds: ignored
        ([5, 9, 64, 64], 9),  # two liars at the bound move the lower median by one rank
        ([None, "40", 3.5, True, [], 12], 12),  # a peer without a proposal, or with garbage
        ([None, "x"], 8),  # nothing valid: H stays
    ],
)
def test_the_group_agrees_on_the_lower_median_of_the_valid_proposals(proposals: list[object], expected: int) -> None:
    assert agreed_round_batches(proposals, low=1, high=64, current=8) == expected
    assert agreed_round_batches(list(reversed(proposals)), low=1, high=64, current=8) == expected  # order-free
