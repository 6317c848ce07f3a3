"""NAT relay experiment: does a volunteer behind a NAT become callable through a public peer's circuit relay?

In a WAN lab (scripts/lab/wanlab.py) with two public hosts and two behind their own masquerading routers:
A (public) starts the swarm; N (NATed, `use_auto_relay`) joins it and publishes its peer ID in the DHT; then, one
after another, B (public) finds N by that key and calls it (an echo, then a bulk pull), B calls A directly (the same
bulk pull, as a baseline), and M (NATed too) calls N. Each node is scripts/lab/relay_node.py; their JSON-lines
events are printed at the end. Run as root from the repository's root:

    PYTHONPATH=scripts .venv/bin/python -m lab.nat_relay --public-octet 11 \
        [--a-reachability public] [--n-reachability private] [--mbps 100] [--dialback]

What it showed with hivemind 1.1.12's p2pd (tests/test_nat_relay.py keeps the part that works):
- with the bridge on 10.x, N reserved a slot on A after 180 s and never announced a /p2p-circuit address; on 11.x
  (public to libp2p) it did, 180-195 s after start, forced reachability or not (autorelay's 3-minute boot delay,
  waited out when it knows fewer than 4 relay candidates: with 4 public nodes it reserved on 2 of them in 15 s);
- B (public) and M (NATed) found N by its DHT key and called it through A;
- 10 MB pulls through A ran at 74-88 Mbit/s on 100 Mbit/s links (direct: 84-93), 230-280 on 300 Mbit/s links,
  and on 1 Gbit/s links 7 pulls of 8 were reset after at most 128 KiB (the other ran at 348 Mbit/s), also with
  `--a-p2pd-args=-relayDataLimit=1073741824` and with `--dialback` (N's connect() rides the relayed connection);
- the relayed connection was never upgraded to a direct one (no hole punching); it carried an echo every 10 s for
  144 s, until the lab ended; N lost its reservation only when A's own AutoNAT flipped it to public mid-run.
(N's "disconnected from relay" at the end of each run is the teardown killing A first.)
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab.processes import await_condition
from lab.wanlab import Host, HostSpec, Lab, Scenario

NODE = Path(__file__).with_name("relay_node.py")


def events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def last(path: Path, event: str) -> dict[str, Any] | None:
    matching = [entry for entry in events(path) if entry["event"] == event]
    return matching[-1] if matching else None


def start(lab: Lab, host: Host, out: Path, *options: str, lifetime_s: float) -> None:
    command = [sys.executable, str(NODE), "--out", str(out), "--listen", f"/ip4/{host.address}/tcp/0",
               "--lifetime-s", str(lifetime_s), *options]  # fmt: skip
    lab.spawn(host, command, stdout=out.with_suffix(".log").open("w"), stderr=subprocess.STDOUT)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-reachability", choices=("public", "private"))
    parser.add_argument("--n-reachability", choices=("public", "private"))
    parser.add_argument("--no-auto-relay", action="store_true", help="N and M start without use_auto_relay")
    parser.add_argument("--trusted-relay", action="store_true", help="N and M name A in trusted_relays")
    parser.add_argument("--public-octet", type=int, default=10, help="first octet of the bridge's addresses")
    parser.add_argument("--a-p2pd-args", default="", help="extra p2pd flags for A, space-separated")
    parser.add_argument("--dialback", action="store_true", help="callers ask N to dial them back, then pull")
    parser.add_argument("--watch-s", type=float, default=0.0, help="B then echoes N every 10 s for this long")
    parser.add_argument("--mbps", type=float, default=1000.0, help="every host's upload and download cap")
    parser.add_argument("--bulk-bytes", type=int, default=10_000_000)
    parser.add_argument("--circuit-timeout-s", type=float, default=60.0)
    parser.add_argument("--skip", nargs="*", default=[], choices=("B", "C", "M"))
    return parser.parse_args()


def await_circuit(path: Path, timeout_s: float) -> None:
    """Print when N first showed a /p2p-circuit address, or that it showed none within `timeout_s`."""
    try:
        circuit = await_condition(
            lambda: next((e for e in events(path) if e["event"] == "maddrs" and e["circuit"]), None),
            timeout_s, "a /p2p-circuit address on N")  # fmt: skip
        print(f"N has a circuit address {circuit['t_s']} s after its DHT started", flush=True)
    except Exception as e:
        print(f"N: {e}", flush=True)


def main() -> None:
    args = parse()
    mbps = args.mbps
    scenario = Scenario(
        name="relay",
        hosts=(
            HostSpec(name="a", upload_mbps=mbps, download_mbps=mbps),
            HostSpec(name="b", upload_mbps=mbps, download_mbps=mbps),
            HostSpec(name="n", upload_mbps=mbps, download_mbps=mbps, nat=True),
            HostSpec(name="m", upload_mbps=mbps, download_mbps=mbps, nat=True),
        ),
    )
    work = Path(tempfile.mkdtemp(prefix="nat-relay-"))
    natted = [] if args.no_auto_relay else ["--auto-relay"]
    n_reach = ["--reachability", args.n_reachability] if args.n_reachability else []
    a_reach = ["--reachability", args.a_reachability] if args.a_reachability else []
    if args.a_p2pd_args:
        a_reach += [f"--p2pd-args={args.a_p2pd_args}"]
    bulk = ["--bulk-bytes", str(args.bulk_bytes)] + (["--dialback"] if args.dialback else [])
    with Lab(scenario, public_octet=args.public_octet) as lab:
        a, b, n, m = lab.hosts
        started = time.monotonic()
        start(lab, a, work / "A.jsonl", "--announce-as", "A", *a_reach, lifetime_s=400)
        a_start = await_condition(lambda: last(work / "A.jsonl", "started"), 30, "A started")
        a_addr = next(addr for addr in a_start["maddrs"] if f"/ip4/{a.address}/" in addr)
        joined = ["--initial-peers", a_addr]
        if args.trusted_relay:
            natted = [*natted, "--trusted-relays", a_addr]
        start(lab, n, work / "N.jsonl", *joined, *natted, *n_reach, "--announce-as", "N", lifetime_s=350)
        await_circuit(work / "N.jsonl", args.circuit_timeout_s)
        for name, host, target in (("B", b, "N"), ("C", b, "A"), ("M", m, "N")):
            if name in args.skip:
                continue
            out = work / f"{name}.jsonl"
            options = [*joined, "--call", target, *bulk] + (natted + n_reach if host.behind_nat else [])
            if name == "B" and args.watch_s:
                options += ["--echo-every-s", "10"]
            start(lab, host, out, *options, lifetime_s=120 if name != "B" else max(120, args.watch_s))
            try:
                await_condition(functools.partial(last, out, "done"), 120, f"{name}'s call to {target}")
            except Exception as e:
                print(f"{name}: {e}", flush=True)
        if args.watch_s:  # B echoes N until its lifetime ends
            watched = lambda: any(e["t_s"] >= args.watch_s - 15 for e in events(work / "B.jsonl"))  # noqa: E731
            await_condition(watched, args.watch_s + 30, "B's last echoes")
        print(f"lab ran {time.monotonic() - started:.0f} s; logs in {work}", flush=True)
    for name in ("A", "N", "B", "C", "M"):
        for entry in events(work / f"{name}.jsonl"):
            print(name, json.dumps(entry))


if __name__ == "__main__":
    main()
