"""A joiner's state download is checked before it is loaded; a donor that serves a bad state is skipped
(issue 14, "verified state")."""

from __future__ import annotations

import functools
import time
from typing import Any

import hivemind
import pytest
import torch

from crowdtrain.averaging.collaboration import PlannedStateAverager
from crowdtrain.averaging.state_download import (
    EPOCH_SLACK,
    MAX_GLOBAL_STEPS_PER_S,
    EpochTooHighError,
    StateTemplate,
    TensorSpec,
    UnacceptableStateError,
    check_state,
    epoch_ceiling,
    optimizer_tensor_specs,
)
from crowdtrain.averaging.traffic import AveragingTraffic
from tests.harness import shut_down

TEMPLATE = StateTemplate(
    (TensorSpec((3, 4), torch.float32), TensorSpec((), torch.float32, non_negative=True)), epoch_ceiling=10
)


def honest_tensors() -> list[torch.Tensor]:
    return [torch.randn(3, 4), torch.tensor(5.0)]


def test_an_honest_state_passes_and_its_epoch_is_returned() -> None:
    assert check_state({"epoch": 7}, honest_tensors(), TEMPLATE) == 7


@pytest.mark.parametrize(
    ("metadata", "tensors", "reason"),
    [
        ({"epoch": -1}, honest_tensors(), "epoch"),
        ({"epoch": 3.0}, honest_tensors(), "epoch"),
        ({"epoch": True}, honest_tensors(), "epoch"),
        ("not a dict", honest_tensors(), "epoch"),
        ({"epoch": 1}, [torch.full((3, 4), float("nan")), torch.tensor(5.0)], "NaN"),
        ({"epoch": 1}, [torch.full((3, 4), float("inf")), torch.tensor(5.0)], "NaN"),
        ({"epoch": 1}, [torch.ones(1), torch.tensor(5.0)], "expected"),  # copy_ would broadcast it
        ({"epoch": 1}, [torch.ones(3, 4, dtype=torch.float64), torch.tensor(5.0)], "expected"),
        ({"epoch": 1}, [torch.randn(3, 4), torch.tensor(-1.0)], "negative"),
        ({"epoch": 1}, honest_tensors()[:1], "tensors"),
        ({"epoch": 1}, [*honest_tensors(), torch.zeros(1)], "tensors"),
        ({"epoch": 1}, [torch.randn(3, 4), "a string"], "expected"),
    ],
)
def test_a_hostile_state_is_refused(metadata: Any, tensors: list[Any], reason: str) -> None:
    with pytest.raises(UnacceptableStateError, match=reason):
        check_state(metadata, tensors, TEMPLATE)


def test_an_epoch_beyond_what_the_run_can_have_reached_is_refused_but_not_held_against_the_donor() -> None:
    # an epoch of 2**62 made hivemind's scheduler step forever; a run a day old can't be past 20 steps/s
    assert epoch_ceiling(created_at=1000.0, now=1000.0 + 86400) == int(86400 * MAX_GLOBAL_STEPS_PER_S) + EPOCH_SLACK
    assert epoch_ceiling(created_at=2000.0, now=1000.0) == EPOCH_SLACK  # a clock behind the founder's
    with pytest.raises(EpochTooHighError):
        check_state({"epoch": 2**62}, honest_tensors(), TEMPLATE)


def test_adam_second_moments_and_steps_must_not_be_negative() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    specs = optimizer_tensor_specs(optimizer)
    assert len(specs) == 6  # per parameter: exp_avg, exp_avg_sq, step
    assert sum(spec.non_negative for spec in specs) == 4
    assert {spec.shape for spec in specs if not spec.non_negative} == {(3, 4), (3,)}


class PoisonedStateAverager(PlannedStateAverager):
    """A donor that serves NaN parameters at a huge epoch, and declares the highest priority to be asked first."""

    def get_current_state(self) -> Any:
        metadata, tensors, infos = super().get_current_state()
        return {**metadata, "epoch": 2**62}, [torch.full_like(tensor, float("nan")) for tensor in tensors], infos


def make_averager(cls: type, dht: hivemind.DHT, seed: int, *, priority: float = 0.0) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    averager = cls(
        dht=dht,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        params=model.parameters(),
        prefix="verified_state_test",
        start=True,
        traffic=AveragingTraffic.new(),
    )
    averager.state_sharing_priority = priority
    return averager, model


def wait_for_donors(dht: hivemind.DHT, priorities: set[float], timeout_s: float = 60.0) -> None:
    """Until the DHT lists donors with these priorities (the averagers declare them in their background)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = dht.get("verified_state_test.all_averagers", latest=True)
        declared = {entry.value for entry in found.value.values()} if found is not None else set()
        if priorities <= declared:
            return
        time.sleep(0.2)
    raise AssertionError(f"the donors' priorities {priorities} never reached the DHT")


@pytest.mark.swarm
def test_a_joiner_skips_a_poisoned_donor_and_loads_the_honest_state() -> None:
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False)
    peers = [str(maddr) for maddr in first.get_visible_maddrs()]
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, use_ipfs=False)
        for _ in range(2)
    ]
    averagers: list[Any] = []
    try:
        honest, honest_model = make_averager(PlannedStateAverager, dhts[0], seed=1, priority=1.0)
        poisoned, _ = make_averager(PoisonedStateAverager, dhts[1], seed=2, priority=1e9)
        joiner, joiner_model = make_averager(PlannedStateAverager, dhts[2], seed=3)
        averagers += [honest, poisoned, joiner]
        honest.local_epoch = 4
        wait_for_donors(dhts[2], {1.0, 1e9})
        joiner.load_state_from_peers(timeout=30)
        assert joiner.local_epoch == 4
        for mine, theirs in zip(joiner_model.parameters(), honest_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        assert all(torch.isfinite(parameter).all() for parameter in joiner_model.parameters())
        assert joiner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    finally:
        shut_down(averagers, dhts)


def test_a_high_epoch_moves_the_learning_rate_schedule_in_one_step() -> None:
    # hivemind stepped the scheduler once per epoch: an epoch of 2**62 never returned.
    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / 100) * 0.5 ** (step // 1000)

    reference = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), schedule)
    for _ in range(2500):
        reference.optimizer.step()
        reference.step()
    averager: Any = object.__new__(PlannedStateAverager)
    averager._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    averager.scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), schedule)
    averager.local_epoch = 2500
    averager._update_scheduler()
    assert averager.scheduler.get_last_lr() == reference.get_last_lr()
    assert averager.scheduler.last_epoch == reference.last_epoch == 2500
    averager.local_epoch = 2**62
    averager._update_scheduler()  # returns at once
    assert averager.scheduler.last_epoch == 2**62
