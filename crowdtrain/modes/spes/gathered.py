"""What a SPES node gathers with its averaging round, signed by its author, and each member's entry read for ownership.

Every member of an averaged round sees the same gathered values, so ownership computed from them agrees. The round's
leader relays them (hivemind's leader collects each member's entry and sends them all to all), so each member signs
its own: its samples/s, expert capacity and dialability, bound to the run, the round (the first of DiLoCo's values)
and its peer ID, with its identity key, and puts its public key and signature beside them (`AUTHOR`). Every member
reads each entry alike (`read_member`): the key must derive the peer ID the entry was gathered under (libp2p's peer ID
is the hash of that key), the signature must verify over exactly those fields, and each field must be well formed.

An entry that fails reads as a member that claimed nothing (`UNSIGNED`): median compute, no memory cap, dialable.
That covers an unsigned one (an older version, or a leader that stripped the signature), a forged one (a field
rewritten) and a wrongly bound one (another run's, round's or peer's signed entry put in its place). So a leader that
forges entries can't inflate its own share (its own entry is signed, and a lie in it counts as at most
`MAX_WEIGHT_RATIO` medians, modes/spes/ownership.py) nor shrink another member's below a median peer's: a capacity
of 0 or "undialable" can only come from the member itself. It can still erase a member's honest claims: a fast member
then counts as the median; one short of memory gets a median share, and if that doesn't fit it fails loudly and leaves
its experts to the others; one peers can't dial is given experts that the others then fetch from it in vain, so those
experts' round is lost (but nobody captures them). Reading a forged entry as undialable instead would let a leader
leave every other member out of ownership and own every expert.

The reading is a pure function of the gathered data and the run, so every honest member computes the same owners.
Its cost is bounded: key and signature are capped in size before they are parsed, the key at MAX_KEY_BITS bits; one
RSA verify per member per round.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain.dht.records import RecordError, load_public_key, peer_id_of_public_key
from crowdtrain.modes.diloco.pseudo_gradients import MAX_GATHERED
from crowdtrain.modes.spes.ownership import assign_owners, owner_candidates

RATE, CAPACITY, DIALABLE, AUTHOR = 3, 4, 5, 6
"""Indices in a SPES member's gathered list, after DiLoCo's round, proposed H and θ₀ digest."""
MAX_PUBLIC_KEY_BYTES = 1024
"""Cap on an author's OpenSSH public key (an RSA-4096 key is 725 bytes)."""
MAX_SIGNATURE_BYTES = 1024
"""Cap on an author's base64 signature (an RSA-4096 key's is 684 bytes)."""
MAX_KEY_BITS = 4096
"""The largest RSA key whose signature is verified: bounds a verify's cost (libp2p's own keys are 2048 bits)."""
_DOMAIN = b"crowdtrain/spes-gathered/1\n"
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
    signed: bool
    """Whether its entry carried its author's valid signature; the others read as `UNSIGNED`."""


UNSIGNED = MemberClaims(rate=0.0, capacity=None, dialable=True, signed=False)
"""What an entry reads as when it is not signed by the member it was gathered under: it claims nothing."""


def spes_gathered(
    diloco: list[Any],
    rate: float,
    capacity: int | None,
    dialable: bool,
    *,
    run_id: str,
    peer_id: str,
    private_key: RSAPrivateKey,
) -> list[Any]:
    """DiLoCo's gathered values (its round first), then this node's samples/s in the round, how many experts it can
    train (-1: not known), whether peers can dial it (an owner serves its experts to every other node) and
    [public key, signature] over those three, the run, the round and `peer_id` (`private_key`'s peer ID)."""
    fields = (float(rate), -1 if capacity is None else int(capacity), bool(dialable))
    signature = private_key.sign(_signed_bytes(run_id, diloco[0], peer_id, *fields))
    return [*diloco, *fields, [private_key.get_public_key().to_bytes(), signature]]


def read_member(peer_id: str, value: Any, run_id: str, round_: int, num_units: int) -> MemberClaims:
    """What the entry `value`, gathered under `peer_id` in round `round_` of `run_id`, counts for: its fields if its
    author signed them, `UNSIGNED` otherwise (see the module's doc). Never raises."""
    if not _is_signed(peer_id, value, run_id, round_):
        return UNSIGNED
    capacity = value[CAPACITY]
    return MemberClaims(
        rate=value[RATE],
        capacity=capacity if 0 <= capacity <= num_units else None,
        dialable=value[DIALABLE],
        signed=True,
    )


def _is_signed(peer_id: str, value: Any, run_id: str, round_: int) -> bool:
    """Whether `value` is a well-formed SPES entry of round `round_` of `run_id` signed by the key `peer_id` derives
    from; sizes and types are checked before anything is parsed."""
    if not isinstance(value, list | tuple) or not AUTHOR < len(value) <= MAX_GATHERED:
        return False
    signed_round, (rate, capacity, dialable, author) = value[0], value[RATE : AUTHOR + 1]
    if type(signed_round) is not int or signed_round != round_ or not 0 <= round_ <= _MAX_INT64:
        return False
    if type(rate) is not float or type(capacity) is not int or not -1 <= capacity <= _MAX_INT64:
        return False
    if type(dialable) is not bool or not isinstance(author, list | tuple) or len(author) != 2:
        return False
    public_key, signature = author
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes):
        return False
    if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        return False
    try:
        key = load_public_key(public_key)
    except RecordError:
        return False
    if key.key_size > MAX_KEY_BITS or peer_id_of_public_key(key).to_base58() != peer_id:
        return False
    return RSAPublicKey(key).verify(_signed_bytes(run_id, round_, peer_id, rate, capacity, dialable), signature)


def read_round(gathered: Mapping[str, Any], run_id: str, round_: int, num_units: int) -> dict[str, MemberClaims]:
    """Every member's claims in an averaged round, by peer ID (`read_member`)."""
    return {peer: read_member(peer, value, run_id, round_, num_units) for peer, value in gathered.items()}


def owners_by_claims(
    group: Sequence[str], claims: Mapping[str, MemberClaims], num_units: int, replicas: int
) -> list[tuple[str, ...]]:
    """The owners of each unit among an averaged round's `group`, by each member's claims (a member without
    claims: `UNSIGNED`): the same on every member that read the same gathered data."""
    members = owner_candidates(group, {peer for peer in group if not claims.get(peer, UNSIGNED).dialable})
    caps = {peer: claims.get(peer, UNSIGNED).capacity for peer in members}
    rates = [(peer, claims.get(peer, UNSIGNED).rate) for peer in members]
    return assign_owners(rates, num_units, replicas, caps)


def _signed_bytes(run_id: str, round_: int, peer_id: str, rate: float, capacity: int, dialable: bool) -> bytes:
    """The bytes a member signs: its fields, bound to the run, the round and its peer ID; one encoding only."""
    run, peer = run_id.encode(), peer_id.encode()
    return b"".join(
        (
            _DOMAIN,
            struct.pack(">I", len(run)),
            run,
            struct.pack(">qI", round_, len(peer)),
            peer,
            struct.pack(">dq?", rate, capacity, dialable),
        )
    )
