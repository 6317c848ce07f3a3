"""What limits a join token beyond its expiry: how many identities may use it, and the founder's revocations.

Both are decided by every node alone, from signed records in the DHT, so every honest node that read the same
records admits the same identities:
- an identity limit: each admitted node's record says, signed with the invite key, since when it has used its join
  token; among the identities using one token, the `max_identities` ranked first by (since, peer ID) are admitted;
- revocations: a list of invite keys the run key signed; no node admits an identity whose certificate's invite key
  is on it, until the certificate expires (after which it admits nobody anyway).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain import proto
from crowdtrain.dht.records import RecordError, load_public_key, parse_capped, peer_id_of_public_key

MAX_IDENTITIES = 1024
"""The most identities one join token may admit (`crowdtrain invite --max-identities`)."""
MAX_REVOKED_INVITES = 1000
"""The most entries one revocation list may hold; the founder drops expired ones before it signs a new list."""
MAX_REVOCATIONS_BYTES = 64 * 1024
"""A list of 1000 entries (about 45 bytes each), the founder's key and signature fit in under 48 KiB."""


class RevocationError(ValueError):
    """A revocation list that is not the run key's, or is malformed or oversized."""


@dataclass(frozen=True, slots=True)
class Admission:
    """One identity's verified admission record."""

    peer_id: str
    invite_key: bytes
    """The certificate's Ed25519 invite key: identities sharing it share one join token and its limit."""
    max_identities: int | None
    """The certificate's limit; None for a certificate made before limits existed (any number)."""
    since: float
    """When the identity says it first used the token, unix seconds; inf when it did not say (an older node)."""
    expires_at: float
    """When its access token ends, unix seconds."""
    label: str = ""


def within_limits(admissions: Iterable[Admission]) -> set[str]:
    """The peer IDs admitted under their tokens' identity limits: per invite key, the first `max_identities` by
    (since, peer ID).

    Why this order: a peer ID can be ground (keys are cheap), so ranking by it alone lets anyone who copies a token
    displace its holder half the time without trying; an earlier `since` keeps the holder who used the token first,
    and a later user must backdate its claim on purpose. Whoever holds a leaked token can sign any claim the holder
    can, so no order keeps a leak out: that is what revocation is for.
    """
    groups: defaultdict[bytes, list[Admission]] = defaultdict(list)
    for admission in admissions:
        groups[admission.invite_key].append(admission)
    admitted: set[str] = set()
    for group in groups.values():
        ranked = sorted(group, key=lambda admission: (admission.since, admission.peer_id))
        limits = [admission.max_identities for admission in group if admission.max_identities is not None]
        limit = min(limits) if limits else None  # one invite key is one certificate; min() whatever the order
        admitted.update(admission.peer_id for admission in ranked[: len(ranked) if limit is None else limit])
    return admitted


def _since_payload(run_id: str, public_key: bytes, since: float) -> bytes:
    return b"crowdtrain-since\0" + run_id.encode() + b"\0" + public_key + b"\0" + repr(since).encode()


def sign_since(invite_key: Ed25519PrivateKey, run_id: str, public_key: bytes, since: float) -> bytes:
    """The invite key's signature of "the identity with `public_key` has used this token since `since`"."""
    return invite_key.sign(_since_payload(run_id, public_key, since))


def verified_since(record: proto.AdmissionRecord, invite_public_key: bytes, run_id: str) -> float:
    """The record's `since` if its invite key signed it and it is a finite time; otherwise inf (ranked last)."""
    if not math.isfinite(record.since) or len(record.since_signature) != 64:
        return math.inf
    try:
        Ed25519PublicKey.from_public_bytes(invite_public_key).verify(
            record.since_signature, _since_payload(run_id, record.public_key, record.since)
        )
    except InvalidSignature:
        return math.inf
    return record.since


def sign_revocations(
    run_id: str, founder_key: RSAPrivateKey, revoked: dict[bytes, float], now: float | None = None
) -> bytes:
    """A revocation list of {invite key: its certificate's expiry}, signed by the run key; expired entries dropped."""
    now = time.time() if now is None else now
    live = sorted((key, expires_at) for key, expires_at in revoked.items() if expires_at > now)
    if len(live) > MAX_REVOKED_INVITES:
        raise RevocationError(f"a revocation list holds at most {MAX_REVOKED_INVITES} unexpired join tokens")
    revocations = proto.InviteRevocations(
        run_id=run_id,
        founder_public_key=founder_key.get_public_key().to_bytes(),
        revoked=[proto.RevokedInvite(invite_public_key=key, expires_at=expires_at) for key, expires_at in live],
        issued_at=now,
    )
    revocations.signature = founder_key.sign(revocations.SerializeToString(deterministic=True))
    return revocations.SerializeToString(deterministic=True)


def verify_revocations(data: bytes, run_key: str, run_id: str, now: float | None = None) -> proto.InviteRevocations:
    """A serialized revocation list checked: bounded before parsing, for `run_id`, signed by `run_key`, every entry
    well-formed. Its expired entries are left in; raises RevocationError."""
    revocations = parse_capped(
        proto.InviteRevocations, data, MAX_REVOCATIONS_BYTES, "the revocation list", RevocationError
    )
    if revocations.run_id != run_id:
        raise RevocationError(f"the revocation list is for run {revocations.run_id!r}, not {run_id!r}")
    if len(revocations.revoked) > MAX_REVOKED_INVITES or not math.isfinite(revocations.issued_at):
        raise RevocationError("the revocation list is oversized or undated")
    if any(len(entry.invite_public_key) != 32 or not math.isfinite(entry.expires_at) for entry in revocations.revoked):
        raise RevocationError("the revocation list has a malformed entry")
    try:
        founder_key = load_public_key(revocations.founder_public_key)
    except RecordError as e:
        raise RevocationError(str(e)) from None
    if peer_id_of_public_key(founder_key).to_base58() != run_key:
        raise RevocationError("the revocation list is not signed by the run key")
    unsigned = proto.InviteRevocations()
    unsigned.CopyFrom(revocations)
    unsigned.signature = b""
    if not RSAPublicKey(founder_key).verify(unsigned.SerializeToString(deterministic=True), revocations.signature):
        raise RevocationError("the revocation list's signature is invalid")
    return revocations


def fingerprint(invite_public_key: bytes) -> str:
    """How `crowdtrain invite` names a join token: the first 16 hex digits of its invite key."""
    return invite_public_key.hex()[:16]
