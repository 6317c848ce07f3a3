"""Listen addresses: the default port with a fallback, port-in-use checks, the address to share."""

from __future__ import annotations

import ipaddress
import logging
import socket

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

    def rank(address: str) -> int:
        parsed = Multiaddr(address)
        host = next((parsed[proto] for proto in ("ip4", "ip6") if proto in parsed), None)
        if host is None:
            return 3
        ip = ipaddress.ip_address(host)
        return 2 if ip.is_loopback else 1 if ip.is_private or ip.is_link_local else 0

    return min(maddrs, key=lambda address: (rank(address), "/ip6/" in address, address))
