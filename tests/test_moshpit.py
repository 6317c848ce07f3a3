"""Moshpit grid keys: pure layout tests, and real hivemind averagers reaching the exact mean in d rounds."""

from __future__ import annotations

import hivemind
import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from crowdtrain.averaging.grid import GroupSizeMixin, bits_per_coordinate, expected_group_size, initial_group_bits
from crowdtrain.averaging.groups import moshpit_bits
from crowdtrain.manifest import AveragingSpec
from tests.harness import ALLREDUCE_TIMEOUT_S, JOIN_REQUEST_TIMEOUT_S, MATCHMAKING_TIME_S, shut_down, step_together


def test_small_swarm_shares_one_group() -> None:
    assert {initial_group_bits(rank, 4, 4, 2) for rank in range(4)} == {""}
    assert initial_group_bits(0, 9, 16, 3) == ""


def test_grid_keys_fill_groups_row_by_row() -> None:
    # 16 peers, groups of 4, 2 dimensions: 4 keys of 2 bits, 4 peers each
    keys = [initial_group_bits(rank, 16, 4, 2) for rank in range(16)]
    assert keys[:4] == ["00"] * 4 and keys[4:8] == ["01"] * 4 and keys[12:] == ["11"] * 4
    # 3 dimensions of 2: 4 keys of 2 bits (coordinates in dimensions 1 and 2)
    keys = [initial_group_bits(rank, 8, 2, 3) for rank in range(8)]
    assert sorted(set(keys)) == ["00", "01", "10", "11"]
    assert all(keys.count(key) == 2 for key in set(keys))


def test_bits_per_coordinate() -> None:
    assert [bits_per_coordinate(size) for size in (1, 2, 4, 16)] == [0, 1, 2, 4]


def test_rank_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError):
        initial_group_bits(5, 5, 2, 2)


def test_moshpit_bits_rank_by_sorted_peer_id() -> None:
    spec = AveragingSpec(group_size=2, grid_dims=2)
    peers = ["d", "a", "c", "b"]
    assert [moshpit_bits(peer, peers, spec) for peer in "abcd"] == ["0", "0", "1", "1"]
    assert moshpit_bits("a", [], spec) == ""


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_four_averagers_in_groups_of_two_reach_the_exact_mean_in_two_rounds() -> None:
    group_size, grid_dims, num_peers = 2, 2, 4
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
        for _ in range(num_peers - 1)
    ]
    values = [torch.tensor([float(rank), 10.0 * rank]) for rank in range(num_peers)]
    averagers = [
        hivemind.averaging.DecentralizedAverager(
            [values[rank].clone()],
            dht=dhts[rank],
            prefix="moshpit-test",
            target_group_size=group_size,
            min_group_size=group_size,
            min_matchmaking_time=MATCHMAKING_TIME_S,
            request_timeout=JOIN_REQUEST_TIMEOUT_S,
            allreduce_timeout=ALLREDUCE_TIMEOUT_S,
            initial_group_bits=initial_group_bits(rank, num_peers, group_size, grid_dims),
            start=True,
        )
        for rank in range(num_peers)
    ]
    try:
        first_round = step_together(averagers)
        assert all(gathered is not None for gathered in first_round), "every peer found its group"
        after_first = [_tensor(averager) for averager in averagers]
        # groups of two, not one group of four: ranks 0,1 and 2,3 each hold their pair's mean
        assert torch.allclose(after_first[0], (values[0] + values[1]) / 2)
        assert torch.allclose(after_first[3], (values[2] + values[3]) / 2)
        second_round = step_together(averagers)
        assert all(gathered is not None for gathered in second_round)
        mean = torch.stack(values).mean(dim=0)
        for averager in averagers:
            assert torch.allclose(_tensor(averager), mean), "exact mean after d=2 rounds"
    finally:
        shut_down(averagers, dhts)


class _SizedAverager(GroupSizeMixin, hivemind.averaging.DecentralizedAverager):
    pass


