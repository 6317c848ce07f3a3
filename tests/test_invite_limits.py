"""A join token's identity limit and the founder's revocations: signed, bounded, and decided alike by every node."""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import random
import time
from pathlib import Path

import hivemind
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.cli.invite import make_invite, revoke_invites
from crowdtrain.dht.admission import (
    AccessChecker,
    AdmissionError,
    InviteAuthorizer,
    _certify,
    issue_join_token,
    parse_join_token,
    verify_certificate,
)
from crowdtrain.dht.gate import AdmissionGate, AdmissionRecords
from crowdtrain.dht.invites import (
    MAX_REVOCATIONS_BYTES,
    MAX_REVOKED_INVITES,
    RevocationError,
    sign_revocations,
    verify_revocations,
)
from crowdtrain.dht.records import load_public_key, peer_id_of_public_key
from crowdtrain.errors import BadInputError
from crowdtrain.node.admission_watch import AdmissionRefused, AdmissionWatch, revocations_path
from crowdtrain.node.identity import load_or_create_identity
from crowdtrain.node.membership import RUN_KEYS_FILE, joined_since, pin_founder

FOUNDER = RSAPrivateKey()
RUN_KEY = peer_id_of_public_key(load_public_key(FOUNDER.get_public_key().to_bytes())).to_base58()
NODE_KEYS = [RSAPrivateKey() for _ in range(5)]
"""RSA keys are slow to make: the simulated identities reuse these."""


def peer_id(authorizer: InviteAuthorizer) -> str:
    return peer_id_of_public_key(load_public_key(authorizer.local_public_key.to_bytes())).to_base58()


def holders(token: str, sinces: list[float], first_key: int = 0) -> list[InviteAuthorizer]:
    """One identity per `since`, all using `token`, with keys from NODE_KEYS[first_key]."""
    invite = parse_join_token(token)
    keys = NODE_KEYS[first_key:]
    return [InviteAuthorizer.for_joiner(invite, key, since) for key, since in zip(keys, sinces, strict=False)]


def records_of(authorizers: list[InviteAuthorizer]) -> dict[str, bytes]:
    return {peer_id(node): node.admission_record().SerializeToString() for node in authorizers}


def gate() -> AdmissionGate:
    async def nothing() -> AdmissionRecords:
        return AdmissionRecords()

    return AdmissionGate(AccessChecker("demo", RUN_KEY), nothing, local_peer_id="QmSelf")


def admitted(node: AdmissionGate) -> set[str]:
    return {peer for peer, until in node._admitted_until.items() if until > time.time()}


def test_a_certificate_carries_its_identity_limit_and_old_ones_have_none() -> None:
    assert parse_join_token(issue_join_token("demo", FOUNDER, 3600, max_identities=3)).certificate.max_identities == 3
    assert parse_join_token(issue_join_token("demo", FOUNDER, 3600)).certificate.max_identities == 1
    unlimited = parse_join_token(issue_join_token("demo", FOUNDER, 3600, max_identities=None)).certificate
    assert not unlimited.HasField("max_identities")  # what tokens made before the limit look like
    for bad in (0, -1, 1025):
        with pytest.raises(BadInputError, match=f"^--max-identities must be between 1 and 1024, not {bad}.$"):
            issue_join_token("demo", FOUNDER, 3600, max_identities=bad)


def test_a_certificate_whose_limit_was_raised_is_refused() -> None:
    invite = parse_join_token(issue_join_token("demo", FOUNDER, 3600, max_identities=1))
    tampered = proto.InviteCertificate()
    tampered.CopyFrom(invite.certificate)
    tampered.max_identities = 1000
    with pytest.raises(AdmissionError, match="founder signature is invalid"):
        verify_certificate(tampered.SerializeToString(deterministic=True), RUN_KEY)
    tampered.ClearField("max_identities")  # dropping the field (any number) breaks it as well
    with pytest.raises(AdmissionError, match="founder signature is invalid"):
        verify_certificate(tampered.SerializeToString(deterministic=True), RUN_KEY)
    token = InviteAuthorizer.for_joiner(invite, NODE_KEYS[0]).access_token()
    token.username = base64.b64encode(tampered.SerializeToString(deterministic=True)).decode()
    assert not InviteAuthorizer.for_founder("demo", FOUNDER, FOUNDER).is_token_valid(token)
    signed_too_high = _certify("demo", FOUNDER, Ed25519PrivateKey.generate(), time.time() + 60, "", 5000)
    with pytest.raises(AdmissionError, match="identity limit"):
        verify_certificate(signed_too_high.SerializeToString(deterministic=True), RUN_KEY)


