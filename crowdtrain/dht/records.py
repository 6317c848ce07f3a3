"""Encode, sign, decode and verify the records crowdtrain stores in the DHT.

Every decoder treats its input as hostile: it caps the size, parses the protobuf, validates the
content, and checks that the record's owner key is the key that wrote it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError, Message
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain import proto
from crowdtrain.dht.bounds import OutOfBoundsError, bound_count, bound_max, check_bounds
from crowdtrain.manifest import RunManifest
from crowdtrain.structured import FieldError

MAX_MANIFEST_RECORD_BYTES = 64 * 1024
"""Cap on a SignedManifest: the model config is capped at 16 KiB, the rest is small."""
MAX_PEER_STATUS_BYTES = 16 * 1024
"""Cap on a PeerStatus: ample for a node with a few hundred experts and a dozen addresses."""
# The bounds below are written once, beside their fields in crowdtrain.proto, and checked there (dht/bounds.py).
MAX_PLAN_DIGEST_CHARS = bound_count(proto.PeerStatus, "plan_digest")
MAX_PHASE_SECONDS = bound_max(proto.PhaseTimes, "compute_s")
"""Cap on each phase time of a global step in a PeerStatus: a day; writers clamp to it, readers reject more."""
MAX_MODE_NAME_CHARS = bound_count(proto.TrainingStatus, "mode")
"""Cap on a PeerStatus's training mode and compression names."""
MAX_EXCLUDED_PEERS = bound_count(proto.PeerStatus, "excluded_peers")
"""Cap on the peers one status record says its node keeps out of its averaging groups."""
MAX_EXCLUSION_REASON_CHARS = bound_count(proto.ExcludedPeer, "reason")
"""Cap on the reason given for keeping a peer out."""
MAX_EXCLUSION_S = bound_max(proto.ExcludedPeer, "remaining_s")
"""The longest a node keeps a peer out of its groups (averaging/quarantine.py)."""
MAX_PEER_ID_CHARS = bound_count(proto.ExcludedPeer, "peer_id")
"""A base58 peer ID of an RSA or Ed25519 key is 46-52 characters."""
MAX_OBSERVED_UPLOADS = bound_count(proto.PeerStatus, "observed_uploads")
"""Cap on the peers whose upload one status record says its node timed (links/observations.py)."""
MAX_INNER_STEPS = int(bound_max(proto.TrainingStatus, "inner_steps"))
"""Cap on a PeerStatus's inner steps per outer round: the manifest's own bound on `diloco.inner_steps`."""
MAX_SPES_EXPERTS = int(bound_max(proto.TrainingStatus, "experts_total"))
"""Cap on the experts a SPES node's status may count (all layers)."""
MAX_SKIPPIPE_STAGES = int(bound_max(proto.TrainingStatus, "skippipe_stage")) + 1
"""Cap on a SkipPipe run's stages: the manifest's own bound on `skippipe.stages`."""

M = TypeVar("M", proto.PeerStatus, proto.SignedManifest)
P = TypeVar("P", bound=Message)

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_SHA2_256_MULTIHASH_PREFIX = b"\x12\x20"  # multihash code of sha2-256, then the digest length


class RecordError(ValueError):
    """A DHT record that is malformed, oversized, or not written by its claimed owner."""


@dataclass(frozen=True, slots=True)
class PublishedManifest:
    """A manifest whose founder signature has been verified."""

    manifest: RunManifest
    founder_peer_id: str


def owner_marker(private_key: RSAPrivateKey) -> bytes:
    """The `[owner:...]` subkey that lets only the holder of `private_key` write a record."""
    return RSASignatureValidator(private_key).local_public_key


def peer_id_of_owner(marker: bytes) -> PeerID:
    """The libp2p peer ID of the RSA key in an `[owner:...]` marker (as p2pd derives it)."""
    match = _OWNER_RE.fullmatch(marker)
    if match is None:
        raise RecordError("subkey is not an [owner:...] marker")
    return peer_id_of_public_key(load_public_key(match.group(1)))


