"""DHT records and their validator: signed manifests, peer statuses, forgeries and garbage."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain import proto
from crowdtrain.dht import keys
from crowdtrain.dht.bounds import field_bound
from crowdtrain.dht.records import (
    MAX_MANIFEST_RECORD_BYTES,
    MAX_OBSERVED_UPLOADS,
    MAX_PEER_ID_CHARS,
    MAX_PEER_STATUS_BYTES,
    MAX_PHASE_SECONDS,
    PHYSICAL_LIMITS,
    RecordError,
    decode_peer_status,
    encode_peer_status,
    open_manifest,
    owner_marker,
    peer_id_of_owner,
    sign_manifest,
)
from crowdtrain.dht.validator import CrowdtrainRecordValidator, SafeSignatureValidator, make_validators
from crowdtrain.manifest import DataSpec, demo
from crowdtrain.node.identity import Identity, load_or_create_identity

RUN_ID = "demo"
FAST = settings(max_examples=50, deadline=None)


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create_identity(tmp_path_factory.mktemp("identity") / "identity.key")


@pytest.fixture(scope="module")
def other_key() -> RSAPrivateKey:
    return RSAPrivateKey()


@pytest.fixture(scope="module")
def validator(identity: Identity) -> CompositeValidator:
    return CompositeValidator(make_validators(identity.private_key, [RUN_ID]))


def peer_id_of(identity: Identity) -> str:
    return PeerID.from_identity(identity.path.read_bytes()).to_base58()


def status_of(peer_id: str, **fields: Any) -> proto.PeerStatus:
    return proto.PeerStatus(peer_id=peer_id, run_id=RUN_ID, version="0.1.0", roles=["trainer"], **fields)


def make_record(key: str, owner: bytes, value: object) -> DHTRecord:
    """A record as hivemind builds it for `dht.store(key, value, subkey=owner)`."""
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + 60,
    )


def signed(validator: CompositeValidator, record: DHTRecord) -> DHTRecord:
    """The record as stored: its value extended with the owner's signature."""
    return dataclasses.replace(record, value=validator.sign_value(record))


def forge(record: DHTRecord, signer: RSAPrivateKey) -> DHTRecord:
    """Sign `record` with `signer` the way hivemind would, whatever owner the record claims."""
    signature = signer.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return dataclasses.replace(record, value=record.value + b"[signature:" + signature + b"]")


# --- manifests ---------------------------------------------------------------------------------


def test_signed_manifest_round_trips_and_names_the_founder(identity: Identity) -> None:
    manifest = dataclasses.replace(demo(), created_at=1_700_000_000.5)
    published = open_manifest(sign_manifest(manifest, identity.private_key))
    assert published.manifest == manifest
    assert published.founder_peer_id == peer_id_of(identity)
    assert published.founder_peer_id == identity.peer_id.to_base58()


def test_owner_marker_maps_to_the_identity_peer_id(identity: Identity) -> None:
    marker = owner_marker(identity.private_key)
    assert marker.startswith(b"[owner:ssh-rsa ") and marker.endswith(b"]")
    assert peer_id_of_owner(marker).to_base58() == peer_id_of(identity)


def test_manifest_altered_after_signing_is_rejected(identity: Identity) -> None:
    wrapper = proto.SignedManifest.FromString(sign_manifest(demo(), identity.private_key))
    altered = proto.RunManifest.FromString(wrapper.manifest)
    altered.optimizer.learning_rate = 10.0
    wrapper.manifest = altered.SerializeToString(deterministic=True)
    with pytest.raises(RecordError, match="signature"):
        open_manifest(wrapper.SerializeToString())


def test_manifest_with_a_damaged_signature_is_rejected(identity: Identity) -> None:
    wrapper = proto.SignedManifest.FromString(sign_manifest(demo(), identity.private_key))
    wrapper.signature = identity.private_key.sign(wrapper.manifest + b"something else")
    with pytest.raises(RecordError, match="signature"):
        open_manifest(wrapper.SerializeToString())


