"""How long a NATed volunteer's `crowdtrain run` takes to become callable through a relay, with real daemons.

In a WAN lab with a public founder (100 Mbit/s) and two volunteers each behind its own masquerading router (20
Mbit/s, nothing forwarded), all three train a tiny DiLoCo run; the founder's `crowdtrain status --json` is read
every 10 s until each volunteer's record names a relay (`relays`), and the seconds from its start are printed with
the status table's `reach` cell. The bridge is on 11.x, which libp2p counts as public (its relay client drops a
relay's private addresses, as on 10.x). Run as root from the repository's root:

    PYTHONPATH=scripts .venv/bin/python -m lab.nat_relay_daemons [--timeout-s 420]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab.fixtures import tiny_run_file
from lab.processes import await_condition
from lab.wanlab import Host, HostSpec, Lab, Scenario

SCENARIO = Scenario(
    name="relayd",
    hosts=(
        HostSpec(name="pub", upload_mbps=100, download_mbps=100),
        HostSpec(name="home", upload_mbps=20, download_mbps=20, nat=True),
        HostSpec(name="home2", upload_mbps=20, download_mbps=20, nat=True),
    ),
)
RUN = tiny_run_file("relay-diloco", 128, mode="diloco", sections="[diloco]\ninner_steps = 16\n")
ENV = {**os.environ, "CROWDTRAIN_NUM_THREADS": "1"}


def node_file(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None


def run_on(host: Host, command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` run to its end inside the host's namespace."""
    return subprocess.run(["ip", "netns", "exec", host.namespace, *command], capture_output=True, text=True,
                          timeout=120, env=ENV)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=420.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nat-relayd-"))
    (work / "run.toml").write_text(RUN)
    crowdtrain = [sys.executable, "-m", "crowdtrain"]
    with Lab(SCENARIO, public_octet=11) as lab:
        public, *homes = lab.hosts
        founder = work / "founder"
        lab.spawn(public, [*crowdtrain, "run", "--state-dir", str(founder), "--run-file", str(work / "run.toml")],
                  stdout=(work / "founder.log").open("w"), stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
        founded = await_condition(lambda: node_file(founder), 90, "the founder's node.json")
        address = next(address for address in founded["multiaddrs"] if f"/ip4/{public.address}/" in address)
        started: dict[str, float] = {}
        for number, home in enumerate(homes):
            state = work / f"home{number}"
            lab.spawn(home, [*crowdtrain, "run", "--state-dir", str(state), "--initial-peers", address],
                      stdout=(work / f"home{number}.log").open("w"), stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
            joined = await_condition(lambda state=state: node_file(state), 90, f"volunteer {number}'s node.json")
            started[joined["peer_id"]] = time.monotonic()
        relayed: dict[str, float] = {}
        status = [*crowdtrain, "status", "--state-dir", str(founder)]
        deadline = time.monotonic() + args.timeout_s
        while len(relayed) < len(started) and time.monotonic() < deadline:
            shown = run_on(public, [*status, "--json"])
            for peer in json.loads(shown.stdout)["peers"] if shown.returncode == 0 else []:
                if peer["peer_id"] in started and peer.get("relays") and peer["peer_id"] not in relayed:
                    relayed[peer["peer_id"]] = time.monotonic() - started[peer["peer_id"]]
                    print(f"…{peer['peer_id'][-8:]}: relayed by {peer['relays']} within "
                          f"{relayed[peer['peer_id']]:.0f} s of its node.json", flush=True)  # fmt: skip
            time.sleep(10)
        print(run_on(public, status).stdout, flush=True)
        missing = sorted(set(started) - set(relayed))
        print(f"{len(relayed)} of {len(started)} volunteers relayed; none within {args.timeout_s:g} s: {missing}")
        print(f"logs in {work}")


if __name__ == "__main__":
    main()
