"""A volunteer behind a home NAT becomes callable through a public peer's libp2p circuit relay (p2pd's own relay
service and `-autoRelay`), in the WAN lab's masquerading routers with nothing forwarded.

What it takes with hivemind 1.1.12's p2pd, found with scripts/lab/nat_relay.py: the relay's address must be one
libp2p counts as public (on the lab's usual 10.x the reservation was made and no circuit address ever announced,
so this lab's bridge uses 11.x); the reservation comes 180 s after start (autorelay waits that long for 4 relay
candidates before it settles for fewer); and reachability is forced on both ends, since AutoNAT on a lab's few
peers flips the relay to public mid-run, which dropped the NATed node's reservation. Callers send a small echo
only: 10 MB pulls through the relay passed on 100 and 300 Mbit/s links, and on 1 Gbit/s links 7 of 8 were reset
after at most 128 KiB.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from lab.nat_relay import events, last, start
from lab.processes import await_condition
from lab.wanlab import HostSpec, Lab, Scenario

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("nft") is None,
        reason="needs root, iproute2 and nftables (make test installs it)",
    ),
]

SCENARIO = Scenario(
    name="relay",
    hosts=(
        HostSpec(name="relay", upload_mbps=100, download_mbps=100),
        HostSpec(name="pub", upload_mbps=100, download_mbps=100),
        HostSpec(name="home", upload_mbps=20, download_mbps=20, nat=True),
        HostSpec(name="home2", upload_mbps=20, download_mbps=20, nat=True),
    ),
)
PUBLIC_OCTET = 11
"""A first octet libp2p counts as public; the namespaces route nowhere outside the lab, whatever the prefix."""
RESERVATION_TIMEOUT_S = 240
"""autorelay's boot delay (180 s) and a margin."""
CALL_TIMEOUT_S = 60


def circuit_address(path: Path) -> str | None:
    """The first /p2p-circuit address a node's log shows among its visible addresses."""
    addresses = (address for entry in events(path) if entry["event"] == "maddrs" for address in entry["maddrs"])
    return next((address for address in addresses if "/p2p-circuit/" in address), None)


def finished_call(path: Path) -> list[dict[str, Any]] | None:
    return events(path) if last(path, "done") else None


def test_a_natted_volunteer_is_called_through_a_public_peers_relay(tmp_path: Path) -> None:
    with Lab(SCENARIO, public_octet=PUBLIC_OCTET) as lab:
        relay, public, home, home2 = lab.hosts
        start(lab, relay, tmp_path / "A.jsonl", "--announce-as", "A", "--reachability", "public", lifetime_s=400)
        started = await_condition(lambda: last(tmp_path / "A.jsonl", "started"), 30, "the relay's DHT")
        relay_address = next(address for address in started["maddrs"] if f"/ip4/{relay.address}/" in address)
        natted = ["--initial-peers", relay_address, "--auto-relay", "--reachability", "private"]
        start(lab, home, tmp_path / "N.jsonl", *natted, "--announce-as", "N", lifetime_s=400)
        circuit = await_condition(lambda: circuit_address(tmp_path / "N.jsonl"), RESERVATION_TIMEOUT_S,
                                  "a /p2p-circuit address on the NATed node")  # fmt: skip
        assert circuit.startswith(relay_address + "/p2p-circuit/"), f"reserved on {circuit}, not on the relay"

        # a public peer and another NATed one, each knowing only the peer ID the NATed node stored in the DHT
        callers = {"B": public, "M": home2}
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
            connected = next(entry for entry in log if entry["event"] == "connections")
            assert connected["addrs"] and all("/p2p-circuit" in address for address in connected["addrs"]), (
                f"{name} reached the NATed node over {connected['addrs']}, not through the relay"
            )
