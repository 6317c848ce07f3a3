"""Real daemons (real p2pd) on loopback: they see each other, keep their identity, and leave."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from lab.processes import await_condition
from lab.procfs import children, command_line, session_alive
from lab.swarm import peer_ids, status_json

from tests.harness import start_daemon

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def start_swarm(tmp_path: Path, num_daemons: int, env: dict[str, str] | None = None) -> list:
    founder = start_daemon(tmp_path / "node0", env=env).await_ready()
    joiners = [
        start_daemon(tmp_path / f"node{i}", initial_peers=[founder.address], env=env) for i in range(1, num_daemons)
    ]
    return [founder, *(joiner.await_ready() for joiner in joiners)]


def test_two_daemons_see_each_other_and_json_logs_parse(tmp_path: Path) -> None:
    founder = start_daemon(tmp_path / "node0").await_ready()
    joiner = start_daemon(tmp_path / "node1", "--log-format", "json", initial_peers=[founder.address]).await_ready()
    expected = {founder.peer_id, joiner.peer_id}
    for daemon in (founder, joiner):
        # Each `status` is a DHT client of its own: it must not be counted as a peer.
        snapshot = await_condition(
            lambda d=daemon: (s := status_json("--state-dir", str(d.state_dir))) and peer_ids(s) == expected and s,
            timeout_s=30,
            what="both peers in status",
        )
        assert snapshot["run"]["run_id"] == "demo"
        assert snapshot["run"]["num_peers"] == 2
        assert snapshot["run"]["target_batch_size"] == 1024
        peer = snapshot["peers"][0]
        # "trainer" until the first plan, then the plan's roles: both peers compute and aggregate.
        assert peer["roles"] in (["trainer"], ["trainer", "aggregator"]) and peer["device"].startswith("cpu")
        assert peer["loss"] is None or peer["loss"] > 0  # null until the first training step
        assert peer["upload_mbps"] is None or peer["upload_mbps"] > 0  # null until the link probe
        assert peer["multiaddrs"] and all(address.startswith("/ip4/127.0.0.1/") for address in peer["multiaddrs"])
    assert joiner.info["run_id"] == "demo"
    assert "crowdtrain run --initial-peers /ip4/127.0.0.1/" in founder.log()
    lines = [line for line in joiner.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line of the JSON-logging joiner a JSON object
    assert any(record["message"].startswith("ready: peer ") for record in records)
    assert all({"ts", "level", "logger", "peer", "message"} <= record.keys() for record in records)


def test_five_daemons_see_each_other(tmp_path: Path) -> None:
    daemons = start_swarm(tmp_path, 5)
    expected = {daemon.peer_id for daemon in daemons}
    assert len(expected) == 5
    await_condition(
        lambda: peer_ids(status_json("--initial-peers", daemons[-1].address)) == expected,
        timeout_s=45,
        what="all five peers in status",
    )


def test_identity_survives_restart(tmp_path: Path) -> None:
    (first,) = start_swarm(tmp_path, 1)
    peer_id = first.peer_id
    key_bytes = (tmp_path / "node0" / "identity.key").read_bytes()
    assert (tmp_path / "node0" / "identity.key").stat().st_mode & 0o777 == 0o600
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    assert not (tmp_path / "node0" / "node.json").exists(), "a clean exit removes node.json"
    second = start_daemon(tmp_path / "node0").await_ready()
    assert second.peer_id == peer_id
    assert (tmp_path / "node0" / "identity.key").read_bytes() == key_bytes


def test_sigterm_leaves_status_at_once_and_sigkill_when_the_record_expires(tmp_path: Path) -> None:
    founder = start_daemon(tmp_path / "node0").await_ready()
    joining = {"initial_peers": [founder.address]}
    leaver = start_daemon(tmp_path / "node1", env={"CROWDTRAIN_STATUS_TTL_S": "600"}, **joining)  # can't expire
    victim = start_daemon(tmp_path / "node2", env={"CROWDTRAIN_STATUS_TTL_S": "8"}, **joining)
    leaver.await_ready()
    victim.await_ready()
    everyone = {founder.peer_id, leaver.peer_id, victim.peer_id}
    await_condition(lambda: peer_ids(status_json("--initial-peers", founder.address)) == everyone, 30, "all three")

    leaver.signal(signal.SIGTERM)
    assert leaver.wait(timeout_s=30) == 0
    snapshot = status_json("--initial-peers", founder.address)
    assert peer_ids(snapshot) == {founder.peer_id, victim.peer_id}, "a clean exit withdraws the record at once"
    await_condition(lambda: not session_alive(leaver.process.pid), 10, "p2pd and the DHT process to exit too")

    victim.signal(signal.SIGKILL)
    victim.wait()
    await_condition(lambda: not session_alive(victim.process.pid), 15, "the victim's p2pd and DHT process to exit")
    await_condition(
        lambda: peer_ids(status_json("--initial-peers", founder.address)) == {founder.peer_id},
        timeout_s=40,
        what="the killed peer's record to expire",
    )


def test_daemon_exits_1_when_its_dht_process_dies(tmp_path: Path) -> None:
    (daemon,) = start_swarm(tmp_path, 1)
    dht_pid = await_condition(lambda: _dht_process_of(daemon.process.pid), 30, "the daemon's DHT process")
    os.kill(dht_pid, signal.SIGTERM)
    assert daemon.wait(timeout_s=60) == 1, "exits within the leave deadline, even if hivemind blocks"
    assert "the DHT process died unexpectedly" in daemon.log()
    assert not (tmp_path / "node0" / "node.json").exists()
    await_condition(lambda: not session_alive(daemon.process.pid), 15, "no process of the daemon left behind")


def _dht_process_of(daemon_pid: int) -> int | None:
    """The child of the daemon whose own child is p2pd."""
    for child in children(daemon_pid):
        if any(b"p2pd" in command_line(grandchild) for grandchild in children(child)):
            return child
    return None
