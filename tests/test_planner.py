"""Re-planning from peer statuses: capabilities from records, defaults for the unmeasured, hysteresis."""

from __future__ import annotations

import pytest

from crowdtrain import proto
from crowdtrain.averaging.plan import PlanProblem
from crowdtrain.averaging.planner import (
    DEFAULT_BANDWIDTH_MBPS,
    OwnCapabilities,
    Planner,
    plan_problem,
    swarm_capabilities,
)
from crowdtrain.manifest import demo

PROBLEM = PlanProblem(vector_size_bytes=10_000_000, target_batch_size=1024)
ME = OwnCapabilities(samples_per_second=100.0, upload_mbps=100.0, download_mbps=100.0, reachable=True)


def _status(peer_id: str, *, compute: float = 100.0, mbps: float | None = 100.0, **fields: object) -> proto.PeerStatus:
    status = proto.PeerStatus(peer_id=peer_id, measured_samples_per_second=compute, reachable=True)
    if mbps is not None:
        status.upload_mbps = status.download_mbps = mbps
    for name, value in fields.items():
        setattr(status, name, value)
    return status


def test_unmeasured_peers_get_the_median_of_the_measured() -> None:
    statuses = [_status("b", mbps=20.0), _status("c", mbps=None, compute=0.0)]
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, statuses)}
    assert peers["c"].upload_mbps == pytest.approx(60.0)  # median of 20 and 100
    assert peers["c"].samples_per_second == pytest.approx(100.0)
    assert peers["a"].upload_mbps == 100.0


def test_nobody_measured_means_a_default_bandwidth() -> None:
    me = OwnCapabilities(samples_per_second=None, upload_mbps=None, download_mbps=None, reachable=True)
    peers = swarm_capabilities("a", me, [_status("b", mbps=None)])
    assert {peer.upload_mbps for peer in peers} == {DEFAULT_BANDWIDTH_MBPS}


def test_live_throughput_stands_in_until_the_probe_reports() -> None:
    status = _status("b", compute=0.0)
    status.samples_per_second = 42.0
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, [status])}
    assert peers["b"].samples_per_second == 42.0


def test_our_own_record_in_the_dht_is_replaced_by_our_measurements() -> None:
    peers = swarm_capabilities("a", ME, [_status("a", mbps=1.0), _status("b")])
    assert [peer.upload_mbps for peer in peers if peer.peer_id == "a"] == [100.0]


def test_role_overrides_are_honoured_and_an_unreachable_aggregator_becomes_a_client() -> None:
    statuses = [_status("b", role_override="aggregator", reachable=False), _status("c", role_override="client")]
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, statuses)}
    assert peers["b"].forced_role == "client" and peers["c"].forced_role == "client"
    plan = Planner("a", PROBLEM).update(ME, statuses)
    assert plan.shares.get("b", 0.0) == 0.0 and plan.shares.get("c", 0.0) == 0.0
    assert plan.shares["a"] == pytest.approx(1.0)


def test_small_changes_keep_the_plan_and_membership_changes_replace_it() -> None:
    planner = Planner("a", PROBLEM)
    statuses = [_status("b", mbps=20.0), _status("c", mbps=20.0)]
    first = planner.update(ME, statuses)
    assert sum(first.shares.values()) == pytest.approx(1.0)
    assert planner.update(ME, [_status("b", mbps=21.0), _status("c", mbps=20.0)]) is first, "noise keeps the plan"
    joined = planner.update(ME, [*statuses, _status("d", mbps=20.0)])
    assert joined is not first and "d" in joined.roles
    faster = planner.update(ME, [_status("b", mbps=1000.0), _status("c", mbps=20.0), _status("d", mbps=20.0)])
    assert faster is not joined, "a tenfold faster link changes the shares beyond the threshold"
    assert faster.shares["b"] > joined.shares["b"]
    assert planner.own_share() == faster.shares["a"]
    assert "trainer" in planner.own_roles()


def test_plan_problem_counts_bytes_on_the_wire() -> None:
    manifest = demo()
    problem = plan_problem(manifest, 1000)
    expected = 2 if manifest.averaging.compression == "fp16" else 4
    assert problem.vector_size_bytes == 1000 * expected
    assert problem.target_batch_size == manifest.target_batch_size


def test_parameters_mode_leaves_no_reachable_peer_out_of_computing() -> None:
    # links so slow against a 100 MB vector that, in gradients mode, one peer training alone is fastest
    slow = [_status(peer_id, mbps=50.0) for peer_id in "abc"]
    weak = OwnCapabilities(samples_per_second=1.0, upload_mbps=1000.0, download_mbps=1000.0, reachable=True)
    problem = PlanProblem(vector_size_bytes=100_000_000, target_batch_size=1024)
    gradients = Planner("me", problem).update(weak, slow)
    assert not all(gradients.computes.values()), "communication-bound: the plan leaves peers out"
    parameters = Planner("me", problem, aggregate_only=False).update(weak, slow)
    assert all(parameters.computes.values())
    assert sum(parameters.shares.values()) == pytest.approx(1.0)
