"""Join tokens and access tokens: what admits a node to an invite-only run, and the forgeries that must not."""

from __future__ import annotations

import asyncio
import base64
import random
import time
from pathlib import Path

import pytest
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.cli.invite import make_invite, parse_duration
from crowdtrain.dht.admission import (
    MAX_VALIDITY_S,
    TOKEN_PREFIX,
    AccessChecker,
    AdmissionError,
    InviteAuthorizer,
    issue_join_token,
    parse_join_token,
)
from crowdtrain.dht.gate import AdmissionGate, AdmissionRecords
from crowdtrain.dht.records import load_public_key, peer_id_of_public_key
from crowdtrain.errors import BadInputError
from crowdtrain.node.identity import load_or_create_identity
from crowdtrain.node.membership import RUN_KEYS_FILE, pin_founder

FOUNDER = RSAPrivateKey()
RUN_KEY = peer_id_of_public_key(load_public_key(FOUNDER.get_public_key().to_bytes())).to_base58()


def joiner(run_id: str = "demo", founder: RSAPrivateKey = FOUNDER, valid_for_s: float = 3600) -> InviteAuthorizer:
    invite = parse_join_token(issue_join_token(run_id, founder, valid_for_s))
    return InviteAuthorizer.for_joiner(invite, RSAPrivateKey())


def test_a_token_names_its_run_and_run_key_and_admits_its_holder() -> None:
    invite = parse_join_token("  " + issue_join_token("demo", FOUNDER, 3600, "alice") + "\n")
    assert (invite.run_id, invite.run_key, invite.certificate.label) == ("demo", RUN_KEY, "alice")
    founder = InviteAuthorizer.for_founder("demo", FOUNDER, FOUNDER)
    node = InviteAuthorizer.for_joiner(invite, RSAPrivateKey())
    assert founder.is_token_valid(node.access_token()) and node.is_token_valid(founder.access_token())
    assert node.is_token_valid(joiner().access_token())  # two joiners admit each other


@pytest.mark.parametrize(
    "authorizer",
    [
        lambda: joiner(founder=RSAPrivateKey()),  # another key's token for a run of the same name
        lambda: joiner(run_id="other"),  # the run key's token for another of its runs
        lambda: InviteAuthorizer.for_founder("demo", RSAPrivateKey(), RSAPrivateKey()),  # an impostor founder
    ],
)
def test_tokens_of_another_run_or_key_are_refused(authorizer) -> None:  # type: ignore[no-untyped-def]
    assert not joiner().is_token_valid(authorizer().access_token())


def test_a_token_bound_to_one_key_does_not_admit_another() -> None:
    token = joiner().access_token()
    token.public_key = RSAPrivateKey().get_public_key().to_bytes()  # a peer that saw the token reuses it
    assert not joiner().is_token_valid(token)
    token = joiner().access_token()
    token.expiration_time = repr(time.time() + 3000.0)  # extended by hand
    assert not joiner().is_token_valid(token)


def test_an_access_token_never_outlives_its_certificate() -> None:
    node = joiner(valid_for_s=60)
    token = node.access_token()
    assert float(token.expiration_time) <= parse_join_token(issue_join_token("demo", FOUNDER, 60)).expires_at + 1
    checker = AccessChecker("demo", RUN_KEY)
    assert checker.expiry(token) <= time.time() + 60
    with pytest.raises(AdmissionError, match="expired"):
        checker.expiry(token, now=time.time() + 61)


def test_a_certificate_refused_by_a_clock_behind_the_founders_is_admitted_once_the_clock_is_there() -> None:
    """Issue 47, finding 14: a year-long token checked first by a node whose clock is 5 s behind the founder's was
    refused, and the refusal cached for good."""
    node = joiner(valid_for_s=MAX_VALIDITY_S)
    checker = AccessChecker("demo", RUN_KEY)
    with pytest.raises(AdmissionError, match="further away than a join token may last"):
        checker.expiry(node.access_token(), now=time.time() - 5)
    assert checker.expiry(node.access_token()) > time.time()
    forged = joiner(founder=RSAPrivateKey()).access_token()
    for _ in range(2):  # a refusal no clock explains is remembered
        with pytest.raises(AdmissionError):
            checker.expiry(forged)
    assert len([c for c in checker._certificates.values() if c is None]) == 1


def test_an_expired_or_damaged_join_token_is_one_sentence() -> None:
    token = issue_join_token("demo", FOUNDER, 60)
    with pytest.raises(BadInputError, match=r"^The join token is not valid: it expired at .*; ask the founder"):
        parse_join_token(token, now=time.time() + 120)
    with pytest.raises(BadInputError, match="damaged"):
        parse_join_token(token[:-7])
    with pytest.raises(BadInputError, match="starts with"):
        parse_join_token("hello")
    with pytest.raises(BadInputError, match="at most 366 days"):
        issue_join_token("demo", FOUNDER, 400 * 86400)


