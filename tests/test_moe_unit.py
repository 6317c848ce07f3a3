"""DMoE without a swarm: the manifest's moe section, the expert-host role, status coverage, the model variant."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from crowdtrain import proto
from crowdtrain.cli.status import render, summarize
from crowdtrain.dht.records import PublishedManifest
from crowdtrain.dht.registry import RunListing
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import (
    MoESpec,
    RunManifest,
    demo,
    demo_moe,
    expert_uids,
    load_run_file,
    manifest_from_overrides,
)
from crowdtrain.models.dmoe import _decoder_layers
from crowdtrain.moe import hosting
from crowdtrain.moe.experts import build_expert, make_backend
from crowdtrain.moe.hosting import ExpertHost, HostOptions
from crowdtrain.node.config import NodeConfig
from crowdtrain.structured import FieldError


def test_demo_moe_preset_is_the_demo_with_a_grid() -> None:
    manifest = load_run_file("demo-moe")
    assert manifest.run_id == "demo-moe"
    assert manifest.model == demo().model and manifest.data == demo().data
    assert manifest.moe is not None and manifest.moe.grid == (4, 4) and manifest.moe.k == 2
    uids = expert_uids(manifest)
    assert len(uids) == 4 * 16 and uids[0] == "demo-moe-ffn0.0.0" and uids[-1] == "demo-moe-ffn3.3.3"
    assert expert_uids(demo()) == []


def test_moe_section_round_trips_through_protobuf_and_dense_runs_stay_dense() -> None:
    manifest = dataclasses.replace(demo_moe(), created_at=12.5)
    manifest = dataclasses.replace(
        manifest,
        moe=dataclasses.replace(manifest.moe, layers=(1, 3), forward_timeout_s=2.5),  # type: ignore[arg-type]
    )
    assert RunManifest.from_bytes(manifest.to_bytes()) == manifest
    assert RunManifest.from_bytes(demo().to_bytes()).moe is None
    message = proto.RunManifest.FromString(demo().to_bytes())
    assert not message.HasField("moe")


def test_a_run_file_moe_table_fills_in_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('run_id = "m"\n[moe]\ngrid = [2, 3]\nk = 1\nlayers = [0]\n')
    manifest = load_run_file(str(path))
    assert manifest.moe == MoESpec(grid=(2, 3), k=1, layers=(0,))
    assert expert_uids(manifest) == [f"m-ffn0.{i}.{j}" for i in range(2) for j in range(3)]


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"grid": []}, "grid must have 1 to 4 dimensions"),
        ({"grid": [4, 0]}, "grid must have 1 to 4 dimensions"),
        ({"k": 0}, "k must be between 1"),
        ({"grid": [2], "k": 3}, "k must be between 1 and the grid's 2 experts"),
        ({"k": 2, "k_min": 3}, "k_min must be between 1 and k"),
        ({"expert": "transformer"}, "expert must be one of ffn"),
        ({"forward_timeout_s": 0}, "must be positive"),
        ({"uid_prefix": "a.b"}, "uid_prefix must be"),
        ({"layers": [9]}, "moe.layers names layer 9, but the model has 4 layers"),
        ({"layers": [1, 1]}, "layers must be distinct"),
        ({"grid": "4x4"}, "field 'moe.grid' must be a list"),
        ({"colour": 1}, "unknown field 'moe.colour'"),
    ],
)
def test_bad_moe_sections_are_one_sentence_naming_the_field(moe: dict[str, object], message: str) -> None:
    with pytest.raises(FieldError, match=message.replace(".", r"\.").replace("(", r"\(")) as raised:
        manifest_from_overrides({"moe": moe})
    assert "\n" not in str(raised.value)


def test_a_dmoe_run_needs_layer_count_and_hidden_size() -> None:
    with pytest.raises(FieldError, match="needs a positive model.config.hidden_size"):
        manifest_from_overrides(
            {"model": {"architecture": "GPT2LMHeadModelForCausalLM", "config": {"num_hidden_layers": 2}}, "moe": {}}
        )


def test_expert_host_and_aggregator_roles_are_accepted_and_capacity_is_checked() -> None:
    assert NodeConfig(role="expert-host", max_experts=4).role == "expert-host"
    with pytest.raises(ValueError, match="max_experts must be positive"):
        NodeConfig(role="expert-host", max_experts=0)
    assert NodeConfig(role="aggregator").role == "aggregator"  # every role exists now


def test_status_shows_the_grid_coverage_of_a_dmoe_run() -> None:
    manifest = dataclasses.replace(demo_moe(), created_at=1.0)
    uids = expert_uids(manifest)
    listing = RunListing(
        published=PublishedManifest(manifest=manifest, founder_peer_id="QmFounder"),
        signed_bytes=b"",
        publishers=frozenset(),
    )
    hosts = [
        proto.PeerStatus(peer_id="QmA", roles=["expert-host"], experts=uids[:40], run_id="demo-moe", last_seen=1.0),
        proto.PeerStatus(peer_id="QmB", roles=["expert-host"], experts=uids[30:50], run_id="demo-moe", last_seen=1.0),
        proto.PeerStatus(peer_id="QmC", roles=["trainer"], run_id="demo-moe", last_seen=1.0),
    ]
    report = summarize("demo-moe", listing, hosts)
    snapshot = report.to_json()
    grid = snapshot["run"]["expert_grid"]
    assert (grid["live"], grid["total"], grid["min_replicas"], grid["max_replicas"]) == (50, 64, 0, 2)
    assert grid["replicas"][uids[35]] == 2
    assert snapshot["peers"][0]["experts"] == uids[:40]
    dense = summarize("demo", dataclasses.replace(listing, published=PublishedManifest(demo(), "QmF")), hosts[2:])
    assert dense.run.expert_grid is None and dense.to_json()["run"]["expert_grid"] is None
    from rich.console import Console

    console = Console(width=240, record=True)
    console.print(render(report, now=2.0))
    assert "experts 50/64 live, replicas 0-2" in console.export_text()


def test_an_expert_keeps_the_shape_and_starts_identical_on_every_host() -> None:
    manifest = dataclasses.replace(demo_moe(), created_at=5.0)
    uid = expert_uids(manifest)[3]
    first, second = build_expert(manifest, uid), build_expert(manifest, uid)
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
    other = build_expert(manifest, expert_uids(manifest)[4])
    assert not torch.equal(first.state_dict()["up.weight"], other.state_dict()["up.weight"])
    hidden = torch.randn(3, manifest.data.sequence_length, 256)
    assert first(hidden).shape == hidden.shape
    backend = make_backend(manifest, uid, first, torch.optim.SGD(first.parameters(), lr=0.1))
    (output,) = backend.forward(hidden)
    assert output.shape == hidden.shape
    (grad,) = backend.backward(hidden, torch.ones_like(hidden))
    assert grad.shape == hidden.shape
    assert not torch.equal(first.state_dict()["up.weight"], second.state_dict()["up.weight"]), "backward trains"


def test_a_backend_is_made_without_running_its_expert_where_it_lives() -> None:
    # An expert on a GPU failed hivemind's trial forward on CPU zeros; the meta device fails it the same way.
    manifest = demo_moe()
    uid = expert_uids(manifest)[0]
    expert = build_expert(manifest, uid).to("meta")
    backend = make_backend(manifest, uid, expert, torch.optim.SGD(expert.parameters(), lr=0.1))
    assert tuple(backend.outputs_schema.shape) == (None, manifest.data.sequence_length, 256)


def test_dmoe_needs_decoder_layers_with_an_mlp() -> None:
    with pytest.raises(BadInputError, match="has no decoder layers with an `mlp` FFN"):
        _decoder_layers(torch.nn.Linear(2, 2), "AlbertForMaskedLM")


def test_an_expert_checkpoint_is_checksummed_and_a_flipped_byte_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hosting, "_children_reset", True)  # register no fork hook in the test process
    manifest = demo_moe()
    uid = expert_uids(manifest)[0]
    options = HostOptions(checkpoint_dir=tmp_path)
    host = ExpertHost(None, manifest, options)  # type: ignore[arg-type]  # no DHT: no server is started
    trained = host._load_or_create(uid)
    with torch.no_grad():
        trained.module.up.weight.add_(1.0)  # type: ignore[operator]
    host._experts[uid] = trained
    host._save(uid)
    assert host.checkpointed() == {uid} and (tmp_path / f"{uid}.pt.sha256").is_file()
    restored = ExpertHost(None, manifest, options)._load_or_create(uid)  # type: ignore[arg-type]
    assert torch.equal(restored.module.up.weight, trained.module.up.weight)

    path = tmp_path / f"{uid}.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's bytes: torch alone would load it without a word
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        fresh = ExpertHost(None, manifest, options)._load_or_create(uid)  # type: ignore[arg-type]
    assert "checksum mismatch" in caplog.text
    assert torch.equal(fresh.module.up.weight, build_expert(manifest, uid).up.weight), "started afresh"
