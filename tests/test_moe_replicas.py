"""Replicas of an expert: the parameter RPC between real p2p daemons, a new replica starting from a live
one's weights, and replicas averaging theirs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hivemind
import pytest
import torch
from torch import nn

from crowdtrain import proto
from crowdtrain.manifest import RunManifest, expert_uids, manifest_from_overrides
from crowdtrain.moe import ExpertSupervisor, HostOptions, SupervisorOptions
from crowdtrain.moe.replicas import ReplicaError, ReplicaService, flat_parameters, mix_into, num_values
from crowdtrain.rpc.service import NodeStopping
from tests.messages import read_first_then_stall

pytestmark = pytest.mark.timeout(120)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def small_module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_mix_into_copies_or_averages_in_parameter_order() -> None:
    target, source = small_module(0), small_module(1)
    before, values = flat_parameters(target), flat_parameters(source)
    assert before.numel() == num_values(target) == 3 * 4 + 4 + 4 * 2 + 2
    mix_into(target, values, 0.5)
    assert torch.allclose(flat_parameters(target), (before + values) / 2)
    mix_into(target, values, 1.0)
    assert torch.equal(flat_parameters(target), values)
    assert torch.equal(target[0].bias, source[0].bias)  # the order maps value to the same parameter
    with pytest.raises(ValueError, match="values for a module with"):
        mix_into(target, values[:-1], 0.5)


@pytest.fixture
def two_dhts() -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    second = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs())
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def test_parameters_travel_exactly_and_bad_answers_are_refused(two_dhts: tuple[hivemind.DHT, hivemind.DHT]) -> None:
    served = {"run-ffn0.0": small_module(2)}
    server = ReplicaService(two_dhts[0], served.get)
    client = ReplicaService(two_dhts[1], lambda uid: None)
    server.start()
    client.start()
    try:
        expected = flat_parameters(served["run-ffn0.0"])
        fetched = client.fetch(server.peer_id, "run-ffn0.0", expected.numel())
        assert torch.equal(fetched, expected)
        with pytest.raises(ReplicaError, match="does not serve expert run-ffn0.1"):
            client.fetch(server.peer_id, "run-ffn0.1", expected.numel())
        with pytest.raises(ReplicaError, match="a different run or version"):
            client.fetch(server.peer_id, "run-ffn0.0", expected.numel() + 1)
        with torch.no_grad():
            served["run-ffn0.0"][0].weight.fill_(float("nan"))
        with pytest.raises(ReplicaError, match="non-finite"):
            client.fetch(server.peer_id, "run-ffn0.0", expected.numel())
    finally:
        client.close()
        server.close()


def test_a_stopping_host_ends_a_copy_its_peer_holds_up_at_once(two_dhts: tuple[hivemind.DHT, hivemind.DHT]) -> None:
    """A copy waits up to FETCH_TIMEOUT_S (60 s) per expert on a peer that does not answer, and an expert host copies
    or averages its experts one after the other: a Ctrl-C waited that out past the daemon's 28-s leave deadline,
    which exits without checkpointing the experts. The node's stop event ends the copy at once."""
    asked, release = threading.Event(), threading.Event()

    def held_up(uid: str) -> nn.Module | None:
        asked.set()
        release.wait(30)
        return None

    stop = threading.Event()
    server = ReplicaService(two_dhts[0], held_up)
    client = ReplicaService(two_dhts[1], lambda uid: None, stop)
    server.start()
    client.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            copying = pool.submit(client.fetch, server.peer_id, "run-ffn0.0", 10)
            assert asked.wait(30), "the peer was asked"
            assert not copying.done()
            stop.set()
            with pytest.raises(NodeStopping):
                copying.result(timeout=5)
        with pytest.raises(NodeStopping):
            client.fetch(server.peer_id, "run-ffn0.0", 10)  # and no more copies are asked for
    finally:
        release.set()
        client.close()
        server.close()


def test_a_peer_that_stops_reading_a_copy_holds_one_chunk_and_no_other_askers_slot() -> None:
    """Each answer holds one 1 MiB chunk (the values are read as they are sent), not a whole copy made before any
    bound; one per peer at once: a peer that stops reading is busy to itself, and another peer gets its copy."""
    dhts = [hivemind.DHT(start=True, host_maddrs=LOOPBACK)]
    dhts += [hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=dhts[0].get_visible_maddrs()) for _ in "ab"]
    torch.manual_seed(4)
    served = {"run-ffn0.0": nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))}  # 8.4M values, 32 MiB
    server, attacker, other = (
        ReplicaService(dht, served.get if i == 0 else lambda uid: None) for i, dht in enumerate(dhts)
    )
    reading = threading.Event()

    async def read_header_then_stop() -> None:
        stub = attacker.get_stub(attacker.require_p2p(), dhts[0].peer_id, namespace="crowdtrain.experts.v1")
        answers = await stub.rpc_expert_parameters(proto.ExpertParametersRequest(uid="run-ffn0.0"))
        await read_first_then_stall(answers, reading, 110)

    for service in (server, attacker, other):
        service.start()
    held = asyncio.run_coroutine_threadsafe(read_header_then_stop(), attacker._loop)
    try:
        expected = flat_parameters(served["run-ffn0.0"])
        assert reading.wait(30)
        assert server.answers.num_answers == 1 and server.answers.bytes_held == 2**20
        with pytest.raises(ReplicaError, match="as many expert copies as it may"):
            attacker.fetch(server.peer_id, "run-ffn0.0", expected.numel())
        assert torch.equal(other.fetch(server.peer_id, "run-ffn0.0", expected.numel()), expected)
    finally:
        held.cancel()
        for service in (other, attacker, server):
            service.close()
        for dht in dhts:
            dht.shutdown()