def test_every_node_admits_the_same_earliest_identities_whatever_order_records_arrive_in() -> None:
    token = issue_join_token("demo", FOUNDER, 3600, max_identities=2)
    nodes = holders(token, [500.0, 100.0, 300.0, 200.0, 200.0])
    records = records_of(nodes)
    # since 100 first; since 200 twice for the second place: the smaller peer ID takes it
    expected = {peer_id(nodes[1]), min(peer_id(nodes[3]), peer_id(nodes[4]))}
    rng = random.Random(3)
    for _ in range(6):
        order = list(records.items())
        rng.shuffle(order)
        split = rng.randrange(len(order) + 1)  # some records in one fetch, the rest in the next
        node = gate()
        node.update(AdmissionRecords(tokens=dict(order[:split])))
        node.update(AdmissionRecords(tokens=dict(order[split:])))
        assert admitted(node) == expected
        assert set(node.refusals) == set(records) - expected
        assert not any(refusal.revoked for refusal in node.refusals.values())
    refusal = node.refusals[peer_id(nodes[0])].reason
    assert refusal.startswith("its join token admits 2 identities and 2 used it first (")


def test_a_claim_not_signed_by_the_invite_key_ranks_last() -> None:
    token = issue_join_token("demo", FOUNDER, 3600, max_identities=1)
    early, late = holders(token, [1000.0, 2000.0])
    backdated = early.admission_record()
    backdated.since = 1.0  # signed for 1000, claims 1
    bare = proto.AdmissionRecord()
    bare.CopyFrom(late.admission_record())
    bare.ClearField("since_signature")  # what a node from before the limit publishes: a bare access token
    node = gate()
    node.update(AdmissionRecords(tokens={peer_id(early): backdated.SerializeToString()}))
    node.update(AdmissionRecords(tokens={peer_id(late): late.admission_record().SerializeToString()}))
    assert admitted(node) == {peer_id(late)}
    ranked_last_both = gate()
    ranked_last_both.update(
        AdmissionRecords(
            tokens={peer_id(early): backdated.SerializeToString(), peer_id(late): bare.SerializeToString()}
        )
    )
    assert admitted(ranked_last_both) == {min(peer_id(early), peer_id(late))}  # both since inf: by peer ID


def test_a_token_without_a_limit_admits_every_identity_and_limits_do_not_mix_across_tokens() -> None:
    unlimited = records_of(holders(issue_join_token("demo", FOUNDER, 3600, max_identities=None), [1.0, 2.0, 3.0]))
    limited = records_of(holders(issue_join_token("demo", FOUNDER, 3600, max_identities=1), [4.0], first_key=3))
    node = gate()
    node.update(AdmissionRecords(tokens={**unlimited, **limited}))
    assert admitted(node) == set(unlimited) | set(limited)


def test_a_refused_identity_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    nodes = holders(issue_join_token("demo", FOUNDER, 3600, label="bob"), [1.0, 2.0])
    records, second = records_of(nodes), peer_id(nodes[1])  # the later user is refused, whatever the peer IDs
    node = gate()
    with caplog.at_level(logging.WARNING, logger="crowdtrain.dht.gate"):
        for _ in range(3):
            node.update(AdmissionRecords(tokens=records))
            node.note_refusal(second, "rpc_download_probe")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"refusing peer {second}: its join token (label 'bob') admits 1 identity")


def revocation_of(*tokens: str, founder: RSAPrivateKey = FOUNDER, run_id: str = "demo") -> bytes:
    revoked = {}
    for token in tokens:
        certificate = parse_join_token(token).certificate
        revoked[certificate.invite_public_key] = certificate.expires_at
    return sign_revocations(run_id, founder, revoked)


