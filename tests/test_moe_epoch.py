"""The epoch an expert host's learning-rate schedule counts is bounded against lying trainers (moe/epoch.py)."""

from __future__ import annotations

from pathlib import Path

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.dht.records import MAX_GLOBAL_STEPS_PER_S, epoch_ceiling, owner_marker, peer_id_of_owner
from crowdtrain.dht.registry import publish_peer_status
from crowdtrain.moe.epoch import MAX_EPOCH_LEAD, ExpertEpoch
from crowdtrain.optimizer import learning_rate_factor
from tests.test_moe_replicas import supervisor, tiny_moe

pytestmark = pytest.mark.timeout(120)

CREATED_AT = 1_000_000.0
NOW = CREATED_AT + 3600.0


def test_one_liar_among_trainers_moves_nothing() -> None:
    epoch = ExpertEpoch(run_created_at=CREATED_AT)
    assert epoch.update({"honest": 7, "liar": 50_000}, NOW) == 7
    assert epoch.update({"a": 7, "b": 8, "liar": 50_000}, NOW + 5) == 8
    assert epoch.update({}, NOW + 10) == 8, "no trainer online: the schedule stays where it was"
    assert epoch.update({"a": 2, "b": 3}, NOW + 15) == 8, "it never goes back"


def test_a_claim_beyond_what_the_run_can_have_reached_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    epoch = ExpertEpoch(run_created_at=CREATED_AT)
    beyond = epoch_ceiling(CREATED_AT, NOW) + 1
    with caplog.at_level("WARNING"):
        assert epoch.update({"liar": beyond}, NOW) == 0
        assert epoch.update({"liar": 2**63 - 1, "honest": 4}, NOW + 1) == 4
    assert caplog.text.count("ignoring the epoch of peer") == 1, "said once per peer"


def test_after_the_first_look_the_epoch_advances_no_faster_than_a_run_can_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    epoch = ExpertEpoch(run_created_at=CREATED_AT)
    assert epoch.update({"a": 1000}, NOW) == 1000, "a host joining a late run starts where the run is"
    with caplog.at_level("WARNING"):
        lied = epoch.update({"a": 60_000, "b": 60_000}, NOW + 5)  # a lying majority
    assert lied == 1000 + MAX_EPOCH_LEAD + 5 * MAX_GLOBAL_STEPS_PER_S
    assert "faster than a run can step" in caplog.text
    assert epoch.update({"a": lied + 3}, NOW + 6) == lied + 3, "honest progress is followed at once"


def publish_trainer(dht: hivemind.DHT, key: RSAPrivateKey, run_id: str, epoch: int) -> None:
    owner = owner_marker(key)
    status = proto.PeerStatus(
        peer_id=peer_id_of_owner(owner).to_base58(), run_id=run_id, roles=["trainer"], epoch=epoch
    )
    assert publish_peer_status(dht, status, owner, ttl_s=60, timeout_s=10)


def test_a_host_beside_an_honest_trainer_and_a_liar_follows_the_honest_schedule(
    keyed_dhts: list[tuple[hivemind.DHT, RSAPrivateKey]], tmp_path: Path
) -> None:
    (host_dht, _), (honest_dht, honest_key), (liar_dht, liar_key) = keyed_dhts
    manifest = tiny_moe()
    publish_trainer(honest_dht, honest_key, manifest.run_id, epoch=3)
    publish_trainer(liar_dht, liar_key, manifest.run_id, epoch=90_000)  # within what the run could have reached
    host = supervisor(host_dht, manifest, tmp_path / "host", max_experts=0)
    host.stop.set()  # one look at the swarm, then the host stops
    host.run()
    assert host.epoch.epoch == 3
    assert host.host._learning_rate_factor == learning_rate_factor(3, manifest.optimizer), (
        "the experts' learning rate is the honest epoch's, not the end of the schedule"
    )