def tiny_moe(grid_size: int = 2) -> RunManifest:
    return manifest_from_overrides(
        {
            "run_id": "replicas",
            "model": {
                "config": {
                    "vocab_size": 260,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 16,
                }
            },
            "data": {"sequence_length": 8},
            "moe": {"grid": [grid_size], "expert_hidden_size": 8, "k": 1},
        }
    )


def supervisor(dht: hivemind.DHT, manifest: RunManifest, state: Path, max_experts: int) -> ExpertSupervisor:
    return ExpertSupervisor(
        dht=dht,
        manifest=manifest,
        peer_id=dht.peer_id.to_base58(),
        host_options=HostOptions(checkpoint_dir=state, declare_period_s=5, declare_ttl_s=15),
        options=SupervisorOptions(max_experts=max_experts),
        on_change=lambda uids: None,
    )


def test_a_new_replica_starts_from_the_live_weights_and_replicas_average(
    two_dhts: tuple[hivemind.DHT, hivemind.DHT], tmp_path: Path
) -> None:
    manifest = tiny_moe()
    grid = expert_uids(manifest)
    assert len(grid) == 2
    first = supervisor(two_dhts[0], manifest, tmp_path / "first", max_experts=2)
    second = supervisor(two_dhts[1], manifest, tmp_path / "second", max_experts=1)
    try:
        first.replicas.start()
        second.replicas.start()
        first.host.set_learning_rate_factor(0.25)  # the run's schedule at some epoch
        first.recheck({})
        assert first.host.hosted == tuple(grid)
        assert all(
            first.host.learning_rate(uid) == pytest.approx(0.25 * manifest.optimizer.learning_rate) for uid in grid
        )
        trained = {}
        for uid in grid:  # weights no fresh expert has: as if the first host had trained them
            module = first.host.module(uid)
            assert module is not None
            mix_into(module, flat_parameters(module) + 1.0, 1.0)
            trained[uid] = flat_parameters(module)

        first.host.set_learning_rate_factor(0.5)  # a later epoch: served experts follow
        assert first.host.learning_rate(grid[1]) == pytest.approx(0.5 * manifest.optimizer.learning_rate)
        second.recheck({first.peer_id: first.host.hosted})
        (uid,) = second.host.hosted
        replica = second.host.module(uid)
        assert replica is not None
        assert torch.equal(flat_parameters(replica), trained[uid]), "the new replica copies the live weights"

        mix_into(replica, trained[uid] + 2.0, 1.0)  # the replicas drift apart as each trains
        assert second.average_replicas({first.peer_id: first.host.hosted}) == 1
        assert torch.allclose(flat_parameters(replica), trained[uid] + 1.0)
        assert first.average_replicas({second.peer_id: second.host.hosted}) == 1
        assert torch.allclose(flat_parameters(first.host.module(uid)), trained[uid] + 0.5)  # type: ignore[arg-type]
        other = next(u for u in grid if u != uid)
        assert torch.equal(flat_parameters(first.host.module(other)), trained[other])  # type: ignore[arg-type]
    finally:
        for host in (second, first):
            host.replicas.close()
            host.host.shutdown()


def test_a_host_serves_in_grid_order_so_a_recheck_with_the_same_set_keeps_its_server(
    two_dhts: tuple[hivemind.DHT, hivemind.DHT], tmp_path: Path
) -> None:
    manifest = tiny_moe(grid_size=3)
    a, b, c = expert_uids(manifest)
    host = supervisor(two_dhts[0], manifest, tmp_path / "host", max_experts=2)
    try:
        host.host.serve([b, c])
        host.host.serve([a, b])  # b kept, c dropped, a added: served in the order asked, not b then a
        assert host.host.hosted == (a, b)
        server = host.host._server
        host.recheck({"QmOther": (c,)})  # placement wants the same two experts
        assert host.host.hosted == (a, b) and host.host._server is server, "no restart without a change"
    finally:
        host.host.shutdown()
