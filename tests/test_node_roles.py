"""This node's roles from its measurements: pure logic, with a stand-in for the probe RPCs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crowdtrain import proto
from crowdtrain.planning.plan import PlanProblem
from crowdtrain.planning.planner import OBSERVED_SLACK, quantize, swarm_capabilities
from crowdtrain.planning.roles import LinkProber, NodeRoles
from crowdtrain.roles import Role

PROBLEM = PlanProblem(vector_size_bytes=1_000_000, target_batch_size=256)


@dataclass
class Report:
    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool | None
    failures: Sequence[str] = ()


def peer(peer_id: str, *, reachable: bool = True) -> proto.PeerStatus:
    return proto.PeerStatus(
        peer_id=peer_id,
        reachable=reachable,
        measured_samples_per_second=50.0,
        upload_mbps=100.0,
        download_mbps=100.0,
        multiaddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}"],
    )


def make_roles(role: Role | None = None, statuses: Sequence[proto.PeerStatus] = ()) -> NodeRoles:
    return NodeRoles(peer_id="me", problem=PROBLEM, role=role, list_statuses=lambda: list(statuses))


def test_before_any_measurement_a_node_is_an_assumed_reachable_trainer() -> None:
    roles = make_roles()
    assert roles.roles() == ("trainer",) and not roles.is_client and roles.computes
    status = proto.PeerStatus()
    roles.fill_status(status)
    assert status.reachable and not status.reachability_measured
    assert not status.HasField("upload_mbps") and status.role_override == ""


def test_a_node_nobody_could_dial_becomes_a_client_of_the_plan() -> None:
    roles = make_roles(statuses=[peer("other")])
    roles.record_throughput(80.0)
    roles.record_links(Report(upload_mbps=20.0, download_mbps=None, reachable=False))
    assert roles.is_client
    assert roles.replan() == 0.0
    assert "client" in roles.roles() and "aggregator" not in roles.roles()
    status = proto.PeerStatus()
    roles.fill_status(status)
    assert not status.reachable and status.reachability_measured
    assert status.upload_mbps == 20.0 and not status.HasField("download_mbps")
    assert status.measured_samples_per_second == 80.0


def test_a_failed_probe_round_keeps_what_was_measured_before() -> None:
    roles = make_roles()
    roles.record_links(Report(upload_mbps=30.0, download_mbps=40.0, reachable=True))
    roles.record_links(Report(upload_mbps=None, download_mbps=None, reachable=None))
    status = proto.PeerStatus()
    roles.fill_status(status)
    assert (status.upload_mbps, status.download_mbps, status.reachable) == (30.0, 40.0, True)


def test_role_client_is_never_overturned_by_a_probe() -> None:
    roles = make_roles(Role.CLIENT)
    roles.record_links(Report(upload_mbps=30.0, download_mbps=40.0, reachable=True))
    assert roles.is_client and roles.roles() == ("client",)


def test_an_override_travels_as_its_string_and_expert_host_is_none_of_the_plans() -> None:
    status = proto.PeerStatus()
    make_roles(Role.CLIENT).fill_status(status)
    assert status.role_override == "client" and type(status.role_override) is str
    host = make_roles(Role.EXPERT_HOST)
    assert host.own.role_override == "" and host.roles() == ("trainer",)


def test_forced_aggregator_computes_nothing_and_takes_a_share() -> None:
    # with two computing peers there is traffic to take over (a lone trainer would aggregate alone for free)
    roles = make_roles(Role.AGGREGATOR, statuses=[peer("a"), peer("b")])
    roles.record_throughput(80.0)
    share = roles.replan()
    assert share is not None and share > 0
    assert not roles.computes and roles.roles() == ("aggregator",)


def test_the_status_publishes_what_this_node_saw_of_others_and_plans_with_it() -> None:
    seen = {"me": 900.0, **{f"peer{i}": 10.0 + i for i in range(10)}}
    liar = peer("peer0")
    liar.upload_mbps = 1000.0
    roles = NodeRoles(
        peer_id="me", problem=PROBLEM, role=None, list_statuses=lambda: [liar], observed_uploads=lambda: seen
    )
    status = proto.PeerStatus()
    roles.fill_status(status)
    published = {entry.peer_id: entry.upload_mbps for entry in status.observed_uploads}
    assert published == {f"peer{i}": 10.0 + i for i in range(8)}, "never itself, at most 8"
    assert roles.own.observed_upload_mbps == published
    planned = {entry.peer_id: entry.upload_mbps for entry in swarm_capabilities("me", roles.own, [liar])}
    assert planned["peer0"] == quantize(OBSERVED_SLACK * 10.0)


class FakeService:
    def __init__(self, report: Report):
        self.report, self.calls = report, []

    def measure(self, peers: Mapping[str, Sequence[str]], own_multiaddrs: Sequence[str], timeout_s: float) -> Report:
        self.calls.append((sorted(peers), dict(peers), tuple(own_multiaddrs)))
        return self.report


def test_the_prober_asks_reachable_peers_other_than_itself() -> None:
    statuses = [peer("me"), peer("a"), peer("b", reachable=False), peer("c")]
    roles = make_roles(statuses=statuses)
    service = FakeService(Report(upload_mbps=10.0, download_mbps=20.0, reachable=True))
    prober = LinkProber(service, roles, lambda: statuses, "me", ["/ip4/127.0.0.1/tcp/9"])
    assert prober.probe_once()
    (peer_ids, addresses, own) = service.calls[0]
    assert peer_ids == ["a", "c"] and set(addresses) == {"a", "c"} and own == ("/ip4/127.0.0.1/tcp/9",)
    assert prober.measured


def test_the_prober_counts_a_link_measured_only_once_both_directions_are() -> None:
    statuses = [peer("me"), peer("a")]
    service = FakeService(Report(upload_mbps=10.0, download_mbps=None, reachable=True))
    prober = LinkProber(service, make_roles(statuses=statuses), lambda: statuses, "me", [])
    assert prober.probe_once() and not prober.measured, "a refused download probe is asked again soon"
    service.report = Report(upload_mbps=None, download_mbps=20.0, reachable=True)
    assert prober.probe_once() and prober.measured, "each direction keeps what an earlier round measured"


def test_the_prober_with_nobody_to_ask_measures_nothing() -> None:
    roles = make_roles()
    service = FakeService(Report(upload_mbps=10.0, download_mbps=20.0, reachable=True))
    prober = LinkProber(service, roles, lambda: [peer("me")], "me", [])
    assert not prober.probe_once() and not service.calls and not prober.measured


def test_the_prober_asks_again_when_the_swarm_grew_past_its_last_round() -> None:
    statuses = [peer("me"), peer("a")]
    service = FakeService(Report(upload_mbps=10.0, download_mbps=20.0, reachable=True))
    prober = LinkProber(service, make_roles(statuses=statuses), lambda: statuses, "me", [])
    assert prober.probe_once() and prober.peers_asked == 1
    assert not prober.more_peers_to_ask()
    statuses.append(peer("b", reachable=False))  # can't be asked
    assert not prober.more_peers_to_ask()
    statuses += [peer("c"), peer("d"), peer("e")]
    assert prober.more_peers_to_ask()
    assert prober.probe_once() and prober.peers_asked == 3 and len(service.calls[-1][0]) == 4
    statuses.append(peer("f"))
    assert not prober.more_peers_to_ask(), "a round asks at most 3 peers: more peers are no reason to ask again"
