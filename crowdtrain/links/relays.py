"""Which circuit relays peers can call this node through: the /p2p-circuit addresses its p2pd announces.

A node behind a NAT that started with relays on (`crowdtrain.dht.swarm.p2p_options`) holds a reservation on a
public peer's relay once libp2p's autorelay made one, and p2pd then announces `<relay's address>/p2p-circuit/p2p/
<this node>`. Such a node is reachable in a third way, between a direct dial and none: peers call it through the
relay, on the relay's uplink. The status record carries the relays' peer IDs (`PeerStatus.relays`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import hivemind
from hivemind.dht.node import DHTNode

from crowdtrain.dht.calls import DHTCallFailed, dht_answer

logger = logging.getLogger(__name__)

RELAY_CHECK_S = 15.0
"""Seconds between two reads of this node's announced addresses (a reservation comes or goes at most this late)."""
MAX_RELAYS = 4
"""The most relays a status record names: libp2p's autorelay holds 2 reservations by default."""
READ_TIMEOUT_S = 5.0
"""Bound on one read of the addresses from the DHT process (a heartbeat must not hang on a busy one)."""


REACHABILITY = ("yes", "assumed", "relay", "no")
"""How peers reach a node: they dialed it back (`yes`), nobody tried yet (`assumed`), only through a circuit relay
(`relay`), or only over connections it opens itself (`no`)."""


def reachability(reachable: bool, measured: bool, relays: Sequence[str]) -> str:
    """One of REACHABILITY for a node's status record's `reachable`, `reachability_measured` and `relays`."""
    if not reachable:
        return "relay" if relays else "no"
    return "yes" if measured else "assumed"


def relay_peers(addresses: Iterable[Any]) -> tuple[str, ...]:
    """The peer IDs of the relays in `addresses` (`.../p2p/<relay>/p2p-circuit/p2p/<self>`), sorted, at most
    MAX_RELAYS; () when none is relayed."""
    relays = set()
    for address in map(str, addresses):
        before, circuit, _ = address.partition("/p2p-circuit")
        if circuit and "/p2p/" in before:
            relays.add(before.rsplit("/p2p/", 1)[1])
    return tuple(sorted(relays)[:MAX_RELAYS])


def announced_addresses(dht: hivemind.DHT) -> list[Any]:
    """The addresses this node's p2pd announces now (asked afresh, not the ones it started with)."""
    future = dht.run_coroutine(_latest_addresses, return_future=True)
    return dht_answer(future, READ_TIMEOUT_S, "this node's addresses")  # type: ignore[no-any-return]


async def _latest_addresses(_dht: hivemind.DHT, node: DHTNode) -> list[Any]:
    return await node.p2p.get_visible_maddrs(latest=True)  # type: ignore[no-any-return]


class RelayWatch:
    """This node's relays, re-read from p2pd at most every RELAY_CHECK_S; a change is logged in one line."""

    def __init__(self, visible_addresses: Callable[[], Iterable[Any]], interval_s: float = RELAY_CHECK_S):
        self._visible_addresses, self._interval_s = visible_addresses, interval_s
        self._relays: tuple[str, ...] = ()
        self._next_read_at = 0.0

    def relays(self) -> tuple[str, ...]:
        """The relays peers can call this node through now (as of the last read); () if none or unreadable."""
        now = time.monotonic()
        if now < self._next_read_at:
            return self._relays
        self._next_read_at = now + self._interval_s
        try:
            relays = relay_peers(self._visible_addresses())
        except DHTCallFailed as e:  # the DHT process is busy or gone: keep the last answer; the beat sees a dead DHT
            logger.debug(f"could not read {e}")
            return self._relays
        if relays != self._relays:
            if relays:
                names = ", ".join(f"…{peer[-8:]}" for peer in relays)
                logger.info(f"peers can call this node through the relay of {names}")
            else:
                logger.warning("this node holds no relay reservation any more: only peers it dials can reach it")
            self._relays = relays
        return relays
