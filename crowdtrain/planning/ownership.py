"""Who owns which expert in a SPES run: a pure function of the peers and their compute, so every node agrees.

SPES (training/modes/spes.py) has each node train only the routed experts it owns. There is no server to hand
experts out: every node computes ownership from the same list of peers, the members of the round just averaged
(or, for a swarm larger than one group, the `PeerStatus` records it reads from the DHT, with their TTL), and
each peer's measured compute from its record. A node that vanishes drops out of the next computation, and its
experts go to the others (who continue from the copies they fetched last round: nothing restarts from scratch).

Balance: each peer's share of the units (one unit is one expert of one layer) is proportional to its measured
compute (`measured_samples_per_second`, the throughput probe), the largest-remainder way, every peer at least
one unit while there are units enough. Self-reported compute is bounded: a claim above `MAX_WEIGHT_RATIO`
times the median counts as that much, so a liar can't take every expert (and with it the whole swarm's
progress on them). Peers that have not measured yet count as the median.

Stability: units go to peers in order of a rendezvous hash of (unit, peer), each peer taking units until its
share is full. A peer that joins or leaves moves few units: the others keep most of theirs, and with them
their optimizer state.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence

MAX_WEIGHT_RATIO = 4.0
"""A peer's compute counts as at most this many times the median peer's."""


def unit_shares(weights: Sequence[float], num_units: int) -> list[int]:
    """How many of `num_units` units each peer owns: proportional to its (bounded) weight, summing to
    `num_units`; every peer gets at least one while `num_units` >= the number of peers."""
    count = len(weights)
    if count == 0:
        return []
    bounded = _bounded(weights)
    floor = 1 if num_units >= count else 0
    spare = num_units - floor * count
    total = sum(bounded)
    exact = [spare * weight / total for weight in bounded]
    shares = [floor + math.floor(value) for value in exact]
    by_remainder = sorted(range(count), key=lambda index: (-(exact[index] - math.floor(exact[index])), index))
    for index in by_remainder[: num_units - sum(shares)]:
        shares[index] += 1
    return shares


def assign_units(peers: Sequence[tuple[str, float]], num_units: int) -> list[str]:
    """The owner of each unit 0..num_units-1, from (peer ID, measured compute) pairs; [] without peers."""
    ordered = sorted(dict(peers).items())  # one entry per peer, in an order every node shares
    if not ordered:
        return []
    shares = unit_shares([weight for _, weight in ordered], num_units)
    left = {peer: share for (peer, _), share in zip(ordered, shares, strict=True)}
    owners: list[str | None] = [None] * num_units
    pairs = sorted(((_score(unit, peer), unit, peer) for unit in range(num_units) for peer, _ in ordered), reverse=True)
    for _, unit, peer in pairs:
        if owners[unit] is None and left[peer] > 0:
            owners[unit] = peer
            left[peer] -= 1
    assert all(owner is not None for owner in owners), "shares sum to the number of units"
    return [owner for owner in owners if owner is not None]


def _bounded(weights: Sequence[float]) -> list[float]:
    """Weights with unknown ones (not finite, not positive) at the median of the known ones, and each known one
    within [median / MAX_WEIGHT_RATIO, median * MAX_WEIGHT_RATIO]; all 1 when none is known."""
    known = [weight for weight in weights if math.isfinite(weight) and weight > 0]
    if not known:
        return [1.0] * len(weights)
    median = statistics.median(known)
    low, high = median / MAX_WEIGHT_RATIO, median * MAX_WEIGHT_RATIO
    return [min(max(weight, low), high) if math.isfinite(weight) and weight > 0 else median for weight in weights]


def _score(unit: int, peer: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{unit}:{peer}".encode(), digest_size=8).digest(), "big")
