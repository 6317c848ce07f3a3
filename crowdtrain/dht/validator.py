"""DHT record validators: every crowdtrain record is parsed, size-capped and owner-checked.

hivemind hashes key names before validators see them, so the validator knows the keys it guards
by their hashed IDs: the runs key always, and each run's peers key once registered. Records under
other keys (hivemind's own averaging and MoE records) pass through to hivemind's validators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from crowdtrain.dht import keys
from crowdtrain.dht.invites import MAX_REVOCATIONS_BYTES
from crowdtrain.dht.records import (
    RecordError,
    check_roster,
    check_stage_declaration,
    decode_peer_status,
    open_manifest,
    peer_id_of_owner,
)
from crowdtrain.proto import InviteRevocations

logger = logging.getLogger(__name__)

RecordCheck = Callable[[bytes, bytes], object]
"""Raises RecordError unless (owner subkey, value) is a valid record for its key."""


class SafeSignatureValidator(RSASignatureValidator):
    """hivemind's RSASignatureValidator, but a garbage `[owner:...]` key is a rejection, not a crash.

    Symptom worked around: RSAPublicKey.from_bytes raises ValueError/UnsupportedAlgorithm on a
    malformed owner key, and the exception escapes `validate` into hivemind's rpc_store handler.
    """

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except Exception as e:
            logger.debug(f"rejected a record with an unusable owner key: {e}")
            return False


class CrowdtrainRecordValidator(RecordValidatorBase):
    """Parses and checks the value of every record stored under a crowdtrain key."""

    def __init__(self, run_ids: Iterable[str] = ()):
        self._checks: dict[bytes, RecordCheck] = {_key_id(keys.RUNS_KEY): _check_manifest_record}
        for run_id in run_ids:
            self._checks[_key_id(keys.peers_key(run_id))] = _check_peer_status_record
            self._checks[_key_id(keys.admitted_key(run_id))] = _check_access_record
            self._checks[_key_id(keys.revoked_key(run_id))] = _check_revocations_record
            self._checks[_key_id(keys.skippipe_stages_key(run_id))] = check_stage_declaration
            self._checks[_key_id(keys.skippipe_roster_key(run_id))] = check_roster

    def validate(self, record: DHTRecord) -> bool:
        check = self._checks.get(record.key)
        if check is None:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            if not isinstance(subkey, bytes) or not isinstance(value, bytes):
                raise RecordError("subkey and value must be bytes")
            check(subkey, value)
        except Exception as e:  # peer data: any parse failure is a rejection
            logger.debug(f"rejected a crowdtrain record: {e}")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, CrowdtrainRecordValidator):
            return False
        self._checks.update(other._checks)
        return True

    @property
    def priority(self) -> int:
        return 0  # below the signature validator (10): it sees values with the signature stripped


def make_validators(private_key: RSAPrivateKey, run_ids: Iterable[str] = ()) -> list[RecordValidatorBase]:
    """The validators every crowdtrain DHT node runs: signatures first, then our schema."""
    return [SafeSignatureValidator(private_key), CrowdtrainRecordValidator(run_ids)]


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def _check_manifest_record(subkey: bytes, value: bytes) -> None:
    peer_id_of_owner(subkey)  # the publisher must be a signed owner; the signature validator checked it
    open_manifest(value)


def _check_peer_status_record(subkey: bytes, value: bytes) -> None:
    decode_peer_status(value, subkey)


MAX_ACCESS_RECORD_BYTES = 8 * 1024
"""An AccessToken: a certificate (under 1 KiB), a public key, a signature; the rest is slack."""


def _check_access_record(subkey: bytes, value: bytes) -> None:
    # Only the shape: whether the token admits its owner depends on the run key, which the gate checks on use.
    _check_owned_message(subkey, value, AccessToken, MAX_ACCESS_RECORD_BYTES, "an access token")


def _check_revocations_record(subkey: bytes, value: bytes) -> None:
    # Only the shape: whether the run key signed it is checked on use, by every reader (dht/gate.py).
    _check_owned_message(subkey, value, InviteRevocations, MAX_REVOCATIONS_BYTES, "a revocation list")


def _check_owned_message(subkey: bytes, value: bytes, message: Any, cap: int, what: str) -> None:
    """A record under an owner's subkey whose value is a protobuf `message` of at most `cap` bytes."""
    peer_id_of_owner(subkey)
    if len(value) > cap:
        raise RecordError(f"{what} of {len(value)} bytes is over the {cap} cap")
    try:
        message.FromString(value)
    except Exception:
        raise RecordError(f"the value is not an {message.__name__}") from None
