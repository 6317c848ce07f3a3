"""Roles from measurement on loopback: links measured by probes, an undialable node made a client, an
auxiliary aggregator that only averages, and shares published in status."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from lab.processes import await_condition

from tests.harness import start_daemon, watch_status
from tests.test_training import RUN_FILE, TRAIN_ENV, await_epoch, peers_by_id

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_measured_links_an_undialable_client_and_an_auxiliary_aggregator(tmp_path: Path) -> None:
    run_file = tmp_path / "tiny.toml"
    run_file.write_text(RUN_FILE)
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file), env=TRAIN_ENV).await_ready()
    hidden_address = f"/ip4/127.0.0.1/tcp/{closed_port()}"
    hidden = start_daemon(
        tmp_path / "hidden", "--announce", hidden_address, initial_peers=[founder.address], env=TRAIN_ENV
    )
    helper = start_daemon(tmp_path / "helper", "--role", "aggregator", initial_peers=[founder.address], env=TRAIN_ENV)
    hidden.await_ready()
    helper.await_ready()

    watcher = watch_status(founder)

    def settled() -> dict[str, Any] | None:
        peers = peers_by_id(watcher.latest() or {"peers": []})
        wanted = (founder.peer_id, hidden.peer_id, helper.peer_id)
        if not set(wanted) <= peers.keys() or peers[hidden.peer_id]["reachability_measured"] is False:
            return None
        # The founder serves one bandwidth probe per direction at a time: a joiner whose first round came while
        # the other's ran was refused and measures in a later round.
        # A joiner retries a direction it could not measure within 30 s (roles.NO_PEERS_RETRY_S).
        joiners = (peers[hidden.peer_id], peers[helper.peer_id])
        if any(joiner[link] is None for joiner in joiners for link in ("upload_mbps", "download_mbps")):
            return None
        return peers

    peers = await_condition(
        settled, 120, "all three peers published, the hidden one's reachability and both joiners' links both ways", 1
    )
    hidden_status, helper_status = peers[hidden.peer_id], peers[helper.peer_id]
    # nobody could open a connection to the announced address: a client that trains but never aggregates
    assert hidden_status["reachable"] is False
    assert "client" in hidden_status["roles"] and "aggregator" not in hidden_status["roles"]
    assert hidden_status["aggregation_share"] == 0.0
    assert "unreachable" in hidden.log() or "could not dial" in hidden.log()
    # the joiners probed the founder's links at start: measured, not declared
    for status in (hidden_status, helper_status):
        assert status["upload_mbps"] is not None and status["upload_mbps"] > 0
        assert status["download_mbps"] is not None and status["download_mbps"] > 0
    assert helper_status["reachable"] is True and helper_status["reachability_measured"] is True
    # --role aggregator: computes nothing, aggregates a share
    assert helper_status["roles"] == ["aggregator"] and helper_status["role_override"] == "aggregator"
    assert helper_status["aggregation_share"] > 0
    assert peers[founder.peer_id]["measured_samples_per_second"] > 0

    # the swarm trains with the client and the auxiliary peer in it; the auxiliary one follows its epochs
    snapshot = await_epoch(watcher, [founder, hidden], 2, timeout_s=180)
    trained = peers_by_id(snapshot)
    assert trained[helper.peer_id]["samples_per_second"] == 0.0, "an auxiliary peer computes no gradients"
    assert trained[hidden.peer_id]["samples_per_second"] > 0, "a client trains"
    await_epoch(watcher, [helper], 2, timeout_s=60)
