"""SkipPipe mode with real daemons on loopback: nodes take stages from their declarations, a roster adds a joiner at
the same iteration on every node, the swarm trains, and `status` shows each node's stage."""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from lab.fixtures import tiny_skippipe_run_file
from lab.processes import await_condition
from lab.swarm import Daemon, crowdtrain

from tests.harness import start_daemon, watch_status

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

RUN_FILE = tiny_skippipe_run_file("tiny-skippipe", extra='gradient_dtype = "int8"')
ENV = {"CROWDTRAIN_MICRO_BATCH_SIZE": "4", "CROWDTRAIN_NUM_THREADS": "1"}


def iterations_with(daemon: Daemon, nodes: int) -> list[int]:
    """The iterations at which `daemon` began running with `nodes` nodes."""
    return [int(i) for i, n in re.findall(r"iteration (\d+): (\d+) nodes", daemon.log()) if int(n) == nodes]


def stage_of(daemon: Daemon) -> int:
    return int(re.findall(r"serving SkipPipe stage (\d+) of", daemon.log())[0])


def test_nodes_take_stages_a_joiner_enters_at_one_iteration_everywhere_and_the_swarm_learns(tmp_path: Path) -> None:
    run_file = tmp_path / "skippipe.toml"
    run_file.write_text(RUN_FILE)
    founder = start_daemon(tmp_path / "node0", "--run-file", str(run_file), env=ENV).await_ready()
    await_condition(lambda: "founded the SkipPipe roster" in founder.log(), 60, "the founder's roster")
    second = start_daemon(tmp_path / "node1", initial_peers=[founder.address], env=ENV).await_ready()
    # the founder serves stage 0 and the second the stage with no replica; the leader adds it two iterations
    # ahead, and both begin running with two nodes at the same iteration
    await_condition(lambda: iterations_with(founder, 2) and iterations_with(second, 2), 120, "an iteration of two")
    assert (stage_of(founder), stage_of(second)) == (0, 1)
    # the second declared its link as its probes (against the founder, before training) measured it; the founder,
    # alone when it probed, has none measured and counts latencies only
    assert "its link not measured" in founder.log()
    assert re.search(
        r"serving SkipPipe stage 1 of 2 \(\d+ ms per microbatch measured, its link [\d.]+ ms a hop", second.log()
    )
    assert iterations_with(founder, 2)[0] == iterations_with(second, 2)[0]

    third = start_daemon(tmp_path / "node2", initial_peers=[founder.address], env=ENV).await_ready()
    daemons = [founder, second, third]
    await_condition(lambda: all(iterations_with(d, 3) for d in daemons), 120, "an iteration of three")
    assert len({iterations_with(d, 3)[0] for d in daemons}) == 1, "the roster applies at one iteration everywhere"
    if stage_of(third) == 1:  # a second replica of stage 1 took its state from the first before its first iteration
        assert "took stage 1's state of iteration" in third.log()

    watcher = watch_status(founder)

    def trained() -> dict[str, Any] | None:
        snapshot = watcher.latest()
        if snapshot is None:
            return None
        peers = snapshot["peers"]
        training = [peer.get("training") or {} for peer in peers]
        # a node publishes no loss before 4 iterations with one (a joiner's count starts at its first iteration)
        done = len(peers) == 3 and all(
            t.get("skippipe_iteration", 0) >= iterations_with(founder, 3)[0] + 3 and peer.get("loss") is not None
            for peer, t in zip(peers, training, strict=True)
        )
        return snapshot if done else None

    snapshot = await_condition(trained, 150, "three nodes three iterations further, each with a loss")
    stages = sorted(peer["training"]["skippipe_stage"] for peer in snapshot["peers"])
    assert stages in ([0, 0, 1], [0, 1, 1])
    replicas = [stages.count(0), stages.count(1)]
    assert snapshot["run"]["skippipe"] == {
        "stages": 2,
        "skip_ratio": 0.0,
        "reorder": True,
        "replicas": replicas,
        "gradient_dtype": "int8",  # a stage's two replicas exchanged their gradients in int8 blocks
        "overlap_exchange": False,
    }
    for peer in snapshot["peers"]:
        assert peer["training"]["mode"] == "skippipe"
        assert peer["loss"] < math.log(260), "the swarm learned"
    for daemon in daemons:
        assert "Traceback" not in daemon.log()

    # eval takes each stage's weights from the swarm (no node's checkpoint holds the trained model) and scores the
    # held-out windows through the whole model and without stage 1
    evaluated = crowdtrain(
        "eval", "--run-file", str(run_file), "--initial-peers", founder.address, "--drop", "1",
        "--batches", "2", "--batch-size", "4", "--state-dir", str(tmp_path / "eval"), "--json",
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    scores = json.loads(evaluated.stdout)
    assert scores["untrained_stages"] == [] and scores["num_stages"] == 2 and scores["epoch"] > 0
    whole, without = scores["scores"]
    assert (whole["path"], without["path"], without["dropped"]) == ([0, 1], [0], [1])
    assert whole["loss"] < math.log(260) - 1.0, "the swarm's stages together learned"

    # a node SIGKILLed mid-run: the others stop waiting for it (a ping, a failed hop, done message or exchange), the
    # leader announces the two survivors, and both run with two nodes from one iteration on
    third.signal(signal.SIGKILL)
    killed_at = max(int(i) for i in re.findall(r"epoch (\d+):", founder.log()))
    survivors = [founder, second]

    def two_again() -> list[int] | None:
        after = [[i for i in iterations_with(d, 2) if i > killed_at - 2] for d in survivors]
        return after[0] if all(after) else None

    again = await_condition(two_again, 120, "the survivors to run with two nodes")
    assert all(again[0] in iterations_with(d, 2) for d in survivors), "the roster applies at one iteration everywhere"
    await_condition(
        lambda: all(max(map(int, re.findall(r"epoch (\d+):", d.log()))) > again[0] + 3 for d in survivors),
        60,
        "three more iterations after the roster dropped the dead node",
    )

    # Ctrl-C on each survivor in turn: each leaves cleanly (exit 0, its stage checkpointed), the second while its
    # iteration waits on the partner that left first, which used to wait out a hop deadline past the leave deadline
    for daemon, state_dir in ((founder, "node0"), (second, "node1")):
        daemon.signal(signal.SIGINT)
        assert daemon.wait(timeout_s=40) == 0, daemon.log()[-3000:]
        assert list((tmp_path / state_dir / "checkpoints").glob("*/*")), f"{state_dir} left no checkpoint"