def test_a_revoked_token_admits_nobody_at_the_rpcs_nor_at_the_dht() -> None:
    bad, good = issue_join_token("demo", FOUNDER, 3600, label="leaked"), issue_join_token("demo", FOUNDER, 3600)
    bad_nodes, good_nodes = holders(bad, [1.0]), holders(good, [2.0], first_key=1)
    records = {**records_of(bad_nodes), **records_of(good_nodes)}
    node = gate()
    node.update(AdmissionRecords(tokens=records))
    assert admitted(node) == set(records)
    node.update(AdmissionRecords(tokens=records, revocations=[revocation_of(bad)]))
    assert admitted(node) == set(records_of(good_nodes))
    refusal = node.refusals[peer_id(bad_nodes[0])]
    assert refusal.revoked and refusal.reason == "the founder revoked its join token (label 'leaked')"
    node.update(AdmissionRecords(tokens=records))  # a later fetch without the list: still revoked
    assert admitted(node) == set(records_of(good_nodes))
    dht_side = InviteAuthorizer.for_founder("demo", FOUNDER, FOUNDER)  # the DHT's authorizer, told by the watch
    dht_side.checker.revoke(node.checker.revoked)
    assert not dht_side.is_token_valid(bad_nodes[0].access_token())
    assert dht_side.is_token_valid(good_nodes[0].access_token())