def peer_id_of_public_key(public_key: rsa.RSAPublicKey) -> PeerID:
    """libp2p peer ID: the sha2-256 multihash of the protobuf-wrapped DER public key."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256_MULTIHASH_PREFIX + hashlib.sha256(wrapped).digest())


def load_public_key(openssh: bytes) -> rsa.RSAPublicKey:
    """An RSA public key in OpenSSH format (as hivemind writes them); RecordError for anything else."""
    try:
        key = serialization.load_ssh_public_key(openssh)
    except Exception as e:  # cryptography raises several types for garbage input
        raise RecordError(f"owner key is not an OpenSSH public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise RecordError("owner key is not an RSA key")
    return key


def sign_manifest(manifest: RunManifest, private_key: RSAPrivateKey) -> bytes:
    """A serialized SignedManifest of `manifest`, signed by the founder's key."""
    body = manifest.to_bytes()
    signed = proto.SignedManifest(
        manifest=body,
        founder_public_key=private_key.get_public_key().to_bytes(),
        signature=private_key.sign(body),
    )
    data = signed.SerializeToString()
    if len(data) > MAX_MANIFEST_RECORD_BYTES:
        raise RecordError(f"the run manifest is {len(data)} bytes, over the {MAX_MANIFEST_RECORD_BYTES} cap")
    return data


def open_manifest(data: bytes) -> PublishedManifest:
    """Parse and verify a SignedManifest; raises RecordError if anything is wrong with it."""
    if len(data) > MAX_MANIFEST_RECORD_BYTES:
        raise RecordError(f"manifest record of {len(data)} bytes is over the {MAX_MANIFEST_RECORD_BYTES} cap")
    signed = _parse(proto.SignedManifest, data)
    founder_key = load_public_key(signed.founder_public_key)
    if not RSAPublicKey(founder_key).verify(signed.manifest, signed.signature):
        raise RecordError("the manifest's founder signature is invalid")
    try:
        manifest = RunManifest.from_bytes(signed.manifest)
    except (DecodeError, FieldError, ValueError, RecursionError) as e:  # RecursionError: deeply nested JSON
        raise RecordError(f"the manifest is invalid: {e}") from None
    return PublishedManifest(manifest=manifest, founder_peer_id=peer_id_of_public_key(founder_key).to_base58())


MIN_PEERS_FOR_OUTLIERS = 3
OUTLIER_RATIO = 64.0
"""With 3+ peers, no peer's self-reported compute or bandwidth counts for more than this many times the swarm's
median, in the plan (planning/planner.py) and in progress claims (averaging/progress_bounds.py): one peer
claiming a huge value would otherwise idle the others, take every round's aggregation or fill the batch's ETA.
An honest GPU among CPUs can be this much faster: it then counts as if it were 64x."""

_PHYSICAL = ("samples_per_second", "measured_samples_per_second", "upload_mbps", "download_mbps", "aggregation_share")
PHYSICAL_LIMITS = {name: bound_max(proto.PeerStatus, name) for name in _PHYSICAL}
"""No honest node reports more (their bounds in crowdtrain.proto): a record beyond one of these is refused, not
trusted (a claimed 1e308 samples/s idled every honest node's plan, 1e9 Mbit/s made its sender the aggregator)."""

MAX_GLOBAL_STEPS_PER_S = 20.0
"""No run makes global steps faster than this (the demo model on one CPU makes about 3 per second)."""
EPOCH_SLACK = 100_000
"""Epochs allowed beyond the time bound, for clocks that disagree (an hour at the maximum rate)."""


def epoch_ceiling(created_at: float, now: float) -> int:
    """The highest epoch a donor may claim: the global steps a run created at `created_at` (the signed manifest's
    time) can have made by `now`, at the fastest plausible rate, plus slack for clocks."""
    return int(max(0.0, now - created_at) * MAX_GLOBAL_STEPS_PER_S) + EPOCH_SLACK


def encode_peer_status(status: proto.PeerStatus) -> bytes:
    """Serialize a PeerStatus, refusing one over the size cap."""
    data = status.SerializeToString()
    if len(data) > MAX_PEER_STATUS_BYTES:
        raise RecordError(f"peer status of {len(data)} bytes is over the {MAX_PEER_STATUS_BYTES} cap")
    return data


