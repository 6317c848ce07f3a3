"""Adaptive H for DiLoCo (issue 15): the number of global batches per outer round, chosen from measurements and
agreed on by the peers that average together.

Each peer measures, for its last outer round, the seconds per global batch of its inner steps (the round's wall
time before its all-reduce, over H) and the seconds its all-reduce took, and proposes the smallest H for which
that all-reduce costs at most SYNC_BUDGET of the round's compute: H ≥ allreduce_s / (SYNC_BUDGET × s_per_batch),
within the manifest's [min_inner_steps, max_inner_steps]. A fast link gives small rounds (the swarm synchronises
often, which DiLoCo's quality likes), a home uplink larger ones.

The proposal travels in the data every member gathers at matchmaking, so after a round every member of the group
holds the same proposals and takes the same H: their median (the lower middle one), proposals outside the bounds
or not integers ignored (a peer's number is untrusted: one liar moves the median by at most one rank). A peer
applies the agreed H from the next round it starts, so all members switch at the same round boundary.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

SYNC_BUDGET = 0.05
"""An outer round's all-reduce may cost at most this fraction of the round's compute time."""


def proposed_round_batches(allreduce_s: float, seconds_per_batch: float, low: int, high: int) -> int:
    """The smallest H in [low, high] whose round computes at least allreduce_s / SYNC_BUDGET seconds."""
    if not (math.isfinite(allreduce_s) and math.isfinite(seconds_per_batch)) or seconds_per_batch <= 0:
        return high if math.isinf(allreduce_s) else low
    needed = math.ceil(max(allreduce_s, 0.0) / (SYNC_BUDGET * seconds_per_batch))
    return min(max(needed, low), high)


def agreed_round_batches(proposals: Iterable[Any], low: int, high: int, current: int) -> int:
    """The H every member of a group takes from the same gathered proposals: the lower median of the valid ones
    (integers in [low, high]); `current` when none is valid."""
    valid = sorted(
        proposal
        for proposal in proposals
        if isinstance(proposal, int) and not isinstance(proposal, bool) and low <= proposal <= high
    )
    return statistics.median_low(valid) if valid else current
