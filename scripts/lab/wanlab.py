"""WAN lab: hosts as network namespaces behind one bridge, each with its own upload/download cap.

A scenario is a small TOML file:

    name = "hetero"
    [[hosts]]
    name = "fast"
    upload_mbps = 1000
    download_mbps = 1000
    [[hosts]]
    name = "slow"
    count = 3
    upload_mbps = 20
    download_mbps = 20

Each host is a namespace `ctlab<id>-<name><i>` with one veth into a bridge in the root namespace and
an address in 10.<lab>.0.0/24 (only our own namespaces; nothing is routed anywhere else). Caps are
token-bucket (`tbf`) qdiscs: upload on the host's end of the veth, download on the bridge's end
(`netem` doesn't exist on these machines, so links add no latency). `Lab` is a context manager that
tears everything down on exit, on error and on Ctrl-C; `PYTHONPATH=scripts python -m lab.wanlab --cleanup` (from
the repository's root) removes leftovers of a lab that was SIGKILLed. Run as root.

A host with `nat = true` sits behind its own home router, as a volunteer's machine does: the router is a second
namespace (`<host>-nat`) holding the bridge address and the caps, the host has 192.168.<i>.2 behind it with the
router as its gateway, and the router masquerades what the host sends (nftables). Nothing is forwarded to the
host: a peer on the bridge can answer the connections the host opens, and can dial nothing of it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

PREFIX = "ctlab"
TBF_LATENCY = "400ms"


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec:
    """One kind of host in a scenario."""

    name: str
    """Host name; with count > 1 the hosts are name0, name1, ..."""
    upload_mbps: float
    """Cap on what the host sends, in Mbit/s."""
    download_mbps: float
    """Cap on what the host receives, in Mbit/s."""
    count: int = 1
    """How many hosts of this kind."""
    nat: bool = False
    """Behind its own masquerading router, with no port forwarded: it can dial out, nobody can dial it."""

    def __post_init__(self) -> None:
        if not self.name.isalnum() or len(self.name) > 6:
            raise ValueError(f"host name must be 1-6 letters or digits, got {self.name!r}")
        if not (self.upload_mbps > 0 and self.download_mbps > 0 and self.count >= 1):
            raise ValueError(f"host {self.name}: caps must be positive and count at least 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """Hosts and their links; loaded from TOML."""

    name: str
    hosts: tuple[HostSpec, ...]

    @classmethod
    def load(cls, path: Path) -> Scenario:
        data = tomllib.loads(path.read_text())
        hosts = tuple(HostSpec(**host) for host in data.get("hosts", ()))
        if not hosts:
            raise ValueError(f"scenario {path} has no [[hosts]]")
        return cls(name=str(data.get("name", path.stem)), hosts=hosts)


@dataclass(slots=True)
class Host:
    """A running host: its namespace, address and caps."""

    name: str
    namespace: str
    address: str
    """The host's own address: on the bridge, or behind its router for a NATed host."""
    upload_mbps: float
    download_mbps: float
    public_address: str = ""
    """The address its peers see it from: its own, or its router's on the bridge."""
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def behind_nat(self) -> bool:
        """Whether it sits behind a masquerading router (peers see the router's address, and can't dial it)."""
        return self.public_address != self.address