def test_manifest_signed_by_another_key_than_the_one_it_names_is_rejected(
    identity: Identity, other_key: RSAPrivateKey
) -> None:
    wrapper = proto.SignedManifest.FromString(sign_manifest(demo(), identity.private_key))
    wrapper.founder_public_key = other_key.get_public_key().to_bytes()
    with pytest.raises(RecordError, match="signature"):
        open_manifest(wrapper.SerializeToString())


def test_manifest_with_a_non_rsa_founder_key_is_rejected() -> None:
    ed_key = ed25519.Ed25519PrivateKey.generate().public_key()
    openssh = ed_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    data = proto.SignedManifest(manifest=demo().to_bytes(), founder_public_key=openssh, signature=b"x")
    with pytest.raises(RecordError, match="RSA"):
        open_manifest(data.SerializeToString())


def test_validly_signed_but_invalid_manifest_is_rejected(identity: Identity) -> None:
    body = proto.RunManifest.FromString(demo().to_bytes())
    body.run_id = "Not A Run ID"
    data = body.SerializeToString()
    wrapper = proto.SignedManifest(
        manifest=data,
        founder_public_key=identity.private_key.get_public_key().to_bytes(),
        signature=identity.private_key.sign(data),
    )
    with pytest.raises(RecordError, match="run_id"):
        open_manifest(wrapper.SerializeToString())


def deeply_nested_manifest(founder: RSAPrivateKey) -> bytes:
    """A validly signed SignedManifest, under the size cap, whose model config nests 20,000 lists deep."""
    body = proto.RunManifest.FromString(demo().to_bytes())
    body.model.config_json = '{"a": ' + "[" * 20_000 + "]" * 20_000 + "}"
    data = body.SerializeToString()
    wrapper = proto.SignedManifest(
        manifest=data, founder_public_key=founder.get_public_key().to_bytes(), signature=founder.sign(data)
    ).SerializeToString()
    assert len(wrapper) <= MAX_MANIFEST_RECORD_BYTES
    return wrapper


def test_validly_signed_manifest_with_deeply_nested_config_raises_record_error(identity: Identity) -> None:
    with pytest.raises(RecordError):
        open_manifest(deeply_nested_manifest(identity.private_key))


def test_oversized_manifest_is_refused_on_both_ends(identity: Identity) -> None:
    huge = dataclasses.replace(demo(), data=DataSpec(source="files", path="x" * MAX_MANIFEST_RECORD_BYTES))
    with pytest.raises(RecordError, match="cap"):
        sign_manifest(huge, identity.private_key)
    body = huge.to_bytes()
    wrapper = proto.SignedManifest(
        manifest=body,
        founder_public_key=identity.private_key.get_public_key().to_bytes(),
        signature=identity.private_key.sign(body),
    ).SerializeToString()
    assert len(wrapper) > MAX_MANIFEST_RECORD_BYTES
    with pytest.raises(RecordError, match="cap"):
        open_manifest(wrapper)


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x05ab", "not bytes"])
def test_open_manifest_rejects_garbage(data: bytes) -> None:
    with pytest.raises(RecordError):
        open_manifest(data)


# --- peer statuses -----------------------------------------------------------------------------


def test_peer_status_of_its_owner_round_trips(identity: Identity) -> None:
    status = status_of(peer_id_of(identity), samples_per_second=12.5, epoch=3, loss=2.25)
    decoded = decode_peer_status(encode_peer_status(status), owner_marker(identity.private_key))
    assert decoded == status
    assert decoded.HasField("loss") and not decoded.HasField("upload_mbps")


def test_peer_status_naming_another_peer_is_rejected(identity: Identity, other_key: RSAPrivateKey) -> None:
    forged = encode_peer_status(status_of(peer_id_of(identity)))
    with pytest.raises(RecordError, match="owner"):
        decode_peer_status(forged, owner_marker(other_key))


