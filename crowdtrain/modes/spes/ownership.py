"""Who owns which expert in a SPES run: a pure function of the peers and their compute, so every node agrees.

SPES (modes/spes/mode.py) has each node train only the routed experts it owns. There is no server to hand
experts out: every node computes ownership from the same list of peers, the members of the round just averaged
(or, for a swarm larger than one group, the `PeerStatus` records it reads from the DHT, with their TTL), and
each peer's measured compute from its record. A node that vanishes drops out of the next computation, and its
experts go to the others (who continue from the copies they fetched last round: nothing restarts from scratch).

Balance: each peer's share of the units (one unit is one expert of one layer) is proportional to its measured
compute (`measured_samples_per_second`, the throughput probe), the largest-remainder way, every peer at least
one unit while there are units enough. Self-reported compute is bounded: a claim above `MAX_WEIGHT_RATIO`
times the median counts as that much, so a liar can't take every expert (and with it the whole swarm's
progress on them). Peers that have not measured yet count as the median.

Memory: a peer's share is capped by the units whose gradients and AdamW moments fit the memory it has free
(`caps`, from what each node gathered in the round): a capped peer's excess goes to the others by compute. When
the swarm as a whole can't hold every unit, the caps are dropped and the units go by compute alone (an expert
nobody trains would stall for good; an owner short of memory fails loudly and leaves its experts to the others).

Dialability: every node fetches the copies of the experts it does not own from their owners, so only a peer that
others can dial owns experts (`owner_candidates`); one that can't (behind a NAT, a client) trains the dense
parameters and uses the experts it fetches. Where no peer can be dialed, all own as before: a lone node behind a
NAT trains every expert itself, as nobody needs to fetch from it.

Stability: units go to peers in order of a rendezvous hash of (unit, peer), each peer taking units until its
share is full. A peer that joins or leaves moves few units: the others keep most of theirs, and with them
their optimizer state.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Collection, Mapping, Sequence

MAX_WEIGHT_RATIO = 4.0
"""A peer's compute counts as at most this many times the median peer's."""


def owner_candidates(peers: Sequence[str], undialable: Collection[str]) -> list[str]:
    """The peers that may own experts: those the others can dial; all of `peers` when none can."""
    dialable = [peer for peer in peers if peer not in undialable]
    return dialable or list(peers)


def unit_shares(weights: Sequence[float], num_units: int, caps: Sequence[int | None] | None = None) -> list[int]:
    """How many of `num_units` units each peer owns: proportional to its (bounded) weight, summing to
    `num_units`; every peer gets at least one while `num_units` >= the number of peers. With `caps` (None: no
    cap), no peer gets more than its cap while the others have room for the rest."""
    count = len(weights)
    if count == 0:
        return []
    bounded = _bounded(weights)
    limits = [None if caps is None or caps[index] is None else max(0, int(caps[index] or 0)) for index in range(count)]
    shares, uncapped, left = [0] * count, list(range(count)), num_units
    while uncapped:
        proposal = _proportional([bounded[index] for index in uncapped], left)
        over = [
            index
            for index, share in zip(uncapped, proposal, strict=True)
            if (limit := limits[index]) is not None and share > limit
        ]
        if not over:
            for index, share in zip(uncapped, proposal, strict=True):
                shares[index] = share
            return shares
        for index in over:
            limit = limits[index] or 0
            shares[index], left = limit, left - limit
            uncapped.remove(index)
    # the swarm can't hold every unit within the caps: they go by weight alone
    return _proportional(bounded, num_units)


def _proportional(weights: Sequence[float], num_units: int) -> list[int]:
    """`num_units` split by `weights` (positive), the largest-remainder way; at least one each while there are
    units enough."""
    count = len(weights)
    floor = 1 if num_units >= count else 0
    spare = num_units - floor * count
    total = sum(weights)
    exact = [spare * weight / total for weight in weights]
    shares = [floor + math.floor(value) for value in exact]
    by_remainder = sorted(range(count), key=lambda index: (-(exact[index] - math.floor(exact[index])), index))
    for index in by_remainder[: num_units - sum(shares)]:
        shares[index] += 1
    return shares


def assign_units(
    peers: Sequence[tuple[str, float]], num_units: int, caps: Mapping[str, int | None] | None = None
) -> list[str]:
    """The owner of each unit 0..num_units-1, from (peer ID, measured compute) pairs and each peer's cap (see
    `unit_shares`; a peer not in `caps` has none); [] without peers."""
    return [owners[0] for owners in assign_owners(peers, num_units, 1, caps)]


def assign_owners(
    peers: Sequence[tuple[str, float]],
    num_units: int,
    replicas: int = 1,
    caps: Mapping[str, int | None] | None = None,
) -> list[tuple[str, ...]]:
    """The owners of each unit 0..num_units-1 (peer IDs in order), `replicas` distinct ones each (as many as
    there are peers when fewer), from (peer ID, measured compute) pairs and each peer's cap (see `unit_shares`;
    a peer not in `caps` has none, and none owns a unit twice); [] without peers.

    The replicas × num_units places are shared out like units (`unit_shares`), and each unit takes its owners
    in the order of their rendezvous score among the peers with places left. Where the places left can't give
    a unit distinct owners (a share that only fits units the peer already owns), a place is swapped with
    another unit (`_complete`)."""
    ordered = sorted(dict(peers).items())  # one entry per peer, in an order every node shares
    if not ordered:
        return []
    copies = max(1, min(replicas, len(ordered)))
    peer_caps = [_cap(caps, peer, num_units) for peer, _ in ordered]
    shares = unit_shares([weight for _, weight in ordered], copies * num_units, peer_caps)
    left = {peer: share for (peer, _), share in zip(ordered, shares, strict=True)}
    owners: list[list[str]] = [[] for _ in range(num_units)]
    pairs = sorted(((_score(unit, peer), unit, peer) for unit in range(num_units) for peer, _ in ordered), reverse=True)
    for _, unit, peer in pairs:
        if len(owners[unit]) < copies and left[peer] > 0 and peer not in owners[unit]:
            owners[unit].append(peer)
            left[peer] -= 1
    for unit in range(num_units):
        while len(owners[unit]) < copies:
            _complete(owners, unit, left, [peer for peer, _ in ordered])
    return [tuple(sorted(unit_owners)) for unit_owners in owners]


def _complete(owners: list[list[str]], unit: int, left: dict[str, int], peers: list[str]) -> None:
    """Give `unit` one more owner. The rendezvous pass leaves a unit short only where every peer with places left
    owns it already: one of them takes another unit's place from a peer `unit` lacks, who moves here, so every
    share stays as it was. Without such a swap, the first peer that doesn't own `unit` takes it past its share."""
    for peer in peers:
        if left[peer] <= 0:
            continue
        for other in owners:
            if peer in other:
                continue
            swapped = next((owner for owner in other if owner not in owners[unit]), None)
            if swapped is not None:
                other[other.index(swapped)] = peer
                owners[unit].append(swapped)
                left[peer] -= 1
                return
    owners[unit].append(next(peer for peer in peers if peer not in owners[unit]))


def _cap(caps: Mapping[str, int | None] | None, peer: str, num_units: int) -> int:
    """The most units `peer` may own: its cap, and never more than one place per unit."""
    cap = None if caps is None else caps.get(peer)
    return num_units if cap is None else min(num_units, max(0, int(cap)))


def _bounded(weights: Sequence[float]) -> list[float]:
    """Weights with unknown ones (not finite, not positive) at the median of the known ones, and each known one
    within [median / MAX_WEIGHT_RATIO, median * MAX_WEIGHT_RATIO]; all 1 when none is known. Of an even count the
    lower middle one is the median: with the mean of the middle two a liar in a group of two moved its own bound (it
    took 7/8 of the experts, where its cap means 4/5)."""
    known = [weight for weight in weights if math.isfinite(weight) and weight > 0]
    if not known:
        return [1.0] * len(weights)
    median = statistics.median_low(known)
    low, high = median / MAX_WEIGHT_RATIO, median * MAX_WEIGHT_RATIO
    return [min(max(weight, low), high) if math.isfinite(weight) and weight > 0 else median for weight in weights]


def _score(unit: int, peer: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{unit}:{peer}".encode(), digest_size=8).digest(), "big")
