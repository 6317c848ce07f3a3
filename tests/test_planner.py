"""Re-planning from peer statuses: capabilities from records, defaults for the unmeasured, agreement between nodes."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from crowdtrain import proto
from crowdtrain.manifest import demo
from crowdtrain.planning.plan import PlanProblem
from crowdtrain.planning.planner import (
    DEFAULT_BANDWIDTH_MBPS,
    OBSERVED_SLACK,
    OwnCapabilities,
    Planner,
    plan_digest,
    plan_problem,
    quantize,
    swarm_capabilities,
)

PROBLEM = PlanProblem(vector_size_bytes=10_000_000, target_batch_size=1024)
ME = OwnCapabilities(samples_per_second=100.0, upload_mbps=100.0, download_mbps=100.0, reachable=True)


def _status(
    peer_id: str,
    *,
    compute: float = 100.0,
    mbps: float | None = 100.0,
    observed: dict[str, float] | None = None,
    **fields: object,
) -> proto.PeerStatus:
    status = proto.PeerStatus(peer_id=peer_id, measured_samples_per_second=compute, reachable=True)
    if mbps is not None:
        status.upload_mbps = status.download_mbps = mbps
    for observed_id, observed_mbps in (observed or {}).items():
        status.observed_uploads.add(peer_id=observed_id, upload_mbps=observed_mbps)
    for name, value in fields.items():
        setattr(status, name, value)
    return status


def test_unmeasured_peers_get_the_median_of_the_measured() -> None:
    statuses = [_status("b", mbps=20.0), _status("c", mbps=None, compute=0.0)]
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, statuses)}
    assert peers["c"].upload_mbps == statistics.median([quantize(20.0), quantize(100.0)])
    assert peers["c"].samples_per_second == quantize(100.0)
    assert peers["a"].upload_mbps == quantize(100.0)


def test_nobody_measured_means_a_default_bandwidth() -> None:
    me = OwnCapabilities(samples_per_second=None, upload_mbps=None, download_mbps=None, reachable=True)
    peers = swarm_capabilities("a", me, [_status("b", mbps=None)])
    assert {peer.upload_mbps for peer in peers} == {DEFAULT_BANDWIDTH_MBPS}


def test_live_throughput_never_enters_the_plan() -> None:
    # The live rate changes between two nodes' readings of the record; the probe's value does not.
    status = _status("b", compute=0.0)
    status.samples_per_second = 42.0
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, [status])}
    assert peers["b"].samples_per_second == quantize(100.0), "the median of the measured, as for any unmeasured peer"


def test_our_own_record_in_the_dht_is_replaced_by_our_measurements() -> None:
    peers = swarm_capabilities("a", ME, [_status("a", mbps=1.0), _status("b")])
    assert [peer.upload_mbps for peer in peers if peer.peer_id == "a"] == [quantize(100.0)]


def test_measurements_are_rounded_to_a_geometric_grid() -> None:
    assert quantize(100.0) == quantize(104.0) != quantize(130.0)
    assert quantize(0.0) == 0.0
    assert quantize(1e-3) > 0
    assert all(abs(quantize(x) / x - 1) < 0.1 for x in (0.5, 3.0, 77.0, 1e4))


def _node_view(me: str, records: list[proto.PeerStatus]) -> tuple[OwnCapabilities, list[proto.PeerStatus]]:
    """What node `me` plans from: its own measurements (as it publishes them) and the records it listed."""
    own = next(record for record in records if record.peer_id == me)
    capabilities = OwnCapabilities(
        samples_per_second=own.measured_samples_per_second or None,
        upload_mbps=own.upload_mbps if own.HasField("upload_mbps") else None,
        download_mbps=own.download_mbps if own.HasField("download_mbps") else None,
        reachable=own.reachable,
        role_override=own.role_override,
        observed_upload_mbps={entry.peer_id: entry.upload_mbps for entry in own.observed_uploads},
    )
    shuffled = list(records)
    random.Random(me).shuffle(shuffled)  # the DHT lists records in no particular order
    return capabilities, shuffled


def test_every_node_derives_the_identical_plan_from_the_same_records() -> None:
    records = [
        _status("p1", compute=3.5, mbps=2003.6, observed={"p2": 17.3}),
        _status("p2", compute=2.4, mbps=807.8, observed={"p1": 95.2, "p4": 17.9}),
        _status("p3", compute=0.0, mbps=None),  # still measuring itself
        _status("p4", compute=40.0, mbps=18.0, observed={"p1": 17.6, "p2": 18.0, "p4": 9e3}),
        _status("p5", compute=12.0, mbps=95.0, role_override="client", reachable=False),
    ]
    problem = PlanProblem(vector_size_bytes=170_000_000, target_batch_size=32)
    plans = {}
    for record in records:
        own, listed = _node_view(record.peer_id, records)
        plans[record.peer_id] = Planner(record.peer_id, problem).update(own, listed)
    digests = {plan_digest(plan) for plan in plans.values()}
    assert len(digests) == 1, f"nodes disagree on the plan: {plans}"
    plan = next(iter(plans.values()))
    assert sum(plan.shares.values()) == pytest.approx(1.0)


def test_a_node_with_a_history_plans_like_a_newcomer() -> None:
    # No hysteresis: a node that saw other records before derives what a node starting now derives.
    records = [_status("b", mbps=20.0), _status("c", mbps=20.0)]
    veteran = Planner("a", PROBLEM)
    veteran.update(ME, [_status("b", mbps=1000.0)])
    veteran.update(replace(ME, upload_mbps=5.0), records)
    assert plan_digest(veteran.update(ME, records)) == plan_digest(Planner("a", PROBLEM).update(ME, records))


def test_role_overrides_are_honoured_and_an_unreachable_aggregator_becomes_a_client() -> None:
    statuses = [_status("b", role_override="aggregator", reachable=False), _status("c", role_override="client")]
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, statuses)}
    assert peers["b"].forced_role == "client" and peers["c"].forced_role == "client"
    plan = Planner("a", PROBLEM).update(ME, statuses)
    assert plan.shares.get("b", 0.0) == 0.0 and plan.shares.get("c", 0.0) == 0.0
    assert plan.shares["a"] == pytest.approx(1.0)


def test_noise_keeps_the_plan_and_membership_or_real_changes_replace_it() -> None:
    planner = Planner("a", PROBLEM)
    statuses = [_status("b", mbps=20.0), _status("c", mbps=20.0)]
    first = planner.update(ME, statuses)
    assert sum(first.shares.values()) == pytest.approx(1.0)
    again = planner.update(ME, [_status("b", mbps=20.5), _status("c", mbps=20.0)])
    assert plan_digest(again) == plan_digest(first), "a reading 2.5% off gives the same plan"
    joined = planner.update(ME, [*statuses, _status("d", mbps=20.0)])
    assert plan_digest(joined) != plan_digest(first) and "d" in joined.roles
    faster = planner.update(ME, [_status("b", mbps=1000.0), _status("c", mbps=20.0), _status("d", mbps=20.0)])
    assert faster.shares["b"] > joined.shares["b"]
    assert planner.own_share() == faster.shares["a"]
    assert planner.digest == plan_digest(faster)
    assert "trainer" in planner.own_roles()


def test_plan_problem_counts_bytes_on_the_wire() -> None:
    manifest = demo()
    problem = plan_problem(manifest, 1000)
    expected = 2 if manifest.averaging.compression == "fp16" else 4
    assert problem.vector_size_bytes == 1000 * expected
    assert problem.target_batch_size == manifest.target_batch_size


def test_parameters_mode_leaves_no_peer_out_of_computing() -> None:
    # links so slow against a 100 MB vector that, in gradients mode, one peer training alone is fastest
    slow = [_status(peer_id, mbps=50.0) for peer_id in "abc"] + [_status("natted", mbps=20.0, reachable=False)]
    weak = OwnCapabilities(samples_per_second=1.0, upload_mbps=1000.0, download_mbps=1000.0, reachable=True)
    problem = PlanProblem(vector_size_bytes=100_000_000, target_batch_size=1024)
    gradients = Planner("me", problem).update(weak, slow)
    assert not all(gradients.computes.values()), "communication-bound: the plan leaves peers out"
    parameters = Planner("me", problem, aggregate_only=False).update(weak, slow)
    assert all(parameters.computes.values())
    assert parameters.roles["natted"] == ("trainer", "client"), "it steps its replica, and nobody can dial it"
    assert sum(parameters.shares.values()) == pytest.approx(1.0)


def test_expert_hosts_are_not_in_the_averaging_plan() -> None:
    host = _status("h")
    host.roles.append("expert-host")
    plan = Planner("a", PROBLEM).update(ME, [_status("b"), host])
    assert set(plan.roles) == {"a", "b"}


def test_one_peer_claiming_huge_numbers_counts_as_at_most_64_times_the_median() -> None:
    # self-reported values within the records' physical limits can still be lies: with 3+ peers, outliers are capped
    liar = _status("z", compute=9e6, mbps=300_000.0)
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, [_status("b"), _status("c"), liar])}
    median = quantize(100.0)
    assert peers["z"].samples_per_second == 64 * median
    assert peers["z"].upload_mbps == 64 * median and peers["z"].download_mbps == 64 * median
    assert peers["b"].samples_per_second == median
    two = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, [liar])}
    assert two["z"].samples_per_second == quantize(9e6), "with two peers there is no median to speak of"


def _planned(own: OwnCapabilities, statuses: list[proto.PeerStatus]) -> dict[str, float]:
    """The upload each peer counts with in node a's plan."""
    return {peer.peer_id: peer.upload_mbps for peer in swarm_capabilities("a", own, statuses)}