def test_forged_oversized_and_foreign_revocation_lists_are_refused() -> None:
    token = issue_join_token("demo", FOUNDER, 3600)
    forged = proto.InviteRevocations.FromString(revocation_of(token, founder=RSAPrivateKey()))
    forged.founder_public_key = FOUNDER.get_public_key().to_bytes()  # claims the run key, signed by another
    cases = {
        "not signed by the run key": revocation_of(token, founder=RSAPrivateKey()),
        "signature is invalid": forged.SerializeToString(),
        "not 'demo'": revocation_of(token, run_id="other"),
        "over 65536": b"\x00" * (MAX_REVOCATIONS_BYTES + 1),
        "not a valid InviteRevocations": b"\xff" * 100,
    }
    node = gate()
    for phrase, data in cases.items():
        with pytest.raises(RevocationError, match=phrase):
            verify_revocations(data, RUN_KEY, "demo")
        node.update(AdmissionRecords(revocations=[data]))
    assert node.checker.revoked == {} and node.newest_revocations is None
    many = {bytes([i % 256, i // 256]) * 16: time.time() + 60 for i in range(MAX_REVOKED_INVITES + 1)}
    with pytest.raises(RevocationError, match="at most 1000"):
        sign_revocations("demo", FOUNDER, many)
    too_many = proto.InviteRevocations.FromString(sign_revocations("demo", FOUNDER, dict(list(many.items())[:1000])))
    too_many.revoked.add(invite_public_key=b"\x01" * 32, expires_at=math.inf)
    with pytest.raises(RevocationError, match="oversized"):
        verify_revocations(too_many.SerializeToString(), RUN_KEY, "demo")


def test_the_founder_revokes_by_label_fingerprint_or_token(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path / "identity.key")
    pin_founder(tmp_path / RUN_KEYS_FILE, "mine", identity.peer_id.to_base58())
    key_path = tmp_path / "identity.key"
    alice, _ = make_invite(tmp_path, key_path, "", "1h", "alice", max_identities=2)
    bob, _ = make_invite(tmp_path, key_path, "", "1h", "bob")
    carol, _ = make_invite(tmp_path, key_path, "", "1h", "carol")
    assert parse_join_token(alice).certificate.max_identities == 2

    def revoked() -> set[bytes]:
        data = revocations_path(tmp_path, "mine").read_bytes()
        return {
            entry.invite_public_key for entry in verify_revocations(data, identity.peer_id.to_base58(), "mine").revoked
        }

    def key(token: str) -> bytes:
        return parse_join_token(token).certificate.invite_public_key

    described, run_id, _ = revoke_invites(tmp_path, key_path, "", "alice")
    assert run_id == "mine" and described == [f"{key(alice).hex()[:16]} (label 'alice')"] and revoked() == {key(alice)}
    revoke_invites(tmp_path, key_path, "", key(bob).hex()[:10])
    revoke_invites(tmp_path, key_path, "", carol)
    assert revoked() == {key(alice), key(bob), key(carol)}  # each revocation adds to the signed list
    for nonsense in ("nobody", "", "abc", "ctjoin1.garbage"):
        with pytest.raises(BadInputError):
            revoke_invites(tmp_path, key_path, "", nonsense)


def test_a_node_keeps_its_rank_across_restarts(tmp_path: Path) -> None:
    invite_key = b"\x07" * 32
    first = joined_since(tmp_path / "joined.json", invite_key)
    assert joined_since(tmp_path / "joined.json", invite_key) == first
    assert joined_since(tmp_path / "joined.json", b"\x08" * 32) >= first


def test_an_admitted_peers_call_never_waits_for_the_recheck_that_revokes_it() -> None:
    token = issue_join_token("demo", FOUNDER, 3600, label="leaked")
    nodes = holders(token, [1.0])
    records = AdmissionRecords(tokens=records_of(nodes))
    revoked = AdmissionRecords(tokens=records.tokens, revocations=[revocation_of(token)])

    async def scenario() -> tuple[bool, bool, bool]:
        answers = [records]
        release = asyncio.Event()

        async def lookup() -> AdmissionRecords:
            if not answers:  # the recheck: the DHT is slow to answer
                await release.wait()
                return revoked
            return answers.pop()

        node = AdmissionGate(AccessChecker("demo", RUN_KEY), lookup, local_peer_id="QmSelf", refresh_s=0.05)
        first = await node.admits(peer_id(nodes[0]))  # not admitted yet: waits for a fetch
        await asyncio.sleep(0.1)  # the records go stale (`refresh_s`)
        during = await asyncio.wait_for(node.admits(peer_id(nodes[0])), 1.0)  # answered while the recheck hangs
        release.set()
        task, _ = node._refresh
        assert task is not None
        await asyncio.wait_for(task, 5.0)
        return first, during, await node.admits(peer_id(nodes[0]))

    assert asyncio.run(scenario()) == (True, True, False)


@pytest.mark.swarm
@pytest.mark.timeout(60)
def test_the_founder_hands_a_revoked_node_the_list_before_refusing_it_and_the_node_stops(tmp_path: Path) -> None:
    """Real DHT nodes, the two admission watches: once the founder's DHT refuses alice, she could read the list
    from nobody, so it is published first; and she stops on the list alone, though no record of hers was read."""
    token = issue_join_token("demo", FOUNDER, 3600, label="alice")
    alice = holders(token, [1.0])[0]
    founder = InviteAuthorizer.for_founder("demo", FOUNDER, RSAPrivateKey())
    (tmp_path / "revocations.bin").write_bytes(revocation_of(token))
    founder_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=founder)
    alice_dht = None
    try:
        alice_dht = hivemind.DHT(
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=founder_dht.get_visible_maddrs(),
            authorizer=alice,
        )
        founder_watch = watch(founder_dht, founder, tmp_path / "revocations.bin")
        founder_watch._check_standing()
        assert founder_watch.revoked_in_dht_process, "the founder's DHT refuses alice from now on"
        assert alice.own_revocation() is None
        with pytest.raises(AdmissionRefused) as refused:
            watch(alice_dht, alice, None)._check_standing()
        assert str(refused.value) == (
            "This node is no longer admitted: the founder revoked its join token (label 'alice'); "
            "ask the founder for a new one."
        )
    finally:
        for dht in (alice_dht, founder_dht):
            if dht is not None:
                dht.shutdown()


def watch(dht: hivemind.DHT, authorizer: InviteAuthorizer, revocations_file: Path | None) -> AdmissionWatch:
    node = AdmissionGate(authorizer.checker, no_lookup, local_peer_id=peer_id(authorizer))
    return AdmissionWatch(dht, authorizer, node, peer_id(authorizer), b"owner", revocations_file, timeout_s=10)


async def no_lookup() -> AdmissionRecords:
    raise AssertionError("the watch hands the gate its records")


def test_the_founder_notices_a_new_revocation_list_at_its_next_beat(tmp_path: Path) -> None:
    founder = InviteAuthorizer.for_founder("demo", FOUNDER, FOUNDER)
    listing = tmp_path / "revocations.bin"
    node = watch(None, founder, listing)  # type: ignore[arg-type]  # no DHT call is made here
    assert not node._own_revocations_changed()  # the first look, no list yet
    listing.write_bytes(b"first")
    assert node._own_revocations_changed() and not node._own_revocations_changed()
    listing.write_bytes(b"second list")
    assert node._own_revocations_changed()
