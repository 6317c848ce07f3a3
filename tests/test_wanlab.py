"""The WAN lab: namespaces reach each other through the bridge at their caps, and leave nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from lab.wanlab import PREFIX, Host, HostSpec, Lab, Scenario, cleanup

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2"),
]

# Receives for a fixed time and prints the bytes it got; the sender sends as fast as the link allows.
RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 5001)); server.settimeout(20)
connection, _ = server.accept(); connection.settimeout(5)
total, started = 0, None
while True:
    chunk = connection.recv(1 << 16)
    if not chunk: break
    started = started or time.monotonic(); total += len(chunk)
print(total * 8 / (time.monotonic() - started) / 1e6)
"""
SENDER = """
import socket, sys, time
for attempt in range(100):
    try: connection = socket.create_connection((sys.argv[1], 5001), timeout=2); break
    except OSError: time.sleep(0.1)
deadline = time.monotonic() + float(sys.argv[2]); payload = b"x" * (1 << 16)
while time.monotonic() < deadline: connection.sendall(payload)
connection.close()
"""


def measure_mbps(lab: Lab, sender: int, receiver: int, seconds: float = 3.0) -> float:
    target = lab.hosts[receiver]
    receiving = lab.spawn(target, [sys.executable, "-c", RECEIVER, target.address], stdout=subprocess.PIPE, text=True)
    sending = lab.spawn(lab.hosts[sender], [sys.executable, "-c", SENDER, target.address, str(seconds)])
    assert sending.wait(timeout=30) == 0
    output, _ = receiving.communicate(timeout=30)
    return float(output)


def test_caps_shape_traffic_and_teardown_removes_everything() -> None:
    scenario = Scenario(
        name="test",
        hosts=(
            HostSpec(name="fast", upload_mbps=200, download_mbps=200),
            HostSpec(name="slow", upload_mbps=10, download_mbps=40),
        ),
    )
    with Lab(scenario) as lab:
        lab_prefix = f"{PREFIX}{lab.lab_id}"
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert namespaces.count(lab_prefix) == 2
        upload = measure_mbps(lab, sender=1, receiver=0)  # limited by slow's upload cap: 10
        download = measure_mbps(lab, sender=0, receiver=1)  # limited by slow's download cap: 40
    assert 7 <= upload <= 11, f"slow host's upload measured {upload:.1f} Mbit/s against a 10 Mbit/s cap"
    assert 28 <= download <= 42, f"slow host's download measured {download:.1f} Mbit/s against a 40 Mbit/s cap"
    assert lab_prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab_prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert cleanup(lab_prefix) == []


# Accepts one connection and prints the address it came from; with an argument, gives up after that many seconds.
ACCEPTOR = """
import socket, sys
server = socket.create_server(("0.0.0.0", 5002)); server.settimeout(float(sys.argv[1]))
try:
    connection, (address, _) = server.accept(); print(address)
except TimeoutError:
    print("nobody")
"""
DIALER = """
import socket, sys, time
for attempt in range(50):
    try: socket.create_connection((sys.argv[1], 5002), timeout=2); print("connected"); break
    except OSError as error: reason = error; time.sleep(0.1)
else: print(type(reason).__name__)
"""


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (make test installs it)")
def test_a_natted_host_dials_out_from_its_routers_address_and_nobody_dials_it() -> None:
    scenario = Scenario(
        name="nat",
        hosts=(
            HostSpec(name="pub", upload_mbps=100, download_mbps=100),
            HostSpec(name="home", upload_mbps=20, download_mbps=20, nat=True),
        ),
    )
    with Lab(scenario) as lab:
        public, home = lab.hosts
        assert not public.behind_nat and home.behind_nat and home.address.startswith("192.168.")

        def run_in(host: Host, script: str, *args: str) -> str:
            command = ["ip", "netns", "exec", host.namespace, sys.executable, "-c", script, *args]
            return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout.strip()

        acceptor = lab.spawn(public, [sys.executable, "-c", ACCEPTOR, "20"], stdout=subprocess.PIPE, text=True)
        assert run_in(home, DIALER, public.address) == "connected"
        assert acceptor.communicate(timeout=30)[0].strip() == home.public_address, "masqueraded as its router"

        acceptor = lab.spawn(home, [sys.executable, "-c", ACCEPTOR, "8"], stdout=subprocess.PIPE, text=True)
        assert run_in(public, DIALER, home.public_address) == "ConnectionRefusedError", "no port is forwarded"
        assert run_in(public, DIALER, home.address) != "connected", "its LAN address is not routed"
        assert acceptor.communicate(timeout=30)[0].strip() == "nobody"
        namespaces = (home.namespace, f"{home.namespace}-nat")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(namespace in listed for namespace in namespaces), "the host and its router are removed"