def test_oversized_peer_status_is_refused_on_both_ends(identity: Identity) -> None:
    status = status_of(peer_id_of(identity), experts=[f"expert.{i}" for i in range(MAX_PEER_STATUS_BYTES // 8)])
    with pytest.raises(RecordError, match="cap"):
        encode_peer_status(status)
    data = status.SerializeToString()
    assert len(data) > MAX_PEER_STATUS_BYTES
    with pytest.raises(RecordError, match="cap"):
        decode_peer_status(data, owner_marker(identity.private_key))


def test_peer_status_with_phase_times_round_trips(identity: Identity) -> None:
    phases = proto.PhaseTimes(compute_s=3.1, wait_s=0.0, allreduce_s=1.4, state_download_s=MAX_PHASE_SECONDS)
    status = status_of(peer_id_of(identity), phase_times=phases)
    decoded = decode_peer_status(encode_peer_status(status), owner_marker(identity.private_key))
    assert decoded.HasField("phase_times") and decoded.phase_times == phases


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -float("inf"), -0.5, MAX_PHASE_SECONDS * 2])
@pytest.mark.parametrize("phase", ["compute_s", "matchmaking_s", "state_download_s"])
def test_peer_status_with_a_bogus_phase_time_is_rejected(identity: Identity, phase: str, seconds: float) -> None:
    status = status_of(peer_id_of(identity), phase_times=proto.PhaseTimes(**{phase: seconds}))
    with pytest.raises(RecordError, match=f"phase_times.{phase}"):
        decode_peer_status(status.SerializeToString(), owner_marker(identity.private_key))


def test_peer_status_with_a_training_status_round_trips(identity: Identity) -> None:
    training = proto.TrainingStatus(
        mode="diloco", compression="int8", inner_step=8, inner_steps=8, round_bytes_sent=2**40, compute_utilisation=1.0
    )
    status = status_of(peer_id_of(identity), training=training)
    decoded = decode_peer_status(encode_peer_status(status), owner_marker(identity.private_key))
    assert decoded.HasField("training") and decoded.training == training


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"compute_utilisation": float("nan")}, "compute_utilisation"),
        ({"compute_utilisation": 1.5}, "compute_utilisation"),
        ({"compute_utilisation": -0.1}, "compute_utilisation"),
        ({"mode": "x" * 17}, "training.mode"),
        ({"compression": "[/bold]" * 3}, "training.compression"),
        ({"inner_step": 9, "inner_steps": 8}, "inner step"),
        ({"inner_step": 0, "inner_steps": 10**12}, "inner.steps"),
        ({"experts_owned": 9, "experts_total": 8}, "experts"),
        ({"experts_owned": 0, "experts_total": 70_000}, "experts"),
        ({"experts_owned": 1, "experts_total": 8, "experts_capacity": 9}, "room for 9 of 8 experts"),
    ],
)
def test_peer_status_with_a_bogus_training_status_is_rejected(
    identity: Identity, fields: dict[str, object], match: str
) -> None:
    status = status_of(peer_id_of(identity), training=proto.TrainingStatus(**fields))
    with pytest.raises(RecordError, match=match):
        decode_peer_status(status.SerializeToString(), owner_marker(identity.private_key))


def _observed(*entries: tuple[str, float]) -> list[proto.ObservedUpload]:
    return [proto.ObservedUpload(peer_id=peer_id, upload_mbps=mbps) for peer_id, mbps in entries]


def test_peer_status_with_observed_uploads_round_trips(identity: Identity) -> None:
    observed = _observed(*((f"QmPeer{i}", 0.001 + i * 100.0) for i in range(MAX_OBSERVED_UPLOADS - 1)))
    observed += _observed(("Qm" + "x" * (MAX_PEER_ID_CHARS - 2), PHYSICAL_LIMITS["upload_mbps"]))
    status = status_of(peer_id_of(identity), observed_uploads=observed)
    decoded = decode_peer_status(encode_peer_status(status), owner_marker(identity.private_key))
    assert list(decoded.observed_uploads) == observed