def decode_peer_status(data: bytes, owner: bytes) -> proto.PeerStatus:
    """Parse a PeerStatus stored under the subkey `owner`; its peer_id must be the owner's."""
    if len(data) > MAX_PEER_STATUS_BYTES:
        raise RecordError(f"peer status of {len(data)} bytes is over the {MAX_PEER_STATUS_BYTES} cap")
    status = _parse(proto.PeerStatus, data)
    if status.peer_id != peer_id_of_owner(owner).to_base58():
        raise RecordError("peer status names a peer_id that is not its owner's")
    try:
        check_bounds(status)  # every field's bound, as crowdtrain.proto writes it
    except OutOfBoundsError as e:
        raise RecordError(f"peer status has {e}") from None
    _check_training_status(status.training)
    _check_observed_uploads(status.observed_uploads)
    return status


def _check_observed_uploads(observed: Sequence[proto.ObservedUpload]) -> None:
    """What the fields' bounds can't say: one entry per peer, a named peer, a rate above 0."""
    if len({entry.peer_id for entry in observed}) < len(observed):
        raise RecordError("peer status observes one peer twice")
    for entry in observed:
        if not entry.peer_id:
            raise RecordError("peer status has an observed upload with an empty peer ID")
        if entry.upload_mbps == 0.0:
            raise RecordError("peer status has an observed upload with an invalid upload_mbps: 0")


def _check_training_status(training: proto.TrainingStatus) -> None:
    """What the fields' bounds can't say: how the fields of one training status fit together."""
    if training.inner_step > training.inner_steps:
        raise RecordError(f"peer status has an invalid inner step {training.inner_step} of {training.inner_steps}")
    if training.experts_owned > training.experts_total:
        raise RecordError(f"peer status owns an invalid {training.experts_owned} of {training.experts_total} experts")
    if training.HasField("experts_capacity") and training.experts_capacity > training.experts_total:
        raise RecordError(f"peer status has room for {training.experts_capacity} of {training.experts_total} experts")


MAX_STAGE_DECLARATION_BYTES = 256
MAX_ROSTER_BYTES = 4 * 256 * 96
"""Caps on a SkipPipe declaration and roster (4 memberships of 256 nodes: a 52-character peer ID, three numbers)."""


def check_stage_declaration(subkey: bytes, value: bytes) -> proto.SkipPipeMember:
    """A SkipPipe stage declaration: a SkipPipeMember of its signer within the size cap
    (modes/skippipe/roster/membership.py checks the rest against the run); RecordError otherwise."""
    if len(value) > MAX_STAGE_DECLARATION_BYTES:
        raise RecordError(f"a stage declaration of {len(value)} bytes is over the {MAX_STAGE_DECLARATION_BYTES} cap")
    member = _parse(proto.SkipPipeMember, value)
    if peer_id_of_owner(subkey).to_base58() != member.peer_id:
        raise RecordError("a stage declaration names another peer than its signer")
    if member.stage >= MAX_SKIPPIPE_STAGES:
        raise RecordError(f"a stage declaration of stage {member.stage}")
    return member


def check_roster(subkey: bytes, value: bytes) -> proto.SkipPipeRoster:
    """A SkipPipe roster: a SkipPipeRoster signed by a node, within the size cap (modes/skippipe/roster/membership.py
    checks its memberships); RecordError otherwise."""
    peer_id_of_owner(subkey)
    if len(value) > MAX_ROSTER_BYTES:
        raise RecordError(f"a roster of {len(value)} bytes is over the {MAX_ROSTER_BYTES} cap")
    return _parse(proto.SkipPipeRoster, value)


def _parse(message_type: type[M], data: bytes) -> M:
    if not isinstance(data, bytes):
        raise RecordError(f"value must be bytes, got {type(data).__name__}")
    try:
        return message_type.FromString(data)
    except (DecodeError, RuntimeWarning) as e:
        raise RecordError(f"value is not a valid {message_type.__name__}: {e}") from None


def parse_capped(message_type: type[P], data: bytes, max_bytes: int, what: str, error: type[ValueError]) -> P:
    """`data` as a `message_type`, its size checked before protobuf reads it; raises `error`, naming `what` ("the
    certificate"), when it is over `max_bytes` or does not parse."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over {max_bytes}")
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise error(f"{what} is not a valid {message_type.__name__}") from None
