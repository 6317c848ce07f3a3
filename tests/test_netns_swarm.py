"""Daemons on two hosts of the WAN lab: default listen address, the printed join command, status across hosts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lab.fixtures import tiny_run_file
from lab.processes import await_condition
from lab.wanlab import HostSpec, Lab, Scenario

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


@pytest.mark.timeout(300)
def test_a_joiner_on_a_slow_link_catches_up_with_a_swarm_that_steps_faster_than_its_download(
    tmp_path: Path,
) -> None:
    """A founder stepping every fraction of a second (the tiny model, a 16-sample global batch) and a joiner whose
    state download over a 1 Mbit/s link takes seconds: the swarm holds its step while the joiner downloads, and the
    joiner then trains with it. Without the hold the joiner downloaded again at every step and never trained (seen
    on a GPU with llama-85m: 13 downloads in 75 s, issue 12)."""
    run_file = tmp_path / "fast.toml"
    run_file.write_text(tiny_run_file("fast-steps", 16))
    scenario = Scenario(
        name="slowjoin",
        hosts=(
            HostSpec(name="fast", upload_mbps=1000, download_mbps=1000),
            HostSpec(name="home", upload_mbps=20, download_mbps=1),
        ),
    )
    env = {**ENV, "CROWDTRAIN_MICRO_BATCH_SIZE": "8"}
    with Lab(scenario) as lab:
        fast, home = lab.hosts
        founder_log, joiner_log = tmp_path / "founder.log", tmp_path / "joiner.log"
        daemon = [sys.executable, "-m", "crowdtrain", "run", "--role", "trainer"]
        lab.spawn(fast, [*daemon, "--state-dir", str(tmp_path / "a"), "--run-file", str(run_file)],
                  stdout=open(founder_log, "w"), stderr=subprocess.STDOUT, env=env)  # fmt: skip
        founder = await_condition(lambda: read_node_file(tmp_path / "a"), 90, "the founder's node.json")
        await_condition(lambda: "epoch 20: loss" in founder_log.read_text(), 90, "the founder at epoch 20")
        address = next(address for address in founder["multiaddrs"] if f"/ip4/{fast.address}/" in address)
        lab.spawn(home, [*daemon, "--state-dir", str(tmp_path / "b"), "--initial-peers", address],
                  stdout=open(joiner_log, "w"), stderr=subprocess.STDOUT, env=env)  # fmt: skip
        await_condition(lambda: steps_since_download(joiner_log.read_text()) >= 5, 150, "5 steps with the swarm")
        assert "download the swarm's state: holding the step of epoch" in founder_log.read_text()
        assert re.search(r"held the step of epoch \d+ for [\d.]+ s: 1 of 1 caught up", founder_log.read_text())


def steps_since_download(log: str) -> int:
    """Global steps with a loss of the node's own (micro-batches computed at the swarm's epoch), one epoch after
    another, since its last state download."""
    after = log.rsplit("downloaded and verified the state", 1)[-1] if "downloaded and verified" in log else ""
    epochs = [int(epoch) for epoch in re.findall(r"epoch (\d+): loss \d", after)]
    return sum(1 for before, epoch in zip(epochs, epochs[1:], strict=False) if epoch == before + 1)
