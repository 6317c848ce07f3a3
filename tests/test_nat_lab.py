"""Volunteers behind a home NAT (the WAN lab's masquerading routers, nothing forwarded) in a real swarm."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lab.fixtures import tiny_run_file, tiny_spes_run_file
from lab.processes import await_condition
from lab.wanlab import Host, HostSpec, Lab, Scenario

from tests.harness import DAEMON_ENV, NEEDS_NAT_LAB

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(300),
    NEEDS_NAT_LAB,
]

DILOCO = tiny_run_file(
    "nat-diloco",
    128,
    mode="diloco",
    sections="""
[diloco]
inner_steps = 16
outer_learning_rate = 0.7
outer_momentum = 0.9
compression = "int8"
""",
)
SPES = tiny_spes_run_file("nat-spes")
"""A tiny OLMoE (2 layers of 8 experts: 16 to own), as tests/test_spes_swarm.py runs it."""
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


@dataclass(frozen=True)
class Pair:
    """A founder on the lab's public host and a volunteer behind the NAT that joined it, each logging to a file."""

    founder: subprocess.Popen
    joiner: subprocess.Popen
    founder_log: Path
    joiner_log: Path
    founded: dict[str, Any]
    """The founder's node.json."""
    address: str
    """The founder's lab address, the one the volunteer joined through."""

    def await_rounds_together(self, num_rounds: int, timeout_s: float) -> None:
        """Wait until both averaged `num_rounds` outer rounds together; fail at once if either daemon exits."""

        def averaged_together() -> bool:
            for process, log in ((self.founder, self.founder_log), (self.joiner, self.joiner_log)):
                assert process.poll() is None, f"a daemon exited ({process.returncode}):\n{log.read_text()[-3000:]}"
            return len(averaged_rounds(self.founder_log) & averaged_rounds(self.joiner_log)) >= num_rounds

        await_condition(averaged_together, timeout_s, f"{num_rounds} outer rounds averaged with the NATed joiner")


def start_pair(lab: Lab, tmp_path: Path, run_file: Path) -> Pair:
    """Found a run of `run_file` on the public host and join it from the NATed one."""
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
    return Pair(founder, joiner, founder_log, joiner_log, founded, address)


@contextlib.contextmanager
def pair_in_lab(tmp_path: Path, run_text: str, timeout_s: float) -> Iterator[tuple[Host, Pair, dict[str, Any]]]:
    """In the NAT lab, a pair training a run of `run_text` that averaged 2 outer rounds together within `timeout_s`:
    the NATed host, the pair and the joiner's node.json; the lab is torn down after."""
    run_file = tmp_path / "run.toml"
    run_file.write_text(run_text)
    with Lab(SCENARIO) as lab:
        pair = start_pair(lab, tmp_path, run_file)
        pair.await_rounds_together(2, timeout_s)
        joined = node_file(tmp_path / "b")
        assert joined is not None
        yield lab.hosts[1], pair, joined


def test_a_diloco_volunteer_behind_nat_averages_outer_rounds_with_a_public_founder(tmp_path: Path) -> None:
    with pair_in_lab(tmp_path, DILOCO, 180) as (home, pair, joined):
        # the join command it prints names the founder it joined through, never its own LAN address
        printed = re.findall(r"crowdtrain run --initial-peers (\S+)", pair.joiner_log.read_text())
        assert printed == [pair.address], f"the NATed joiner printed {printed}"
        assert joined["join_address"] == pair.address, "node.json holds the address it printed"
        assert "works only on this node's own network" in pair.founder_log.read_text(), "the lab's 10.x is private"
        shown = status_from(home, tmp_path / "b")  # both have published their status for rounds by now
        peers = {peer["peer_id"]: peer for peer in shown["peers"]}
        assert peers[joined["peer_id"]]["reachable"] is False, "peers can't dial it, and it knows"
        assert peers[joined["peer_id"]]["reachability_measured"] is True
        assert peers[pair.founded["peer_id"]]["reachable"] is True


@pytest.mark.timeout(420)
def test_a_spes_volunteer_behind_nat_owns_no_expert_and_every_round_gets_every_copy(tmp_path: Path) -> None:
    with pair_in_lab(tmp_path, SPES, 300) as (home, pair, joined):
        shown = status_from(home, tmp_path / "b")
        trained = {peer["peer_id"]: peer["training"] for peer in shown["peers"]}
        assert trained[joined["peer_id"]]["experts_owned"] == 0, "nobody could fetch an expert it owned"
        assert trained[pair.founded["peer_id"]]["experts_owned"] == 16
        assert "did not come" not in pair.founder_log.read_text(), "no copy was asked of the NATed node"
        # The joiner's first exchange asks for the round of the state it took, which the founder (alone, rounds
        # well under a second) may have left by then: those copies are "behind", never undialable.
        assert "failed to dial" not in pair.joiner_log.read_text()
        assert pair.joiner_log.read_text().count("peers can't dial this node, so it owns no experts") == 1, "said once"
        assert "owns 16 of 16 experts" in pair.founder_log.read_text()