@pytest.mark.parametrize(
    ("observed", "match"),
    [
        (_observed(*((f"QmPeer{i}", 10.0) for i in range(MAX_OBSERVED_UPLOADS + 1))), "over the 8 cap"),
        (_observed(("QmPeerA", 10.0), ("QmPeerB", 20.0), ("QmPeerA", 900.0)), "twice"),
        (_observed(("", 10.0)), "empty peer ID"),
        (_observed(("x" * (MAX_PEER_ID_CHARS + 1), 10.0)), "observed_uploads.peer_id longer than 64 characters"),
        (_observed(("QmPeerA", float("nan"))), "upload_mbps"),
        (_observed(("QmPeerA", float("inf"))), "upload_mbps"),
        (_observed(("QmPeerA", 0.0)), "upload_mbps"),
        (_observed(("QmPeerA", -5.0)), "upload_mbps"),
        (_observed(("QmPeerA", PHYSICAL_LIMITS["upload_mbps"] * 1.001)), "upload_mbps"),
    ],
)
def test_peer_status_with_malformed_observed_uploads_is_rejected(
    identity: Identity, observed: list[proto.ObservedUpload], match: str
) -> None:
    status = status_of(peer_id_of(identity), observed_uploads=observed)
    with pytest.raises(RecordError, match=match):
        decode_peer_status(status.SerializeToString(), owner_marker(identity.private_key))


def test_peer_status_that_is_not_protobuf_is_rejected(identity: Identity) -> None:
    with pytest.raises(RecordError, match="PeerStatus"):
        decode_peer_status(b"\xff\xff\xff", owner_marker(identity.private_key))


@pytest.mark.parametrize(
    "marker",
    [
        b"",
        b"garbage",
        b"[owner:]",
        b"[owner:ssh-rsa not-base64]",
        b"[owner:ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ]",
        b"prefix [owner:ssh-rsa AAAA]",
    ],
)
def test_peer_id_of_owner_rejects_garbage(marker: bytes) -> None:
    with pytest.raises(RecordError):
        peer_id_of_owner(marker)


def test_peer_id_of_owner_rejects_a_non_rsa_key() -> None:
    ed_key = ed25519.Ed25519PrivateKey.generate().public_key()
    openssh = ed_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    with pytest.raises(RecordError, match="RSA"):
        peer_id_of_owner(b"[owner:" + openssh + b"]")


# --- the validator, fed records built exactly as hivemind builds them --------------------------


def test_validator_accepts_a_signed_manifest_record(identity: Identity, validator: CompositeValidator) -> None:
    manifest = sign_manifest(demo(), identity.private_key)
    record = signed(validator, make_record(keys.RUNS_KEY, owner_marker(identity.private_key), manifest))
    assert b"[signature:" in record.value
    assert validator.validate(record) is True
    assert MSGPackSerializer.loads(validator.strip_value(record)) == manifest


def test_validator_rejects_a_deeply_nested_manifest_without_raising(
    identity: Identity, validator: CompositeValidator
) -> None:
    owner = owner_marker(identity.private_key)
    record = signed(validator, make_record(keys.RUNS_KEY, owner, deeply_nested_manifest(identity.private_key)))
    assert validator.validate(record) is False


def test_validator_accepts_a_manifest_republished_by_another_member(
    identity: Identity, other_key: RSAPrivateKey, validator: CompositeValidator
) -> None:
    founders_manifest = sign_manifest(demo(), other_key)
    record = signed(validator, make_record(keys.RUNS_KEY, owner_marker(identity.private_key), founders_manifest))
    assert validator.validate(record) is True


def test_validator_accepts_the_owners_peer_status(identity: Identity, validator: CompositeValidator) -> None:
    status = encode_peer_status(status_of(peer_id_of(identity)))
    record = signed(validator, make_record(keys.peers_key(RUN_ID), owner_marker(identity.private_key), status))
    assert validator.validate(record) is True


def test_validator_rejects_a_status_naming_another_peer(
    identity: Identity, other_key: RSAPrivateKey, validator: CompositeValidator
) -> None:
    someone_else = peer_id_of_owner(owner_marker(other_key)).to_base58()
    status = encode_peer_status(status_of(someone_else))
    record = signed(validator, make_record(keys.peers_key(RUN_ID), owner_marker(identity.private_key), status))
    assert b"[signature:" in record.value  # the signature is genuine: only the content lies
    assert validator.validate(record) is False


