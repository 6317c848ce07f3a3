"""Daemons on two hosts of the WAN lab: default listen address, the printed join command, status across hosts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.testing.processes import await_condition
from crowdtrain.testing.wanlab import HostSpec, Lab, Scenario
from tests.harness import FAST_HEARTBEAT_ENV

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2"),
]

ENV = {**os.environ, **FAST_HEARTBEAT_ENV, "CROWDTRAIN_NUM_THREADS": "1"}


def read_node_file(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None


def test_daemons_in_two_namespaces_join_over_the_lab_network(tmp_path: Path) -> None:
    scenario = Scenario(name="pair", hosts=(HostSpec(name="home", count=2, upload_mbps=50, download_mbps=50),))
    with Lab(scenario) as lab:
        first, second = lab.hosts
        founder_log = open(tmp_path / "founder.log", "w")
        lab.spawn(first, [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(tmp_path / "a")],
                  stdout=founder_log, stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
        founder = await_condition(lambda: read_node_file(tmp_path / "a"), 90, "the founder's node.json")
        lab_address = next(address for address in founder["multiaddrs"] if f"/ip4/{first.address}/" in address)
        assert "/tcp/31330/" in lab_address, "the default listen port on all interfaces"
        await_condition(
            lambda: f"crowdtrain run --initial-peers {lab_address}" in (tmp_path / "founder.log").read_text(),
            30,
            "the join command with the lab address",
        )
        lab.spawn(second, [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(tmp_path / "b"),
                           "--initial-peers", lab_address], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                  env=ENV)  # fmt: skip
        joiner = await_condition(lambda: read_node_file(tmp_path / "b"), 90, "the joiner's node.json")

        def both_seen_from_second_host() -> bool:
            status = subprocess.run(
                ["ip", "netns", "exec", second.namespace, sys.executable, "-m", "crowdtrain", "status", "--json",
                 "--state-dir", str(tmp_path / "b")],
                capture_output=True, text=True, timeout=60, env=ENV,
            )  # fmt: skip
            if status.returncode != 0:
                return False
            return {peer["peer_id"] for peer in json.loads(status.stdout)["peers"]} == {
                founder["peer_id"],
                joiner["peer_id"],
            }

        await_condition(both_seen_from_second_host, 60, "both peers in status on the second host", poll_s=1)
