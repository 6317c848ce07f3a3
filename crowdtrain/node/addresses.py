"""Listen addresses: the default port with a fallback, port-in-use checks, the address to share."""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.utils.multiaddr import Multiaddr

from crowdtrain.errors import BadInputError

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31330
"""TCP port a daemon listens on unless told otherwise; forward this port on a home router."""


def resolve_listen(listen: tuple[str, ...]) -> tuple[str, ...]:
    """The addresses to give p2pd: explicit ones if free, else all interfaces on the default port."""
    if listen:
        for address in listen:
            host, port = _tcp_endpoint(address)
            if port and not port_is_free(host, port):
                raise BadInputError(
                    f"Cannot listen on {address}: port {port} is already in use; "
                    "stop what uses it or pass --listen with another port (tcp/0 picks a free one)."
                )
        return listen
    if port_is_free("0.0.0.0", DEFAULT_PORT):
        return (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}",)
    logger.warning(
        f"default port {DEFAULT_PORT} is in use (another daemon?); listening on a free port instead, "
        "which peers behind your router can't reach unless you forward it"
    )
    return ("/ip4/0.0.0.0/tcp/0",)


def _tcp_endpoint(address: str) -> tuple[str, int]:
    parsed = Multiaddr(address)
    host = next((parsed[proto] for proto in ("ip4", "ip6") if proto in parsed), "0.0.0.0")
    return host, int(parsed["tcp"]) if "tcp" in parsed else 0


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind host:port right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def shareable_address(maddrs: list[str]) -> str:
    """The address to print in the join command: a public one, else private, else loopback."""
    return min(maddrs, key=lambda address: (_scope(address), "/ip6/" in address, address))


class JoinVia(enum.Enum):
    """Whose address a node's join command names, and so where that command works."""

    OWN = "own"
    """This node's own public address: it works from anywhere peers can route to."""
    INITIAL_PEER = "initial_peer"
    """The peer this node joined through (its own addresses are not public): it works wherever it worked for
    this node."""
    LOCAL_ONLY = "local_only"
    """This node's own private or loopback address: it works only on this node's network (or machine)."""


@dataclass(frozen=True, slots=True)
class JoinAddress:
    """The address a node's join command names, and whose it is."""

    address: str
    via: JoinVia

    @property
    def on_loopback(self) -> bool:
        """Whether the address works only on this machine."""
        return _scope(self.address) == _LOOPBACK

    @property
    def port(self) -> int:
        """The address's TCP port (0 when it has none): the port to forward for a LOCAL_ONLY address."""
        return _tcp_endpoint(self.address)[1]


def join_address(own: Sequence[str], initial_peers: Sequence[str]) -> JoinAddress:
    """The address another machine joins through: this node's own when it is public; else the initial peer it
    joined through (the widest-reaching one, in the order given), unless that one reaches less far than its own
    (a loopback peer, a LAN node); else its own, which works only on its network. A DNS name counts as public."""
    own_best = shareable_address(list(own))
    own_scope = _scope(own_best)
    if own_scope == _PUBLIC:
        return JoinAddress(own_best, JoinVia.OWN)
    if initial_peers:
        ranked = sorted(enumerate(initial_peers), key=lambda item: (_peer_scope(item[1]), item[0]))
        peer = ranked[0][1]
        if _peer_scope(peer) <= own_scope:
            return JoinAddress(peer, JoinVia.INITIAL_PEER)
    return JoinAddress(own_best, JoinVia.LOCAL_ONLY)


_PUBLIC, _PRIVATE, _LOOPBACK, _NO_IP = range(4)


def _scope(address: str) -> int:
    """How far an address reaches: public, private (a LAN, link-local), loopback, or not an IP address."""
    parsed = Multiaddr(address)
    host = next((parsed[proto] for proto in ("ip4", "ip6") if proto in parsed), None)
    if host is None:
        return _NO_IP
    ip = ipaddress.ip_address(host)
    return _LOOPBACK if ip.is_loopback else _PRIVATE if ip.is_private or ip.is_link_local else _PUBLIC


def _peer_scope(address: str) -> int:
    """An initial peer's scope: a DNS name the volunteer typed is meant to resolve anywhere, so it counts as public."""
    parsed = Multiaddr(address)
    return _PUBLIC if any(proto in parsed for proto in ("dns", "dns4", "dns6")) else _scope(address)
