"""Each member's gathered data signed by the member: a round's leader relays it, and may not rewrite it.

hivemind's matchmaking gathers, from every member of a group, its aggregation share (the plan's, averaging/
partition.py), its averaging mode and what its mode gathers (a DiLoCo round, proposed H and θ₀ digest; SPES's
rate, capacity and dialability; hivemind's epoch), and the group's leader sends them all to all, unsigned.
Every member turns them into the same decisions (who aggregates what, whether the round is applied, who owns an
expert), so a leader that rewrote another member's entry could give itself the whole vector to aggregate, get an
honest member quarantined, or own every expert.

Here each member signs its own entry (its share, its mode and its mode's data, bound to the averager's prefix,
which names the run and the averager, and to its peer ID) with its identity key, and every member checks every
entry before any of it is used (`authored_entries`). A group in which one entry fails is not averaged at all, the
same on every member (all hold the same gathered data): the entry was forged by the leader or sent malformed by
its member, and which is not knowable, so nobody is blamed. That costs the round, which a leader can always cost
by not starting it. A member's older entry replayed by the leader verifies: it carries only that member's own
earlier claims (DiLoCo's round check then refuses one of another round).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.dht.authorship import is_authored_by, key_peer_id, sign

_DOMAIN = b"crowdtrain/gathered/1\n"
_MODES = frozenset(mode.value for mode in AveragingMode)


class UnauthoredEntryError(RuntimeError):
    """A group member's gathered entry is not signed by that member: the group is not averaged."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One member's gathered entry, checked to be its own."""

    share: Any
    """The aggregation share it sent (unchecked beyond its signature: partition.py reads it)."""
    mode: Any
    """Its hivemind AveragingMode value."""
    value: Any
    """What its training mode gathered."""


class AuthoredAverager(DecentralizedAverager):
    """A DecentralizedAverager whose gathered data is signed by `author`, the key its DHT's peer ID derives from.

    Put it last among a subclass's bases, after hivemind's averagers: their `step`s call this one's, which signs
    what they gather. `authored_entries` reads a group's entries in the averager's process."""

    def __init__(self, *args: Any, author: RSAPrivateKey, **kwargs: Any):
        dht = kwargs.get("dht", args[1] if len(args) > 1 else None)
        if dht is not None and key_peer_id(author) != dht.peer_id.to_base58():
            raise ValueError("an averager's author key must be the key its DHT's peer ID derives from")
        self._author = author
        self._gather_lock = threading.Lock()  # one share read for the signature and for hivemind's data
        super().__init__(*args, **kwargs)

    def step(self, **kwargs: Any) -> Any:
        with self._gather_lock:
            gather = kwargs.pop("gather", None)
            share, mode = self.bandwidth, self.mode.value
            signed = authored_gather(self.serializer, self.prefix, self._author, share, mode, gather)
            return super().step(gather=signed, **kwargs)

    def set_bandwidth(self, bandwidth: float | None) -> None:
        """Set what the next round gathers as this member's share, never between its signature and its use."""
        with self._gather_lock:
            self.bandwidth = bandwidth

    def authored_entries(self, group_info: GroupInfo) -> list[Entry]:
        """Every member's entry, in `group_info.peer_ids`' order (`read_entries`); a group's entries are checked
        once, however many of the averager's layers read them."""
        checked: tuple[bytes, list[Entry]] | None = self.__dict__.get("_checked_entries")
        if checked is None or checked[0] != group_info.group_id:
            entries = read_entries(self.serializer, self.prefix, group_info.peer_ids, group_info.gathered)
            checked = self._checked_entries = (group_info.group_id, entries)
        return checked[1]


def authored_gather(serializer: Any, prefix: str, author: RSAPrivateKey, share: Any, mode: int, gather: Any) -> list:
    """What a member gives hivemind to gather for `gather`: [its bytes, public key, signature] over them, its
    `share` and `mode`, bound to the averager's `prefix` and the peer ID of `author`."""
    value = serializer.dumps(gather)
    message = _signed_bytes(prefix, key_peer_id(author), share, mode, value)
    assert message is not None, "a share is a number or None, a mode an int"
    return [value, *sign(author, message)]


def read_entries(serializer: Any, prefix: str, peer_ids: Sequence[Any], gathered: Sequence[bytes]) -> list[Entry]:
    """Every member's entry of a group (hivemind's `GroupInfo.peer_ids` and `.gathered`), in that order;
    UnauthoredEntryError when one is malformed or not signed by the member it is attributed to."""
    return [_entry(serializer, prefix, peer.to_base58(), data) for peer, data in zip(peer_ids, gathered, strict=True)]


def _entry(serializer: Any, prefix: str, peer_id: str, data: bytes) -> Entry:
    try:
        share, mode, user_bytes = serializer.loads(data)
        value, *author = serializer.loads(user_bytes)
    except Exception:  # msgpack raises several types for garbage
        raise UnauthoredEntryError(f"{peer_id[-8:]}'s gathered entry is malformed") from None
    message = _signed_bytes(prefix, peer_id, share, mode, value) if isinstance(value, bytes) else None
    if message is None or not is_authored_by(peer_id, author, message):
        raise UnauthoredEntryError(f"{peer_id[-8:]}'s gathered entry is not signed by it")
    if mode not in _MODES:
        raise UnauthoredEntryError(f"{peer_id[-8:]}'s gathered entry names no averaging mode")
    try:
        return Entry(share=share, mode=mode, value=serializer.loads(value))
    except Exception:
        raise UnauthoredEntryError(f"{peer_id[-8:]}'s gathered value is malformed") from None


def own_gathered(serializer: Any, data_for_gather: bytes) -> Any:
    """What this member's training mode gathers in a step it started (hivemind's `StepControl.data_for_gather`)."""
    return serializer.loads(serializer.loads(serializer.loads(data_for_gather)[2])[0])


def _signed_bytes(prefix: str, peer_id: str, share: Any, mode: Any, value: bytes) -> bytes | None:
    """The bytes a member signs: its share (or none), mode and gathered value, bound to the averager's prefix and
    its peer ID; one encoding only. None for a share or mode of a type no member sends."""
    if not isinstance(share, float | int | None) or isinstance(share, bool) or type(mode) is not int:
        return None
    if not -(2**31) <= mode < 2**31:
        return None
    prefix_bytes, peer = prefix.encode(), peer_id.encode()
    share_bytes = b"\x00" if share is None else b"\x01" + struct.pack(">d", float(share))
    return b"".join(
        (
            _DOMAIN,
            struct.pack(">I", len(prefix_bytes)),
            prefix_bytes,
            struct.pack(">I", len(peer)),
            peer,
            share_bytes,
            struct.pack(">iI", mode, len(value)),
            value,
        )
    )