def test_expected_group_size_counts_the_swarm_up_to_a_group() -> None:
    assert [expected_group_size(n, 16) for n in (1, 2, 5, 16, 40)] == [2, 2, 5, 16, 16]


def test_a_group_closes_once_every_expected_peer_joined_not_at_the_end_of_matchmaking() -> None:
    # Two peers of a run whose groups hold 16: hivemind alone closes the group only when the leader's matchmaking
    # time runs out (120 s here); with the expected size set, it closes as soon as both are in (seconds).
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    averagers = [
        _SizedAverager(
            [value.clone()],
            dht=dht,
            prefix="group-size-test",
            target_group_size=16,
            min_matchmaking_time=120.0,
            # A follower whose join request is not accepted within request_timeout gives that leader up for the
            # leader's whole declaration (hivemind's `past_attempts`: here 120 s); at 2 s a stall of the loaded CI
            # machine once failed this test at its 30-s bound. 10 s stays well under both.
            request_timeout=10.0,
            start=True,
        )
        for value, dht in zip(values, (first, second), strict=True)
    ]
    try:
        for averager in averagers:
            averager.set_target_group_size(expected_group_size(2, 16))
        started = get_dht_time()
        controls = [averager.step(scheduled_time=started, timeout=130, wait=False) for averager in averagers]
        # The bound is a quarter of the matchmaking time: without the expected size, no result before 120 s.
        gathered = [control.result(timeout=30) for control in controls]
        assert all(result is not None for result in gathered), "the group closed when both peers were in"
        for averager in averagers:
            assert torch.allclose(_tensor(averager), (values[0] + values[1]) / 2)
    finally:
        shut_down(averagers, (first, second))


def _tensor(averager: hivemind.averaging.DecentralizedAverager) -> torch.Tensor:
    with averager.get_tensors() as tensors:
        return tensors[0].clone()


class _StubAverager:
    def __init__(self, bits: str):
        self.bits = bits

    def get_group_bits(self) -> str:
        return self.bits

    def set_group_bits(self, bits: str) -> None:
        self.bits = bits

    def set_target_group_size(self, size: int) -> None:
        self.target_group_size = size


class _StubOptimizer:
    use_local_updates = False

    def __init__(self, bits: str):
        self.grad_averager = _StubAverager(bits)
        self.state_averager = _StubAverager("")


def test_group_key_is_reseeded_only_when_the_swarm_crosses_the_group_size() -> None:
    from crowdtrain.averaging.groups import refresh_moshpit_groups

    spec = AveragingSpec(group_size=2, grid_dims=2)
    optimizer = _StubOptimizer("")
    assert not refresh_moshpit_groups(optimizer, "a", ["b"], spec)  # type: ignore[arg-type]
    assert refresh_moshpit_groups(optimizer, "c", ["a", "b", "d"], spec)  # type: ignore[arg-type]
    assert optimizer.grad_averager.bits == "1"
    optimizer.grad_averager.bits = "0"  # hivemind rotated it after a round: must be left alone
    assert not refresh_moshpit_groups(optimizer, "c", ["a", "b", "d", "e"], spec)  # type: ignore[arg-type]
    assert optimizer.grad_averager.bits == "0"
    assert refresh_moshpit_groups(optimizer, "c", ["a"], spec)  # type: ignore[arg-type]
    assert optimizer.grad_averager.bits == ""


def test_both_averagers_close_groups_at_the_swarm_size_up_to_a_group() -> None:
    from crowdtrain.averaging.groups import refresh_moshpit_groups

    spec = AveragingSpec(group_size=4, grid_dims=2)
    optimizer = _StubOptimizer("")
    refresh_moshpit_groups(optimizer, "a", ["b", "c", "a"], spec)  # type: ignore[arg-type]
    assert optimizer.grad_averager.target_group_size == optimizer.state_averager.target_group_size == 3
    refresh_moshpit_groups(optimizer, "a", list("bcdefg"), spec)  # type: ignore[arg-type]
    assert optimizer.grad_averager.target_group_size == optimizer.state_averager.target_group_size == 4
