"""Trainers find experts only through the hosts' signed status records (moe/directory.py), never through
hivemind's unsigned declarations, which any peer can forge."""

from __future__ import annotations

import numpy as np
import pytest
from hivemind.dht import DHT
from hivemind.moe.client.beam_search import MoEBeamSearcher
from hivemind.moe.server.dht_handler import declare_experts
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.dht.records import owner_marker, peer_id_of_owner
from crowdtrain.dht.registry import publish_peer_status
from crowdtrain.manifest import expert_uid_prefix, expert_uids
from crowdtrain.models.dmoe import DMoEFeedForward
from crowdtrain.moe.directory import ExpertDirectory
from tests.test_moe_replicas import tiny_moe

pytestmark = pytest.mark.timeout(120)

MANIFEST = tiny_moe(grid_size=3)
ONE, TWO, THREE = expert_uids(MANIFEST)


def peer_id(key: RSAPrivateKey) -> str:
    return peer_id_of_owner(owner_marker(key)).to_base58()


def publish(dht: DHT, key: RSAPrivateKey, *, peer: str, roles: list[str], experts: list[str]) -> bool:
    status = proto.PeerStatus(peer_id=peer, run_id=MANIFEST.run_id, roles=roles, experts=experts)
    return publish_peer_status(dht, status, owner_marker(key), ttl_s=60, timeout_s=10)


def best_experts(searcher: object) -> set[tuple[str, str]]:
    scores = [np.zeros((2, 3))]  # two sequences, a flat grid of three experts scored alike
    found = searcher.batch_find_best_experts(scores, 3)  # type: ignore[attr-defined]
    return {(expert.uid, expert.peer_id.to_base58()) for row in found for expert in row}


def test_a_forged_declaration_naming_another_peer_or_unsigned_is_not_used(
    keyed_dhts: list[tuple[DHT, RSAPrivateKey]],
) -> None:
    (trainer_dht, _), (host_dht, host_key), (forger_dht, forger_key) = keyed_dhts
    host, forger = peer_id(host_key), peer_id(forger_key)
    assert publish(host_dht, host_key, peer=host, roles=["expert-host"], experts=[ONE])

    # hivemind's declarations: the forger claims to host every expert, the honest host's one included
    assert all(declare_experts(forger_dht, [ONE, TWO, THREE], get_dht_time() + 60).values())
    # a signed status naming the honest host, serving an expert it does not: no DHT node stores it
    assert not publish(forger_dht, forger_key, peer=host, roles=["expert-host"], experts=[TWO])
    # its own status, listing as no expert host an expert of the grid and one off it
    assert publish(forger_dht, forger_key, peer=forger, roles=["trainer"], experts=[THREE, "replicas-ffn9.0"])

    prefix = expert_uid_prefix(MANIFEST, 0)
    hivemind_search = MoEBeamSearcher(trainer_dht, prefix, MANIFEST.moe.grid)  # type: ignore[union-attr]
    assert (TWO, forger_dht.peer_id.to_base58()) in best_experts(hivemind_search), "hivemind's search takes forgeries"

    directory = ExpertDirectory(trainer_dht, MANIFEST)
    layer = DMoEFeedForward(
        hidden_size=16, dht=trainer_dht, uid_prefix=prefix, spec=MANIFEST.moe, find_hosts=directory.hosts
    )  # type: ignore[arg-type]
    assert directory.hosts() == {ONE: (host,)}
    assert best_experts(layer.experts.beam_search) == {(ONE, host)}, "a trainer calls only the signed host"
