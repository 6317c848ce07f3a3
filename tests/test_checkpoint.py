"""Checkpoints: round trip, last K kept, corrupt or truncated ones rejected and the previous used; written
in the background on an interval, from a snapshot, failures logged and the older ones kept."""

from __future__ import annotations

import errno
import io
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from crowdtrain import files as files_module
from crowdtrain.files import write_atomically, write_checksummed
from crowdtrain.manifest import OptimizerSpec, demo
from crowdtrain.modes.progress import Progress
from crowdtrain.optimizer import learning_rate_factor
from crowdtrain.training.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    parameter_shapes,
    save_checkpoint,
)
from crowdtrain.training.checkpoint_writer import (
    CheckpointSchedule,
    CheckpointSnapshot,
    CheckpointWriter,
    take_snapshot,
)
from crowdtrain.training.loop import Trainer


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


# Checkpoints in the background: the interval, the snapshot and the writer thread.

DEADLINE_S = 10.0
"""Bound on every wait for the writer thread (it writes a few kilobytes)."""


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class BlockingWrite:
    """An atomic write that waits for `release` before touching the disk, recording what it was asked to write."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.names: list[str] = []

    def __call__(self, path: Path, data: bytes | memoryview) -> None:
        self.names.append(path.name)
        self.entered.set()
        assert self.release.wait(DEADLINE_S), "the test never released the write"
        write_atomically(path, data)


def snapshot_of(epoch: int, seed: int = 0) -> CheckpointSnapshot:
    model = make_model(seed)
    return take_snapshot(epoch, model.state_dict(), optimizer_state(model))


@pytest.fixture
def writers() -> Iterator[list[CheckpointWriter]]:
    """Writers a test made; each is closed at the end so no thread outlives its test."""
    made: list[CheckpointWriter] = []
    yield made
    for writer in made:
        writer.close(None, timeout_s=DEADLINE_S)


def test_schedule_is_due_once_the_interval_passed_since_start_or_the_last_checkpoint() -> None:
    clock = FakeClock()
    schedule = CheckpointSchedule(interval_s=600, clock=clock)
    assert not schedule.is_due(), "never at the start"
    clock.now_s += 599.9
    assert not schedule.is_due()
    clock.now_s += 0.1
    assert schedule.is_due()
    clock.now_s += 50
    assert schedule.is_due(), "stays due until a checkpoint is taken"
    schedule.restart()
    assert not schedule.is_due()
    clock.now_s += 600
    assert schedule.is_due()
    with pytest.raises(ValueError, match="interval_s must be positive"):
        CheckpointSchedule(interval_s=0)


def test_snapshot_is_a_copy_that_training_can_not_change() -> None:
    model = make_model(0)
    state = optimizer_state(model)
    snapshot = take_snapshot(3, model.state_dict(), state)
    before = {name: tensor.clone() for name, tensor in snapshot.model_state.items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    state["state"][0]["exp_avg"].add_(1.0)
    assert all(torch.equal(before[name], tensor) for name, tensor in snapshot.model_state.items())
    assert not torch.equal(snapshot.optimizer_state["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert hasattr(snapshot.model_state, "_metadata"), "module versions kept for load_state_dict"


def test_snapshot_keeps_tied_tensors_tied() -> None:
    shared = torch.arange(6.0)
    snapshot = take_snapshot(1, {"embed": shared, "head": shared.detach(), "other": shared.clone()}, {})
    assert snapshot.model_state["embed"] is snapshot.model_state["head"]
    assert snapshot.model_state["other"] is not snapshot.model_state["embed"]
    assert snapshot.model_state["embed"].data_ptr() != shared.data_ptr()


def test_submit_returns_while_the_write_blocks_and_a_second_submit_is_skipped(
    tmp_path: Path, writers: list[CheckpointWriter], caplog: pytest.LogCaptureFixture
) -> None:
    write = BlockingWrite()
    writer = CheckpointWriter(directory=tmp_path, keep=3, write_file=write)
    writers.append(writer)
    first = snapshot_of(1)
    assert writer.submit(first), "accepted at once"
    assert write.entered.wait(DEADLINE_S), "the writer thread started the write"
    assert writer.busy and not list_checkpoints(tmp_path), "submit returned while the disk write is blocked"
    with caplog.at_level(logging.DEBUG, logger="crowdtrain.training.checkpoint_writer"):
        assert not writer.submit(snapshot_of(2)), "one write in flight at most"
    assert "skipped the checkpoint of epoch 2" in caplog.text
    write.release.set()
    assert writer.wait_idle(DEADLINE_S)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt"]
    loaded = load_checkpoint(tmp_path / "epoch-00000001.pt", make_model(5))
    assert loaded.epoch == 1
    assert all(torch.equal(loaded.model_state[name], tensor) for name, tensor in first.model_state.items())
    exp_avg = first.optimizer_state["state"][0]["exp_avg"]
    assert torch.equal(loaded.optimizer_state["state"][0]["exp_avg"], exp_avg)
    assert writer.num_written == 1 and writer.num_failed == 0


def test_writer_keeps_the_last_k(tmp_path: Path, writers: list[CheckpointWriter]) -> None:
    writer = CheckpointWriter(directory=tmp_path, keep=2)
    writers.append(writer)
    for epoch in range(1, 5):
        assert writer.submit(snapshot_of(epoch))
        assert writer.wait_idle(DEADLINE_S)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000003.pt", "epoch-00000004.pt"]
    assert load_latest_checkpoint(tmp_path, make_model(0)) is not None


def test_close_waits_for_the_write_in_flight_then_writes_the_final_one(tmp_path: Path) -> None:
    write = BlockingWrite()
    writer = CheckpointWriter(directory=tmp_path, keep=3, write_file=write)
    assert writer.submit(snapshot_of(1))
    assert write.entered.wait(DEADLINE_S)
    results: list[bool] = []
    closer = threading.Thread(target=lambda: results.append(writer.close(snapshot_of(2), timeout_s=DEADLINE_S)))
    closer.start()
    write.release.set()
    closer.join(DEADLINE_S)
    assert results == [True]
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt", "epoch-00000002.pt"]
    assert write.names == [f"epoch-0000000{n}.pt{suffix}" for n in (1, 2) for suffix in ("", ".sha256")]
    assert load_latest_checkpoint(tmp_path, make_model(0)).epoch == 2  # type: ignore[union-attr]


def test_close_gives_the_final_write_up_past_its_bound(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write = BlockingWrite()
    writer = CheckpointWriter(directory=tmp_path, keep=3, write_file=write)
    assert writer.submit(snapshot_of(1))
    assert write.entered.wait(DEADLINE_S)
    with caplog.at_level(logging.WARNING):
        assert not writer.close(snapshot_of(2), timeout_s=0.05)
    assert "gave up waiting for the final checkpoint" in caplog.text
    write.release.set()
    assert writer.wait_idle(DEADLINE_S)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt"], "the final one given up"


def test_a_failed_write_is_one_warning_and_keeps_the_older_checkpoints(
    tmp_path: Path, writers: list[CheckpointWriter], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CheckpointWriter(directory=tmp_path, keep=1)
    writers.append(writer)
    assert writer.submit(snapshot_of(1)) and writer.wait_idle(DEADLINE_S)

    def disk_full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_module.os, "fsync", disk_full)
    with caplog.at_level(logging.WARNING):
        assert writer.submit(snapshot_of(2, seed=1)) and writer.wait_idle(DEADLINE_S)
    warnings = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert writer.num_failed == 1
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt"], "keep=1 rotated nothing away"
    assert not list(tmp_path.glob(".*.tmp")), "the staged file is removed"
    assert load_latest_checkpoint(tmp_path, make_model(0)).epoch == 1  # type: ignore[union-attr]
    monkeypatch.undo()
    assert writer.submit(snapshot_of(3)) and writer.wait_idle(DEADLINE_S), "the writer goes on after a failure"
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000003.pt"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_one_warning(
    tmp_path: Path, writers: list[CheckpointWriter], caplog: pytest.LogCaptureFixture
) -> None:
    writer = CheckpointWriter(directory=tmp_path, keep=3)
    writers.append(writer)
    assert writer.submit(snapshot_of(1)) and writer.wait_idle(DEADLINE_S)
    tmp_path.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            assert writer.submit(snapshot_of(2)) and writer.wait_idle(DEADLINE_S)
    finally:
        tmp_path.chmod(0o700)
    assert "Permission denied" in caplog.text and writer.num_failed == 1
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt"]


def test_a_restarted_writer_removes_what_a_killed_write_left_staged(tmp_path: Path) -> None:
    (tmp_path / ".epoch-00000007.pt.tmp").write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, 6, make_model(0), {}, keep=3)
    writer = CheckpointWriter(directory=tmp_path, keep=3)
    assert writer.close(None, timeout_s=DEADLINE_S)
    assert not list(tmp_path.glob(".*.tmp"))
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000006.pt"]


class FakeMode:
    """The three things the trainer's checkpointing reads of its training mode."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.epoch = 0
        self.state_dict = lambda: optimizer_state(model)

    def checkpoint_model_state(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return model_state  # as every mode but an overlapped SkipPipe one


def test_trainer_checkpoints_on_the_interval_never_at_epoch_0_and_never_waits_for_the_disk(tmp_path: Path) -> None:
    clock, write = FakeClock(), BlockingWrite()
    trainer = Trainer(
        dht=None,  # type: ignore[arg-type]
        manifest=demo(),
        peer_id="me",
        private_key=None,  # type: ignore[arg-type]
        options=None,  # type: ignore[arg-type]
        progress=Progress(),
        known_peers=list,
    )
    trainer._checkpoint_writer = writer = CheckpointWriter(directory=tmp_path, keep=3, write_file=write)
    trainer._checkpoint_schedule = schedule = CheckpointSchedule(interval_s=600, clock=clock)
    model = make_model(0)
    mode = FakeMode(model)
    mode.epoch = 1
    trainer._checkpoint_if_due(model, mode)  # type: ignore[arg-type]
    assert not writer.busy, "not due before the interval"
    clock.now_s += 600
    mode.epoch = 0
    trainer._checkpoint_if_due(model, mode)  # type: ignore[arg-type]
    assert not writer.busy, "never at epoch 0"
    mode.epoch = 1
    trainer._checkpoint_if_due(model, mode)  # type: ignore[arg-type]
    assert write.entered.wait(DEADLINE_S) and writer.busy, "returned while the write is blocked"
    assert not schedule.is_due()
    clock.now_s += 600
    mode.epoch = 2
    trainer._checkpoint_if_due(model, mode)  # type: ignore[arg-type]
    assert schedule.is_due(), "skipped while the last is written: due again at the next epoch"
    mode.epoch = 3
    closer = threading.Thread(target=trainer._final_checkpoint, args=(model, mode))
    closer.start()
    write.release.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive()
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt", "epoch-00000003.pt"]


def poisoned(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with one weight NaN, as a step on an infinite gradient left it before steps were checked."""
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    return model


def test_a_state_that_is_not_finite_is_never_saved(
    tmp_path: Path, writers: list[CheckpointWriter], caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(tmp_path, 1, make_model(0), {}, keep=3)
    with pytest.raises(CheckpointError, match="holds NaN or infinite values .*: not saved"):
        save_checkpoint(tmp_path, 2, poisoned(make_model(0)), {}, keep=3)
    model = make_model(0)
    state = optimizer_state(model)
    state["state"][0]["exp_avg"].view(-1)[0] = float("inf")
    with pytest.raises(CheckpointError, match=r"state\.0\.exp_avg"):
        save_checkpoint(tmp_path, 2, model, state, keep=3)
    writer = CheckpointWriter(directory=tmp_path, keep=1)
    writers.append(writer)
    with caplog.at_level(logging.WARNING):
        assert writer.submit(take_snapshot(3, poisoned(make_model(0)).state_dict(), {}))
        assert writer.wait_idle(DEADLINE_S)
    assert writer.num_failed == 1 and "not saved; training goes on" in caplog.text and "Traceback" not in caplog.text
    assert [path.name for path in list_checkpoints(tmp_path)] == ["epoch-00000001.pt"], "keep=1 rotated nothing away"


def test_a_checkpoint_with_weights_that_are_not_finite_is_refused_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(tmp_path, 1, make_model(0), {}, keep=3)
    model = poisoned(make_model(0))  # written as a version without the check wrote it
    buffer = io.BytesIO()
    torch.save({"epoch": 2, "model": model.state_dict(), "optimizer": {}, "shapes": parameter_shapes(model)}, buffer)
    path = tmp_path / "epoch-00000002.pt"
    write_checksummed(path, buffer.getbuffer(), write_atomically)
    with pytest.raises(CheckpointError, match="epoch-00000002.pt holds NaN or infinite values .*, so it is not used"):
        load_checkpoint(path, make_model(0))
    with caplog.at_level(logging.WARNING):
        chosen = load_latest_checkpoint(tmp_path, make_model(0))
    assert chosen is not None and chosen.epoch == 1, "the finite checkpoint before it is used"
