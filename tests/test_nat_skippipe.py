"""A SkipPipe volunteer behind a home NAT (the WAN lab's masquerading router, nothing forwarded) serves a stage of a
real swarm: the stage-0 founder calls it over the connection it keeps open."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lab.fixtures import tiny_skippipe_run_file
from lab.processes import await_condition
from lab.swarm import StatusWatcher
from lab.wanlab import Lab

from tests.harness import NEEDS_NAT_LAB, STARTED
from tests.test_nat_lab import SCENARIO, node_file, start_pair

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300), NEEDS_NAT_LAB]

SKIPPIPE = tiny_skippipe_run_file("nat-skippipe")


def iterations_of_two(log: Path) -> list[int]:
    return [int(i) for i, n in re.findall(r"iteration (\d+): (\d+) nodes", log.read_text()) if n == "2"]


def test_a_skippipe_volunteer_behind_nat_serves_a_stage_the_public_founder_calls(tmp_path: Path) -> None:
    run_file = tmp_path / "skippipe.toml"
    run_file.write_text(SKIPPIPE)
    with Lab(SCENARIO) as lab:
        home = lab.hosts[1]
        pair = start_pair(lab, tmp_path, run_file)

        def together() -> bool:
            for process, log in ((pair.founder, pair.founder_log), (pair.joiner, pair.joiner_log)):
                assert process.poll() is None, f"a daemon exited ({process.returncode}):\n{log.read_text()[-3000:]}"
            return bool(iterations_of_two(pair.founder_log) and iterations_of_two(pair.joiner_log))

        await_condition(together, 150, "an iteration of the founder and the NATed volunteer")
        joiner_log = pair.joiner_log.read_text()
        assert "peers can't dial this node: it keeps a connection open" in joiner_log
        assert re.search(r"serving SkipPipe stage 1 of 2", joiner_log), "it holds the stage the founder calls"
        first = iterations_of_two(pair.founder_log)[0]
        assert iterations_of_two(pair.joiner_log)[0] == first, "the roster applies at one iteration on both"
        joined = node_file(tmp_path / "b")
        assert joined is not None

        watcher = StatusWatcher(
            STARTED, pair.address, 1.0, tmp_path / "status.log", ["ip", "netns", "exec", home.namespace]
        )

        def trained() -> dict[str, dict] | None:
            peers = {peer["peer_id"]: peer for peer in (watcher.latest() or {"peers": []})["peers"]}
            done = len(peers) == 2 and all(
                (peer.get("training") or {}).get("skippipe_iteration", 0) >= first + 3 and peer["loss"] is not None
                for peer in peers.values()
            )
            return peers if done else None

        peers = await_condition(trained, 150, "both nodes three iterations further, each with a loss")
        assert peers[joined["peer_id"]]["reachable"] is False, "peers can't dial it, and it knows"
        assert peers[joined["peer_id"]]["training"]["skippipe_stage"] == 1
        founder_log = pair.founder_log.read_text()
        # every hop of the founder's microbatches through stage 1 reached the NATed node: none failed over
        assert "asking another replica" not in founder_log, founder_log[-3000:]
        assert "Traceback" not in founder_log + pair.joiner_log.read_text()
