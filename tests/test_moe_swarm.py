"""Real expert hosts and trainers on loopback: a DMoE run trains, loses a host, heals; hivemind clients interoperate."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from lab.fixtures import TINY_MODEL_TOML, tiny_run_file
from lab.processes import await_condition
from lab.procfs import session_alive
from lab.swarm import Daemon, StatusWatcher, crowdtrain, status_json

from tests.harness import start_daemon, watch_status

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

_TINY = tomllib.loads(TINY_MODEL_TOML)
HIDDEN_SIZE, SEQUENCE_LENGTH = _TINY["model"]["config"]["hidden_size"], _TINY["data"]["sequence_length"]
# Two DMoE layers over a 2x2 grid: 8 experts, 4 per host, so each host serves half the grid.
RUN_FILE = tiny_run_file(
    "tiny-moe",
    128,
    sections="""
[moe]
grid = [2, 2]
expert_hidden_size = 64
k = 2
forward_timeout_s = 5.0
backward_timeout_s = 5.0
""",
)

ENV = {
    "CROWDTRAIN_MICRO_BATCH_SIZE": "8",
    "CROWDTRAIN_NUM_THREADS": "1",
    "CROWDTRAIN_MAX_EXPERTS": "4",
    # A killed host's status and expert announcements expire after this long; then others take over.
    "CROWDTRAIN_STATUS_TTL_S": "8",
}
NUM_EXPERTS = 8
STATUS_INTERVAL_S = 1.0
"""The harness's heartbeat interval."""