def test_validator_rejects_a_record_signed_by_a_key_other_than_its_owner(
    identity: Identity, other_key: RSAPrivateKey, validator: CompositeValidator
) -> None:
    victim = owner_marker(other_key)
    status = encode_peer_status(status_of(peer_id_of_owner(victim).to_base58()))
    unsigned = make_record(keys.peers_key(RUN_ID), victim, status)
    assert validator.sign_value(unsigned) == unsigned.value  # our key does not sign for another owner
    assert validator.validate(unsigned) is False
    assert validator.validate(forge(unsigned, identity.private_key)) is False
    assert validator.validate(forge(unsigned, other_key)) is True  # the same record, signed by its owner


def test_validator_rejects_a_signed_record_moved_to_another_owner(
    identity: Identity, other_key: RSAPrivateKey, validator: CompositeValidator
) -> None:
    manifest = sign_manifest(demo(), identity.private_key)
    original = signed(validator, make_record(keys.RUNS_KEY, owner_marker(identity.private_key), manifest))
    assert validator.validate(original) is True
    moved = dataclasses.replace(original, subkey=MSGPackSerializer.dumps(owner_marker(other_key)))
    assert validator.validate(moved) is False


def test_validator_passes_records_under_unrelated_keys(validator: CompositeValidator) -> None:
    for key in ("some/averaging/key", keys.peers_key("a-run-not-registered")):
        record = make_record(key, b"any subkey", b"\xff any value")
        assert validator.validate(record) is True


def test_validator_rejects_a_regular_value_under_the_runs_key(
    identity: Identity, validator: CompositeValidator
) -> None:
    record = DHTRecord(
        key=DHTID.generate(source=keys.RUNS_KEY).to_bytes(),
        subkey=MSGPackSerializer.dumps(None),  # hivemind's marker of a non-dictionary value
        value=MSGPackSerializer.dumps(sign_manifest(demo(), identity.private_key)),
        expiration_time=get_dht_time() + 60,
    )
    assert validator.validate(record) is False


def test_merged_validators_guard_runs_registered_later(identity: Identity) -> None:
    composite = CompositeValidator(make_validators(identity.private_key, [RUN_ID]))
    composite.extend([CrowdtrainRecordValidator(["later"])])
    garbage = signed(composite, make_record(keys.peers_key("later"), owner_marker(identity.private_key), b"\xff"))
    assert composite.validate(garbage) is False


def assert_rejected_under_crowdtrain_keys(
    identity: Identity, validator: CompositeValidator, value: object, under_peers_key: bool
) -> None:
    """`value`, stored under the peers key or the runs key, fails validation."""
    key = keys.peers_key(RUN_ID) if under_peers_key else keys.RUNS_KEY
    record = signed(validator, make_record(key, owner_marker(identity.private_key), value))
    assert validator.validate(record) is False


@FAST
@given(value=st.binary(max_size=512), under_peers_key=st.booleans())
def test_validator_rejects_arbitrary_bytes_under_crowdtrain_keys(
    identity: Identity, validator: CompositeValidator, value: bytes, under_peers_key: bool
) -> None:
    assert_rejected_under_crowdtrain_keys(identity, validator, value, under_peers_key)


MSGPACK_OBJECTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=32)
    | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@FAST
@given(value=MSGPACK_OBJECTS, under_peers_key=st.booleans())
def test_validator_rejects_arbitrary_msgpack_values_under_crowdtrain_keys(
    identity: Identity, validator: CompositeValidator, value: object, under_peers_key: bool
) -> None:
    assert_rejected_under_crowdtrain_keys(identity, validator, value, under_peers_key)


@FAST
@given(raw_value=st.binary(max_size=256), raw_subkey=st.binary(max_size=64), under_peers_key=st.booleans())
def test_validator_never_raises_on_raw_bytes(
    validator: CompositeValidator, raw_value: bytes, raw_subkey: bytes, under_peers_key: bool
) -> None:
    key = keys.peers_key(RUN_ID) if under_peers_key else keys.RUNS_KEY
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), raw_subkey, raw_value, get_dht_time() + 60)
    assert validator.validate(record) is False


