"""Listen addresses and the pure half of `crowdtrain status`: the summary and its rendering."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console, Group

from crowdtrain import proto
from crowdtrain.cli import status as status_view
from crowdtrain.cli.runs import choose_run
from crowdtrain.cli.status import StatusReport, render, summarize
from crowdtrain.dht.records import PublishedManifest
from crowdtrain.dht.registry import RunListing
from crowdtrain.errors import BadInputError, CrowdtrainError
from crowdtrain.manifest import demo
from crowdtrain.node import addresses
from crowdtrain.node.addresses import port_is_free, resolve_listen, shareable_address

PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"
PEER_C = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
FOUNDER = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"

# --- addresses ---------------------------------------------------------------------------------


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A loopback port something listens on for the test's duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_port_is_free_sees_a_listener(listening_port: int) -> None:
    assert port_is_free("127.0.0.1", listening_port) is False
    assert port_is_free("0.0.0.0", listening_port) is False  # all interfaces include loopback


def test_port_is_free_after_the_listener_closes() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_is_free("127.0.0.1", port) is False
    assert port_is_free("127.0.0.1", port) is True


def test_explicit_busy_port_is_bad_input(listening_port: int) -> None:
    busy = f"/ip4/127.0.0.1/tcp/{listening_port}"
    with pytest.raises(BadInputError, match=f"port {listening_port} is already in use") as caught:
        resolve_listen(("/ip4/127.0.0.1/tcp/0", busy))
    assert busy in str(caught.value)


def test_explicit_free_addresses_are_kept_as_given() -> None:
    listen = ("/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0", "/ip4/127.0.0.1/udp/5/quic")
    assert resolve_listen(listen) == listen


def test_default_port_when_free(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    monkeypatch.setattr(addresses, "DEFAULT_PORT", free_port)
    assert resolve_listen(()) == (f"/ip4/0.0.0.0/tcp/{free_port}",)


def test_busy_default_port_falls_back_to_a_free_one(
    monkeypatch: pytest.MonkeyPatch, listening_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(addresses, "DEFAULT_PORT", listening_port)
    with caplog.at_level(logging.WARNING, logger="crowdtrain.node.addresses"):
        assert resolve_listen(()) == ("/ip4/0.0.0.0/tcp/0",)
    assert str(listening_port) in caplog.text


def test_shareable_address_prefers_public_then_private_then_loopback() -> None:
    loopback = f"/ip4/127.0.0.1/tcp/31330/p2p/{PEER_A}"
    private = f"/ip4/192.168.1.20/tcp/31330/p2p/{PEER_A}"
    public = f"/ip4/8.8.4.4/tcp/31330/p2p/{PEER_A}"
    assert shareable_address([loopback, private, public]) == public
    assert shareable_address([public, loopback, private]) == public
    assert shareable_address([loopback, private]) == private
    assert shareable_address([loopback]) == loopback


def test_shareable_address_ranks_ipv6_and_link_local() -> None:
    public_v6 = f"/ip6/2001:4860:4860::8888/tcp/31330/p2p/{PEER_A}"
    public_v4 = f"/ip4/1.1.1.1/tcp/31330/p2p/{PEER_A}"
    link_local = f"/ip6/fe80::1/tcp/31330/p2p/{PEER_A}"
    loopback_v6 = f"/ip6/::1/tcp/31330/p2p/{PEER_A}"
    assert shareable_address([public_v6, public_v4]) == public_v4  # same rank: IPv4 first
    assert shareable_address([loopback_v6, public_v6]) == public_v6
    assert shareable_address([loopback_v6, link_local]) == link_local
    assert shareable_address([f"/dns4/example.org/tcp/1/p2p/{PEER_A}", loopback_v6]) == loopback_v6


# --- status: summarize -------------------------------------------------------------------------

RUN_KEYS = {"run_id", "epoch", "samples_accumulated", "target_batch_size", "samples_per_second", "eta_s", "num_peers"}
PEER_KEYS = {
    "peer_id",
    "roles",
    "device",
    "samples_per_second",
    "epoch",
    "loss",
    "upload_mbps",
    "download_mbps",
    "reachable",
    "experts",
    "version",
    "last_seen",
    "multiaddrs",
}


def listing(target_batch_size: int = 256) -> RunListing:
    manifest = dataclasses.replace(demo(), target_batch_size=target_batch_size, created_at=1000.0)
    return RunListing(
        published=PublishedManifest(manifest=manifest, founder_peer_id=FOUNDER),
        signed_bytes=b"",
        publishers=frozenset(),
    )


def statuses() -> list[proto.PeerStatus]:
    return [
        proto.PeerStatus(
            peer_id=PEER_A,
            version="0.1.0",
            roles=["trainer", "aggregator"],
            device="cuda:0 (NVIDIA A100)",
            samples_per_second=30.0,
            epoch=5,
            loss=2.5,
            upload_mbps=100.0,
            download_mbps=250.0,
            reachable=True,
            experts=["ffn.0", "ffn.1"],
            multiaddrs=[f"/ip4/127.0.0.1/tcp/31330/p2p/{PEER_A}", f"/ip4/8.8.8.8/tcp/31330/p2p/{PEER_A}"],
            last_seen=995.0,
            samples_accumulated=40,
            run_id="demo",
        ),
        proto.PeerStatus(
            peer_id=PEER_B,
            version="0.1.0",
            roles=["trainer"],
            device="cpu",
            samples_per_second=10.0,
            epoch=5,
            last_seen=990.0,
            samples_accumulated=16,
            run_id="demo",
        ),
        proto.PeerStatus(  # a straggler: its samples count toward an older epoch, its speed still counts
            peer_id=PEER_C,
            roles=["client"],
            device="cpu",
            samples_per_second=0.0,
            epoch=4,
            samples_accumulated=1000,
            run_id="demo",
        ),
    ]


def summary_json(run_id: str, listing: RunListing | None, statuses: list[proto.PeerStatus]) -> dict[str, Any]:
    """The `status --json` object of a summary: what scripts and the contract in docs/status.md read."""
    return summarize(run_id, listing, statuses).to_json()


def test_summary_has_the_contract_fields() -> None:
    snapshot = summary_json("demo", listing(), statuses())
    assert RUN_KEYS <= snapshot["run"].keys()
    assert all(PEER_KEYS <= peer.keys() for peer in snapshot["peers"])
    assert json.loads(json.dumps(snapshot)) == snapshot  # plain JSON types only


def test_summary_of_the_run() -> None:
    run = summary_json("demo", listing(target_batch_size=256), statuses())["run"]
    assert run["run_id"] == "demo"
    assert run["epoch"] == 5
    assert run["samples_accumulated"] == 56  # only peers at the newest epoch
    assert run["target_batch_size"] == 256
    assert run["samples_per_second"] == 40.0
    assert run["eta_s"] == pytest.approx((256 - 56) / 40.0)
    assert run["num_peers"] == 3
    assert run["model"] == "LlamaForCausalLM"
    assert run["founder"] == FOUNDER
    assert run["created_at"] == 1000.0


def test_summary_json_is_the_documented_object_key_for_key() -> None:
    # `status --json` is a contract: the report's JSON keeps the keys, their order, the values and the nulls.
    snapshot = summary_json("demo", listing(), statuses())
    assert list(snapshot) == ["run", "peers"]
    assert snapshot["run"] == {
        "run_id": "demo",
        "epoch": 5,
        "samples_accumulated": 56,
        "target_batch_size": 256,
        "samples_per_second": 40.0,
        "eta_s": 5.0,
        "num_peers": 3,
        "partial_averages": 0,
        "num_aggregators": 0,
        "plans_agree": None,
        "model": "LlamaForCausalLM",
        "founder": FOUNDER,
        "created_at": 1000.0,
        "expert_grid": None,
        "excluded_peers": {},
        "skippipe": None,
    }
    assert list(snapshot["run"]) == [
        "run_id",
        "epoch",
        "samples_accumulated",
        "target_batch_size",
        "samples_per_second",
        "eta_s",
        "num_peers",
        "partial_averages",
        "num_aggregators",
        "plans_agree",
        "model",
        "founder",
        "created_at",
        "expert_grid",
        "excluded_peers",
        "skippipe",
    ]
    assert list(snapshot["peers"][0]) == [
        "peer_id",
        "roles",
        "device",
        "samples_per_second",
        "samples_accumulated",
        "epoch",
        "loss",
        "upload_mbps",
        "download_mbps",
        "reachable",
        "reachability_measured",
        "aggregation_share",
        "plan_digest",
        "measured_samples_per_second",
        "role_override",
        "experts",
        "version",
        "last_seen",
        "multiaddrs",
        "partial_averages",
        "local_steps",
        "phase_times_s",
        "training",
        "excluded_peers",
        "relays",
    ]


def test_a_status_field_the_view_does_not_know_shows_at_the_end_of_the_peer_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A field added to PeerStatus needs no code in cli/status.py: every field but the few left out is shown.
    names = {field.name for field in proto.PeerStatus.DESCRIPTOR.fields}
    assert status_view._VIEWED | status_view._NOT_SHOWN < names, "relays, for one, is in no list of the view"
    # as a new field would: run_id, known to no line of the view, once it is no longer left out
    monkeypatch.setattr(status_view, "_NOT_SHOWN", status_view._NOT_SHOWN - {"run_id", "observed_uploads"})
    peers = summary_json("demo", listing(), statuses())["peers"]
    assert [list(peer)[-3:] for peer in peers] == [["run_id", "observed_uploads", "relays"]] * 3
    assert [peer["run_id"] for peer in peers] == [status.run_id for status in statuses()]
    assert all(peer["observed_uploads"] == [] for peer in peers)


def test_the_report_is_typed_and_frozen() -> None:
    report = summarize("demo", listing(), statuses())
    assert report.run.epoch == 5 and report.run.eta_s == 5.0 and report.run.expert_grid is None
    assert report.peers[0].roles == ("trainer", "aggregator") and report.peers[1].loss is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.run.epoch = 6  # type: ignore[misc]


def test_summary_of_each_peer() -> None:
    first, second, _ = summary_json("demo", listing(), statuses())["peers"]
    assert first == {
        "peer_id": PEER_A,
        "roles": ["trainer", "aggregator"],
        "device": "cuda:0 (NVIDIA A100)",
        "samples_per_second": 30.0,
        "samples_accumulated": 40,
        "epoch": 5,
        "loss": 2.5,
        "upload_mbps": 100.0,
        "download_mbps": 250.0,
        "reachable": True,
        "experts": ["ffn.0", "ffn.1"],
        "version": "0.1.0",
        "last_seen": 995.0,
        "multiaddrs": [f"/ip4/127.0.0.1/tcp/31330/p2p/{PEER_A}", f"/ip4/8.8.8.8/tcp/31330/p2p/{PEER_A}"],
        "partial_averages": 0,
        "local_steps": 0,
        "reachability_measured": False,
        "aggregation_share": 0.0,
        "plan_digest": None,
        "measured_samples_per_second": 0.0,
        "role_override": None,
        "phase_times_s": None,
        "training": None,
        "excluded_peers": [],
        "relays": [],
    }
    assert isinstance(second["roles"], list) and second["roles"] == ["trainer"]
    assert (second["loss"], second["upload_mbps"], second["download_mbps"]) == (None, None, None)
    assert second["reachable"] is False and second["experts"] == [] and second["multiaddrs"] == []


def test_phase_times_of_a_peer_that_completed_a_step() -> None:
    phases = proto.PhaseTimes(compute_s=3.5, wait_s=0.25, matchmaking_s=0.5, allreduce_s=1.0, optimizer_step_s=0.125)
    snapshot = summary_json("demo", None, [proto.PeerStatus(peer_id=PEER_A, phase_times=phases), *statuses()[1:]])
    first, second, _ = snapshot["peers"]
    assert first["phase_times_s"] == {
        "compute": 3.5,
        "wait": 0.25,
        "matchmaking": 0.5,
        "allreduce": 1.0,
        "state_averaging": 0.0,
        "optimizer_step": 0.125,
        "state_download": 0.0,
    }
    assert second["phase_times_s"] is None  # no global step completed yet
    assert json.loads(json.dumps(snapshot)) == snapshot


def test_training_mode_and_round_of_a_diloco_peer() -> None:
    training = proto.TrainingStatus(
        mode="diloco", compression="int8", inner_step=3, inner_steps=8, round_bytes_sent=5 * 2**20,
        compute_utilisation=0.96,
    )  # fmt: skip
    report = summarize("demo", None, [proto.PeerStatus(peer_id=PEER_A, training=training), *statuses()[1:]])
    first = report.peers[0].to_json()
    assert first["training"] == {
        "mode": "diloco",
        "compression": "int8",
        "inner_step": 3,
        "inner_steps": 8,
        "round_bytes_sent": 5 * 2**20,
        "compute_utilisation": 0.96,
        "experts_owned": 0,
        "experts_total": 0,
        "skippipe_stage": None,
        "skippipe_iteration": 0,
        "experts_capacity": None,
    }
    assert report.peers[1].to_json()["training"] is None
    console = Console(width=400, record=True)
    console.print(render(report, now=1000.0))
    table = console.export_text()
    assert "diloco 3/8 int8" in table and "96%" in table and "5.0 MiB" in table
    assert "experts" not in table


def test_a_spes_peer_shows_the_experts_it_owns() -> None:
    training = proto.TrainingStatus(
        mode="spes", compression="fp16", inner_step=2, inner_steps=20, experts_owned=8, experts_total=32
    )
    short = proto.TrainingStatus(mode="spes", compression="fp16", experts_owned=3, experts_total=32, experts_capacity=3)
    report = summarize(
        "demo",
        None,
        [proto.PeerStatus(peer_id=PEER_A, training=training), proto.PeerStatus(peer_id=PEER_B, training=short)],
    )
    assert report.peers[0].to_json()["training"]["experts_owned"] == 8
    assert report.peers[1].to_json()["training"]["experts_capacity"] == 3
    console = Console(width=400, record=True)
    console.print(render(report, now=1000.0))
    table = console.export_text()
    assert "spes 2/20 fp16, owns 8/32 experts" in table and "owns 8/32 experts (room" not in table
    assert "owns 3/32 experts (room for 3)" in table


def test_loss_of_zero_is_not_unset() -> None:
    peer = summary_json("demo", None, [proto.PeerStatus(peer_id=PEER_A, loss=0.0, upload_mbps=0.0)])["peers"][0]
    assert peer["loss"] == 0.0 and peer["upload_mbps"] == 0.0 and peer["download_mbps"] is None


@pytest.mark.parametrize(
    ("target", "accumulated", "samples_per_second", "eta_s"),
    [(256, 56, 40.0, 5.0), (100, 100, 10.0, 0.0), (100, 150, 10.0, 0.0), (100, 0, 0.0, None)],
)
def test_eta_from_target_and_throughput(
    target: int, accumulated: int, samples_per_second: float, eta_s: float | None
) -> None:
    status = proto.PeerStatus(peer_id=PEER_A, samples_accumulated=accumulated, samples_per_second=samples_per_second)
    assert summary_json("demo", listing(target), [status])["run"]["eta_s"] == eta_s


@pytest.mark.parametrize(
    ("digests", "agree"),
    [(("", ""), None), (("ab12", ""), True), (("ab12", "ab12"), True), (("ab12", "cd34"), False)],
)
def test_plans_agree_when_every_peer_with_a_plan_has_the_same_digest(
    digests: tuple[str, str], agree: bool | None
) -> None:
    peers = [
        proto.PeerStatus(peer_id=peer, plan_digest=digest)
        for peer, digest in zip((PEER_A, PEER_B), digests, strict=True)
    ]
    snapshot = summary_json("demo", None, peers)
    assert snapshot["run"]["plans_agree"] is agree
    assert [peer["plan_digest"] for peer in snapshot["peers"]] == [digest or None for digest in digests]


def test_summary_without_manifest_or_peers() -> None:
    run = summary_json("demo", None, statuses())["run"]
    assert run["target_batch_size"] is None and run["eta_s"] is None and run["founder"] is None
    empty = summary_json("demo", listing(), [])
    assert empty["peers"] == []
    assert (empty["run"]["epoch"], empty["run"]["num_peers"], empty["run"]["samples_accumulated"]) == (0, 0, 0)
    assert empty["run"]["eta_s"] is None


def test_choose_run_by_name_or_the_only_one() -> None:
    runs = {"demo": listing(), "other": listing()}
    assert choose_run(runs, "other") == "other"
    assert choose_run({"demo": listing()}, "") == "demo"
    with pytest.raises(BadInputError, match="The swarm holds no run named 'x'; runs here: demo, other[.]$"):
        choose_run(runs, "x")
    with pytest.raises(BadInputError, match="The swarm holds 2 runs: demo, other; pass --run-id to choose one[.]$"):
        choose_run(runs, "")
    with pytest.raises(CrowdtrainError, match="^The swarm answered but holds no run yet[.]$"):
        choose_run({}, "")
    with pytest.raises(CrowdtrainError, match="^The swarm answered but holds no run yet; there is nothing to do[.]$"):
        choose_run({}, "", empty_note="; there is nothing to do")


# --- status: render ----------------------------------------------------------------------------


def rendered(report: StatusReport, now: float) -> str:
    group = render(report, now)
    assert isinstance(group, Group)
    console = Console(record=True, width=240, color_system=None)  # as `status` piped
    console.print(group)
    return console.export_text()


def test_render_shows_the_run_and_short_peer_ids() -> None:
    text = rendered(summarize("demo", listing(), statuses()), now=1000.0)
    assert "run demo" in text
    assert "epoch 5" in text and "samples 56/256" in text and "40.0 samples/s" in text
    assert "ETA 5 s" in text and "3 peers" in text
    rows = [line.strip() for line in text.splitlines()]
    for peer_id in (PEER_A, PEER_B, PEER_C):
        assert any(row.startswith("…" + peer_id[-8:] + " ") for row in rows)
    assert PEER_B not in text and PEER_C not in text  # the peer column shows the short form only
    assert "trainer,aggregator" in text and "cuda:0 (NVIDIA A100)" in text
    assert "2.500" in text
    assert "5 s ago" in text and "10 s ago" in text
    assert "100/250" in text and "?/?" in text  # measured links, and none yet
    assert "assumed" in text  # reachable, but nobody dialed it back yet
    assert f"/ip4/8.8.8.8/tcp/31330/p2p/{PEER_A}" in text  # the shareable (public) address


def test_render_without_manifest_or_measurements() -> None:
    snapshot = summarize("demo", None, [proto.PeerStatus(peer_id=PEER_B, last_seen=2000.0, loss=math.nan)])
    text = rendered(snapshot, now=1000.0)
    assert "samples 0/?" in text and "ETA —" in text and "1 peers" in text
    assert "…" + PEER_B[-8:] in text
    assert "nan" not in text.lower()
    assert "0 s ago" in text  # a clock ahead of ours never shows negative ages


def test_render_of_an_empty_swarm() -> None:
    text = rendered(summarize("demo", listing(), []), now=0.0)
    assert "0 peers" in text and "peer" in text and "address" in text


def test_render_shows_markup_in_a_peers_record_as_text() -> None:
    # A peer's record is anyone's: "[/bold]" as its device crashed `crowdtrain status` (rich parsed it as markup).
    hostile = proto.PeerStatus(peer_id=PEER_B, last_seen=1000.0, device="[/bold][red]gpu", roles=["[link=x]t"])
    text = rendered(summarize("demo", listing(), [hostile]), now=1000.0)
    assert "[/bold][red]gpu" in text and "[link=x]t" in text
