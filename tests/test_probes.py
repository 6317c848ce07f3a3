"""Probe RPCs between two real DHTs on loopback: bandwidth, rate limits, caps and dial-back; the limiter's rules."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import hivemind
import pytest

from crowdtrain import proto
from crowdtrain.dht.records import MAX_OBSERVED_UPLOADS
from crowdtrain.links.observations import MAX_TRACKED_PEERS, UploadObservations
from crowdtrain.links.probes import BandwidthSample, ProbeLimiter, ProbeLimits, ProbeService
from crowdtrain.links.protocol import CHUNK_BYTES

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class Pair:
    server: ProbeService
    client: ProbeService
    server_addresses: list[str]
    client_addresses: list[str]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    dhts: list[hivemind.DHT] = []
    services: list[ProbeService] = []
    try:
        dhts.append(hivemind.DHT(start=True, host_maddrs=[LOOPBACK], use_ipfs=False))
        server_addresses = [str(address) for address in dhts[0].get_visible_maddrs()]
        dhts.append(hivemind.DHT(start=True, host_maddrs=[LOOPBACK], use_ipfs=False, initial_peers=server_addresses))
        services.append(ProbeService(dhts[0], ProbeLimits(dial_interval_s=0, min_interval_s=0.05)))
        services.append(ProbeService(dhts[1]))
        for service in services:
            service.start()
        yield Pair(services[0], services[1], server_addresses, [str(a) for a in dhts[1].get_visible_maddrs()])
    finally:
        for service in services:
            service.close()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(90)
def test_measure_gives_positive_bandwidth_and_reachability(pair: Pair) -> None:
    server = pair.server.peer_id
    report = pair.client.measure({server: pair.server_addresses}, pair.client_addresses, timeout_s=40)
    assert report.failures == ()
    assert report.upload_mbps is not None and report.upload_mbps > 0
    assert report.download_mbps is not None and report.download_mbps > 0
    assert report.reachable is True
    assert report.answered_peers == (server,)
    assert report.observed_ips == ("127.0.0.1",)
    assert {verdict.verdict for verdict in report.verdicts} == {"dialed"}
    # each side timed the streams it received: the server's downloads sent, the client's uploads
    client, seen_by_server = pair.client.peer_id, pair.server.observations.fastest()
    assert list(pair.client.observations.fastest()) == [server] and list(seen_by_server) == [client]
    assert 0 < seen_by_server[client] and 0 < pair.client.observations.fastest()[server]


@pytest.mark.timeout(60)
def test_measure_without_peers_reports_nothing_measured(pair: Pair) -> None:
    report = pair.client.measure({pair.client.peer_id: []}, pair.client_addresses, timeout_s=5)
    assert (report.upload_mbps, report.download_mbps, report.reachable) == (None, None, None)


@pytest.mark.timeout(60)
def test_a_direction_whose_probes_timed_nothing_says_so(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    async def one_chunk(*args: object) -> BandwidthSample:  # the whole stream read at once, or cut after a chunk
        return BandwidthSample(measured_bytes=0, duration_s=0.0, truncated=True)

    monkeypatch.setattr(pair.client, "_download", one_chunk)
    report = pair.client.measure({pair.server.peer_id: pair.server_addresses}, pair.client_addresses, timeout_s=20)
    assert report.upload_mbps is not None and report.download_mbps is None
    assert [failure for failure in report.failures if "download probe" in failure and "timed nothing" in failure]


@pytest.mark.timeout(60)
def test_a_second_probe_inside_the_interval_is_refused(pair: Pair) -> None:
    original = pair.server.limiter
    pair.server.limiter = ProbeLimiter(ProbeLimits(min_interval_s=60))
    try:
        first = pair.client.probe_upload(pair.server.peer_id, 2**20)
        second = pair.client.probe_download(pair.server.peer_id, 2**20)
    finally:
        pair.server.limiter = original
    assert isinstance(first, BandwidthSample) and first.mbps is not None and first.mbps > 0
    assert isinstance(second, proto.ProbeRefusal)
    assert "too soon" in second.reason and 50 < second.retry_after_s <= 60


@pytest.mark.timeout(60)
def test_an_oversized_probe_is_refused_for_good(pair: Pair) -> None:
    too_big = pair.server.limits.max_probe_bytes + 1
    for outcome in (
        pair.client.probe_download(pair.server.peer_id, too_big),
        pair.client.probe_upload(pair.server.peer_id, too_big),
    ):
        assert isinstance(outcome, proto.ProbeRefusal)
        assert f"1 to {too_big - 1}" in outcome.reason and outcome.retry_after_s == 0


@pytest.mark.timeout(60)
def test_dial_back_dials_only_the_requesters_own_ip(pair: Pair) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening, socket.create_server(("127.0.0.1", 0)) as closing:
        open_port = listening.getsockname()[1]
        closed_port = closing.getsockname()[1]
    # both sockets are closed now; listen again on the first port only
    with socket.create_server(("127.0.0.1", open_port)):
        addresses = [
            f"/ip4/127.0.0.1/tcp/{open_port}",
            f"/ip4/127.0.0.1/tcp/{closed_port}",
            "/ip4/10.20.30.40/tcp/80",  # someone else's machine: must not be dialed
            "/dns4/example.org/tcp/80",
            *(f"/ip4/127.0.0.1/tcp/{closed_port}" for _ in range(4)),
        ]
        result = pair.client.probe_dial_back(pair.server.peer_id, addresses)
    verdicts = [proto.DialAttempt.Verdict.Name(attempt.verdict) for attempt in result.attempts]
    assert verdicts == [
        "DIALED",
        "REFUSED",
        "IP_MISMATCH",
        "UNSUPPORTED",
        "REFUSED",
        "REFUSED",
        "NOT_TRIED",
        "NOT_TRIED",
    ]
    assert result.observed_ip == "127.0.0.1"
    assert "connected from 127.0.0.1" in result.attempts[2].detail


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_one_probe_at_a_time_with_an_interval_per_peer() -> None:
    clock = FakeClock()
    limiter = ProbeLimiter(ProbeLimits(min_interval_s=1.0, probe_time_limit_s=10), clock)
    lease, refusal = limiter.admit_bandwidth("a", 1000)
    assert refusal is None
    _, busy = limiter.admit_bandwidth("b", 1000)
    assert busy is not None and "another bandwidth probe is running" in busy.reason
    limiter.release("bandwidth", "a", lease)
    assert limiter.admit_bandwidth("a", 1000)[1] is not None  # a must wait its interval
    lease_b, refusal_b = limiter.admit_bandwidth("b", 1000)
    assert refusal_b is None
    limiter.release("bandwidth", "b", lease_b)
    clock.now += 1.0
    assert limiter.admit_bandwidth("a", 1000)[1] is None


def test_limiter_lease_of_a_hung_probe_expires() -> None:
    clock = FakeClock()
    limiter = ProbeLimiter(ProbeLimits(probe_time_limit_s=10), clock)
    limiter.admit_bandwidth("a", 1000)  # never released
    clock.now += 10 + ProbeLimiter.LEASE_GRACE_S + 0.1
    assert limiter.admit_bandwidth("b", 1000)[1] is None


def test_limiter_byte_budgets_per_peer_and_in_total() -> None:
    clock = FakeClock()
    limits = ProbeLimits(min_interval_s=0, max_probe_bytes=100, peer_bytes_per_minute=250, total_bytes_per_minute=400)
    limiter = ProbeLimiter(limits, clock)

    def probe(peer: str, size: int) -> proto.ProbeRefusal | None:
        lease, refusal = limiter.admit_bandwidth(peer, size)
        if refusal is None:
            limiter.release("bandwidth", peer, lease)
        clock.now += 1.0
        return refusal

    assert probe("a", 100) is None and probe("a", 100) is None
    refused = probe("a", 100)
    assert refused is not None and "this peer's probe budget" in refused.reason
    assert 57 < refused.retry_after_s <= 60  # when a's first probe leaves the window
    assert probe("b", 100) is None and probe("b", 100) is None
    total = probe("c", 100)
    assert total is not None and "the node's probe budget" in total.reason
    clock.now += 60
    assert probe("a", 100) is None


def test_limiter_dial_back_interval() -> None:
    clock = FakeClock()
    limiter = ProbeLimiter(ProbeLimits(dial_interval_s=10), clock)
    lease, refusal = limiter.admit_dial("a")
    assert refusal is None
    limiter.release("dial", "a", lease)
    assert limiter.admit_dial("a")[1] is not None
    assert limiter.admit_dial("b")[1] is None


@pytest.mark.parametrize("duration_s", [float("nan"), float("inf"), 0.0, -1.0, 1e-12])
def test_a_peers_unphysical_upload_figures_are_no_measurement(duration_s: float) -> None:
    # An upload is timed by the peer that received it: a NaN duration crashed the prober; a tiny one made any
    # node the plan's aggregator.
    assert BandwidthSample(measured_bytes=10**6, duration_s=duration_s, truncated=False).mbps is None
    assert BandwidthSample(measured_bytes=10**6, duration_s=0.1, truncated=False).mbps == pytest.approx(80.0)


def timed(mbps: float, duration_s: float = 1.0) -> BandwidthSample:
    return BandwidthSample(measured_bytes=round(mbps * 125_000 * duration_s), duration_s=duration_s, truncated=False)


def test_observations_keep_the_fastest_recent_rate_of_the_peers_seen_last() -> None:
    clock = FakeClock()
    observations = UploadObservations(max_age_s=100.0, clock=clock)
    for mbps in (5.0, 40.0, 20.0, 0.0, 1e9):  # nothing timed, or not physical: not a rate
        observations.record("b", timed(mbps))
    observations.record("b", BandwidthSample(measured_bytes=10**9, duration_s=float("nan"), truncated=False))
    assert observations.fastest() == {"b": 40.0}
    clock.now += 60
    observations.record("a", timed(7.0))
    observations.record("b", timed(10.0))
    assert observations.fastest() == {"a": 7.0, "b": 40.0}
    clock.now += 50  # b's 40 Mbit/s is 110 s old, its 10 Mbit/s 50 s
    assert observations.fastest() == {"a": 7.0, "b": 10.0}
    clock.now += 100
    assert observations.fastest() == {}


def test_observations_publish_the_peers_observed_last_and_track_a_bounded_number() -> None:
    clock = FakeClock()
    observations = UploadObservations(clock=clock)
    for i in range(MAX_TRACKED_PEERS + 10):
        observations.record(f"peer{i:04}", timed(1.0 + i))
        clock.now += 1
    observations.record("peer0100", timed(1.0))  # seen again: among the latest, with its fastest rate
    latest = observations.fastest()
    assert len(latest) == MAX_OBSERVED_UPLOADS and list(latest) == sorted(latest)
    assert latest["peer0100"] == 101.0 and latest["peer0265"] == 266.0 and "peer0258" not in latest
    observations.record("peer0000", timed(1.0))
    assert len(observations._samples) == MAX_TRACKED_PEERS and "peer0010" not in observations._samples


def test_a_short_stream_read_in_one_burst_is_no_observation() -> None:
    # two chunks queued while the event loop was busy arrive back to back: 256 KiB in 0.1 ms is no 20 Gbit/s link
    observations = UploadObservations()
    observations.record("burst", BandwidthSample(measured_bytes=CHUNK_BYTES, duration_s=1e-4, truncated=False))
    observations.record("slow", BandwidthSample(measured_bytes=CHUNK_BYTES, duration_s=2.0, truncated=False))
    observations.record("fast", BandwidthSample(measured_bytes=16 * 2**20, duration_s=0.05, truncated=False))
    assert set(observations.fastest()) == {"slow", "fast"}
