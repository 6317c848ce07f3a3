"""A volunteer behind a home NAT becomes callable through a public peer's libp2p circuit relay (p2pd's own relay
service and `-autoRelay`), in the WAN lab's masquerading routers with nothing forwarded.

What it takes with hivemind 1.1.12's p2pd, found with scripts/lab/nat_relay.py: the relay's address must be one
libp2p counts as public (on the lab's usual 10.x the reservation was made and no circuit address ever announced,
so this lab's bridge uses 11.x); autorelay reserves as soon as it knows 4 relay candidates (15 s here) and with
fewer waits out a 180 s boot delay, so the lab has 4 public nodes; and reachability is forced on both ends, since
AutoNAT on a lab's few peers flips the relay to public mid-run, which dropped the NATed node's reservation.
Callers send a small echo only: 10 MB pulls through the relay passed on 100 and 300 Mbit/s links, and on 1 Gbit/s
links 7 of 8 were reset after at most 128 KiB.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from lab.nat_relay import events, last, start
from lab.processes import await_condition
from lab.wanlab import Host, HostSpec, Lab, Scenario

from tests.harness import NEEDS_NAT_LAB

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(300),
    NEEDS_NAT_LAB,
]

NUM_RELAYS = 4
"""autorelay reserves at once when it knows 4 relay candidates; with fewer it waits out a 180 s boot delay."""
SCENARIO = Scenario(
    name="relay",
    hosts=(
        HostSpec(name="relay", upload_mbps=100, download_mbps=100, count=NUM_RELAYS),
        HostSpec(name="home", upload_mbps=20, download_mbps=20, nat=True),
        HostSpec(name="home2", upload_mbps=20, download_mbps=20, nat=True),
    ),
)
PUBLIC_OCTET = 11
"""A first octet libp2p counts as public; the namespaces route nowhere outside the lab, whatever the prefix."""
RESERVATION_TIMEOUT_S = 150
"""Short of the boot delay: with 4 relays the reservation came 15 s after start."""
CALL_TIMEOUT_S = 60


def circuit_address(path: Path) -> str | None:
    """The first /p2p-circuit address a node's log shows among its visible addresses."""
    addresses = (address for entry in events(path) if entry["event"] == "maddrs" for address in entry["maddrs"])
    return next((address for address in addresses if "/p2p-circuit/" in address), None)


def finished_call(path: Path) -> list[dict[str, Any]] | None:
    return events(path) if last(path, "done") else None


def start_relays(lab: Lab, hosts: list[Host], tmp_path: Path) -> list[str]:
    """A public node on each of `hosts`, the first founding the swarm and the others joining it; their addresses."""
    addresses: list[str] = []
    for number, host in enumerate(hosts):
        path = tmp_path / f"relay{number}.jsonl"
        joined = ["--initial-peers", addresses[0]] if addresses else []
        start(lab, host, path, *joined, "--reachability", "public", lifetime_s=300)
        started = await_condition(functools.partial(last, path, "started"), 30, f"relay {number}'s DHT")
        addresses.append(next(address for address in started["maddrs"] if f"/ip4/{host.address}/" in address))
    return addresses


def test_a_natted_volunteer_is_called_through_a_public_peers_relay(tmp_path: Path) -> None:
    with Lab(SCENARIO, public_octet=PUBLIC_OCTET) as lab:
        *relays, home, home2 = lab.hosts
        addresses = start_relays(lab, relays, tmp_path)
        relay_address = addresses[0]
        natted = ["--initial-peers", relay_address, "--auto-relay", "--reachability", "private"]
        start(lab, home, tmp_path / "N.jsonl", *natted, "--announce-as", "N", lifetime_s=300)
        circuit = await_condition(lambda: circuit_address(tmp_path / "N.jsonl"), RESERVATION_TIMEOUT_S,
                                  "a /p2p-circuit address on the NATed node")  # fmt: skip
        assert any(circuit.startswith(f"{address}/p2p-circuit/") for address in addresses), f"reserved on {circuit}"

        # a public peer and another NATed one, each knowing only the peer ID the NATed node stored in the DHT
        callers = {"B": relays[1], "M": home2}
        for name, host in callers.items():
            options = ["--initial-peers", relay_address, "--call", "N", "--bulk-bytes", "0"]
            if host.behind_nat:
                options += ["--reachability", "private"]
            start(lab, host, tmp_path / f"{name}.jsonl", *options, "--call-timeout-s", str(CALL_TIMEOUT_S),
                  lifetime_s=CALL_TIMEOUT_S * 2)  # fmt: skip
        for name in callers:
            path = tmp_path / f"{name}.jsonl"
            log = await_condition(functools.partial(finished_call, path), CALL_TIMEOUT_S * 2, f"{name}'s call")
            echo = next(entry for entry in log if entry["event"] == "echo")
            assert echo["ok"], f"{name} could not call the NATed node: {echo}"
        # Two NATed nodes have no path but the relay. A public caller may have one more: the NATed node's DHT may
        # have dialed it already, and a connection it opened carries streams both ways.
        connected = next(
            entry for entry in finished_call(tmp_path / "M.jsonl") or [] if entry["event"] == "connections"
        )
        assert connected["addrs"] and all("/p2p-circuit" in address for address in connected["addrs"]), (
            f"the NATed caller reached the NATed node over {connected['addrs']}, not through a relay"
        )
