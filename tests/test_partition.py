"""The all-reduce partition follows the plan's shares: pure fractions, and real averagers on loopback."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from lab.diloco import identity_key, loopback_dhts

from crowdtrain.averaging.partition import PlannedAverager, PlanSharesMixin, group_fractions
from tests.harness import ALLREDUCE_TIMEOUT_S, JOIN_REQUEST_TIMEOUT_S, MATCHMAKING_TIME_S, shut_down, step_together

NODE, CLIENT = AveragingMode.NODE, AveragingMode.CLIENT


def test_shares_are_renormalised_over_the_group() -> None:
    assert group_fractions([0.5, 0.25, 0.25], [NODE] * 3, 1000) == (0.5, 0.25, 0.25)
    # a Moshpit group holding two of the plan's aggregators splits between them in proportion
    assert group_fractions([0.3, 0.1], [NODE, NODE], 1000) == pytest.approx((0.75, 0.25))


def test_clients_get_nothing_even_with_a_share() -> None:
    assert group_fractions([0.5, 0.5, 0.0], [CLIENT, NODE, NODE], 1000) == (0.0, 1.0, 0.0)


def test_no_plan_means_an_equal_split_among_those_who_can_aggregate() -> None:
    assert group_fractions([None, None, None], [NODE, CLIENT, NODE], 1000) == (0.5, 0.0, 0.5)
    # the plan gave every member of this group zero: they still must average, equally
    assert group_fractions([0.0, 0.0], [NODE, NODE], 1000) == (0.5, 0.5)


def test_garbage_from_peers_counts_as_no_share() -> None:
    fractions = group_fractions([float("nan"), -1.0, "x", 0.5], [NODE] * 4, 1000)  # type: ignore[list-item]
    assert fractions == (0.0, 0.0, 0.0, 1.0)


def test_parts_below_the_minimum_size_go_to_the_others() -> None:
    assert group_fractions([0.99, 0.01], [NODE, NODE], 1000, min_vector_size=50) == (1.0, 0.0)
    # ... unless that leaves nobody
    assert group_fractions([0.5, 0.5], [NODE, NODE], 10, min_vector_size=50) == (0.5, 0.5)


def test_a_group_of_clients_is_an_error() -> None:
    with pytest.raises(ValueError, match="client"):
        group_fractions([None, None], [CLIENT, CLIENT], 10)


def test_a_share_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="within"):
        PlanSharesMixin().set_share(1.5)


class _RecordingAverager(PlannedAverager):
    """Reports the fractions each round ran with, from the averager's own process."""

    def __init__(self, *args: Any, recorded: Any, **kwargs: Any):
        super().__init__(*args, start=False, **kwargs)
        self.recorded = recorded
        self.run_in_background(await_ready=True)

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: Any = None, **kwargs: Any) -> Any:
        self.recorded.put(tuple(kwargs["peer_fractions"]))
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_averagers_split_the_vector_by_their_shares_and_reach_the_exact_mean() -> None:
    shares = [0.75, 0.25, 0.0]
    dhts = loopback_dhts(len(shares))
    recorded: Any = mp.get_context("fork").Queue()
    values = [torch.arange(1000, dtype=torch.float32) * (rank + 1) for rank in range(len(shares))]
    averagers = [
        _RecordingAverager(
            [values[rank].clone()],
            dht=dhts[rank],
            prefix="partition-test",
            target_group_size=len(shares),
            min_group_size=len(shares),
            min_matchmaking_time=MATCHMAKING_TIME_S,
            request_timeout=JOIN_REQUEST_TIMEOUT_S,
            allreduce_timeout=ALLREDUCE_TIMEOUT_S,
            share=share,
            author=identity_key(dhts[rank]),
            recorded=recorded,
        )
        for rank, share in enumerate(shares)
    ]
    try:
        gathered = step_together(averagers)
        assert all(result is not None for result in gathered), "every peer found the group"
        mean = torch.stack(values).mean(dim=0)
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert torch.allclose(tensors[0], mean)
        rounds = [recorded.get(timeout=10) for _ in shares]
        assert len(set(rounds)) == 1, "every member computed the same partition"
        # fractions are in the group's peer order; as a multiset they are the shares
        assert sorted(rounds[0]) == pytest.approx(sorted(shares))
    finally:
        shut_down(averagers, dhts)