class Lab:
    """The namespaces, veths, bridge and caps of one scenario; everything is removed on exit."""

    def __init__(self, scenario: Scenario, lab_id: str | None = None, public_octet: int = 10):
        """`public_octet`: the first octet of the bridge's addresses. 10 makes them private, as libp2p sees them;
        a public one (11) makes a host on the bridge look like an internet host to libp2p, whose circuit relay
        client drops a relay's private addresses."""
        if not 1 <= public_octet <= 223 or public_octet == 127:
            raise ValueError(f"public_octet must be a unicast first octet other than 127, got {public_octet}")
        self.scenario = scenario
        self.public_octet = public_octet
        self.lab_id = lab_id or secrets.token_hex(2)
        self.bridge = f"{PREFIX}{self.lab_id}br"
        self.subnet_octet = int(self.lab_id, 16) % 200 + 20
        self.hosts: list[Host] = []
        self._previous_sigterm: object = None

    def __enter__(self) -> Lab:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            index = 1
            for spec in self.scenario.hosts:
                for number in range(spec.count):
                    name = spec.name if spec.count == 1 else f"{spec.name}{number}"
                    self.hosts.append(self._add_host(name, index, spec))
                    index += 1
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_host(self, name: str, index: int, spec: HostSpec) -> Host:
        namespace = f"{PREFIX}{self.lab_id}-{name}"
        public = f"{self.public_octet}.{self.subnet_octet}.0.{index}"
        # the namespace on the bridge: the host itself, or its router
        edge = f"{namespace}-nat" if spec.nat else namespace
        outer, inner = f"{PREFIX}{self.lab_id}v{index}", f"{PREFIX}{self.lab_id}i{index}"
        _ip("netns", "add", edge)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", edge)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _up(edge, inner, "eth0", f"{public}/24")
        _cap(["ip", "netns", "exec", edge, "tc"], "eth0", spec.upload_mbps)  # what the host sends
        _cap(["tc"], outer, spec.download_mbps)  # what the bridge delivers to the host
        if not spec.nat:
            return Host(name, namespace, public, spec.upload_mbps, spec.download_mbps, public)
        address = f"192.168.{index}.2"
        wan, lan = f"{PREFIX}{self.lab_id}w{index}", f"{PREFIX}{self.lab_id}l{index}"
        _ip("netns", "add", namespace)
        _ip("link", "add", wan, "type", "veth", "peer", "name", lan)
        _ip("link", "set", wan, "netns", edge)
        _ip("link", "set", lan, "netns", namespace)
        _up(edge, wan, "lan0", f"192.168.{index}.1/24")
        _up(namespace, lan, "eth0", f"{address}/24")
        _ip("netns", "exec", namespace, "ip", "route", "add", "default", "via", f"192.168.{index}.1")
        subprocess.run(["ip", "netns", "exec", edge, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], check=True)
        masquerade = (
            "table ip nat {\n chain postrouting {\n"
            '  type nat hook postrouting priority 100;\n  oifname "eth0" masquerade\n }\n}\n'
        )
        subprocess.run(["ip", "netns", "exec", edge, "nft", "-f", "-"], input=masquerade, text=True, check=True)
        return Host(name, namespace, address, spec.upload_mbps, spec.download_mbps, public)

    def spawn(self, host: Host, command: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start `command` inside the host's namespace, in its own session (killed on teardown)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, *command],
            start_new_session=True,
            **kwargs,  # type: ignore[call-overload]
        )
        host.processes.append(process)
        return process

    def teardown(self) -> None:
        """Kill every process started in the lab, then delete namespaces (and their veths) and the bridge."""
        for host in self.hosts:
            for process in host.processes:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        cleanup(f"{PREFIX}{self.lab_id}")

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.teardown()
        signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace and link whose name starts with `prefix`; returns what was removed."""
    removed = []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for line in namespaces.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(prefix):
            subprocess.run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(prefix):
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)
            removed.append(name)
    return removed


def _cap(tc: list[str], device: str, rate_mbps: float) -> None:
    # burst: at least one MTU and ~2 ms at the rate, so tbf can reach its rate at high speeds
    burst_bytes = max(16_000, int(rate_mbps * 1e6 / 8 * 0.002))
    command = [*tc, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbps}mbit"]
    subprocess.run([*command, "burst", str(burst_bytes), "latency", TBF_LATENCY], check=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def _up(namespace: str, device: str, name: str, address: str) -> None:
    """Rename `device` in `namespace` to `name`, give it `address` (with its prefix) and bring it and lo up."""
    in_ns = ("netns", "exec", namespace, "ip")
    _ip(*in_ns, "link", "set", "lo", "up")
    _ip(*in_ns, "link", "set", device, "name", name)
    _ip(*in_ns, "addr", "add", address, "dev", name)
    _ip(*in_ns, "link", "set", name, "up")


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    """`PYTHONPATH=scripts python -m lab.wanlab`: create a lab from a scenario file and run a command in every host."""
    parser = argparse.ArgumentParser(description="Create a WAN lab and run a command in every host.")
    parser.add_argument("scenario", nargs="?", type=Path, help="scenario TOML file")
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers of killed labs and exit")
    parser.add_argument("--run", nargs=argparse.REMAINDER, help="command to run in every host ({address} expands)")
    args = parser.parse_args()
    if args.cleanup:
        print("removed:", " ".join(cleanup()) or "nothing")
        return
    if args.scenario is None:
        parser.error("a scenario file is required")
    with Lab(Scenario.load(args.scenario)) as lab:
        for host in lab.hosts:
            print(
                f"{host.name:8} {host.namespace:20} {host.address:14} "
                f"{'behind NAT at ' + host.public_address + ' ' if host.behind_nat else ''}"
                f"up {host.upload_mbps:g} / down {host.download_mbps:g} Mbit/s"
            )
        if args.run:
            processes = [
                lab.spawn(host, [part.format(address=host.address) for part in args.run]) for host in lab.hosts
            ]
            try:
                for process in processes:
                    process.wait()
            except KeyboardInterrupt:
                print("interrupted: tearing the lab down", file=sys.stderr)


if __name__ == "__main__":
    main()