def peers_by_id(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {peer["peer_id"]: peer for peer in snapshot["peers"]}


def await_snapshot(watcher: StatusWatcher, check: Any, timeout_s: float, what: str) -> dict[str, Any]:
    def poll() -> dict[str, Any] | None:
        snapshot = watcher.latest()
        return snapshot if snapshot is not None and check(snapshot) else None

    return await_condition(poll, timeout_s, what, poll_s=1)


def live_experts(snapshot: dict[str, Any]) -> int:
    return int(snapshot["run"]["expert_grid"]["live"])


EPOCH_LINE = re.compile(r"epoch (\d+): loss ([0-9.]+)")


def epochs(trainer: Daemon) -> dict[int, float]:
    """The epochs a trainer logged reaching, with its loss then (reading logs is cheaper than `status` here)."""
    return {int(epoch): float(loss) for epoch, loss in EPOCH_LINE.findall(trainer.log())}


def await_epoch(trainers: list[Daemon], epoch: int, timeout_s: float, what: str) -> None:
    await_condition(lambda: all(max(epochs(t), default=0) >= epoch for t in trainers), timeout_s, what, poll_s=0.5)


def test_dmoe_swarm_trains_loses_a_host_and_heals(tmp_path: Path) -> None:
    run_file = tmp_path / "tiny-moe.toml"
    run_file.write_text(RUN_FILE)
    host1 = start_daemon(tmp_path / "host1", "--run-file", str(run_file), "--role", "expert-host", env=ENV)
    host1.await_ready()
    await_condition(lambda: "serving 4 experts" in host1.log(), 60, "the first host to serve 4 experts")
    time.sleep(2 * STATUS_INTERVAL_S)  # its next heartbeats publish them, so the second host places around them
    host2 = start_daemon(tmp_path / "host2", "--role", "expert-host", initial_peers=[host1.address], env=ENV)
    trainers = [
        start_daemon(tmp_path / f"trainer{i}", "--role", "trainer", initial_peers=[host1.address], env=ENV)
        for i in range(2)
    ]
    for daemon in (host2, *trainers):
        daemon.await_ready()

    await_epoch(trainers, 3, 150, "trainers at epoch 3")
    # A trainer that starts late catches up by loading the swarm's state and may log only epoch 3: the falling
    # loss is the swarm's, from the first epoch either trainer logged to the last.
    logged = sorted((epoch, loss) for trainer in trainers for epoch, loss in epochs(trainer).items())
    (first_epoch, first_loss), (last_epoch, last_loss) = logged[0], logged[-1]
    assert first_epoch < last_epoch and last_loss < first_loss, f"loss falls as the swarm trains: {logged}"
    covered = status_json("--initial-peers", host2.address)
    hosted = {peer["peer_id"]: set(peer["experts"]) for peer in covered["peers"] if "expert-host" in peer["roles"]}
    assert hosted[host1.peer_id].isdisjoint(hosted[host2.peer_id])
    grid = covered["run"]["expert_grid"]
    assert (grid["live"], grid["total"], grid["min_replicas"], grid["max_replicas"]) == (8, 8, 1, 1)

    host1.signal(signal.SIGKILL)
    await_condition(lambda: not session_alive(host1.process.pid), 20, "every process of the killed host to exit")
    epoch_at_kill = max(max(epochs(trainer)) for trainer in trainers)
    await_epoch(trainers, epoch_at_kill + 2, 120, "trainers to keep training on the surviving experts")
    watcher = watch_status(host2)
    shrunk = await_snapshot(watcher, lambda s: live_experts(s) == 4, 60, "the killed host's experts to leave the grid")
    assert host1.peer_id not in peers_by_id(shrunk)

    # The newcomer has room for 6 experts: the 4 lost ones, and replicas of 2 of host2's.
    newcomer_env = {**ENV, "CROWDTRAIN_MAX_EXPERTS": "6", "CROWDTRAIN_REPLICA_AVERAGE_INTERVAL_S": "2"}
    host3 = start_daemon(tmp_path / "host3", "--role", "expert-host", initial_peers=[host2.address], env=newcomer_env)
    host3.await_ready()
    healed = await_snapshot(
        watcher,
        lambda s: live_experts(s) == NUM_EXPERTS and s["run"]["expert_grid"]["max_replicas"] == 2,
        60,
        "a new host to take over the lost experts and replicate two more",
    )
    served = set(peers_by_id(healed)[host3.peer_id]["experts"])
    replicated = served - hosted[host1.peer_id]
    assert hosted[host1.peer_id] <= served and len(replicated) == 2 and replicated <= hosted[host2.peer_id]
    copied = set(re.findall(r"starting expert (\S+) from the weights of its replica", host3.log()))
    assert copied == replicated, "a new replica starts from the live replica's weights, not from scratch"
    await_condition(lambda: "averaged 2 replicated experts" in host3.log(), 30, "the replicas to average", poll_s=0.5)
    epoch_healed = max(max(epochs(trainer)) for trainer in trainers)
    await_epoch(trainers, epoch_healed + 1, 120, "trainers to train on the healed grid")
    for trainer in trainers:
        assert "Traceback" not in trainer.log()
        assert "non-finite loss" not in trainer.log(), "a sequence whose experts all died must not yield NaN"


def test_hosted_experts_answer_an_unmodified_hivemind_client_and_outlive_a_restart(tmp_path: Path) -> None:
    run_file = tmp_path / "tiny-moe.toml"
    run_file.write_text(RUN_FILE)
    args = ("--run-file", str(run_file), "--role", "expert-host")
    host = start_daemon(tmp_path / "host", *args, env=ENV).await_ready()
    await_condition(lambda: "serving 4 experts" in host.log(), 60, "the host to serve 4 experts")
    uid = re.findall(r"serving 4 experts: ([^,\s]+)", host.log())[0]
    trained = call_with_hivemind_client(host, uid)

    host.signal(signal.SIGTERM)
    assert host.wait(timeout_s=40) == 0
    saved = sorted(path.stem for path in (host.state_dir / "experts" / "tiny-moe").glob("*.pt"))
    assert len(saved) == 4 and uid in saved
    restarted = start_daemon(host.state_dir, *args, env=ENV).await_ready()
    await_condition(lambda: restarted.log().count("serving 4 experts") == 2, 60, "the restarted host to serve again")
    assert restarted.log().count("restored expert") == 4
    assert torch.allclose(call_with_hivemind_client(restarted, uid, train=False), trained, atol=1e-5), (
        "the restarted host serves the weights its expert had trained to"
    )


HIVEMIND_CLIENT = """
import sys, hivemind, torch
from hivemind.moe.server.dht_handler import get_experts

address, uid, peer_id, train, out = sys.argv[1:6]
sequence_length, hidden_size = int(sys.argv[6]), int(sys.argv[7])
dht = hivemind.DHT(initial_peers=[address], client_mode=True, use_ipfs=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   start=True)
(expert,) = get_experts(dht, [uid])
assert expert is not None and expert.peer_id.to_base58() == peer_id, expert
inputs = torch.randn(3, sequence_length, hidden_size, generator=torch.Generator().manual_seed(0))
if train == "1":
    inputs.requires_grad_(True)
    outputs = expert(inputs)
    assert outputs.shape == inputs.shape and torch.isfinite(outputs).all()
    outputs.sum().backward()
    assert inputs.grad is not None and inputs.grad.abs().sum() > 0
torch.save(expert(inputs.detach()).detach(), out)
dht.shutdown()
"""


def call_with_hivemind_client(host: Daemon, uid: str, *, train: bool = True) -> torch.Tensor:
    """Find `uid` with hivemind's get_experts and call it as a RemoteExpert, in a process of its own.

    Returns the expert's output on a fixed input; with `train`, a backward pass goes first (the host's
    optimizer steps, so the output is the trained expert's).
    """
    out = host.state_dir.parent / f"client-output-{train}.pt"
    command = [sys.executable, "-c", HIVEMIND_CLIENT, host.address, uid, host.peer_id, "1" if train else "0", str(out)]
    command += [str(SEQUENCE_LENGTH), str(HIDDEN_SIZE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_expert_host_of_a_dense_run_is_bad_input(tmp_path: Path) -> None:
    result = crowdtrain(
        "run", "--state-dir", str(tmp_path / "host"), "--listen", "/ip4/127.0.0.1/tcp/0", "--run-file", "demo",
        "--role", "expert-host",
        env={"CROWDTRAIN_BOOTSTRAP_TIMEOUT_S": "10"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "crowdtrain: Run 'demo' is a dense run with no experts to host; use --role trainer, "
        "or found a DMoE run (e.g. --run-file demo-moe)."
    )
    assert "Traceback" not in result.stderr
