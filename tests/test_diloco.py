"""DiLoCo mode with real daemons on loopback: inner steps alone, outer rounds averaged together, a joiner syncs."""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from lab.fixtures import tiny_run_file
from lab.processes import await_condition
from lab.swarm import Daemon, StatusWatcher

from tests.harness import start_daemon, watch_status

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

INNER_STEPS = 16
RUN_FILE = tiny_run_file(
    "tiny-diloco",
    128,
    mode="diloco",
    sections=f"""
[diloco]
inner_steps = {INNER_STEPS}
outer_learning_rate = 0.7
outer_momentum = 0.9
compression = "int8"
""",
)

ENV = {"CROWDTRAIN_MICRO_BATCH_SIZE": "8", "CROWDTRAIN_NUM_THREADS": "1"}


def averaged_rounds(daemon: Daemon) -> set[int]:
    return {int(number) for number in re.findall(r"outer round (\d+): averaged with the swarm", daemon.log())}


def solo_rounds(daemon: Daemon) -> set[int]:
    return {int(number) for number in re.findall(r"outer round (\d+): alone", daemon.log())}


def all_rounds(daemon: Daemon) -> set[int]:
    return averaged_rounds(daemon) | solo_rounds(daemon)


def held_out_scores(log: str, every: int) -> dict[int, float]:
    """The held-out losses a node's log shows, by epoch; each at an epoch divisible by `every`, or the first past one
    after the node took the swarm's state (it may jump over the multiple)."""
    scores: dict[int, float] = {}
    jumped = False
    for line in log.splitlines():
        jumped = jumped or "took the swarm's state" in line
        scored = re.search(r"epoch (\d+): held-out loss ([\d.]+) on 32 windows", line)
        if scored is None:
            continue
        epoch = int(scored[1])
        assert epoch % every == 0 or jumped, f"scored at epoch {epoch} with no jump since the last score:\n{log}"
        assert not scores or epoch // every > max(scores) // every, f"scored twice within {every} epochs:\n{log}"
        scores[epoch], jumped = float(scored[2]), False
    return scores


def snapshot_when(watcher: StatusWatcher, daemons: list[Daemon], epoch: int, timeout_s: float) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        snapshot = watcher.latest()
        if snapshot is None:
            return None
        peers = {peer["peer_id"]: peer for peer in snapshot["peers"]}
        epochs = [peers.get(daemon.peer_id, {}).get("epoch", -1) for daemon in daemons]
        return snapshot if min(epochs) >= epoch else None

    return await_condition(reached, timeout_s, f"every peer at outer round {epoch}", poll_s=1)


def test_two_peers_average_outer_rounds_and_learn_and_a_joiner_takes_the_swarms_round(tmp_path: Path) -> None:
    run_file = tmp_path / "diloco.toml"
    run_file.write_text(RUN_FILE)
    # the founder scores its replica on the held-out windows every second outer round (eval_every)
    founder_env = {**ENV, "CROWDTRAIN_EVAL_EVERY": "2"}
    founder = start_daemon(tmp_path / "node0", "--run-file", str(run_file), env=founder_env).await_ready()
    second = start_daemon(tmp_path / "node1", initial_peers=[founder.address], env=ENV).await_ready()
    # outer rounds after the second joined are averaged by both: the same rounds on both sides
    await_condition(
        lambda: len(averaged_rounds(founder) & averaged_rounds(second)) >= 3, 200, "three outer rounds averaged by both"
    )
    snapshot = snapshot_when(watch_status(founder), [founder, second], max(averaged_rounds(founder)), timeout_s=60)
    assert snapshot["run"]["run_id"] == "tiny-diloco"
    daemons = {founder.peer_id: founder, second.peer_id: second}
    for peer in snapshot["peers"]:
        assert peer["loss"] is not None and peer["loss"] < math.log(260) - 1.0, "the swarm learned"
        assert peer["partial_averages"] == 0
        # status shows the mode: H, the round's bytes (an averaged round sent some), the time spent computing
        training = peer["training"]
        assert (training["mode"], training["compression"], training["inner_steps"]) == ("diloco", "int8", INNER_STEPS)
        assert 0 <= training["inner_step"] <= INNER_STEPS
        assert 0 < training["compute_utilisation"] <= 1
        if peer["epoch"] in averaged_rounds(daemons[peer["peer_id"]]):  # the round it shows was averaged
            assert training["round_bytes_sent"] > 0
    assert snapshot["run"]["epoch"] >= 4
    scores = held_out_scores(founder.log(), every=2)
    assert scores, founder.log()
    assert scores[max(scores)] < math.log(260) - 1.0, "the held-out loss fell with the training loss"
    assert "held-out loss" not in second.log()
    # a late joiner downloads the outer state (verified) and continues from the swarm's round, at least the
    # last one averaged before it started (the swarm goes on averaging while it joins)
    averaged_before_joining = max(averaged_rounds(founder) & averaged_rounds(second))
    late = start_daemon(tmp_path / "node2", initial_peers=[founder.address], env=ENV).await_ready()
    await_condition(lambda: "took the swarm's state of outer round" in late.log(), 120, "the joiner to sync")
    joined_round = int(re.findall(r"took the swarm's state of outer round (\d+)", late.log())[0])
    assert joined_round >= averaged_before_joining

    # A peer that dies costs the others one outer round at most: the round it was part of (its all-reduce may
    # have been running, with overlap, while the others computed), then they average without it.
    await_condition(
        lambda: averaged_rounds(founder) & averaged_rounds(second) & averaged_rounds(late), 200, "a round of three"
    )
    late.signal(signal.SIGKILL)
    killed_after = max(all_rounds(founder) | all_rounds(second))
    await_condition(
        lambda: any(number > killed_after + 1 for number in averaged_rounds(founder) & averaged_rounds(second)),
        200,
        "the survivors to average a round without the dead peer",
    )
    for survivor in (founder, second):
        lost = {number for number in solo_rounds(survivor) if number > killed_after}
        assert len(lost) <= 1, f"{survivor.peer_id} lost rounds {sorted(lost)} to the dead peer"