def test_hostile_access_tokens_are_refused_without_raising() -> None:
    rng = random.Random(7)
    checker = joiner()
    valid = joiner().access_token().SerializeToString()
    for _ in range(10_000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            token = AccessToken.FromString(bytes(data))
        except Exception:
            continue
        assert not checker.is_token_valid(token) or token.SerializeToString() == valid
    garbage = AccessToken(username=base64.b64encode(b"\x00" * 5000).decode(), expiration_time="nan")
    assert not checker.is_token_valid(garbage)


TIMER_SLACK_S = 0.005
"""The gate spaces its fetches by its own clock reading just before each; the test's lookup stamps each a moment
later, and on a loaded machine that moment varies by more than the spacing's rounding: checks allow for it."""


def test_the_gate_admits_peers_whose_published_token_is_valid_for_them() -> None:
    honest, other = joiner(), joiner()
    honest_id = peer_id_of_public_key(load_public_key(honest.local_public_key.to_bytes())).to_base58()
    other_id = peer_id_of_public_key(load_public_key(other.local_public_key.to_bytes())).to_base58()
    records = {
        honest_id: honest.access_token().SerializeToString(),
        "QmClaimsSomeoneElsesToken": other.access_token().SerializeToString(),
        "QmGarbage": b"\xff" * 100,
    }
    lookups: list[float] = []

    async def lookup() -> AdmissionRecords:
        lookups.append(time.monotonic())
        return AdmissionRecords(tokens=records)

    gate = AdmissionGate(AccessChecker("demo", RUN_KEY), lookup, local_peer_id="QmSelf", refetch_interval_s=0.2)

    async def ask() -> list[bool]:
        return [await gate.admits(peer) for peer in (honest_id, "QmClaimsSomeoneElsesToken", other_id, "QmSelf")]

    assert asyncio.run(ask()) == [True, False, False, True]
    # Each refused peer waited for one fresh fetch, and fetches never come closer than the interval.
    assert len(lookups) == 3
    assert all(later - earlier >= 0.2 - TIMER_SLACK_S for earlier, later in zip(lookups, lookups[1:], strict=False))

    async def scan() -> list[bool]:  # a burst of calls from unknown peers shares one fetch
        return await asyncio.gather(*(gate.admits(f"QmScanner{i}") for i in range(5)), gate.admits(honest_id))

    started = len(lookups)
    assert asyncio.run(scan()) == [False] * 5 + [True]
    assert len(lookups) - started == 1
    assert all(later - earlier >= 0.2 - TIMER_SLACK_S for earlier, later in zip(lookups, lookups[1:], strict=False))


def test_invite_needs_a_run_this_node_founded(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path / "identity.key")
    with pytest.raises(BadInputError, match="founded no run"):
        make_invite(tmp_path, tmp_path / "identity.key", "", "7d", "")
    pin_founder(tmp_path / RUN_KEYS_FILE, "joined", "QmSomeoneElse")
    pin_founder(tmp_path / RUN_KEYS_FILE, "mine", identity.peer_id.to_base58())
    token, run_id = make_invite(tmp_path, tmp_path / "identity.key", "", "12h", "bob")
    assert run_id == "mine" and token.startswith(TOKEN_PREFIX)
    assert parse_join_token(token).run_key == identity.peer_id.to_base58()
    with pytest.raises(BadInputError, match="did not found a run named 'joined'"):
        make_invite(tmp_path, tmp_path / "identity.key", "joined", "7d", "")
    with pytest.raises(BadInputError, match="does not exist"):
        make_invite(tmp_path, tmp_path / "missing.key", "", "7d", "")


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("45m", 2700.0), ("12h", 43200.0), ("7d", 604800.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7w", "-1d", "0", "367d", "1e9"])
def test_bad_durations_are_one_sentence(text: str) -> None:
    with pytest.raises(BadInputError, match="--expires"):
        parse_duration(text)


def test_a_certificate_signed_for_other_content_is_refused() -> None:
    invite = parse_join_token(issue_join_token("demo", FOUNDER, 3600))
    tampered = proto.InviteCertificate()
    tampered.CopyFrom(invite.certificate)
    tampered.expires_at += 86_400  # a longer life than the founder signed
    token = InviteAuthorizer.for_joiner(invite, RSAPrivateKey()).access_token()
    token.username = base64.b64encode(tampered.SerializeToString(deterministic=True)).decode()
    assert not joiner().is_token_valid(token)
