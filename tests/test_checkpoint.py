"""Checkpoints: round trip, last K kept, corrupt or truncated ones rejected and the previous used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from crowdtrain.averaging.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from crowdtrain.averaging.schedule import learning_rate_factor
from crowdtrain.manifest import OptimizerSpec


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def optimizer_state(model: torch.nn.Module) -> dict:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def test_round_trip(tmp_path: Path) -> None:
    model = make_model(0)
    state = optimizer_state(model)
    path = save_checkpoint(tmp_path, 7, model, state, keep=3)
    fresh = make_model(1)
    loaded = load_checkpoint(path, fresh)
    assert loaded.epoch == 7
    fresh.load_state_dict(loaded.model_state)
    for ours, theirs in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(loaded.optimizer_state["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    model = make_model(0)
    for epoch in range(1, 6):
        save_checkpoint(tmp_path, epoch, model, {}, keep=2)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000004.pt", "epoch-00000005.pt"]
    assert len(list(tmp_path.glob("*.sha256"))) == 2
    assert not list(tmp_path.glob(".*.tmp")), "no temporary files left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_latest_falls_back_to_previous(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(0)
    save_checkpoint(tmp_path, 1, model, {}, keep=3)
    latest = save_checkpoint(tmp_path, 2, model, {}, keep=3)
    data = latest.read_bytes()
    latest.write_bytes(
        data[: len(data) // 2] if damage == "truncate" else data[:100] + bytes([data[100] ^ 1]) + data[101:]
    )
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(latest, model)
    with caplog.at_level(logging.WARNING):
        chosen = load_latest_checkpoint(tmp_path, model)
    assert chosen is not None and chosen.epoch == 1
    assert "epoch-00000002.pt is corrupt" in caplog.text


def test_checkpoint_of_another_model_is_rejected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, make_model(0), {}, keep=1)
    with pytest.raises(CheckpointError, match="another shape"):
        load_checkpoint(path, torch.nn.Linear(4, 2))
    assert load_latest_checkpoint(tmp_path / "missing", make_model(0)) is None


def test_learning_rate_schedule_warms_up_then_decays() -> None:
    spec = OptimizerSpec(warmup_steps=4, total_steps=14)
    factors = [learning_rate_factor(step, spec) for step in range(16)]
    assert factors[0] == pytest.approx(0.2) and factors[3] == pytest.approx(0.8)
    assert factors[4] == pytest.approx(1.0)
    assert all(later <= earlier for earlier, later in zip(factors[4:], factors[5:], strict=False))
    assert factors[14] == pytest.approx(0.0) and factors[15] == pytest.approx(0.0)


def test_partial_average_is_rejected_and_complete_one_accepted() -> None:
    from crowdtrain.averaging.exact import PartialAverageError, require_complete

    require_complete(0, 1000)
    with pytest.raises(PartialAverageError, match="4 of 1000 elements"):
        require_complete(4, 1000)