@FAST
@given(junk=st.binary(min_size=1, max_size=128))
def test_garbage_owner_marker_is_rejected_without_raising(identity: Identity, junk: bytes) -> None:
    marker = b"[owner:" + junk + b"]"
    record = make_record(keys.RUNS_KEY, marker, sign_manifest(demo(), identity.private_key))
    record = dataclasses.replace(record, value=record.value + b"[signature:AAAA]")
    assert SafeSignatureValidator(identity.private_key).validate(record) in (True, False)
    assert CompositeValidator(make_validators(identity.private_key, [RUN_ID])).validate(record) is False


def test_unparsable_owner_key_is_a_rejection(identity: Identity) -> None:
    record = make_record(keys.RUNS_KEY, b"[owner:ssh-rsa garbage]", b"")
    record = dataclasses.replace(record, value=record.value + b"[signature:AAAA]")
    assert SafeSignatureValidator(identity.private_key).validate(record) is False


def test_identity_file_peer_id_is_the_one_p2pd_derives(tmp_path: Path) -> None:
    created = load_or_create_identity(tmp_path / "identity.key")
    from_file = PeerID.from_identity((tmp_path / "identity.key").read_bytes())
    assert created.peer_id == from_file
    assert peer_id_of_owner(owner_marker(created.private_key)) == from_file


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("measured_samples_per_second", float("inf")),
        ("measured_samples_per_second", 1e308),  # idled every honest node's plan
        ("samples_per_second", 2e7),
        ("upload_mbps", 1e9),  # made its sender the plan's aggregator
        ("download_mbps", float("nan")),
        ("aggregation_share", 1e300),  # reduced the whole vector alone
        ("aggregation_share", 1.5),
        ("loss", float("inf")),
    ],
)
def test_peer_status_with_an_unphysical_number_is_rejected(identity: Identity, field: str, value: float) -> None:
    status = status_of(peer_id_of(identity), **{field: value})
    with pytest.raises(RecordError, match=field):
        decode_peer_status(status.SerializeToString(), owner_marker(identity.private_key))


def _breaches(descriptor: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, field, a value past its bound) for every bounded or floating field under `descriptor`."""
    found = []
    for field in descriptor.fields:
        name, bound = path + field.name, field_bound(field)
        if field.message_type is not None:
            found += _breaches(field.message_type, name + ".")
        elif field.type == field.TYPE_STRING and bound is not None and bound.HasField("max_count"):
            found.append((name, field, "x" * (bound.max_count + 1)))
        elif field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
            found.append((name, field, float("nan")))
            if bound is not None and bound.HasField("max"):
                found.append((name, field, bound.max * 2 + 1))
            if bound is not None and bound.HasField("min"):
                found.append((name, field, bound.min - 1))
        elif bound is not None and bound.HasField("max"):
            found.append((name, field, int(bound.max) + 1))
    return found


BREACHES = _breaches(proto.PeerStatus.DESCRIPTOR)


@pytest.mark.parametrize(("path", "field", "value"), BREACHES, ids=[f"{path}={value}" for path, _, value in BREACHES])
def test_every_bound_written_in_the_proto_is_checked_on_read(
    identity: Identity, path: str, field: Any, value: Any
) -> None:
    # A field added to PeerStatus with its bound in crowdtrain.proto is refused past it with no reader code.
    status = status_of(peer_id_of(identity))
    *parents, name = path.split(".")
    message = status
    for parent in parents:
        holder = getattr(message, parent)
        message = holder.add() if parent in ("excluded_peers", "observed_uploads") else holder
    if field.is_repeated:
        getattr(message, name).append(value)
    else:
        setattr(message, name, value)
    with pytest.raises(RecordError, match=path.replace(".", r"\.")):
        decode_peer_status(status.SerializeToString(), owner_marker(identity.private_key))


def test_the_bounds_are_read_from_the_proto() -> None:
    assert {path for path, _, _ in BREACHES} >= {"samples_per_second", "loss", "phase_times.compute_s",
                                                   "training.compute_utilisation", "excluded_peers.reason"}  # fmt: skip
    assert PHYSICAL_LIMITS["upload_mbps"] == 400_000 and MAX_PHASE_SECONDS == 86_400
