"""What a SPES node gathers with its averaging round, and each member's entry read for ownership.

Every member of an averaged round sees the same gathered values, so ownership computed from them agrees. The
round's leader relays them, but every entry is signed by its member in the core (averaging/authored.py), so a
leader can't rewrite another member's samples/s, expert capacity or dialability: a forged entry costs the group
its round (nobody is blamed, as a forgery and a malformed entry can't be told apart). A member's own lie about its
compute counts as at most `MAX_WEIGHT_RATIO` medians (modes/spes/ownership.py).

Every member reads each entry alike (`read_member`), a pure function of the gathered data and the round: an entry
that is malformed or of another round claims nothing (`NO_CLAIMS`: median compute, no memory cap, dialable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crowdtrain.modes.diloco.pseudo_gradients import MAX_GATHERED
from crowdtrain.modes.spes.ownership import assign_owners, owner_candidates

RATE, CAPACITY, DIALABLE = 3, 4, 5
"""Indices in a SPES member's gathered list, after DiLoCo's round, proposed H and θ₀ digest."""
_MAX_INT64 = 2**63 - 1


@dataclass(frozen=True, slots=True)
class MemberClaims:
    """What ownership counts of one member of an averaged round."""

    rate: float
    """Its samples/s in the round; 0 (counted as the median) if unknown."""
    capacity: int | None
    """How many experts it can train; None: no cap."""
    dialable: bool
    """Whether peers can dial it (only those own experts, `owner_candidates`)."""
    well_formed: bool
    """Whether its entry was a well-formed SPES entry of the round; the others read as `NO_CLAIMS`."""


NO_CLAIMS = MemberClaims(rate=0.0, capacity=None, dialable=True, well_formed=False)
"""What an entry that is malformed or of another round reads as: it claims nothing."""


def spes_gathered(diloco: list[Any], rate: float, capacity: int | None, dialable: bool) -> list[Any]:
    """DiLoCo's gathered values (its round first), then this node's samples/s in the round, how many experts it can
    train (-1: not known) and whether peers can dial it (an owner serves its experts to every other node)."""
    return [*diloco, float(rate), -1 if capacity is None else int(capacity), bool(dialable)]


def read_member(value: Any, round_: int, num_units: int) -> MemberClaims:
    """What the entry `value`, gathered in round `round_`, counts for: its fields if it is a well-formed SPES entry
    of that round (a capacity above `num_units` reads as no cap), `NO_CLAIMS` otherwise. Never raises."""
    if not isinstance(value, list | tuple) or not DIALABLE < len(value) <= MAX_GATHERED:
        return NO_CLAIMS
    entry_round, rate, capacity, dialable = value[0], value[RATE], value[CAPACITY], value[DIALABLE]
    if type(entry_round) is not int or entry_round != round_:
        return NO_CLAIMS
    if type(rate) is not float or type(capacity) is not int or not -1 <= capacity <= _MAX_INT64:
        return NO_CLAIMS
    if type(dialable) is not bool:
        return NO_CLAIMS
    return MemberClaims(
        rate=rate,
        capacity=capacity if 0 <= capacity <= num_units else None,
        dialable=dialable,
        well_formed=True,
    )


def read_round(gathered: Mapping[str, Any], round_: int, num_units: int) -> dict[str, MemberClaims]:
    """Every member's claims in an averaged round, by peer ID (`read_member`)."""
    return {peer: read_member(value, round_, num_units) for peer, value in gathered.items()}


def owners_by_claims(
    group: Sequence[str], claims: Mapping[str, MemberClaims], num_units: int, replicas: int
) -> list[tuple[str, ...]]:
    """The owners of each unit among an averaged round's `group`, by each member's claims (a member without
    claims: `NO_CLAIMS`): the same on every member that read the same gathered data."""
    members = owner_candidates(group, {peer for peer in group if not claims.get(peer, NO_CLAIMS).dialable})
    caps = {peer: claims.get(peer, NO_CLAIMS).capacity for peer in members}
    rates = [(peer, claims.get(peer, NO_CLAIMS).rate) for peer in members]
    return assign_owners(rates, num_units, replicas, caps)
