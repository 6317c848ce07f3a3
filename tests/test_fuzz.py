"""Fuzzing every decoder of peer data: at least 10,000 hostile inputs per type, none crashes it, none gets in.

Inputs come two ways, each type from its own seeded `random.Random`, so a failure names the case that reproduces
it: mutations of genuine encodings made by crowdtrain's own encoders and a real key (bytes flipped, cut, added,
spliced; fields set to NaN, inf, negative, huge or overlong through the protobuf API, then signed again with a
valid key, so the content checks run and not only the signature's), and random bytes. A case is hostile when the
decoder's documented contract says it must be refused. A mutation that leaves its input valid (a base64 bit the
decoder ignores) is benign: it may be accepted and is not counted. A crash is any error but the documented one.
Where the contract also says what a checker must take (state digests, expert requests), valid inputs are generated
too, and every benign case must be accepted: a checker that refuses everything would pass otherwise.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import functools
import hashlib
import itertools
import json
import math
import random
import re
import struct
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from google.protobuf.message import DecodeError
from hivemind.compression import serialize_torch_tensor
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from crowdtrain import proto
from crowdtrain.codecs.compression import (
    INT8_BLOCK,
    MAX_SPARSE_PART_VALUES,
    SPARSE_WIRE_TYPE,
    BoundedInt8,
    SparseFloat16,
)
from crowdtrain.dht import keys, records
from crowdtrain.dht.records import (
    MAX_INNER_STEPS,
    MAX_MODE_NAME_CHARS,
    MAX_OBSERVED_UPLOADS,
    MAX_PEER_ID_CHARS,
    MAX_PEER_STATUS_BYTES,
    MAX_PHASE_SECONDS,
    MAX_PLAN_DIGEST_CHARS,
    MAX_ROSTER_BYTES,
    MAX_SKIPPIPE_STAGES,
    MAX_STAGE_DECLARATION_BYTES,
    PHYSICAL_LIMITS,
)
from crowdtrain.dht.validator import make_validators
from crowdtrain.links.protocol import MAX_PLAUSIBLE_MBPS, dial_back_verdicts, retry_after_s, upload_sample
from crowdtrain.manifest import PROTOCOL_VERSION, DiLoCoSpec, RunManifest, TrainingSpec, demo, demo_moe
from crowdtrain.modes.diloco.pseudo_gradients import MAX_GATHERED
from crowdtrain.modes.skippipe.hops.hop_callers import MAX_DONE_LOSS, IterationCallers, done_loss, hop_refusal
from crowdtrain.modes.skippipe.hops.hop_wire import (
    CHUNK_BYTES,
    GRADIENT_DTYPES,
    WIRE_DTYPES,
    HopLimits,
    HopRefusedError,
    payload_frames,
    receive_frames,
    stream_values,
    wire_bytes,
)
from crowdtrain.modes.skippipe.roster.costs import MAX_SECONDS_PER_HOP, MAX_SECONDS_PER_MICROBATCH
from crowdtrain.modes.skippipe.roster.membership import (
    HISTORY,
    MAX_MEMBERS,
    PipelineMembers,
    encode_roster,
    member_proto,
    node_info,
    parse_declaration,
    parse_roster,
)
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo
from crowdtrain.modes.spes.expert_exchange import (
    BLOCK,
    DIGEST_BYTES,
    ExpertExchange,
    ExpertFetchError,
    encode_change,
)
from crowdtrain.modes.spes.gathered import (
    CAPACITY,
    DIALABLE,
    NO_CLAIMS,
    RATE,
    MemberClaims,
    read_round,
    spes_gathered,
)
from crowdtrain.moe.experts import MAX_BATCH_SEQUENCES
from crowdtrain.moe.requests import (
    STREAM_CHUNK_BYTES,
    RefusedRequestError,
    RequestShape,
    StreamedRequest,
    check_tensors,
)
from crowdtrain.state.digest import (
    SKETCH_RELATIVE_TOLERANCE,
    SKETCH_SAMPLES,
    Corroboration,
    MalformedDigestError,
    Sketch,
    TensorSketch,
    judge,
    max_digest_bytes,
    read_digest,
    sketch_state,
    to_digest,
)
from crowdtrain.state.template import StateTemplate, TensorSpec, UnacceptableStateError, check_state
from crowdtrain.structured import FieldError, from_mapping
from tests.messages import set_field

SEED = 20_251
CASES_PER_TYPE = 10_000
RUN_ID = "demo"
NAN, INF = float("nan"), float("inf")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Case:
    """One input: how it was made (to reproduce it), and whether the decoder's contract says it must be refused."""

    label: str
    data: Any
    hostile: bool = True


@dataclass(slots=True)
class Tally:
    """What one decoder did with its cases."""

    hostile: int = 0
    benign: int = 0
    crashes: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    benign_refused: list[str] = field(default_factory=list)

    def summary(self, name: str) -> str:
        shown = "\n".join([*self.crashes[:5], *self.accepted[:5], *self.benign_refused[:5]])
        return (
            f"{name} (seed {SEED}): {self.hostile} hostile and {self.benign} benign cases, "
            f"{len(self.crashes)} crashes, {len(self.accepted)} hostile accepted, "
            f"{len(self.benign_refused)} benign refused\n{shown}"
        )


def fuzz(
    name: str, decode: Callable[[Any], bool], refusals: tuple[type[BaseException], ...], cases: Iterator[Case]
) -> Tally:
    """Feed `decode` (True: accepted) cases until CASES_PER_TYPE hostile ones were tried; `refusals` may be raised."""
    tally = Tally()
    for index, case in enumerate(cases):
        label = f"{name} case {index}: {case.label}"
        try:
            accepted = decode(case.data)
        except refusals:
            accepted = False
        except Exception as e:  # the fuzzer's point: anything else is a crash, recorded with its case
            tally.crashes.append(f"{label} -> {type(e).__name__}: {str(e)[:200]}")
            accepted = False
        if case.hostile and accepted:
            tally.accepted.append(label)
        if not case.hostile and not accepted:
            tally.benign_refused.append(label)
        tally.hostile += case.hostile
        tally.benign += not case.hostile
        if tally.hostile >= CASES_PER_TYPE:
            return tally
    raise AssertionError(f"{name}: the case generator ran dry")


def assert_all_refused(
    name: str,
    decode: Callable[[Any], bool],
    refusals: tuple[type[BaseException], ...],
    cases: Iterator[Case],
    *,
    min_benign_accepted: int = 0,
) -> None:
    """`fuzz` `decode` with `cases`: no crash, no hostile case accepted; and, where `min_benign_accepted` is set, at
    least that many benign cases, each accepted (a checker that refuses everything proves nothing)."""
    tally = fuzz(name, decode, refusals, cases)
    assert tally.hostile >= CASES_PER_TYPE and tally.crashes == [] and tally.accepted == [], tally.summary(name)
    if min_benign_accepted:
        assert tally.benign >= min_benign_accepted and tally.benign_refused == [], tally.summary(name)


# --- mutations -----------------------------------------------------------------------------------------------


def random_bytes(rng: random.Random, max_len: int = 512) -> bytes:
    return rng.randbytes(rng.randrange(max_len + 1))


def mutate(rng: random.Random, data: bytes, donors: Sequence[bytes]) -> tuple[str, bytes]:
    """One byte-level mutation of `data`: flip, cut, extend, insert, delete, duplicate, or splice with a donor."""
    how = rng.choice(("flip", "truncate", "extend", "insert", "delete", "duplicate", "splice"))
    at = rng.randrange(len(data) + 1)
    if how == "flip" and data:
        at = min(at, len(data) - 1)
        return f"flip byte {at}", data[:at] + bytes([data[at] ^ rng.randrange(1, 256)]) + data[at + 1 :]
    if how == "truncate" and data:
        return f"truncate to {at % len(data)}", data[: at % len(data)]
    if how == "insert":
        return f"insert at {at}", data[:at] + random_bytes(rng, 64) + data[at:]
    if how == "delete":
        end = rng.randrange(at, len(data) + 1)
        return f"delete {at}:{end}", data[:at] + data[end:]
    if how == "duplicate":
        end = rng.randrange(at, len(data) + 1)
        return f"duplicate {at}:{end}", data[:end] + data[at:end] + data[end:]
    if how == "splice":
        donor = rng.choice(donors)
        cut = rng.randrange(len(donor) + 1)
        return f"splice at {at} with a donor from {cut}", data[:at] + donor[cut:]
    return "extend", data + random_bytes(rng, 64) + b"\x00" * rng.randrange(2)


def hostile_float(rng: random.Random) -> float:
    """A non-finite, negative, huge or denormal double, or one from 8 random bytes (often a NaN payload)."""
    pool = (NAN, INF, -INF, -1.0, -1e-300, -5e-324, 1e308, 1.7976931348623157e308, -0.0)
    return rng.choice(pool) if rng.random() < 0.8 else struct.unpack("<d", rng.randbytes(8))[0]


def set_path(message: Any, path: str, value: Any) -> None:
    """Set a dotted field of a protobuf message or a nested dict; a list value replaces a repeated field."""
    *parents, last = path.split(".")
    for part in parents:
        if isinstance(message, dict) and message.get(part) is None:
            message[part] = {}  # an unset optional table, such as [diloco] in a gradients run
        message = message[part] if isinstance(message, dict) else getattr(message, part)
    if isinstance(message, dict):
        message[last] = value
    else:
        set_field(message, last, value)


# --- manifests -----------------------------------------------------------------------------------------------

