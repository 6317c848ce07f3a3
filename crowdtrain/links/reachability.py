"""Dial-back reachability: which announced addresses a server may dial, and the verdict from the attempts."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from hivemind.utils.multiaddr import Multiaddr

from crowdtrain import proto
from crowdtrain.links.protocol import AddressVerdict


def classify_address(address: str, observed: set[Any]) -> tuple[proto.DialAttempt | None, tuple[str, int] | None]:
    """A verdict for an address the server won't dial, or the (host, port) to dial."""
    verdicts = proto.DialAttempt
    try:
        parsed = Multiaddr(address)
        ip = direct_ip(parsed)
        port = int(parsed["tcp"]) if "tcp" in parsed else None
    except Exception:
        return verdicts(multiaddr=address, verdict=verdicts.UNSUPPORTED, detail="not a multiaddr"), None
    if ip is None or port is None:
        return verdicts(
            multiaddr=address, verdict=verdicts.UNSUPPORTED, detail="not a direct ip4/ip6 TCP address"
        ), None
    if ip not in observed:
        seen = ", ".join(sorted(map(str, observed))) or "no direct connection"
        return verdicts(multiaddr=address, verdict=verdicts.IP_MISMATCH, detail=f"connected from {seen}"), None
    return None, (str(ip), port)


def direct_ip(address: Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a direct /ip4 or /ip6 address (IPv4-mapped IPv6 as IPv4); None for relayed or DNS ones."""
    if "p2p-circuit" in address:
        return None
    for protocol in ("ip4", "ip6"):
        if protocol in address:
            ip = ipaddress.ip_address(address[protocol])
            mapped = getattr(ip, "ipv4_mapped", None)
            return mapped or ip
    return None


def reachability(dial_results: Sequence[list[AddressVerdict]]) -> bool | None:
    """True if any peer dialed one of our addresses, False if peers tried and none could, None if none tried."""
    verdicts = [verdict for result in dial_results for verdict in result]
    if not any(dial_results):
        return None
    return any(verdict.verdict == "dialed" for verdict in verdicts)
