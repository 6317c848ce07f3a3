"""Each averaging group member's gathered entry is signed by it, and checked by every member before use."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from lab.diloco import identity_key, loopback_dht

from crowdtrain.averaging.authored import Entry, UnauthoredEntryError, authored_gather, read_entries
from crowdtrain.averaging.partition import PlannedAverager
from crowdtrain.dht.authorship import MAX_PUBLIC_KEY_BYTES, key_peer_id
from tests.harness import shut_down

PREFIX = "crowdtrain-run-a_diloco"
KEYS = [RSAPrivateKey() for _ in range(3)]
PEERS = [PeerID.from_base58(key_peer_id(key)) for key in KEYS]


def hivemind_data(share: Any, mode: Any, gather: Any) -> bytes:
    """What hivemind's `step` gathers from a member that asked it to gather `gather`."""
    return MSGPackSerializer.dumps([share, mode, MSGPackSerializer.dumps(gather)])


def member_data(index: int, gather: Any, *, share: float | None = 0.5, mode: int = 0, prefix: str = PREFIX) -> bytes:
    return hivemind_data(share, mode, authored_gather(MSGPackSerializer, prefix, KEYS[index], share, mode, gather))


def read(gathered: list[bytes]) -> list[Entry]:
    return read_entries(MSGPackSerializer, PREFIX, PEERS[: len(gathered)], gathered)


def test_a_groups_signed_entries_read_as_their_members_sent_them() -> None:
    gathered = [member_data(0, [3, 8, b"digest"]), member_data(1, [3, 8, b"digest"], share=None, mode=1)]
    assert read(gathered) == [
        Entry(share=0.5, mode=0, value=[3, 8, b"digest"]),
        Entry(share=None, mode=1, value=[3, 8, b"digest"]),
    ]


def _rewritten(field: int, value: Any) -> bytes:
    share, mode, user_bytes = MSGPackSerializer.loads(member_data(1, [3, 8, b"digest"]))
    fields = [share, mode, MSGPackSerializer.loads(user_bytes)]
    if field < 2:
        fields[field] = value
    else:
        fields[2] = [MSGPackSerializer.dumps(value), *fields[2][1:]]
    return hivemind_data(*fields)


def _with_author(author: Any) -> bytes:
    share, mode, user_bytes = MSGPackSerializer.loads(member_data(1, [3, 8, b"digest"]))
    return hivemind_data(share, mode, [MSGPackSerializer.loads(user_bytes)[0], *author])


FORGED = {
    "its share raised by the leader": lambda: _rewritten(0, 1.0),
    "its mode set to client": lambda: _rewritten(1, 1),
    "its round rewritten": lambda: _rewritten(2, [4, 8, b"digest"]),
    "its H rewritten": lambda: _rewritten(2, [3, 1, b"digest"]),
    "another member's entry under its name": lambda: member_data(2, [3, 8, b"digest"]),
    "signed for another run": lambda: member_data(1, [3, 8, b"digest"], prefix="crowdtrain-run-b_diloco"),
    "unsigned": lambda: hivemind_data(0.5, 0, [3, 8, b"digest"]),
    "another key's signature": lambda: _with_author([KEYS[1].get_public_key().to_bytes(), KEYS[2].sign(b"x")]),
    "an oversized key": lambda: _with_author([b" " * (MAX_PUBLIC_KEY_BYTES + 1), b"sig"]),
    "a key that is not one": lambda: _with_author([b"ssh-rsa AAAA", b"sig"]),
    "a share that is not a number": lambda: _rewritten(0, "0.5"),
    "its own entry naming no averaging mode": lambda: member_data(1, [3, 8, b"digest"], mode=99),
    "garbage": lambda: b"\xc1\xff",
    "a gathered list of one": lambda: MSGPackSerializer.dumps([0.5]),
}


@pytest.mark.parametrize("what", FORGED)
def test_an_entry_its_member_did_not_sign_as_read_or_malformed_fails_the_whole_group(what: str) -> None:
    with pytest.raises(UnauthoredEntryError, match=PEERS[1].to_base58()[-8:]):
        read([member_data(0, [3, 8, b"digest"]), FORGED[what]()])


def test_an_averager_signs_only_with_the_key_its_peer_id_derives_from() -> None:
    dht = loopback_dht([])
    averagers = []
    try:
        with pytest.raises(ValueError, match="author key"):
            PlannedAverager([torch.zeros(2)], dht=dht, prefix="authored", author=RSAPrivateKey(), start=False)
        averagers.append(
            PlannedAverager([torch.zeros(2)], dht=dht, prefix="authored", author=identity_key(dht), start=True)
        )
    finally:
        shut_down(averagers, [dht])