def test_a_liar_observed_by_peers_counts_for_at_most_the_slack_over_their_observations() -> None:
    liar = _status("z", mbps=1000.0)
    honest = [_status("b"), _status("c")]
    unobserved = Planner("a", PROBLEM).update(ME, [*honest, liar])
    assert max(unobserved.shares, key=unobserved.shares.__getitem__) == "z", "self-reports alone: the liar wins"
    observers = [_status("b", observed={"z": 20.0}), _status("c", observed={"z": 19.0})]
    assert _planned(ME, [*observers, liar])["z"] == quantize(OBSERVED_SLACK * 20.0) <= OBSERVED_SLACK * 20.0
    plan = Planner("a", PROBLEM).update(ME, [*observers, liar])
    assert plan.shares["z"] < min(plan.shares[peer] for peer in "abc")
    assert sum(plan.shares.values()) == pytest.approx(1.0)


def test_an_honest_claim_within_the_slack_of_what_peers_saw_is_untouched() -> None:
    # a joint probe: three streams at once, each slowed by one receiver's download
    fast = _status("f", mbps=300.0)
    observers = [_status("b", observed={"f": 100.0}), _status("c", observed={"f": 80.0})]
    planned = _planned(replace(ME, observed_upload_mbps={"f": 90.0}), [*observers, fast])
    assert planned["f"] == quantize(300.0)
    assert planned["b"] == planned["c"] == quantize(100.0), "nobody observed them: their own figures"


