"""Volunteers behind a home NAT (the WAN lab's masquerading routers, nothing forwarded) in a real swarm."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lab.fixtures import tiny_run_file
from lab.processes import await_condition
from lab.wanlab import Host, HostSpec, Lab, Scenario

from tests.harness import DAEMON_ENV

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("nft") is None,
        reason="needs root, iproute2 and nftables (make test installs it)",
    ),
]

DILOCO = tiny_run_file(
    "nat-diloco",
    128,
    averaging='mode = "diloco"',
    sections="""
[diloco]
inner_steps = 16
outer_learning_rate = 0.7
outer_momentum = 0.9
compression = "int8"
""",
)
ENV = {**os.environ, **DAEMON_ENV, "CROWDTRAIN_MICRO_BATCH_SIZE": "8"}
SCENARIO = Scenario(
    name="nat",
    hosts=(
        HostSpec(name="pub", upload_mbps=100, download_mbps=100),
        HostSpec(name="home", upload_mbps=20, download_mbps=20, nat=True),
    ),
)


def node_file(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None


def averaged_rounds(log: Path) -> set[int]:
    return {int(number) for number in re.findall(r"outer round (\d+): averaged with the swarm", log.read_text())}


def status_from(host: Host, state_dir: Path) -> dict[str, Any]:
    """`crowdtrain status --json` run on `host` against its daemon (about 15 s beside two training daemons)."""
    command = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "crowdtrain", "status", "--json",
               "--state-dir", str(state_dir)]  # fmt: skip
    shown = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_a_diloco_volunteer_behind_nat_averages_outer_rounds_with_a_public_founder(tmp_path: Path) -> None:
    run_file = tmp_path / "diloco.toml"
    run_file.write_text(DILOCO)
    with Lab(SCENARIO) as lab:
        public, home = lab.hosts
        founder_log, joiner_log = tmp_path / "founder.log", tmp_path / "joiner.log"
        founder = lab.spawn(public, [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(tmp_path / "a"),
                                     "--run-file", str(run_file)],
                            stdout=founder_log.open("w"), stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
        founded = await_condition(lambda: node_file(tmp_path / "a"), 90, "the founder's node.json")
        address = next(address for address in founded["multiaddrs"] if f"/ip4/{public.address}/" in address)
        joiner = lab.spawn(home, [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(tmp_path / "b"),
                                  "--initial-peers", address],
                           stdout=joiner_log.open("w"), stderr=subprocess.STDOUT, env=ENV)  # fmt: skip

        def both_averaged_two_rounds() -> bool:
            for process, log in ((founder, founder_log), (joiner, joiner_log)):
                assert process.poll() is None, f"a daemon exited ({process.returncode}):\n{log.read_text()[-3000:]}"
            return len(averaged_rounds(founder_log) & averaged_rounds(joiner_log)) >= 2

        await_condition(both_averaged_two_rounds, 180, "two outer rounds averaged by the founder and the NATed joiner")
        joined = node_file(tmp_path / "b")
        assert joined is not None
        shown = status_from(home, tmp_path / "b")  # both have published their status for rounds by now
        peers = {peer["peer_id"]: peer for peer in shown["peers"]}
        assert peers[joined["peer_id"]]["reachable"] is False, "peers can't dial it, and it knows"
        assert peers[joined["peer_id"]]["reachability_measured"] is True
        assert peers[founded["peer_id"]]["reachable"] is True