NON_FINITE = [NAN, INF, -INF]
POSITIVE_FLOAT_ATTACKS = [*NON_FINITE, 0.0, -1.0, -5e-324]
DILOCO = dataclasses.replace(demo(), training=TrainingSpec(mode="diloco"), diloco=DiLoCoSpec())
BASES = {"demo": demo(), "moe": demo_moe(), "diloco": DILOCO}
BASE_BYTES = {name: manifest.to_bytes() for name, manifest in BASES.items()}
MANIFEST_ATTACKS: list[tuple[str, str, list[Any]]] = [
    # (base, field path, values the contract refuses)
    ("demo", "run_id", ["", "Demo", "x" * 64, "../etc", "a b", "a\x00", "é"]),
    ("demo", "protocol_version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 2**32 - 1]),
    ("demo", "created_at", [*NON_FINITE, -1.0, -1e308, 1e300, 1.7976931348623157e308]),
    ("demo", "target_batch_size", [0]),
    ("demo", "model.architecture", ["", "a b", "x;import os", "1abc"]),
    ("demo", "model.tokenizer", [""]),
    ("demo", "model.precision", ["", "fp8", "x" * 100]),
    ("demo", "model.config_json", ["[]", "1", "{", "null", '{"a": NaN}', '{"b": Infinity}', '{"c": [-Infinity]}']),
    ("demo", "model.config_json", ['{"a": ' + "[" * 20_000 + "]" * 20_000 + "}", json.dumps({"a": "x" * 17_000})]),
    ("demo", "data.source", ["", "ftp", "files", "hf"]),  # files and hf need a path
    ("demo", "data.sequence_length", [0, 65537, 2**32 - 1]),
    ("demo", "optimizer.name", ["", "adam", "x" * 1000]),
    ("demo", "optimizer.learning_rate", POSITIVE_FLOAT_ATTACKS),
    ("demo", "optimizer.weight_decay", [*NON_FINITE, -0.5, -1e300]),
    ("demo", "optimizer.warmup_steps", [10_001, 2**32 - 1]),
    ("demo", "optimizer.total_steps", [0, 9]),
    ("demo", "optimizer.max_grad_norm", [*NON_FINITE, -1.0, -5e-324]),
    ("demo", "training.mode", ["", "GRADIENTS", "x" * 1000]),
    ("demo", "averaging.compression", ["", "zip", "int8"]),
    ("demo", "averaging.aggregation", ["", "median", "x" * 1000]),
    ("demo", "averaging.group_size", [0, 1, 3, 6, 2**32 - 1]),
    ("demo", "averaging.grid_dims", [0, 9, 2**32 - 1]),
    ("demo", "averaging.timeout_s", POSITIVE_FLOAT_ATTACKS),
    ("demo", "averaging.matchmaking_time_s", POSITIVE_FLOAT_ATTACKS),
    ("demo", "diloco.inner_steps", [0, 50]),  # a [diloco] section in a gradients run
    ("moe", "moe.grid", [[], [0], [257], [1, 1, 1, 1, 1], [256, 256, 2]]),
    ("moe", "moe.layers", [[4], [1, 1], [1024]]),
    ("moe", "moe.expert", ["", "cnn"]),
    ("moe", "moe.expert_hidden_size", [0, 65537]),
    ("moe", "moe.k", [0, 17]),
    ("moe", "moe.k_min", [0, 3]),
    ("moe", "moe.forward_timeout_s", POSITIVE_FLOAT_ATTACKS),
    ("moe", "moe.backward_timeout_s", POSITIVE_FLOAT_ATTACKS),
    ("moe", "moe.timeout_after_k_min_s", POSITIVE_FLOAT_ATTACKS),
    ("moe", "moe.uid_prefix", ["", "1ffn", "x" * 33, "a.b"]),
    ("moe", "model.config_json", ['{"num_hidden_layers": 4}', '{"num_hidden_layers": NaN, "hidden_size": 8}']),
    ("diloco", "diloco.inner_steps", [0, 1_000_001]),
    ("diloco", "diloco.outer_learning_rate", [*POSITIVE_FLOAT_ATTACKS, 10.5, 1e300]),
    ("diloco", "diloco.outer_momentum", [*NON_FINITE, -0.1, 1.0, 1e300]),
    ("diloco", "diloco.compression", ["", "zip"]),
    ("diloco", "diloco.topk_fraction", [*POSITIVE_FLOAT_ATTACKS, 1.5, 1e300]),
]
ALL_MANIFEST_ATTACKS = [(base, path, value) for base, path, values in MANIFEST_ATTACKS for value in values]


def hostile_manifest_body(base: str, path: str, value: Any) -> bytes:
    """A RunManifest message with one field set to `value` through the protobuf API."""
    message = proto.RunManifest.FromString(BASE_BYTES[base])
    set_path(message, path, value)
    return message.SerializeToString()


def sign_body(body: bytes, key: RSAPrivateKey) -> bytes:
    """A SignedManifest around `body`, genuinely signed by `key`, whatever `body` holds."""
    public_key = key.get_public_key().to_bytes()
    return proto.SignedManifest(
        manifest=body, founder_public_key=public_key, signature=key.sign(body)
    ).SerializeToString()


@dataclass(frozen=True, slots=True)
class Keys:
    """Two real keys and what was signed with them once, for every test of this module."""

    founder: RSAPrivateKey
    other: RSAPrivateKey
    valid_manifest: bytes
    hostile_manifests: list[tuple[str, bytes]]


@pytest.fixture(scope="module")
def signed() -> Keys:
    founder, other = RSAPrivateKey(), RSAPrivateKey()
    valid = records.sign_manifest(dataclasses.replace(demo(), created_at=1.7e9), founder)
    hostile = [
        (
            f"{path}={str(value)[:40]!r} signed by the founder",
            sign_body(hostile_manifest_body(base, path, value), founder),
        )
        for base, path, value in ALL_MANIFEST_ATTACKS
    ]
    body = demo().to_bytes()
    public_key = founder.get_public_key().to_bytes()
    forgeries = [
        ("a body signed by another key", proto.SignedManifest(manifest=body, signature=other.sign(body))),
        ("the signature of another body", proto.SignedManifest(manifest=body, signature=founder.sign(body + b"x"))),
        ("no signature", proto.SignedManifest(manifest=body)),
    ]
    for _, message in forgeries:
        message.founder_public_key = public_key
    forgeries.append(("no key", proto.SignedManifest(manifest=body, signature=founder.sign(body))))
    hostile += [(label, message.SerializeToString()) for label, message in forgeries]
    return Keys(founder=founder, other=other, valid_manifest=valid, hostile_manifests=hostile)


def same_signed_manifest(data: bytes, original: bytes) -> bool:
    """Whether `data` holds the same body, signature and founder key as `original` (a harmless re-encoding)."""
    try:
        mutated, genuine = proto.SignedManifest.FromString(data), proto.SignedManifest.FromString(original)
        keys_equal = (
            serialization.load_ssh_public_key(mutated.founder_public_key).public_numbers()  # type: ignore[union-attr]
            == serialization.load_ssh_public_key(genuine.founder_public_key).public_numbers()  # type: ignore[union-attr]
        )
    except Exception:
        return False
    return keys_equal and (mutated.manifest, mutated.signature) == (genuine.manifest, genuine.signature)


def signed_manifest_cases(rng: random.Random, signed: Keys) -> Iterator[Case]:
    donors = [signed.valid_manifest, *(data for _, data in signed.hostile_manifests[:20])]
    while True:
        roll = rng.random()
        if roll < 0.4:
            label, data = rng.choice(signed.hostile_manifests)
            if rng.random() < 0.5:
                how, data = mutate(rng, data, donors)
                label = f"{label}, then {how}"
            yield Case(label, data)
        elif roll < 0.85:
            how, data = mutate(rng, signed.valid_manifest, donors)
            yield Case(f"the valid record, {how}", data, hostile=not same_signed_manifest(data, signed.valid_manifest))
        else:
            yield Case("random bytes", random_bytes(rng, 2048))


def test_open_manifest_refuses_every_hostile_record(signed: Keys) -> None:
    assert (
        records.open_manifest(signed.valid_manifest).manifest.created_at == 1.7e9
    )  # the mutations start from a valid one
    assert_all_refused(
        "open_manifest",
        lambda data: records.open_manifest(data) is not None,
        (records.RecordError,),
        signed_manifest_cases(random.Random(f"{SEED}:open_manifest"), signed),
    )


def manifest_body_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        if rng.random() < 0.1:
            yield Case("random bytes", random_bytes(rng))
            continue
        attacks = rng.sample(ALL_MANIFEST_ATTACKS, rng.randrange(1, 3))
        base = attacks[0][0]
        attacks = [attack for attack in attacks if attack[0] == base]
        message = proto.RunManifest.FromString(BASE_BYTES[base])
        message.created_at = rng.uniform(0, 2e9)  # a benign change, so the cases differ beyond their attacks
        for _, path, value in attacks:
            set_path(message, path, value)
        label = ", ".join(f"{path}={str(value)[:40]!r}" for _, path, value in attacks)
        yield Case(f"{base} with {label}", message.SerializeToString())


def test_manifest_from_bytes_refuses_every_hostile_body() -> None:
    assert_all_refused(
        "RunManifest.from_bytes",
        lambda data: RunManifest.from_bytes(data) is not None,
        (ValueError,),
        manifest_body_cases(random.Random(f"{SEED}:manifest_body")),
    )


WRONG_TYPES: dict[type, list[Any]] = {
    float: ["7", b"7", True, None, [1.0], {"a": 1}, 10**400],
    int: ["7", b"7", True, None, [1], {"a": 1}, 3.5, 2.0],
    str: [7, b"x", True, None, ["x"], {"a": 1}, 3.5],
    dict: ["x", 7, None, [1], True],
}


def manifest_table_cases(rng: random.Random) -> Iterator[Case]:
    tables = {name: dataclasses.asdict(manifest) for name, manifest in BASES.items()}
    while True:
        roll = rng.random()
        if roll < 0.5:
            base, path, value = rng.choice(ALL_MANIFEST_ATTACKS)
            if path == "model.config_json":
                path, value = "model.config", {"a": rng.choice(NON_FINITE), "b": "x" * rng.randrange(20_000)}
            label = f"{path}={str(value)[:40]!r}"
        elif roll < 0.8:
            base = rng.choice(list(tables))
            path = rng.choice(["run_id", "created_at", "target_batch_size", "optimizer.learning_rate",
                               "averaging.group_size", "averaging.timeout_s", "data.source", "model"])  # fmt: skip
            current: Any = tables[base]
            for part in path.split("."):
                current = current[part]
            value = rng.choice(WRONG_TYPES[type(current)])
            label = f"{path} of the wrong type or beyond a double: {str(value)[:40]}"
        else:
            base, path, value = rng.choice(list(tables)), rng.choice(["", "model.", "optimizer."]), 1
            length = rng.choice([rng.randrange(1, 40), rng.randrange(1, 10_000)])
            path += "".join(rng.choices("abcdefghijklmnopqrstuvwxyz_", k=length))
            label = f"an unknown field {path[:40]}..."
        table = json.loads(json.dumps(tables[base]))
        set_path(table, path, list(value) if isinstance(value, tuple) else value)
        yield Case(label, table)


def test_manifest_tables_with_hostile_fields_are_refused() -> None:
    assert_all_refused(
        "from_mapping(RunManifest)",
        lambda table: from_mapping(RunManifest, table) is not None,
        (FieldError,),
        manifest_table_cases(random.Random(f"{SEED}:manifest_table")),
    )


# --- peer statuses -------------------------------------------------------------------------------------------

STATUS_LIMITS = {**PHYSICAL_LIMITS, "loss": INF, "last_seen": INF}


def valid_status(peer_id: str) -> proto.PeerStatus:
    return proto.PeerStatus(
        peer_id=peer_id, run_id=RUN_ID, version="0.1.0", roles=["trainer"], device="cpu", samples_per_second=12.5,
        epoch=3, loss=-2.25, upload_mbps=50.0, download_mbps=200.0, last_seen=1.7e9, multiaddrs=["/ip4/1.2.3.4/tcp/1"],
        measured_samples_per_second=13.0, aggregation_share=0.5, plan_digest="abc",
        phase_times=proto.PhaseTimes(compute_s=3.0, wait_s=0.5),
        training=proto.TrainingStatus(mode="diloco", compression="int8", inner_step=3, inner_steps=8),
        observed_uploads=[proto.ObservedUpload(peer_id="QmPeerA", upload_mbps=20.0)],
    )  # fmt: skip


def observed_upload(peer_id: str, mbps: float) -> proto.ObservedUpload:
    return proto.ObservedUpload(peer_id=peer_id, upload_mbps=mbps)


def status_within_contract(data: bytes, owner_peer_id: str) -> bool:
    """The contract of decode_peer_status restated: parsable, capped, the owner's, every number finite and bounded."""
    try:
        status = proto.PeerStatus.FromString(data)
    except (DecodeError, RuntimeWarning):
        return False
    numbers = {name: getattr(status, name) for name in STATUS_LIMITS}
    phases = [getattr(status.phase_times, f.name) for f in status.phase_times.DESCRIPTOR.fields]
    training = status.training
    observed = status.observed_uploads
    return (
        len(data) <= MAX_PEER_STATUS_BYTES
        and status.peer_id == owner_peer_id
        and all(math.isfinite(v) and (v >= 0 or n == "loss") and v <= STATUS_LIMITS[n] for n, v in numbers.items())
        and all(math.isfinite(seconds) and 0 <= seconds <= MAX_PHASE_SECONDS for seconds in phases)
        and len(status.plan_digest) <= MAX_PLAN_DIGEST_CHARS
        and max(len(training.mode), len(training.compression)) <= MAX_MODE_NAME_CHARS
        and training.inner_step <= training.inner_steps <= MAX_INNER_STEPS
        and 0 <= training.compute_utilisation <= 1
        and len(observed) <= MAX_OBSERVED_UPLOADS
        and len({entry.peer_id for entry in observed}) == len(observed)
        and all(0 < len(entry.peer_id) <= MAX_PEER_ID_CHARS for entry in observed)
        and all(
            math.isfinite(entry.upload_mbps) and 0 < entry.upload_mbps <= STATUS_LIMITS["upload_mbps"]
            for entry in observed
        )
    )


STATUS_ATTACKS: list[tuple[str, Callable[[random.Random], Any]]] = [
    *((name, hostile_float) for name in STATUS_LIMITS if name != "loss"),
    *((name, lambda rng, name=name: STATUS_LIMITS[name] * rng.uniform(1.001, 1e6)) for name in PHYSICAL_LIMITS),
    ("loss", lambda rng: rng.choice(NON_FINITE)),
    *((f"phase_times.{f.name}", hostile_float) for f in proto.PhaseTimes.DESCRIPTOR.fields),
    ("phase_times.wait_s", lambda rng: MAX_PHASE_SECONDS * rng.uniform(1.001, 1e6)),
    ("plan_digest", lambda rng: "x" * rng.randrange(MAX_PLAN_DIGEST_CHARS + 1, 4000)),
    ("training.mode", lambda rng: "[/bold]" * rng.randrange(3, 500)),
    ("training.compression", lambda rng: "x" * rng.randrange(MAX_MODE_NAME_CHARS + 1, 4000)),
    ("training.inner_steps", lambda rng: rng.randrange(MAX_INNER_STEPS + 1, 2**64)),
    ("training.inner_step", lambda rng: rng.randrange(9, 2**64)),  # beyond inner_steps = 8
    ("training.compute_utilisation", lambda rng: rng.choice([*NON_FINITE, -0.1, 1.0001, 1e300])),
    ("peer_id", lambda rng: rng.choice(["", "QmSomeoneElse", "x" * 2000])),
    ("experts", lambda rng: [f"expert.{i}" for i in range(MAX_PEER_STATUS_BYTES // 8)]),
    ("observed_uploads", lambda rng: [observed_upload(f"Qm{i}", 1.0) for i in range(rng.randrange(9, 400))]),
    ("observed_uploads", lambda rng: [observed_upload("QmPeerA", 1.0), observed_upload("QmPeerA", 2.0)]),
    ("observed_uploads", lambda rng: [observed_upload(rng.choice(["", "x" * 65]), 1.0)]),
    ("observed_uploads", lambda rng: [observed_upload("QmPeerA", rng.choice([*NON_FINITE, 0.0, -1.0, 4.1e5]))]),
]


def peer_status_cases(rng: random.Random, owner: bytes, other_owner: bytes) -> Iterator[Case]:
    peer_id = records.peer_id_of_owner(owner).to_base58()
    valid = records.encode_peer_status(valid_status(peer_id))
    donors = [valid, records.encode_peer_status(valid_status(records.peer_id_of_owner(other_owner).to_base58()))]
    garbage_owners = [b"", b"garbage", b"[owner:]", b"[owner:ssh-rsa AAAA]", other_owner]
    while True:
        roll = rng.random()
        if roll < 0.45:
            status = valid_status(peer_id)
            attacks = rng.sample(STATUS_ATTACKS, rng.randrange(1, 3))
            values = [(path, make(rng)) for path, make in attacks]
            for path, value in values:
                set_path(status, path, value)
            label = ", ".join(f"{path}={str(value)[:40]!r}" for path, value in values)
            data = status.SerializeToString()  # hostile unless the values drawn happen to fit (-0.0, 1e308 last_seen)
            yield Case(label, (data, owner), hostile=not status_within_contract(data, peer_id))
        elif roll < 0.85:
            how, data = mutate(rng, valid, donors)
            yield Case(f"the valid status, {how}", (data, owner), hostile=not status_within_contract(data, peer_id))
        elif roll < 0.95:
            yield Case("random bytes", (random_bytes(rng), owner))
        else:
            bad_owner = rng.choice([*garbage_owners, random_bytes(rng, 64)])
            yield Case(f"the valid status under owner {bad_owner[:40]!r}", (valid, bad_owner), bad_owner != owner)


def test_decode_peer_status_refuses_every_hostile_status(signed: Keys) -> None:
    owner, other = records.owner_marker(signed.founder), records.owner_marker(signed.other)
    assert records.decode_peer_status(
        records.encode_peer_status(valid_status(records.peer_id_of_owner(owner).to_base58())), owner
    )
    assert_all_refused(
        "decode_peer_status",
        lambda pair: records.decode_peer_status(*pair) is not None,
        (records.RecordError,),
        peer_status_cases(random.Random(f"{SEED}:peer_status"), owner, other),
    )


# --- DHT records through the validators hivemind runs --------------------------------------------------------

RUNS_KEY_ID = DHTID.generate(source=keys.RUNS_KEY).to_bytes()
PEERS_KEY_ID = DHTID.generate(source=keys.peers_key(RUN_ID)).to_bytes()


def owned_record(validator: CompositeValidator, key_id: bytes, owner: bytes, value: Any) -> DHTRecord:
    """A record as hivemind stores it under `owner`'s subkey, signed by the validator's own key."""
    record = DHTRecord(key_id, MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(value), 1e10)
    return dataclasses.replace(record, value=validator.sign_value(record))


SIGNATURE_RE = re.compile(rb"\[signature:(.+?)\]")


def same_signed_value(value: bytes, original: bytes) -> bool:
    """Whether `value` holds `original`'s payload and signature (base64 ignores what follows its padding)."""
    found, genuine = SIGNATURE_RE.findall(value), SIGNATURE_RE.findall(original)
    try:
        same_signature = len(found) == 1 and base64.b64decode(found[0]) == base64.b64decode(genuine[0])
    except binascii.Error:
        return False
    return same_signature and SIGNATURE_RE.sub(b"", value) == SIGNATURE_RE.sub(b"", original)


def dht_record_cases(rng: random.Random, validator: CompositeValidator, signed: Keys) -> Iterator[Case]:
    owner = records.owner_marker(signed.founder)
    peer_id = records.peer_id_of_owner(owner).to_base58()
    valid = [
        owned_record(validator, RUNS_KEY_ID, owner, signed.valid_manifest),
        owned_record(validator, PEERS_KEY_ID, owner, records.encode_peer_status(valid_status(peer_id))),
    ]
    status_cases = peer_status_cases(rng, owner, records.owner_marker(signed.other))
    statuses = [(case.label, case.data[0]) for _, case in zip(range(80), status_cases, strict=False) if case.hostile]
    statuses = [(label, data) for label, data in statuses if "under owner" not in label]  # hostile by owner only
    values: list[tuple[str, bytes, Any]] = [
        *(("runs", label, data) for label, data in rng.sample(signed.hostile_manifests, 50)),
        *(("peers", f"status {label}", data) for label, data in statuses),
        *(("peers", "a manifest", signed.valid_manifest), ("runs", "a status", valid[1].value)),
        *((rng.choice(["runs", "peers"]), "random bytes", random_bytes(rng)) for _ in range(10)),
        *(
            (rng.choice(["runs", "peers"]), f"msgpack {value!r}", value)
            for value in [None, 7, -1.5, "text", [b"x"], {}]
        ),
    ]
    hostile = [
        (label, owned_record(validator, RUNS_KEY_ID if key == "runs" else PEERS_KEY_ID, owner, value))
        for key, label, value in values
    ]
    donors = [record.value for record in valid]
    while True:
        roll = rng.random()
        if roll < 0.35:
            label, record = rng.choice(hostile)
            yield Case(f"signed {label}", record)
        elif roll < 0.85:
            record = rng.choice(valid)
            part = rng.choice(["value", "subkey"])
            how, data = mutate(rng, getattr(record, part), donors)
            label = f"a valid {'manifest' if record is valid[0] else 'status'} record, its {part}: {how}"
            same = same_signed_value(data, record.value) if part == "value" else data == record.subkey
            yield Case(label, dataclasses.replace(record, **{part: data}), hostile=not same)
        else:
            key_id, subkey = rng.choice([RUNS_KEY_ID, PEERS_KEY_ID]), random_bytes(rng, 64)
            if rng.random() < 0.5:
                subkey = MSGPackSerializer.dumps(rng.choice([owner, records.owner_marker(signed.other)]))
            yield Case("random subkey and value", DHTRecord(key_id, subkey, random_bytes(rng), rng.choice([1e10, NAN])))


def test_validators_refuse_every_hostile_record_without_raising(signed: Keys) -> None:
    validator = CompositeValidator(make_validators(signed.founder, [RUN_ID]))
    rng = random.Random(f"{SEED}:dht_record")
    cases = dht_record_cases(rng, validator, signed)
    assert_all_refused("validate", validator.validate, (), cases)


# --- tensor parts, whatever their codec ------------------------------------------------------------------------


def mutate_part_size(
    rng: random.Random, part: runtime_pb2.Tensor, sizes: Sequence[int], min_many_dimensions: int
) -> str:
    """Set `part`'s size to up to 5 dimensions drawn from `sizes` (or any 32-bit one), or by chance to its own behind
    `min_many_dimensions` or more 1s; what was done."""
    size = [rng.choice([*sizes, rng.randrange(2**32)]) for _ in range(rng.randrange(6))]
    how = f"size {size}"
    if rng.random() < 0.3:
        size = [1] * rng.randrange(min_many_dimensions, 200) + list(part.size)
        how = f"{len(size)} dimensions"
    set_field(part, "size", size)
    return how


def randomize_part(rng: random.Random, part: runtime_pb2.Tensor) -> str:
    """Replace `part`'s buffer with random bytes and its size with up to 3 small dimensions; what was done."""
    part.buffer = random_bytes(rng, 2000)
    set_field(part, "size", [rng.randrange(40) for _ in range(rng.randrange(4))])
    return "a random buffer"


def mutate_part_buffer(rng: random.Random, part: runtime_pb2.Tensor, donors: Sequence[bytes]) -> str:
    """`mutate` `part`'s buffer; what was done."""
    how, part.buffer = mutate(rng, part.buffer, donors)
    return how


def mutate_part_dtype(rng: random.Random, part: runtime_pb2.Tensor, dtypes: Sequence[str]) -> str:
    part.dtype = rng.choice(dtypes)
    return f"dtype {part.dtype!r}"


PartChange = tuple[float, Callable[[runtime_pb2.Tensor], str]]
"""A change of a tensor part (it returns what it did), and the roll below which it is the one made."""


def changed_parts(
    rng: random.Random,
    valid: Sequence[runtime_pb2.Tensor],
    changes: Sequence[PartChange],
    within_contract: Callable[[runtime_pb2.Tensor], bool],
) -> Iterator[Case]:
    """Copies of `valid` parts, each changed by the first of `changes` whose bound its roll (in [0, 1)) is below;
    hostile where `within_contract` says the codec must refuse it."""
    while True:
        part = runtime_pb2.Tensor()
        part.CopyFrom(rng.choice(valid))
        roll = rng.random()
        how = next(change for bound, change in changes if roll < bound)(part)
        yield Case(how, part, hostile=not within_contract(part))


# --- 8-bit tensor parts --------------------------------------------------------------------------------------


def int8_within_contract(part: runtime_pb2.Tensor) -> bool:
    """BoundedInt8's contract restated: a float dtype and a 256-entry codebook before exactly one byte per value."""
    buffer = bytes(part.buffer)
    return (
        part.dtype in ("float32", "float16", "bfloat16")
        and len(buffer) == 8 + 4 * 256 + math.prod(part.size)
        and int.from_bytes(buffer[:8], "little", signed=True) == 256
    )


def int8_cases(rng: random.Random) -> Iterator[Case]:
    valid = [
        serialize_torch_tensor(torch.randn(shape), runtime_pb2.UNIFORM_8BIT) for shape in [(64,), (4, 16), (3, 5, 7)]
    ]
    donors = [part.buffer for part in valid]
    dtypes = ["", "int64", "float64", "bool", "complex64", "uint8", "float32 ", "torch.float32", "__class__", "Tensor"]

    def mutate_codebook_size(part: runtime_pb2.Tensor) -> str:
        codebook_size = rng.choice([0, 255, 257, -1, 2**62, -(2**63), rng.randrange(-(2**63), 2**63)])
        part.buffer = codebook_size.to_bytes(8, "little", signed=True) + part.buffer[8:]
        return f"codebook size {codebook_size}"

    changes: list[PartChange] = [
        (0.3, lambda part: mutate_part_buffer(rng, part, donors)),
        (0.55, lambda part: mutate_part_size(rng, part, [0, 1, 2, 64, 2**31, 2**32 - 1], min_many_dimensions=60)),
        (0.7, lambda part: mutate_part_dtype(rng, part, dtypes)),
        (0.85, mutate_codebook_size),
        (1.0, lambda part: randomize_part(rng, part)),
    ]
    return changed_parts(rng, valid, changes, int8_within_contract)


# --- top-k tensor parts --------------------------------------------------------------------------------------


def sparse_within_contract(part: runtime_pb2.Tensor) -> bool:
    """SparseFloat16's contract restated: a float dtype, at most MAX_SPARSE_PART_VALUES places, a SparsePart of
    version 1 whose fp16 values are finite and either fill every place (dense) or sit at increasing places."""
    numel = math.prod(part.size)
    if part.dtype not in ("float32", "float16", "bfloat16") or len(part.size) > 8 or numel > MAX_SPARSE_PART_VALUES:
        return False
    try:
        sparse = proto.SparsePart.FromString(part.buffer)
    except DecodeError:
        return False
    if sparse.version != 1 or len(sparse.values) % 2:
        return False
    values = struct.unpack(f"<{len(sparse.values) // 2}e", sparse.values)
    if not all(math.isfinite(value) for value in values):
        return False
    if sparse.dense:
        return not sparse.index_gaps and len(values) == numel
    gaps = list(sparse.index_gaps)
    return len(gaps) == len(values) and all(gap >= 1 for gap in gaps[1:]) and sum(gaps) < numel if gaps else True


def mutate_sparse_part(rng: random.Random, sparse: proto.SparsePart) -> tuple[str, bytes]:
    """One field of a genuine SparsePart set to what its contract refuses (or, by chance, still allows)."""
    field = rng.choice(["version", "dense", "index_gaps", "values"])
    if field == "version":
        sparse.version = rng.choice([0, 2, 2**32 - 1])
    elif field == "dense":
        sparse.dense = not sparse.dense
    elif field == "index_gaps":
        gaps = list(sparse.index_gaps) or [0]
        gaps[rng.randrange(len(gaps))] = rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)])
        gaps += [rng.randrange(8)] * rng.randrange(3)
        set_field(sparse, "index_gaps", gaps)
    else:
        special = rng.choice([b"\x00\x7c", b"\x00\xfc", b"\x01\x7e", b"\x00"])  # inf, -inf, a NaN, half a value
        at = 2 * rng.randrange(len(sparse.values) // 2 + 1)
        sparse.values = sparse.values[:at] + special + sparse.values[at + len(special) :]
    return f"SparsePart.{field}", sparse.SerializeToString()


def sparse_cases(rng: random.Random) -> Iterator[Case]:
    valid = []
    for shape, density in [((64,), 0.1), ((4, 16), 0.05), ((3, 5, 7), 1.0), ((300,), 0.02)]:
        tensor = torch.randn(shape) * (torch.rand(shape) < density)
        valid.append(serialize_torch_tensor(tensor.half().float(), SPARSE_WIRE_TYPE))
    donors = [part.buffer for part in valid]
    dtypes = ["", "int64", "float64", "bool", "uint8", "float32 ", "torch.float32"]

    def mutate_sparse_buffer(part: runtime_pb2.Tensor) -> str:
        how, part.buffer = mutate_sparse_part(rng, proto.SparsePart.FromString(part.buffer))
        return how

    changes: list[PartChange] = [
        (0.35, lambda part: mutate_part_buffer(rng, part, donors)),
        (0.55, lambda part: mutate_part_size(rng, part, [0, 1, 7, 64, 2**20, 2**32 - 1], min_many_dimensions=9)),
        (0.65, lambda part: mutate_part_dtype(rng, part, dtypes)),
        (0.9, mutate_sparse_buffer),
        (1.0, lambda part: randomize_part(rng, part)),
    ]
    return changed_parts(rng, valid, changes, sparse_within_contract)


@pytest.mark.parametrize(
    ("codec", "cases", "seed"),
    [(BoundedInt8, int8_cases, "int8"), (SparseFloat16, sparse_cases, "topk")],
    ids=["int8", "topk"],
)
def test_a_tensor_codec_refuses_every_hostile_part(
    codec: type[BoundedInt8 | SparseFloat16], cases: Callable[[random.Random], Iterator[Case]], seed: str
) -> None:
    name = f"{codec.__name__}.extract"
    assert_all_refused(
        name, lambda part: codec().extract(part) is not None, (ValueError,), cases(random.Random(f"{SEED}:{seed}"))
    )


# --- downloaded states ---------------------------------------------------------------------------------------

TEMPLATE = StateTemplate(
    (
        TensorSpec((3, 4), torch.float32),
        TensorSpec((), torch.float32, non_negative=True),
        TensorSpec((5,), torch.float16, non_negative=True),
        TensorSpec((2, 2), torch.int64, non_negative=True),
    ),
    epoch_ceiling=1_000_000,
    epoch_floor=5,
)
EPOCH_ATTACKS: list[Any] = [-1, -(2**63), 1_000_001, 2**62, 2**64, 10**100, 4, 0, 3.0, NAN, INF, True, "7", None, [7]]
SHAPE_ATTACKS = [(1,), (4, 3), (3, 4, 1), (12,), (), (0,), (3, 0), (1, 1, 1, 1, 1, 1, 1, 1)]
DTYPE_ATTACKS = [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.bool, torch.complex64, torch.uint8]


def honest_state(rng: random.Random) -> tuple[dict[str, Any], list[Any]]:
    tensors = [torch.randn(3, 4), torch.tensor(rng.uniform(0, 9)), torch.rand(5).half(), torch.randint(0, 9, (2, 2))]
    return {"epoch": rng.randrange(5, 1_000_001), "other": "fields ignored"}, tensors


def poison(rng: random.Random, tensors: list[Any]) -> str:
    """One attack on the tensor list, in place; its description."""
    index = rng.randrange(len(tensors))
    spec = TEMPLATE.tensors[index] if index < len(TEMPLATE.tensors) else None
    tensor = tensors[index]
    intact = (
        isinstance(tensor, torch.Tensor)
        and spec is not None
        and (tuple(tensor.shape), tensor.dtype) == (spec.shape, spec.dtype)
    )
    roll = rng.random()
    if roll < 0.3 and intact and tensor.is_floating_point():
        value = rng.choice(NON_FINITE)
        tensor.view(-1)[rng.randrange(tensor.numel())] = value
        return f"tensor {index} holds {value}"
    if roll < 0.45 and intact and spec is not None and spec.non_negative:
        value = rng.choice([-1, -7, -1e-3] if tensor.is_floating_point() else [-1, -(2**40)])
        tensor.view(-1)[rng.randrange(tensor.numel())] = value
        return f"tensor {index} holds {value}"
    if roll < 0.65 and spec is not None:
        shape = rng.choice([shape for shape in SHAPE_ATTACKS if shape != spec.shape])
        tensors[index] = torch.zeros(shape, dtype=spec.dtype)
        return f"tensor {index} of shape {shape}"
    if roll < 0.8 and intact and spec is not None:
        dtype = rng.choice([dtype for dtype in DTYPE_ATTACKS if dtype != spec.dtype])
        tensors[index] = tensor.to(dtype)
        return f"tensor {index} of dtype {dtype}"
    if roll < 0.9 and isinstance(tensor, torch.Tensor):
        tensors[index] = rng.choice(["a string", None, 1.0, [1.0], torch.zeros(spec.shape if spec else ()).numpy()])
        return f"tensor {index} is a {type(tensors[index]).__name__}"
    if rng.random() < 0.5:
        del tensors[index]
        return f"tensor {index} missing"
    tensors.insert(index, torch.zeros(3, 4))
    return f"an extra tensor at {index}"


def state_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        metadata, tensors = honest_state(rng)
        labels = []
        if rng.random() < 0.3:
            metadata = rng.choice([{"epoch": rng.choice(EPOCH_ATTACKS)}, [], "epoch", None, b"", {}, 7])
            labels.append(f"metadata {str(metadata)[:40]}")
        if not labels or rng.random() < 0.3:
            for _ in range(rng.randrange(1, 3)):
                labels.append(poison(rng, tensors))
                if len(tensors) != len(TEMPLATE.tensors):
                    break  # a second attack could put the count right again
        yield Case(", ".join(labels), (metadata, tensors))


def test_check_state_refuses_every_hostile_state() -> None:
    rng = random.Random(f"{SEED}:state")
    assert check_state(*honest_state(rng), TEMPLATE) >= 5
    assert_all_refused(
        "check_state",
        lambda pair: check_state(*pair, TEMPLATE) is not None,
        (UnacceptableStateError,),
        state_cases(rng),
    )


# --- state digests -------------------------------------------------------------------------------------------

DIGEST_EPOCH = 1_234
DIGEST_SEEDS = (0, 1, 7, 2**63, 2**64 - 1)
"""The joiners' seeds: an honest answer to one is a replay for the others."""
DIGEST_REFUSALS = (DecodeError, RuntimeWarning, MalformedDigestError)
"""hivemind's stub refuses what does not parse; read_digest the rest (_ask_digest drops the answer either way)."""


def digest_state() -> list[torch.Tensor]:
    """A downloaded state: tensors of 12, 1, 5, 4 and 40 values; float, half and integer; of scale 1 and 1,000."""
    generator = torch.Generator().manual_seed(SEED)
    return [
        torch.randn(3, 4, generator=generator),
        torch.tensor(2.5),
        torch.rand(5, generator=generator).half(),
        torch.randint(0, 9, (2, 2), generator=generator),
        1e3 * torch.randn(40, generator=generator),
    ]


DIGEST_SIZES = [tensor.numel() for tensor in digest_state()]
JOINER_SKETCHES = [sketch_state(digest_state(), seed) for seed in DIGEST_SEEDS]


def relative_difference(a: float, b: float, scale: float) -> float:
    difference = abs(a - b)
    return difference / scale if scale else (0.0 if difference == 0 else INF)


def sketch_distance(part: proto.TensorSketch, mine: TensorSketch) -> float:
    """The largest difference between `part`'s numbers and `mine`'s, each relative to its scale: the larger norm;
    the sum's bound sqrt(n) × norm; a sample's magnitude, floored at the RMS."""
    norm = max(part.norm, mine.norm)
    rms = norm / math.sqrt(mine.num_values)
    pairs = [
        (part.norm, mine.norm, norm),
        (part.sum, mine.total, norm * math.sqrt(mine.num_values)),
        *((a, b, max(abs(a), abs(b), rms)) for a, b in zip(part.samples, mine.samples, strict=True)),
    ]
    return max(relative_difference(*pair) for pair in pairs)


class DigestVerdict(enum.Enum):
    """What an answer is to a joiner, by read_digest's and _corroborate's contracts."""

    REFUSED = "refused"  # malformed, not served or at another epoch: it does not count
    AGREES = "agrees"  # it corroborates the joiner's state
    DISAGREES = "disagrees"  # it counts against it


def digest_verdict(data: bytes, mine: Sketch) -> DigestVerdict | None:
    """The contracts restated for an answer to a joiner whose sketch is `mine`. REFUSED: unparsable, not served
    (whatever else it sets), over max_digest_bytes, not one sketch per tensor with min(16, size) samples, a number not
    finite, a negative norm, or another epoch. Else AGREES when every number is within half SKETCH_RELATIVE_TOLERANCE
    of `mine`'s, DISAGREES beyond twice it, and None in between: too close to the tolerance to call."""
    try:
        digest = proto.StateDigest.FromString(data)
    except (DecodeError, RuntimeWarning):
        return DigestVerdict.REFUSED
    parts = list(digest.tensors)
    well_formed = (
        digest.served
        and digest.ByteSize() <= max_digest_bytes(len(DIGEST_SIZES))
        and len(parts) == len(DIGEST_SIZES)
        and all(
            len(part.samples) == min(SKETCH_SAMPLES, size)
            and all(math.isfinite(number) for number in [part.sum, part.norm, *part.samples])
            and part.norm >= 0
            for part, size in zip(parts, DIGEST_SIZES, strict=False)
        )
    )
    if not well_formed or digest.epoch != DIGEST_EPOCH:
        return DigestVerdict.REFUSED
    distance = max(map(sketch_distance, parts, mine))
    if distance <= SKETCH_RELATIVE_TOLERANCE / 2:
        return DigestVerdict.AGREES
    return DigestVerdict.DISAGREES if distance >= 2 * SKETCH_RELATIVE_TOLERANCE else None


def rounded_elsewhere(rng: random.Random, digest: proto.StateDigest) -> None:
    """Another machine's last bits: every number of `digest` moved by at most 1e-5 of itself."""
    for part in digest.tensors:
        part.sum *= 1 + rng.uniform(-1e-5, 1e-5)
        part.norm *= 1 + rng.uniform(-1e-5, 1e-5)
        part.samples[:] = [value * (1 + rng.uniform(-1e-5, 1e-5)) for value in part.samples]


def change_sketch_count(rng: random.Random, digest: proto.StateDigest) -> str:
    how = rng.choice(["one fewer", "an empty one more", "a copy more", "hundreds more"])
    if how == "one fewer" and digest.tensors:
        del digest.tensors[rng.randrange(len(digest.tensors))]
    elif how == "an empty one more" or not digest.tensors:
        digest.tensors.add()
    else:
        copies = 1 if how == "a copy more" else rng.randrange(100, 400)
        digest.tensors.extend([rng.choice(digest.tensors)] * copies)
    return f"{how} tensor sketches"


def change_sample_count(rng: random.Random, part: proto.TensorSketch) -> str:
    how = rng.choice(["one fewer", "one more", "hundreds more", "none"])
    if how == "one fewer" and part.samples:
        del part.samples[-1]
    elif how in ("one more", "hundreds more"):
        part.samples.extend([rng.gauss(0, 1)] * (1 if how == "one more" else rng.randrange(100, 2000)))
    else:
        del part.samples[:]
    return f"{how} samples"


def change_number(rng: random.Random, part: proto.TensorSketch) -> str:
    name, value = rng.choice(["sum", "norm", "sample"]), rng.choice([hostile_float(rng), 1e300, -1e300])
    if name == "sample" and part.samples:
        part.samples[rng.randrange(len(part.samples))] = value
    else:
        setattr(part, "norm" if name == "norm" else "sum", value)
    return f"{name} {value}"


def scale_sketch(rng: random.Random, part: proto.TensorSketch) -> str:
    factor = rng.choice([0.0, -1.0, 0.5, 0.99, 1.01, 2.0, 1e6])
    part.sum, part.norm = part.sum * factor, abs(part.norm * factor)
    part.samples[:] = [value * factor for value in part.samples]
    return f"scaled by {factor}"


def attack_digest(rng: random.Random, digest: proto.StateDigest) -> str:
    """One attack on an answer, through the protobuf API; its description."""
    roll = rng.random()
    if roll < 0.1:
        digest.served = False
        return "served=false with every other field set"
    if roll < 0.25:
        digest.epoch = rng.choice([0, 1, DIGEST_EPOCH - 1, DIGEST_EPOCH + 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
        return f"epoch {digest.epoch}"
    if roll < 0.4 or not digest.tensors:
        return change_sketch_count(rng, digest)
    if roll < 0.9:
        index = rng.randrange(len(digest.tensors))
        change = change_sample_count if roll < 0.55 else change_number if roll < 0.75 else scale_sketch
        return f"tensor {index}: {change(rng, digest.tensors[index])}"
    other = rng.randrange(len(DIGEST_SEEDS))
    digest.ClearField("tensors")
    digest.tensors.extend(to_digest(DIGEST_EPOCH, JOINER_SKETCHES[other]).tensors)
    return f"the answer to seed {DIGEST_SEEDS[other]}"


@dataclass(frozen=True, slots=True)
class Answer:
    """One donor's answer to a joiner, and what it is by the contracts (digest_verdict)."""

    label: str
    seed_index: int
    data: bytes
    verdict: DigestVerdict


def digest_answers(rng: random.Random) -> Iterator[Answer]:
    honest = [to_digest(DIGEST_EPOCH, sketch) for sketch in JOINER_SKETCHES]
    donors = [digest.SerializeToString() for digest in honest]
    while True:
        seed_index = rng.randrange(len(DIGEST_SEEDS))
        digest = proto.StateDigest()
        digest.CopyFrom(honest[seed_index])
        if rng.random() < 0.5:
            rounded_elsewhere(rng, digest)
        roll = rng.random()
        if roll < 0.2:
            label, data = "an honest answer", digest.SerializeToString()
        elif roll < 0.25:  # an unknown field, as a later version may send: ignored
            label, data = "an honest answer with an unknown field", digest.SerializeToString() + b"\x78\x2a"
        elif roll < 0.6:
            label = ", ".join(attack_digest(rng, digest) for _ in range(rng.randrange(1, 3)))
            data = digest.SerializeToString()
        elif roll < 0.9:
            label, data = mutate(rng, digest.SerializeToString(), donors)
        else:
            label, data = "random bytes", random_bytes(rng, 256)
        verdict = digest_verdict(data, JOINER_SKETCHES[seed_index])
        if verdict is not None:
            yield Answer(f"{label} (seed {DIGEST_SEEDS[seed_index]})", seed_index, data, verdict)


def corroborates(answer: Answer) -> bool:
    """Whether `answer`, parsed as hivemind's stub does and read as _ask_digest does, corroborates the joiner's
    state (_corroborate: at its epoch, then judge)."""
    read = read_digest(proto.StateDigest.FromString(answer.data), DIGEST_SIZES)
    if read is None or read[0] != DIGEST_EPOCH:
        return False
    return judge(JOINER_SKETCHES[answer.seed_index], [read[1]]).verdict is Corroboration.CORROBORATED


def test_state_digests_that_are_malformed_or_disagree_never_corroborate() -> None:
    """read_digest's contract, then _corroborate's: an answer counts only when it parses, is served, is within
    max_digest_bytes and holds one sketch per tensor with min(16, size) samples, every number finite and the norm
    non-negative (else MalformedDigestError); it corroborates only at the state's epoch and within
    SKETCH_RELATIVE_TOLERANCE of the state's own sketch. Honest answers whose last bits differ corroborate."""
    answers = digest_answers(random.Random(f"{SEED}:digest"))
    cases = (Case(answer.label, answer, hostile=answer.verdict is not DigestVerdict.AGREES) for answer in answers)
    assert_all_refused("read_digest", corroborates, DIGEST_REFUSALS, cases, min_benign_accepted=1_000)


def judge_answers(case: tuple[int, list[Answer]]) -> bool:
    """judge's verdict on the joiner's state from `answers` read as _ask_digest and _corroborate read them: an answer
    refused is one donor fewer, one at another epoch does not count."""
    seed_index, answers = case
    sketches = []
    for answer in answers:
        try:
            read = read_digest(proto.StateDigest.FromString(answer.data), DIGEST_SIZES)
        except DIGEST_REFUSALS:
            continue
        if read is not None and read[0] == DIGEST_EPOCH:
            sketches.append(read[1])
    return judge(JOINER_SKETCHES[seed_index], sketches).verdict is Corroboration.CORROBORATED


def majority_cases(rng: random.Random) -> Iterator[Case]:
    pool: dict[int, list[Answer]] = {}
    for _, answer in zip(range(2_000), digest_answers(rng), strict=False):
        pool.setdefault(answer.seed_index, []).append(answer)
    while True:
        seed_index = rng.randrange(len(DIGEST_SEEDS))
        answers = rng.choices(pool[seed_index], k=rng.randrange(1, 5))
        agreeing = sum(answer.verdict is DigestVerdict.AGREES for answer in answers)
        disagreeing = sum(answer.verdict is DigestVerdict.DISAGREES for answer in answers)
        corroborated = agreeing + disagreeing > 0 and 1 + agreeing > disagreeing
        label = f"{agreeing} agreeing and {disagreeing} disagreeing of " + "; ".join(a.label[:60] for a in answers)
        yield Case(label, (seed_index, answers), hostile=not corroborated)


def test_hostile_digests_never_make_a_majority() -> None:
    """judge's contract: a downloaded state is corroborated only when answers at its epoch exist and a strict
    majority of the sketches, its own included, agree with it. Refused answers and answers at another epoch count
    for nothing; disagreeing ones count against it; honest majorities still corroborate."""
    assert_all_refused(
        "judge", judge_answers, (), majority_cases(random.Random(f"{SEED}:digest_majority")), min_benign_accepted=1_000
    )


# --- probe answers -------------------------------------------------------------------------------------------

SENT_BYTES = 8 * 1024 * 1024


def upload_within_contract(measured_bytes: int, duration_s: float) -> bool:
    """A plausible answer: some bytes timed over a finite positive time, at a physical rate (bytes capped at sent)."""
    measured = min(measured_bytes, SENT_BYTES)
    finite = math.isfinite(duration_s) and duration_s > 0
    return finite and measured > 0 and measured * 8 / duration_s / 1e6 <= MAX_PLAUSIBLE_MBPS


def upload_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        roll = rng.random()
        if roll < 0.85:
            measured = rng.choice([0, 1, SENT_BYTES, SENT_BYTES + 1, 2**64 - 1, rng.randrange(2**64)])
            duration = rng.choice([hostile_float(rng), rng.uniform(0, 1e-3), 0.0, rng.uniform(0, 10)])
            result = proto.UploadResult(measured_bytes=measured, duration_s=duration, received_bytes=measured)
            yield Case(f"{measured} bytes in {duration} s", result, not upload_within_contract(measured, duration))
        else:
            try:
                result = proto.UploadResult.FromString(random_bytes(rng, 64))
            except DecodeError:
                continue  # hivemind's stub refuses what does not parse before crowdtrain sees it
            contract = upload_within_contract(result.measured_bytes, result.duration_s)
            yield Case(f"random bytes: {result.measured_bytes} bytes in {result.duration_s} s", result, not contract)


def read_upload(result: proto.UploadResult) -> bool:
    sample = upload_sample(result, SENT_BYTES)
    return sample.mbps is not None or sample.measured_bytes > SENT_BYTES


def test_upload_answers_with_unphysical_figures_give_no_measurement() -> None:
    assert upload_sample(proto.UploadResult(measured_bytes=10**6, duration_s=0.1), SENT_BYTES).mbps == 80.0
    assert_all_refused("upload_sample", read_upload, (), upload_cases(random.Random(f"{SEED}:upload")))


def refusal_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        wait_s = hostile_float(rng) if rng.random() < 0.9 else struct.unpack("<d", rng.randbytes(8))[0]
        refusal = proto.ProbeRefusal(reason=random_bytes(rng, 32).hex(), retry_after_s=wait_s)
        yield Case(f"retry after {wait_s} s", refusal, hostile=not (math.isfinite(wait_s) and wait_s > 0))


def test_refusals_with_unusable_waits_are_not_retried() -> None:
    assert retry_after_s(proto.ProbeRefusal(retry_after_s=2.5)) == 2.5
    assert_all_refused(
        "retry_after_s",
        lambda refusal: retry_after_s(refusal) != 0.0,
        (),
        refusal_cases(random.Random(f"{SEED}:refusal")),
    )


VERDICT_NUMBERS = list(proto.DialAttempt.Verdict.values())
ASKED = ["/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/udp/5/quic", "/ip6/::1/tcp/7"]


def dial_back_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        attempts = [
            proto.DialAttempt(
                multiaddr=address, verdict=rng.choice(VERDICT_NUMBERS), detail=random_bytes(rng, 16).hex()
            )
            for address in ASKED[: rng.randrange(len(ASKED) + 1)]
        ]
        result = proto.DialBackResult(attempts=attempts, observed_ip="1.2.3.4")
        roll = rng.random()
        if roll < 0.4:
            extra = rng.randrange(len(ASKED) - len(result.attempts) + 1, 100)
            result.attempts.extend(proto.DialAttempt(multiaddr="/ip4/6.6.6.6/tcp/1") for _ in range(extra))
            yield Case(f"{extra} attempts beyond the addresses asked", result)
        elif roll < 0.8 or not result.attempts:
            result.attempts.add(verdict=rng.choice([7, 99, -1, 2**31 - 1, -(2**31)]))
            yield Case(f"an attempt with verdict {result.attempts[-1].verdict}", result)
        else:
            how, data = mutate(rng, result.SerializeToString(), [result.SerializeToString()])
            try:
                mutated = proto.DialBackResult.FromString(data)
            except DecodeError:
                continue
            within = len(mutated.attempts) <= len(ASKED) and all(a.verdict in VERDICT_NUMBERS for a in mutated.attempts)
            yield Case(how, mutated, hostile=not within)


def test_dial_back_answers_with_unknown_verdicts_or_extra_attempts_are_refused() -> None:
    assert (
        dial_back_verdicts("peer", proto.DialBackResult(attempts=[proto.DialAttempt()]), ASKED)[0].verdict == "dialed"
    )
    assert_all_refused(
        "dial_back_verdicts",
        lambda result: dial_back_verdicts("peer", result, ASKED) is not None,
        (ValueError,),
        dial_back_cases(random.Random(f"{SEED}:dial_back")),
    )


# --- expert requests -----------------------------------------------------------------------------------------

EXPERT_SAMPLE = (8, 16)
"""A small run's [sequence_length, hidden_size]: what make_backend declares after the batch dimension."""
EXPERT_SCHEMA = BatchTensorDescriptor.from_tensor(torch.empty(1, *EXPERT_SAMPLE))
REQUEST_SHAPES = {
    "forward": RequestShape((EXPERT_SCHEMA,), MAX_BATCH_SEQUENCES),
    "backward": RequestShape((EXPERT_SCHEMA, EXPERT_SCHEMA), MAX_BATCH_SEQUENCES),  # inputs, output gradients
}
NUM_SAMPLE_BYTES = math.prod(EXPERT_SAMPLE) * 4


def request_within_contract(tensors: Sequence[runtime_pb2.Tensor], shape: RequestShape) -> bool:
    """check_tensors' contract restated: one tensor per schema, each uncompressed float32 of shape [batch, 8, 16]
    with 1 to max_batch_size sequences, the same batch for all, exactly the bytes of its shape, every value finite."""
    if len(tensors) != len(shape.schemas) or len({tuple(tensor.size[:1]) for tensor in tensors}) > 1:
        return False
    for tensor in tensors:
        if tensor.compression != runtime_pb2.CompressionType.NONE or tensor.dtype != "float32":
            return False
        if len(tensor.size) != 3 or tuple(tensor.size[1:]) != EXPERT_SAMPLE:
            return False
        if not 1 <= tensor.size[0] <= shape.max_batch_size or len(tensor.buffer) != tensor.size[0] * NUM_SAMPLE_BYTES:
            return False
    return all(numpy.isfinite(numpy.frombuffer(tensor.buffer, dtype="<f4")).all() for tensor in tensors)


@functools.cache
def serialized_batches() -> dict[int, list[runtime_pb2.Tensor]]:
    """Four tensors per batch size as hivemind's client serializes them (two requiring grad), made once."""
    generator = torch.Generator().manual_seed(SEED)
    return {
        batch: [
            serialize_torch_tensor(
                torch.randn(batch, *EXPERT_SAMPLE, generator=generator).requires_grad_(copy % 2 == 1)
            )
            for copy in range(4)
        ]
        for batch in range(1, MAX_BATCH_SEQUENCES + 1)
    }


def honest_request(rng: random.Random, shape: RequestShape) -> tuple[int, list[runtime_pb2.Tensor]]:
    """What hivemind's client sends: a batch of 1 to max_batch_size sequences (mostly a few); a copy, to attack."""
    batch = rng.choice([rng.randint(1, 4), rng.randint(1, shape.max_batch_size)])
    tensors = [runtime_pb2.Tensor() for _ in shape.schemas]
    for tensor in tensors:
        tensor.CopyFrom(rng.choice(serialized_batches()[batch]))
    return batch, tensors


def change_tensor_count(rng: random.Random, tensors: list[runtime_pb2.Tensor]) -> str:
    how = rng.choice(["one fewer", "one more", "dozens more", "none"])
    if how == "one fewer" and tensors:
        del tensors[rng.randrange(len(tensors))]
    elif how in ("one more", "dozens more") and tensors:
        tensors.extend([tensors[0]] * (1 if how == "one more" else rng.randrange(10, 60)))
    else:
        tensors.clear()
    return f"{how} tensors"


def change_shape(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    size = rng.choice([
        [batch], [batch, 8], [batch, 8, 16, 1], [batch, 16, 8], [batch, 128], [8, 16], [1, batch, 8, 16],
        [0, 8, 16], [MAX_BATCH_SEQUENCES + 1, 8, 16], [2**31, 8, 16], [2**32 - 1, 8, 16],
        [rng.randrange(2**32) for _ in range(rng.randrange(6))],
    ])  # fmt: skip
    set_field(tensor, "size", size)
    if rng.random() < 0.3 and math.prod(size) <= 2**16:  # the buffer agrees with the lie
        tensor.buffer = bytes(4 * math.prod(size))
        return f"of shape {size}, with as many bytes"
    return f"declares shape {size}"


def change_dtype(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    dtype = rng.choice([torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool])
    if rng.random() < 0.5:
        tensor.CopyFrom(serialize_torch_tensor(torch.randn(batch, *EXPERT_SAMPLE).to(dtype)))
        return f"of dtype {dtype}"
    tensor.dtype = rng.choice([str(dtype).replace("torch.", ""), "", "torch.float32", "Float32", "float32\x00"])
    return f"labelled {tensor.dtype!r}"


def change_compression(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    tensor.compression = rng.choice([*range(1, 6), 99, 2**31 - 1])
    return f"compressed as {tensor.compression}"


def change_value(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    value = struct.pack("<f", rng.choice(NON_FINITE)) if rng.random() < 0.8 else rng.randbytes(4)
    at = 4 * rng.randrange(len(tensor.buffer) // 4 or 1)
    tensor.buffer = tensor.buffer[:at] + value + tensor.buffer[at + 4 :]
    return f"holds {struct.unpack('<f', value)[0]} at byte {at}"


def change_buffer(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    how, cut = rng.choice(["cut", "padded", "replaced"]), rng.randrange(1, len(tensor.buffer) + 2)
    if how == "cut":
        tensor.buffer = tensor.buffer[:-cut]
    else:
        tensor.buffer = (tensor.buffer if how == "padded" else b"") + random_bytes(rng, 4 * cut)
    return f"has its buffer {how}"


def change_batch(rng: random.Random, tensor: runtime_pb2.Tensor, batch: int) -> str:
    tensor.CopyFrom(serialize_torch_tensor(torch.randn(rng.randint(1, MAX_BATCH_SEQUENCES), *EXPERT_SAMPLE)))
    return f"of batch {tensor.size[0]}"


TENSOR_ATTACKS = [change_shape, change_dtype, change_compression, change_value, change_value, change_buffer]


def attack_request(rng: random.Random, tensors: list[runtime_pb2.Tensor], batch: int) -> str:
    """One attack on a request of `batch` sequences, in place; its description."""
    if rng.random() < 0.12 or not tensors:
        return change_tensor_count(rng, tensors)
    index = rng.randrange(len(tensors))
    attack = rng.choice([*TENSOR_ATTACKS, change_batch] if len(tensors) > 1 else TENSOR_ATTACKS)
    return f"tensor {index} {attack(rng, tensors[index], batch)}"


def parse_request(data: bytes) -> runtime_pb2.ExpertRequest | None:
    try:
        return runtime_pb2.ExpertRequest.FromString(data)
    except (DecodeError, RuntimeWarning):
        return None


def request_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        call = rng.choice(list(REQUEST_SHAPES))
        shape = REQUEST_SHAPES[call]
        batch, tensors = honest_request(rng, shape)
        roll, label = rng.random(), "an honest request"
        if 0.2 <= roll < 0.3:
            tensors[0].requires_grad, tensors[0].chunks = rng.random() < 0.5, rng.randrange(-(2**31), 2**31)
            label = "an honest request, its ignored fields set"
        elif 0.3 <= roll < 0.8:
            label = ", ".join(attack_request(rng, tensors, batch) for _ in range(rng.randrange(1, 3)))
        data = runtime_pb2.ExpertRequest(uid="ffn.0.0", tensors=tensors).SerializeToString()
        if roll >= 0.95:
            label, data = "random bytes", random_bytes(rng)
        elif roll >= 0.8:
            label, data = mutate(rng, data, [data])
        request = parse_request(data)
        yield Case(
            f"{call}: {label}", (call, data), hostile=not request or not request_within_contract(request.tensors, shape)
        )


def take_request(case: tuple[str, bytes]) -> bool:
    call, data = case
    return check_tensors(runtime_pb2.ExpertRequest.FromString(data).tensors, REQUEST_SHAPES[call]) is not None


def test_expert_requests_off_the_schema_are_refused() -> None:
    """check_tensors' contract (moe/requests.py): a forward or backward request runs only with one tensor per schema,
    each uncompressed float32 [batch, 8, 16], 1 to MAX_BATCH_SEQUENCES sequences shared by all, its buffer exactly
    its shape's bytes, every value finite; else RefusedRequestError (or hivemind's DecodeError before it, for bytes
    that don't parse). Honest requests, whatever their ignored fields, run."""
    cases = request_cases(random.Random(f"{SEED}:expert_request"))
    assert_all_refused(
        "check_tensors",
        take_request,
        (RefusedRequestError, DecodeError, RuntimeWarning),
        cases,
        min_benign_accepted=1_000,
    )


def stream_within_contract(frames: Sequence[Sequence[runtime_pb2.Tensor]], shape: RequestShape) -> bool:
    """StreamedRequest's contract restated: at most max_frames frames; its first part names a dtype and each part
    that names one starts a tensor, whose header it is; the tensors so joined within check_tensors' contract."""
    parts = [part for frame in frames for part in frame]
    if len(frames) > shape.max_frames or (parts and not parts[0].dtype):
        return False
    headers: list[runtime_pb2.Tensor] = []
    buffers: list[list[bytes]] = []
    for part in parts:
        if part.dtype:
            headers.append(part)
            buffers.append([])
        buffers[-1].append(part.buffer)
    tensors = [runtime_pb2.Tensor() for _ in headers]
    for tensor, header, buffer in zip(tensors, headers, buffers, strict=True):
        tensor.CopyFrom(header)
        tensor.buffer = b"".join(buffer)
    return request_within_contract(tensors, shape)


def attack_stream(rng: random.Random, parts: list[runtime_pb2.Tensor]) -> str:
    """One attack on a stream's parts, in place; its description."""
    how = rng.choice(["headless", "a second header", "a lying later header", "dropped", "twice", "swapped", "padded"])
    headers = [index for index, part in enumerate(parts) if part.dtype]
    later = [index for index, part in enumerate(parts) if not part.dtype]
    candidates = headers if how == "headless" else later if "header" in how else []
    index = rng.choice(candidates or range(len(parts)))
    part = runtime_pb2.Tensor()
    part.CopyFrom(parts[index])
    if how == "headless":  # its buffer joins the tensor before, if any
        part = runtime_pb2.Tensor(buffer=part.buffer)
    elif how == "a second header" and not part.dtype:
        part.dtype, part.size[:] = "float32", [1, *EXPERT_SAMPLE]
    elif how == "a lying later header" and not part.dtype:  # the tensor's header is its first part's: ignored
        part.size[:], part.compression = [2**32 - 1], runtime_pb2.CompressionType.FLOAT16
    elif how == "dropped":
        del parts[index]
        return f"part {index} dropped"
    elif how == "twice":
        parts.insert(index, part)
        return f"part {index} twice"
    elif how == "swapped":
        other = rng.randrange(len(parts))
        parts[index], parts[other] = parts[other], parts[index]
        return f"parts {index} and {other} swapped"
    else:
        how = "padded"
        part.buffer += random_bytes(rng, 64) + b"\x00"
    parts[index] = part
    return f"part {index} {how}"


def stream_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        call = rng.choice(list(REQUEST_SHAPES))
        shape = REQUEST_SHAPES[call]
        batch, tensors = honest_request(rng, shape)
        labels = [attack_request(rng, tensors, batch)] if rng.random() < 0.4 else []
        chunk_bytes = rng.choice([1024, 8192, 2**16, STREAM_CHUNK_BYTES])
        parts = [part for tensor in tensors for part in split_for_streaming(tensor, chunk_bytes)]
        if parts and rng.random() < 0.4:
            labels.append(attack_stream(rng, parts))
        ends = sorted({0, len(parts), *(rng.randrange(len(parts) + 1) for _ in range(len(parts) // 2))})
        frames = [parts[start:end] for start, end in itertools.pairwise(ends)]  # 1 to a few parts each
        if rng.random() < 0.15:
            num_empty = rng.randrange(1, 2 * shape.max_frames)
            for _ in range(num_empty):
                frames.insert(rng.randrange(len(frames) + 1), [])
            labels.append(f"{num_empty} empty frames")
        label = f"{call} in {len(frames)} frames, chunks of {chunk_bytes} bytes: {', '.join(labels) or 'honest'}"
        yield Case(label, (call, frames), hostile=not stream_within_contract(frames, shape))


def take_stream(case: tuple[str, list[list[runtime_pb2.Tensor]]]) -> bool:
    call, frames = case
    streamed = StreamedRequest(REQUEST_SHAPES[call])
    for frame in frames:
        streamed.add(frame)
    return streamed.tensors() is not None


def test_expert_streams_off_the_schema_or_over_their_bounds_are_refused() -> None:
    """StreamedRequest's contract (moe/requests.py): a streamed request runs only within max_frames frames, its first
    part naming a dtype, and its parts joined (each part naming a dtype starts a tensor) within check_tensors'
    contract; else RefusedRequestError, as soon as a frame is over a bound or at the end. Honest streams, whatever
    their chunking within the frames, run."""
    assert_all_refused(
        "StreamedRequest",
        take_stream,
        (RefusedRequestError,),
        stream_cases(random.Random(f"{SEED}:stream")),
        min_benign_accepted=1_000,
    )


# --- SkipPipe declarations and rosters -----------------------------------------------------------------------

NUM_STAGES = 4
MAX_DECLARED_MICROBATCHES = 4096
"""node_info's bound on a member's memory_microbatches."""


def synthetic_peer_id(index: int) -> str:
    """A 46-character string shaped like a base58 peer ID (roster members are checked by shape, not by key)."""
    return f"QmRosterMember{index:032d}"


def member_within_contract(member: proto.SkipPipeMember, num_stages: int) -> bool:
    """node_info's contract restated: a peer ID of 40 to 60 characters, a stage of the run, 1 to 4096 microbatches,
    seconds per microbatch above 0 and at most MAX_SECONDS_PER_MICROBATCH, seconds per hop 0..MAX_SECONDS_PER_HOP
    (unset: 0)."""
    compute, hop = member.seconds_per_microbatch, member.seconds_per_hop
    return (
        40 <= len(member.peer_id) <= 60
        and member.stage < num_stages
        and 1 <= member.memory_microbatches <= MAX_DECLARED_MICROBATCHES
        and 0 < compute <= MAX_SECONDS_PER_MICROBATCH
        and math.isfinite(hop)
        and 0 <= hop <= MAX_SECONDS_PER_HOP
    )


def parsed(message_type: type[Any], data: bytes) -> Any:
    """`data` as a `message_type`, or None where protobuf refuses it."""
    try:
        return message_type.FromString(data)
    except (DecodeError, RuntimeWarning):
        return None


def declaration_within_contract(subkey: bytes, value: bytes, owners: dict[bytes, str], num_stages: int | None) -> bool:
    """check_stage_declaration's contract restated (`num_stages` None), or with it parse_declaration's: at most
    MAX_STAGE_DECLARATION_BYTES, a SkipPipeMember naming its signer (`owners`: marker → peer ID) on a stage below
    MAX_SKIPPIPE_STAGES; and a valid node of a run of `num_stages` (member_within_contract)."""
    member = parsed(proto.SkipPipeMember, value) if len(value) <= MAX_STAGE_DECLARATION_BYTES else None
    if member is None or owners.get(subkey) != member.peer_id or member.stage >= MAX_SKIPPIPE_STAGES:
        return False
    return num_stages is None or member_within_contract(member, num_stages)


def hostile_compute(rng: random.Random) -> float:
    return rng.choice([0.0, -0.0, 5e-324, 1e308, rng.uniform(1e-9, 1e3)]) if rng.random() < 0.3 else hostile_float(rng)


MEMBER_ATTACKS: list[tuple[str, Callable[[random.Random], Any]]] = [
    ("peer_id", lambda rng: rng.choice(["", "x" * 39, "x" * 61, "Qm" + "x" * rng.randrange(100, 3000), "é" * 45])),
    ("stage", lambda rng: rng.choice([NUM_STAGES, MAX_SKIPPIPE_STAGES, 2**32 - 1, rng.randrange(2**32)])),
    ("seconds_per_microbatch", hostile_compute),
    (
        "memory_microbatches",
        lambda rng: rng.choice([0, MAX_DECLARED_MICROBATCHES + 1, 2**32 - 1, rng.randrange(2**32)]),
    ),
    ("seconds_per_hop", hostile_float),
    ("seconds_per_hop", lambda rng: MAX_SECONDS_PER_HOP * rng.choice([1.0, 1.0000001, rng.uniform(1, 1e9)])),
]


def attack_member(rng: random.Random, member: proto.SkipPipeMember) -> str:
    path, make = rng.choice(MEMBER_ATTACKS)
    value = make(rng)
    set_path(member, path, value)
    return f"{path}={str(value)[:40]!r}"


def unknown_field(num_bytes: int) -> bytes:
    """An unknown length-delimited field 15 of `num_bytes` bytes: parsers skip it, size caps count it."""
    header = bytes([15 << 3 | 2])
    length = bytearray()
    size = num_bytes
    while True:
        length.append(size & 0x7F | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            return header + bytes(length) + b"u" * num_bytes


def valid_members(rng: random.Random, peer_ids: Sequence[str]) -> list[proto.SkipPipeMember]:
    return [
        member_proto(
            NodeInfo(
                peer_id=peer_id,
                stage=rng.randrange(NUM_STAGES),
                seconds_per_microbatch=rng.uniform(1e-3, 5.0),
                memory_microbatches=rng.randint(1, 16),
                seconds_per_hop=rng.choice([0.0, rng.uniform(1e-3, 2.0)]),
            )
        )
        for peer_id in peer_ids
    ]


@dataclass(frozen=True, slots=True)
class Signers:
    """The owner markers records are signed under, and the peer ID each derives."""

    owner: bytes
    peer_id: str
    other: bytes
    peer_ids: dict[bytes, str]
    garbage: tuple[bytes, ...] = (
        b"",
        b"garbage",
        b"[owner:]",
        b"[owner:ssh-rsa AAAA]",
        b"[owner:" + b"A" * 3000 + b"]",
    )


@pytest.fixture(scope="module")
def signers(signed: Keys) -> Signers:
    owner, other = records.owner_marker(signed.founder), records.owner_marker(signed.other)
    peer_ids = {marker: records.peer_id_of_owner(marker).to_base58() for marker in (owner, other)}
    return Signers(owner=owner, peer_id=peer_ids[owner], other=other, peer_ids=peer_ids)


def declaration_cases(rng: random.Random, signers: Signers, num_stages: int | None) -> Iterator[Case]:
    valid = valid_members(rng, [signers.peer_id] * 6)
    for member in valid[::2]:
        member.serving = True
    donors = [member.SerializeToString() for member in valid]
    while True:
        member = proto.SkipPipeMember()
        member.CopyFrom(rng.choice(valid))
        subkey, roll = signers.owner, rng.random()
        if roll < 0.45:
            label = ", ".join(attack_member(rng, member) for _ in range(rng.randrange(1, 3)))
            data = member.SerializeToString()
        elif roll < 0.8:
            label, data = mutate(rng, member.SerializeToString(), donors)
        elif roll < 0.88:
            padding = rng.choice([1, rng.randrange(MAX_STAGE_DECLARATION_BYTES), rng.randrange(256, 100_000)])
            label, data = f"padded by {padding} unknown bytes", member.SerializeToString() + unknown_field(padding)
        elif roll < 0.95:
            label, data = "random bytes", random_bytes(rng)
        else:
            subkey = rng.choice([signers.other, *signers.garbage, random_bytes(rng, 64)])
            label, data = f"under subkey {subkey[:40]!r}", member.SerializeToString()
        hostile = not declaration_within_contract(subkey, data, signers.peer_ids, num_stages)
        yield Case(label, (subkey, data), hostile=hostile)


def test_check_stage_declaration_refuses_every_hostile_record(signers: Signers) -> None:
    """check_stage_declaration's contract (dht/records.py): a declaration is at most MAX_STAGE_DECLARATION_BYTES, a
    SkipPipeMember whose peer ID is its signer's, on a stage below MAX_SKIPPIPE_STAGES; else RecordError."""
    assert_all_refused(
        "check_stage_declaration",
        lambda pair: records.check_stage_declaration(*pair) is not None,
        (records.RecordError,),
        declaration_cases(random.Random(f"{SEED}:check_stage_declaration"), signers, None),
        min_benign_accepted=1_000,
    )


def take_declaration(pair: tuple[bytes, bytes]) -> bool:
    node = parse_declaration(*pair, NUM_STAGES)
    member = proto.SkipPipeMember.FromString(pair[1])
    expected = (member.peer_id, member.stage, member.seconds_per_microbatch, member.memory_microbatches)
    if (node.peer_id, node.stage, node.seconds_per_microbatch, node.memory_microbatches) != expected:
        raise AssertionError(f"accepted as {node}, not as declared")
    return True


def test_parse_declaration_refuses_every_hostile_declaration(signers: Signers) -> None:
    """parse_declaration's contract (modes/skippipe/roster/membership.py): check_stage_declaration's, then a node of
    the run (member_within_contract); else RecordError. An accepted one is the node it declares."""
    assert_all_refused(
        "parse_declaration",
        take_declaration,
        (records.RecordError,),
        declaration_cases(random.Random(f"{SEED}:parse_declaration"), signers, NUM_STAGES),
        min_benign_accepted=1_000,
    )


def roster_within_contract(subkey: bytes, value: bytes, owners: dict[bytes, str], num_stages: int | None) -> bool:
    """check_roster's contract restated (`num_stages` None: an owner marker's, at most MAX_ROSTER_BYTES, a
    SkipPipeRoster), or with it parse_roster's: 1 to HISTORY memberships in rising iterations, each of at most
    MAX_MEMBERS distinct members, each a valid node of a run of `num_stages`."""
    roster = parsed(proto.SkipPipeRoster, value) if subkey in owners and len(value) <= MAX_ROSTER_BYTES else None
    if roster is None or num_stages is None:
        return roster is not None
    history = list(roster.history)
    return (
        1 <= len(history) <= HISTORY
        and all(older.from_iteration < newer.from_iteration for older, newer in itertools.pairwise(history))
        and all(
            len(entry.members) <= MAX_MEMBERS
            and len({member.peer_id for member in entry.members}) == len(entry.members)
            and all(member_within_contract(member, num_stages) for member in entry.members)
            for entry in history
        )
    )


@functools.cache
def crowd() -> list[proto.SkipPipeMember]:
    """Valid members no roster of the cases lists otherwise, made once: to crowd a membership or fill new ones."""
    return valid_members(random.Random(f"{SEED}:crowd"), [synthetic_peer_id(1000 + i) for i in range(400)])


def attack_roster(rng: random.Random, roster: proto.SkipPipeRoster) -> str:
    """One attack on a roster's memberships, in place; its description."""
    history = roster.history
    how = rng.choice(["member", "member", "iteration", "count", "crowd", "twice"])
    entry = rng.choice(history) if history else None
    if how == "member" and entry is not None and entry.members:
        return f"a member's {attack_member(rng, rng.choice(entry.members))}"
    if how == "iteration" and entry is not None:
        entry.from_iteration = rng.choice([0, 1, 2**64 - 1, history[0].from_iteration, rng.randrange(2**64)])
        return f"a membership from iteration {entry.from_iteration}"
    if how == "crowd" and entry is not None:
        extra = rng.choice([MAX_MEMBERS + 1 - len(entry.members), rng.randrange(1, 400)])
        entry.members.extend(crowd()[:extra])
        return f"{extra} more members"
    if how == "twice" and entry is not None and entry.members:
        twin = proto.SkipPipeMember()
        twin.CopyFrom(rng.choice(entry.members))
        twin.stage = rng.randrange(NUM_STAGES)
        entry.members.append(twin)
        return "a member listed twice"
    count = rng.choice([0, HISTORY + 1, rng.randrange(HISTORY + 1, 40)])
    del history[count:]
    while len(history) < count:
        history.add(from_iteration=(history[-1].from_iteration + 1) % 2**64 if history else 0).members.extend(
            crowd()[: rng.randint(1, 3)]
        )
    return f"{count} memberships"


def roster_cases(rng: random.Random, signers: Signers, num_stages: int | None) -> Iterator[Case]:
    valid = []
    for _ in range(8):
        members = [synthetic_peer_id(i) for i in range(rng.randrange(2, 12))] + [signers.peer_id]
        history: list[PipelineMembers] = []
        start = rng.randrange(10**6)
        for number in range(rng.randint(1, HISTORY)):
            nodes = [node_info(member, NUM_STAGES) for member in valid_members(rng, rng.sample(members, 3))]
            history.append(PipelineMembers(start + 2 * number, tuple(sorted(nodes, key=lambda node: node.peer_id))))
        valid.append(encode_roster(history))
    while True:
        data, subkey, roll = rng.choice(valid), signers.owner, rng.random()
        if roll < 0.45:
            roster = proto.SkipPipeRoster.FromString(data)
            label = ", ".join(attack_roster(rng, roster) for _ in range(rng.randrange(1, 3)))
            data = roster.SerializeToString()
        elif roll < 0.8:
            label, data = mutate(rng, data, valid)
        elif roll < 0.86:
            padding = rng.choice(
                [rng.randrange(MAX_ROSTER_BYTES - len(data)), rng.randrange(MAX_ROSTER_BYTES, 200_000)]
            )
            label, data = f"padded by {padding} unknown bytes", data + unknown_field(padding)
        elif roll < 0.95:
            label, data = "random bytes", random_bytes(rng, 2048)
        else:
            subkey = rng.choice([*signers.garbage, random_bytes(rng, 64)])
            label = f"under subkey {subkey[:40]!r}"
        yield Case(
            label, (subkey, data), hostile=not roster_within_contract(subkey, data, signers.peer_ids, num_stages)
        )


def test_check_roster_refuses_every_hostile_record(signers: Signers) -> None:
    """check_roster's contract (dht/records.py): a roster is signed under an owner marker, at most
    MAX_ROSTER_BYTES, a SkipPipeRoster; else RecordError."""
    assert_all_refused(
        "check_roster",
        lambda pair: records.check_roster(*pair) is not None,
        (records.RecordError,),
        roster_cases(random.Random(f"{SEED}:check_roster"), signers, None),
        min_benign_accepted=1_000,
    )


def take_roster(pair: tuple[bytes, bytes]) -> bool:
    history = parse_roster(*pair, NUM_STAGES)
    roster = proto.SkipPipeRoster.FromString(pair[1])
    expected = [(entry.from_iteration, sorted(member.peer_id for member in entry.members)) for entry in roster.history]
    if [(entry.from_iteration, [node.peer_id for node in entry.members]) for entry in history] != expected:
        raise AssertionError("accepted as other memberships than the roster's")
    return True


def test_parse_roster_refuses_every_hostile_roster(signers: Signers) -> None:
    """parse_roster's contract (modes/skippipe/roster/membership.py): check_roster's, then 1 to HISTORY memberships
    in rising iterations, each of at most MAX_MEMBERS distinct valid nodes; else RecordError. An accepted roster
    holds the memberships it lists, their members in peer-ID order."""
    assert_all_refused(
        "parse_roster",
        take_roster,
        (records.RecordError,),
        roster_cases(random.Random(f"{SEED}:parse_roster"), signers, NUM_STAGES),
        min_benign_accepted=1_000,
    )


# --- SkipPipe hops: who may call, what a done message may say, what a stream may carry ------------------------

HOP_SOURCES = (synthetic_peer_id(0), synthetic_peer_id(1))
HOP_CALLERS = IterationCallers.of(7, HOP_SOURCES, 8, "float16")
PEER_ATTACKS = ["", synthetic_peer_id(2), synthetic_peer_id(0)[:-1], synthetic_peer_id(0) + "x", "x" * 10_000]


def hop_served_by_contract(callers: IterationCallers | None, peer: str, header: proto.StageHop) -> bool:
    """hop_refusal's contract restated: no hop asks for stage 0; with callers, only from a source of the iteration,
    for a microbatch 0..M-1."""
    if header.stage == 0:
        return False
    return callers is None or (peer in callers.sources and header.microbatch < callers.num_microbatches)


def hop_header_cases(rng: random.Random) -> Iterator[Case]:
    valid = proto.StageHop(iteration=7, microbatch=3, stage=2, shape=[2, 16, 8], dtype="float16")
    while True:
        header, peer, callers = proto.StageHop(), rng.choice(HOP_SOURCES), HOP_CALLERS
        header.CopyFrom(valid)
        roll, label = rng.random(), "an honest header"
        if roll < 0.2:
            header.stage, header.microbatch = rng.randrange(1, 2**32), rng.randrange(HOP_CALLERS.num_microbatches)
            header.iteration, label = rng.randrange(2**64), "another iteration, stage and microbatch"
        elif roll < 0.45:
            field_name, value = rng.choice([("stage", 0), ("microbatch", rng.choice([8, 9, 2**32 - 1]))])
            setattr(header, field_name, value)
            label = f"{field_name}={value}"
        elif roll < 0.75:
            how, data = mutate(rng, valid.SerializeToString(), [valid.SerializeToString()])
            mutated = parsed(proto.StageHop, data)
            if mutated is None:
                continue
            header, label = mutated, how
        elif roll < 0.95:
            peer = rng.choice([*PEER_ATTACKS, random_bytes(rng, 60).decode("latin-1")])
            label = f"from peer {peer[:20]!r}"
        if rng.random() < 0.1:
            callers, label = None, f"{label}, in a tool's service"
        yield Case(label, (callers, peer, header), hostile=not hop_served_by_contract(callers, peer, header))


def test_hop_refusal_serves_only_the_iteration_sources_hops() -> None:
    """hop_refusal's contract (modes/skippipe/hops/hop_callers.py): a hop asks for a stage 1..S-1, and, in an
    iteration, comes from one of its sources for one of its microbatches; else a sentence why not."""
    assert_all_refused(
        "hop_refusal",
        lambda case: hop_refusal(*case) is None,
        (),
        hop_header_cases(random.Random(f"{SEED}:hop")),
        min_benign_accepted=1_000,
    )


def done_cases(rng: random.Random) -> Iterator[Case]:
    valid = proto.StageHop(iteration=7, stage=1, loss=3.25, microbatches=8)
    while True:
        request, roll = proto.StageHop(), rng.random()
        request.CopyFrom(valid)
        if roll < 0.6:
            request.loss = rng.choice([
                hostile_float(rng), rng.uniform(0, 20), 0.0, -0.0, MAX_DONE_LOSS, math.nextafter(MAX_DONE_LOSS, INF),
                5e-324, MAX_DONE_LOSS * rng.uniform(1, 1e300),
            ])  # fmt: skip
            if rng.random() < 0.5:
                request.microbatches = rng.choice([0, 1, 8, 9, 2**32 - 1, rng.randrange(2**32)])
            label = f"loss {request.loss!r} over {request.microbatches} microbatches"
        elif roll < 0.95:
            label, data = mutate(rng, valid.SerializeToString(), [valid.SerializeToString()])
            mutated = parsed(proto.StageHop, data)
            if mutated is None:
                continue
            request = mutated
        else:
            request.microbatches, label = 0, "no microbatches"
        loss, count = request.loss, request.microbatches
        within = math.isfinite(loss) and 0 <= loss <= MAX_DONE_LOSS and 0 < count <= HOP_CALLERS.num_microbatches
        yield Case(label, request, hostile=not within)


def take_done(request: proto.StageHop) -> bool:
    kept = done_loss(request, HOP_CALLERS.num_microbatches)
    if kept is not None and kept != (request.loss, request.microbatches):
        raise AssertionError(f"kept {kept}, not what the message said")
    return kept is not None


def test_done_loss_keeps_only_a_loss_an_honest_source_can_report() -> None:
    """done_loss's contract (modes/skippipe/hops/hop_callers.py): a done message's loss is kept only where it is
    finite, 0..MAX_DONE_LOSS, over 1..M microbatches, and then as it was sent; else None."""
    assert_all_refused("done_loss", take_done, (), done_cases(random.Random(f"{SEED}:done")), min_benign_accepted=1_000)


class HopStreamRefusal(Exception):
    """What a reader's `refused` callback makes of a refusal (the stage service's and the callers' do likewise)."""


HOP_LIMITS = HopLimits(max_batch=4, max_sequence=16, hidden_size=8)
HOP_STAGE = 2
GRADIENT_VALUES = 300
"""A stage's gradient in the test (in int8: one partial block)."""


def flat_gradient(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape check of a gradient or state answer (stage_calls): one vector of GRADIENT_VALUES."""
    if list(shape) != [GRADIENT_VALUES]:
        raise HopRefusedError(f"a gradient of shape {list(shape)[:4]}, not [{GRADIENT_VALUES}]")
    return (GRADIENT_VALUES,)


@dataclass(frozen=True, slots=True)
class HopReader:
    """One way a node reads a hop stream (receive_frames' arguments)."""

    name: str
    check_shape: Callable[[Sequence[int]], tuple[int, ...]]
    expected_stage: int | None
    to_end: bool
    dtypes: tuple[str, ...]


HOP_READERS = (
    HopReader("a forward", HOP_LIMITS.check_shape, HOP_STAGE, True, ("float16",)),
    HopReader("a tool's backward", HOP_LIMITS.check_shape, HOP_STAGE, True, tuple(WIRE_DTYPES)),
    HopReader("a gradient answer", flat_gradient, None, False, GRADIENT_DTYPES),
)
NON_FINITE_WIRE = {
    "float32": [struct.pack("<f", value) for value in NON_FINITE],
    "float16": [b"\x00\x7c", b"\x00\xfc", b"\x01\x7e"],
    "bfloat16": [b"\x80\x7f", b"\x80\xff", b"\xc0\x7f"],
}


def int8_values(payload: bytes, numel: int, block: int) -> numpy.ndarray | None:
    """decode_int8_blocks' contract restated: float32 scales (finite, >= 0), then int8s within ±127; None else."""
    blocks = -(-numel // block)
    if len(payload) != numel + 4 * blocks:
        return None
    scales = numpy.frombuffer(payload, "<f4", count=blocks)
    values = numpy.frombuffer(payload, numpy.int8, offset=4 * blocks)
    if not numpy.isfinite(scales).all() or (scales < 0).any() or (values == -128).any():
        return None
    padded = numpy.zeros(blocks * block, numpy.float32)
    padded[:numel] = values
    with numpy.errstate(over="ignore"):
        return (padded.reshape(blocks, block) * scales[:, None]).reshape(-1)[:numel]


def wire_array(payload: bytes, numel: int, dtype: str) -> numpy.ndarray | None:
    """The float32 values `payload` carries in wire dtype `dtype`; None where it is not their exact bytes."""
    if dtype == "int8":
        return int8_values(payload, numel, INT8_BLOCK)
    itemsize = 4 if dtype == "float32" else 2
    if len(payload) != numel * itemsize:
        return None
    if dtype == "bfloat16":
        return (numpy.frombuffer(payload, "<u2").astype("<u4") << 16).view("<f4")
    return numpy.frombuffer(payload, "<f4" if dtype == "float32" else "<f2").astype(numpy.float32)


def hop_values_by_contract(frames: Sequence[proto.StageHop], reader: HopReader) -> numpy.ndarray | None:
    """receive_frames' and stream_values' contract restated: a first frame with the expected stage, an allowed
    dtype, no values and a shape within the reader's bounds, then exactly the shape's bytes (a request: to the end
    of the stream; an answer: read up to them), every value finite. The values, or None where it must be refused."""
    if not frames:
        return None
    header, shape = frames[0], list(frames[0].shape)
    if reader.expected_stage is not None and header.stage != reader.expected_stage:
        return None
    if header.dtype not in reader.dtypes or header.payload:
        return None
    if reader.expected_stage is None and shape != [GRADIENT_VALUES]:
        return None
    limits = HOP_LIMITS
    if reader.expected_stage is not None and not (
        len(shape) == 3
        and 1 <= shape[0] <= limits.max_batch
        and 1 <= shape[1] <= limits.max_sequence
        and shape[2] == limits.hidden_size
    ):
        return None
    numel = math.prod(shape)
    size = (
        numel + 4 * -(-numel // INT8_BLOCK)
        if header.dtype == "int8"
        else numel * (4 if header.dtype == "float32" else 2)
    )
    received = b""
    for frame in frames[1:]:
        received += frame.payload
        if len(received) > size:
            return None
        if len(received) == size and not reader.to_end:
            break
    values = wire_array(received, numel, header.dtype) if len(received) == size else None
    return values if values is not None and numpy.isfinite(values).all() else None


@functools.cache
def honest_hops(reader: HopReader) -> list[tuple[bytes, ...]]:
    """Streams as honest nodes send them to `reader`, made once: in each of its dtypes, of several shapes and chunk
    sizes, each frame serialized (a case parses its own copy)."""
    rng, streams = random.Random(f"{SEED}:{reader.name}"), []
    generator = torch.Generator().manual_seed(rng.randrange(2**32))
    for _ in range(48):
        dtype = rng.choice(reader.dtypes)
        if reader.expected_stage is None:
            shape: tuple[int, ...] = (GRADIENT_VALUES,)
        else:
            shape = (rng.randint(1, HOP_LIMITS.max_batch), rng.randint(1, HOP_LIMITS.max_sequence), 8)
        tensor = torch.randn(shape, generator=generator)
        header = proto.StageHop(iteration=7, microbatch=3, stage=HOP_STAGE if reader.expected_stage else 5)
        chunk_bytes = rng.choice([16, 64, 256, CHUNK_BYTES])
        frames = payload_frames(wire_bytes(tensor, dtype), list(tensor.shape), header, dtype, chunk_bytes)
        streams.append(tuple(frame.SerializeToString() for frame in frames))
    return streams


def run_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (it reads from a list): run without an event loop, ~20 times
    faster than run_until_complete over 10,000 cases."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise AssertionError("the coroutine waited for something")


def attack_hop_header(rng: random.Random, header: proto.StageHop) -> str:
    how = rng.choice(["stage", "dtype", "shape", "shape", "payload"])
    if how == "stage":
        header.stage = rng.choice([0, 1, 3, 2**32 - 1])
    elif how == "dtype":
        header.dtype = rng.choice(["", "float64", "int8", "FLOAT16", "float16\x00", "bool", *GRADIENT_DTYPES])
    elif how == "shape":
        header.shape[:] = rng.choice([
            [], [1], [2, 8], [1, 1, 8, 1], [0, 4, 8], [5, 4, 8], [1, 17, 8], [1, 4, 7], [1, 4, 9], [2**32 - 1, 1, 8],
            [GRADIENT_VALUES], [GRADIENT_VALUES + 1], [GRADIENT_VALUES - 1], [1, GRADIENT_VALUES], [2**32 - 1],
            [rng.randrange(2**32) for _ in range(rng.randrange(5))],
        ])  # fmt: skip
    else:
        header.payload = random_bytes(rng, 64) or b"\x00"
    return f"header {how}"


def attack_hop_value(rng: random.Random, frames: list[proto.StageHop], index: int, dtype: str) -> str:
    """A value of frame `index` made non-finite (or, in int8, a byte or the first scale changed), in place."""
    frame = frames[index]
    if dtype == "int8":
        at = rng.randrange(len(frame.payload))
        frame.payload = frame.payload[:at] + rng.choice([b"\x80", rng.randbytes(1)]) + frame.payload[at + 1 :]
        scale = struct.pack("<f", rng.choice([*NON_FINITE, -1.0, 3e38, 0.0]))
        if rng.random() < 0.5 and len(frames[1].payload) >= 4:
            frames[1].payload = scale + frames[1].payload[4:]
        return "int8 bytes changed"
    special = rng.choice(NON_FINITE_WIRE[dtype]) if dtype in NON_FINITE_WIRE else rng.randbytes(2)
    at = len(special) * rng.randrange(max(1, len(frame.payload) // len(special)))
    frame.payload = frame.payload[:at] + special + frame.payload[at + len(special) :]
    return f"a value {special.hex()} at byte {at} of frame {index}"


def attack_hop_frames(rng: random.Random, frames: list[proto.StageHop], dtype: str) -> str:
    """One attack on a stream's frames, in place; its description."""
    how = rng.choice(["header", "header", "value", "value", "drop", "twice", "swap", "empty", "extra", "cut", "bytes"])
    body = [index for index in range(1, len(frames)) if frames[index].payload]
    if how == "header":
        return attack_hop_header(rng, frames[0])
    if how == "value" and body:
        return attack_hop_value(rng, frames, rng.choice(body), dtype)
    if how in ("drop", "twice", "swap") and frames:
        index = rng.randrange(len(frames))
        if how == "drop":
            del frames[index]
        elif how == "twice":
            frames.insert(index, frames[index])
        else:
            other = rng.randrange(len(frames))
            frames[index], frames[other] = frames[other], frames[index]
        return f"frame {index} {how}"
    if how == "empty":
        frames.insert(rng.randint(1, len(frames)), proto.StageHop(stage=rng.randrange(4), dtype="float32"))
        return "an empty frame with header fields"
    if how == "extra":
        frames.append(proto.StageHop(payload=random_bytes(rng, 64) or b"\x00"))
        return "an extra frame"
    if how == "cut" and body:
        index = rng.choice(body)
        frames[index] = proto.StageHop(payload=frames[index].payload[: rng.randrange(len(frames[index].payload))])
        return f"frame {index} cut"
    index = rng.randrange(len(frames)) if frames else 0
    data = frames[index].SerializeToString() if frames else b""
    how, data = mutate(rng, data, [data])
    mutated = parsed(proto.StageHop, data)
    if mutated is not None and frames:
        frames[index] = mutated
    return f"frame {index}: {how}"


def hop_stream_cases(rng: random.Random) -> Iterator[Case]:
    while True:
        reader = rng.choice(HOP_READERS)
        frames = [proto.StageHop.FromString(data) for data in rng.choice(honest_hops(reader))]
        dtype = frames[0].dtype
        labels = [
            attack_hop_frames(rng, frames, dtype) for _ in range(rng.randrange(0, 3) if rng.random() < 0.9 else 0)
        ]
        expected = hop_values_by_contract(frames, reader)
        label = f"{reader.name} in {dtype}: {', '.join(labels) or 'honest'}"
        yield Case(label, (reader, frames, expected), hostile=expected is None)


async def read_hop(reader: HopReader, frames: Sequence[proto.StageHop]) -> torch.Tensor:
    async def stream() -> AsyncIterator[proto.StageHop]:
        for frame in frames:
            yield frame

    header, shape, payload = await receive_frames(
        stream(),
        reader.check_shape,
        HopStreamRefusal,
        reader.expected_stage,
        to_end=reader.to_end,
        dtypes=reader.dtypes,
    )
    return stream_values(header, shape, payload, HopStreamRefusal)


def test_hop_streams_off_their_header_or_bounds_are_refused() -> None:
    """receive_frames' and stream_values' contract (modes/skippipe/hops/hop_wire.py), for a forward or backward
    request and for a gradient's answer: see hop_values_by_contract; else the `refused` callback's error. An
    accepted stream gives its values exactly."""

    def take(case: tuple[HopReader, list[proto.StageHop], numpy.ndarray | None]) -> bool:
        reader, frames, expected = case
        values = run_now(read_hop(reader, frames))
        if expected is not None and not numpy.array_equal(values.numpy().reshape(-1), expected):
            raise AssertionError("accepted other values than the stream's")
        return True

    assert_all_refused(
        "receive_frames",
        take,
        (HopStreamRefusal,),
        hop_stream_cases(random.Random(f"{SEED}:hops")),
        min_benign_accepted=1_000,
    )


# --- SPES: gathered entries and expert answers ----------------------------------------------------------------

SPES_UNITS = 64
SPES_ROUND = 12


@dataclass(frozen=True, slots=True)
class SpesEntry:
    """A member's gathered entry as `spes_gathered` makes it, and what it must read as in its round."""

    round_: int
    value: list[Any]
    claims: MemberClaims


@pytest.fixture(scope="module")
def gathered_entries() -> list[SpesEntry]:
    rng, entries = random.Random(f"{SEED}:spes_entries"), []
    for _ in range(8):
        round_ = rng.choice([SPES_ROUND, SPES_ROUND + 1])
        rate, capacity, dialable = rng.uniform(0.1, 500), rng.choice([None, 0, 5, SPES_UNITS, 100]), rng.random() < 0.7
        value = spes_gathered([round_, rng.randrange(1, 64), rng.randbytes(16)], rate, capacity, dialable)
        entries.append(SpesEntry(round_, value, MemberClaims(rate, counted_capacity(capacity), dialable, True)))
    return entries


def counted_capacity(capacity: int | None) -> int | None:
    """A well-formed capacity as ownership counts it: a cap of 0 to SPES_UNITS, else none."""
    return capacity if capacity is not None and 0 <= capacity <= SPES_UNITS else None


def same_claims(read: MemberClaims, expected: MemberClaims) -> bool:
    """Equal, the rate bit for bit (NaN included) and every field of the same type."""
    return (
        type(read.rate) is float
        and struct.pack(">d", read.rate) == struct.pack(">d", expected.rate)
        and (type(read.capacity), read.capacity) == (type(expected.capacity), expected.capacity)
        and (type(read.dialable), read.dialable) == (type(expected.dialable), expected.dialable)
        and read.well_formed is expected.well_formed
    )


WELL_FORMED_FIELD_VALUES: dict[int, list[Any]] = {
    RATE: [NAN, INF, -INF, -0.0, 0.0, 1e308, 5e-324, -1.5],
    CAPACITY: [-1, 0, 1, SPES_UNITS, SPES_UNITS + 1, 2**63 - 1],
    DIALABLE: [True, False],
}
"""Values of a SPES field that an entry reads as (type and range right, whatever they claim)."""
MALFORMED_FIELD_VALUES: dict[int, list[Any]] = {
    0: [-1, 2**63, 2**64, True, None, [SPES_ROUND], "12", 12.0],  # and its round ± 1, as a float or string
    RATE: [1, "1.5", None, True, numpy.float64(1.5), [1.5], b"1.5"],
    CAPACITY: [-2, 2**63, 2**64, -(2**63), True, False, 5.0, "5", None, numpy.int64(5)],
    DIALABLE: [0, 1, None, "true", b"\x01", [True], numpy.bool_(True)],
}
"""Values of an entry's round or a SPES field that make the entry claim nothing."""


def attack_entry(rng: random.Random, value: list[Any], round_: int, expected: MemberClaims) -> tuple[str, Any, Any]:
    """One attack on a well-formed entry (a list, changed in place or replaced): its description, the entry and
    what it must read as by construction (None: NO_CLAIMS)."""
    how = rng.choice(["good field", "good field", "bad field", "bad field", "length", "container", "diloco"])
    if how == "good field":
        index = rng.choice(list(WELL_FORMED_FIELD_VALUES))
        value[index] = rng.choice(WELL_FORMED_FIELD_VALUES[index])
        field = {RATE: "rate", CAPACITY: "capacity", DIALABLE: "dialable"}[index]
        counted = counted_capacity(value[index]) if index == CAPACITY else value[index]
        return f"item {index} = {value[index]!r}", value, dataclasses.replace(expected, **{field: counted})
    if how == "bad field":
        index = rng.choice(list(MALFORMED_FIELD_VALUES))
        if index == 0 and rng.random() < 0.5:
            value[0] = rng.choice([round_ - 1, round_ + 1, float(round_), str(round_)])
        else:
            value[index] = rng.choice(MALFORMED_FIELD_VALUES[index])
        return f"item {index} = {str(value[index])[:30]}", value, None
    if how == "length":
        count = rng.choice([0, 1, RATE, DIALABLE, DIALABLE + 1, DIALABLE + 2, MAX_GATHERED, MAX_GATHERED + 1, 1000])
        made = (value + [rng.randbytes(4)] * count)[:count]
        return f"{count} items", made, expected if DIALABLE < count <= MAX_GATHERED else None
    if how == "container":
        container = rng.choice([tuple, lambda items: dict(enumerate(items)), str, bytes, lambda items: None])
        try:
            made = container(value)
        except (TypeError, ValueError):
            made = repr(value)
        return f"a {type(made).__name__}", made, expected if isinstance(made, tuple) else None
    value[rng.choice([1, 2])] = rng.choice([None, -1, 2**70, "x" * 1000, [1, 2], NAN])
    return "DiLoCo's items changed", value, expected  # DiLoCo reads them (pseudo_gradients.py, joining.py)


def gathered_cases(rng: random.Random, entries: Sequence[SpesEntry]) -> Iterator[Case]:
    while True:
        entry = rng.choice(entries)
        round_, value, labels = entry.round_, list(entry.value), []
        expected: MemberClaims | None = entry.claims
        roll = rng.random()
        if roll < 0.8:
            for _ in range(rng.randint(1, 3)):
                label, value, expected = attack_entry(rng, value, round_, expected)
                labels.append(label)
                if expected is None or not isinstance(value, list) or len(value) <= DIALABLE:
                    break  # a further attack needs a well-formed list (a good value could mend a bad one)
        elif roll < 0.9:
            round_ += rng.choice([-1, 1, 2**40, -(2**40)])
            labels.append(f"read in round {round_}")
            expected = None
        elif roll < 0.97:
            value = rng.choice([None, 7, "x", b"", [], [None] * 7, [[1] * 3] * 7, {"a": 1}, random_bytes(rng, 64)])
            labels.append(f"{str(value)[:30]}")
            expected = None
        yield Case(", ".join(labels) or "as made", (value, round_, expected), hostile=expected is None)


def take_gathered(case: tuple[Any, int, MemberClaims | None]) -> bool:
    value, round_, expected = case
    claims = read_round({"peer": value}, round_, SPES_UNITS)["peer"]
    if not same_claims(claims, expected or NO_CLAIMS):
        raise AssertionError(f"read as {claims}, not {expected or NO_CLAIMS}")
    return claims.well_formed


def test_gathered_entries_read_as_their_fields_only_when_well_formed_of_the_round(
    gathered_entries: list[SpesEntry],
) -> None:
    """read_member's contract (modes/spes/gathered.py), through read_round: never raises; a list or tuple of more
    than DIALABLE and at most MAX_GATHERED items, of the round (an int), whose rate is a float, capacity an int in
    -1..2**63-1 and dialability a bool reads as those fields (a capacity outside 0..units as none); anything else
    as NO_CLAIMS."""
    for entry in gathered_entries:
        assert read_round({"peer": entry.value}, entry.round_, SPES_UNITS) == {"peer": entry.claims}
    assert_all_refused(
        "read_round",
        take_gathered,
        (),
        gathered_cases(random.Random(f"{SEED}:gathered"), gathered_entries),
        min_benign_accepted=1_000,
    )


EXPERT_VALUES = 600
"""An expert of the test: three blocks of a change, the last one partial."""
EXPERT_OWNER = PeerID(b"\x12\x20" + bytes(32))


class ScriptedOwner(ExpertExchange):
    """An exchange whose every owner answers `answer`'s chunks, as read from a stream (no p2p daemon)."""

    def __init__(self) -> None:
        super().__init__(dht=None)  # type: ignore[arg-type]  # never started: it only fetches, from the script
        self.answer: Sequence[proto.SpesExpertChunk] = ()

    def require_p2p(self) -> Any:
        return None

    def get_stub(self, p2p: Any, peer: PeerID, *, namespace: str | None = None) -> Any:  # type: ignore[override]
        async def rpc_spes_expert(request: proto.SpesExpertRequest) -> AsyncIterator[proto.SpesExpertChunk]:
            async def stream() -> AsyncIterator[proto.SpesExpertChunk]:
                for chunk in self.answer:
                    yield chunk

            return stream()

        return types.SimpleNamespace(rpc_spes_expert=rpc_spes_expert)


def expert_by_contract(chunks: Sequence[proto.SpesExpertChunk], held: numpy.ndarray) -> numpy.ndarray | None:
    """The fetcher's contract restated (modes/spes/expert_exchange.py, `_fetch`): a found header of the held
    expert's values with a 16-byte digest; chunks read up to the header's size (a change: int8 blocks of BLOCK
    values; else float32), none empty before it, none over it; the copy (held + the change, or the values) finite
    and of that digest. The copy, or None where it must be refused."""
    header = chunks[0] if chunks else None
    if header is None or not header.found or header.num_values != len(held) or len(header.digest) != DIGEST_BYTES:
        return None
    size = len(held) + 4 * -(-len(held) // BLOCK) if header.change else 4 * len(held)
    received = b""
    for chunk in chunks[1:]:
        if len(received) >= size:
            break
        if not chunk.payload or len(received + chunk.payload) > size:
            return None
        received += chunk.payload
    if len(received) != size:
        return None
    change = int8_values(received, len(held), BLOCK) if header.change else None
    if header.change and change is None:
        return None
    with numpy.errstate(over="ignore", invalid="ignore"):
        values = held + change if change is not None else numpy.frombuffer(received, "<f4")
    if not numpy.isfinite(values).all():
        return None
    digest = hashlib.blake2b(values.astype(numpy.float32).tobytes(), digest_size=DIGEST_BYTES).digest()
    return values if digest == header.digest else None


def expert_answer(values: numpy.ndarray, payload: bytes, change: bool, rng: random.Random) -> list[Any]:
    """An answer as an owner streams it: the header naming `values`' digest, `payload` in chunks, the end marker."""
    digest = hashlib.blake2b(values.astype(numpy.float32).tobytes(), digest_size=DIGEST_BYTES).digest()
    header = proto.SpesExpertChunk(found=True, num_values=EXPERT_VALUES, change=change, digest=digest)
    chunk_bytes = rng.choice([100, 1000, CHUNK_BYTES])
    chunks = [
        proto.SpesExpertChunk(payload=payload[at : at + chunk_bytes]) for at in range(0, len(payload), chunk_bytes)
    ]
    return [header, *chunks, proto.SpesExpertChunk()]


def honest_expert_answer(rng: random.Random, held: torch.Tensor) -> tuple[list[Any], str]:
    """The change from `held` (as an owner answers a fetcher whose copy it knows) or the full values of a copy."""
    target = held + 0.01 * torch.randn(EXPERT_VALUES, generator=torch.Generator().manual_seed(rng.randrange(2**32)))
    if rng.random() < 0.6:
        change, copy = encode_change(held, target)
        return expert_answer(copy.numpy(), change, True, rng), "a change"
    return expert_answer(target.numpy(), target.numpy().astype("<f4").tobytes(), False, rng), "full values"


def attack_expert_header(rng: random.Random, header: proto.SpesExpertChunk) -> str:
    how = rng.choice(["found", "num_values", "digest", "digest", "change"])
    if how == "found":
        header.found, header.not_owner, header.busy = False, rng.random() < 0.5, rng.random() < 0.5
    elif how == "num_values":
        header.num_values = rng.choice([0, EXPERT_VALUES - 1, EXPERT_VALUES + 1, 2**32, 2**64 - 1])
    elif how == "digest":
        at = rng.randrange(DIGEST_BYTES)
        header.digest = rng.choice([b"", header.digest[:15], header.digest + b"\x00", header.digest[:at] + b"?"])
    else:
        header.change = not header.change
    return f"header {how}"


def poisoned_expert_answer(rng: random.Random, held: torch.Tensor) -> tuple[list[Any], str]:
    """An owner's consistent answer: non-finite, or other values, its header naming their digest."""
    if rng.random() < 0.5:
        values = held.numpy() + numpy.float32(rng.uniform(-1, 1))  # another copy: a dishonest owner's to send
        if rng.random() < 0.6:
            values[rng.randrange(EXPERT_VALUES)] = rng.choice(NON_FINITE)
        return expert_answer(values, values.astype("<f4").tobytes(), False, rng), "consistent values"
    change, copy = encode_change(held, held + 0.01)
    blocks = -(-EXPERT_VALUES // BLOCK)
    scales, steps = bytearray(change[: 4 * blocks]), bytearray(change[4 * blocks :])
    if rng.random() < 0.5:
        at = 4 * rng.randrange(blocks)
        scales[at : at + 4] = struct.pack("<f", rng.choice([*NON_FINITE, -1.0, 3e38]))
    else:
        steps[rng.randrange(EXPERT_VALUES)] = rng.choice([0x80, rng.randrange(256)])
    poisoned = bytes(scales + steps)
    decoded = int8_values(poisoned, EXPERT_VALUES, BLOCK)
    with numpy.errstate(over="ignore", invalid="ignore"):
        values = held.numpy() + decoded if decoded is not None else copy.numpy()
    return expert_answer(values, poisoned, True, rng), "a consistent change"


def attack_expert_chunks(rng: random.Random, chunks: list[Any]) -> str:
    how = rng.choice(["header", "header", "drop", "twice", "swap", "empty", "padded", "cut", "bytes"])
    index = rng.randrange(len(chunks))
    if how == "header" or not chunks:
        return attack_expert_header(rng, chunks[0])
    if how == "drop":
        del chunks[index]
    elif how == "twice":
        chunks.insert(index, chunks[index])
    elif how == "swap":
        other = rng.randrange(len(chunks))
        chunks[index], chunks[other] = chunks[other], chunks[index]
    elif how == "empty":
        chunks.insert(rng.randint(1, len(chunks)), proto.SpesExpertChunk(found=True))
    elif how in ("padded", "cut"):
        payload = chunks[index].payload
        payload = (
            payload + random_bytes(rng, 64) + b"\x00" if how == "padded" else payload[: rng.randrange(len(payload) + 1)]
        )
        chunks[index] = proto.SpesExpertChunk(payload=payload)
    else:
        data = chunks[index].SerializeToString()
        how, data = mutate(rng, data, [data])
        chunks[index] = parsed(proto.SpesExpertChunk, data) or chunks[index]
    return f"chunk {index} {how}"


def expert_answer_pool(rng: random.Random, held: torch.Tensor) -> list[tuple[str, list[bytes]]]:
    """Honest and consistently poisoned answers, made once (encoding a change is the costly part), serialized."""
    pool = []
    for number in range(96):
        chunks, label = (poisoned_expert_answer if number % 4 == 0 else honest_expert_answer)(rng, held)
        pool.append((label, [chunk.SerializeToString() for chunk in chunks]))
    return pool


def expert_answer_cases(rng: random.Random, held: torch.Tensor) -> Iterator[Case]:
    pool = expert_answer_pool(rng, held)
    while True:
        label, serialized = rng.choice(pool)
        chunks = [proto.SpesExpertChunk.FromString(data) for data in serialized]
        if rng.random() < 0.75:
            label += ", " + ", ".join(attack_expert_chunks(rng, chunks) for _ in range(rng.randint(1, 2)))
        expected = expert_by_contract(chunks, held.numpy())
        yield Case(label, (chunks, expected), hostile=expected is None)


def test_expert_answers_off_their_header_size_or_digest_are_refused() -> None:
    """A fetcher's contract (modes/spes/expert_exchange.py): an owner's answer is taken only as expert_by_contract
    says (else ExpertFetchError), and then as the copy its digest names, exactly. A dishonest owner's finite copy
    with its own digest is its to send: accepted."""
    owner, held = ScriptedOwner(), torch.randn(EXPERT_VALUES, generator=torch.Generator().manual_seed(SEED))

    def take(case: tuple[list[Any], numpy.ndarray | None]) -> bool:
        owner.answer, expected = case
        copy = run_now(owner._fetch(EXPERT_OWNER, 3, SPES_ROUND, held, deadline=time.monotonic() - 1.0))
        if expected is not None and not numpy.array_equal(copy.numpy(), expected):
            raise AssertionError("took another copy than the answer's")
        return True

    assert_all_refused(
        "ExpertExchange._fetch",
        take,
        (ExpertFetchError,),
        expert_answer_cases(random.Random(f"{SEED}:expert"), held),
        min_benign_accepted=1_000,
    )


# --- what the fuzzer found, kept as plain cases ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("created_at", -1e308),  # the state download's epoch bound overflowed: int(inf)
        ("optimizer.learning_rate", INF),
        ("optimizer.weight_decay", NAN),
        ("averaging.timeout_s", INF),
        ("model.config_json", '{"hidden_size": NaN}'),
        ("model.config_json", '{"a": ' + "[" * 20_000 + "]" * 20_000 + "}"),  # RecursionError from from_bytes
    ],
)
def test_manifest_findings_are_refused(path: str, value: Any) -> None:
    with pytest.raises(FieldError):
        RunManifest.from_bytes(hostile_manifest_body("demo", path, value))


def test_probe_answer_findings_are_refused() -> None:
    assert retry_after_s(proto.ProbeRefusal(retry_after_s=NAN)) == 0.0  # asyncio.sleep(nan) never returned
    with pytest.raises(ValueError, match="unknown verdict"):  # escaped `measure`
        dial_back_verdicts("peer", proto.DialBackResult(attempts=[proto.DialAttempt(verdict=99)]), ASKED)