def test_a_peer_nobody_observed_keeps_its_self_report_within_the_outlier_bound() -> None:
    liar = _status("z", mbps=9000.0)
    planned = _planned(ME, [_status("b", observed={"c": 50.0}), _status("c"), liar])
    assert planned["z"] == 64 * quantize(100.0), "the outlier rule still bounds it"
    assert planned["c"] == quantize(100.0), "within the slack of 50"


def test_what_a_peer_says_it_saw_of_itself_is_no_observation() -> None:
    liar = _status("z", mbps=1000.0, observed={"z": 1000.0, "b": 100.0})
    assert _planned(ME, [_status("b"), liar])["z"] == quantize(1000.0)
    assert _planned(ME, [_status("b", observed={"z": 20.0}), liar])["z"] == quantize(OBSERVED_SLACK * 20.0)
    me = replace(ME, upload_mbps=1000.0, observed_upload_mbps={"a": 1000.0})
    assert _planned(me, [_status("b")])["a"] == quantize(1000.0)


def test_this_nodes_observations_count_as_it_publishes_them() -> None:
    # its own record in the DHT may lag what its heartbeat publishes next; `own` is what every node will read
    statuses = [_status("a", observed={"z": 500.0}), _status("b"), _status("z", mbps=1000.0)]
    assert _planned(replace(ME, observed_upload_mbps={"z": 20.0}), statuses)["z"] == quantize(OBSERVED_SLACK * 20.0)
    me = replace(ME, upload_mbps=1000.0)
    assert _planned(me, [_status("b", observed={"a": 20.0})])["a"] == quantize(OBSERVED_SLACK * 20.0)


def test_only_uploads_are_capped_and_the_plan_takes_the_slower_direction() -> None:
    # a download is timed by the downloader alone: nobody observes it, and the plan uses min(upload, download)
    liar = _status("z", mbps=1000.0)
    peers = {peer.peer_id: peer for peer in swarm_capabilities("a", ME, [_status("b", observed={"z": 20.0}), liar])}
    assert peers["z"].download_mbps == quantize(1000.0) and peers["z"].upload_mbps == quantize(80.0)
