"""Pure logic of the training loop: throughput/loss averages and the solo-training warning."""

from __future__ import annotations

import logging

import pytest

from crowdtrain import proto
from crowdtrain.manifest import demo
from crowdtrain.modes.progress import LOSS_FIRST_BATCHES, Progress
from crowdtrain.training.loop import SOLO_EPOCHS_BEFORE_WARNING, Trainer, has_started


def make_trainer(progress: Progress) -> Trainer:
    return Trainer(
        dht=None,  # type: ignore[arg-type]
        manifest=demo(),
        peer_id="me",
        private_key=None,  # type: ignore[arg-type]
        options=None,  # type: ignore[arg-type]
        progress=progress,
        known_peers=list,
    )


def test_progress_moving_averages() -> None:
    progress = Progress()
    progress.observe(loss=4.0, num_samples=8, elapsed_s=1.0)
    assert progress.loss is None and progress.samples_per_second == 8.0  # one micro-batch's loss is noise
    progress.observe(loss=2.0, num_samples=16, elapsed_s=1.0)
    assert progress.samples_per_second == pytest.approx(8.8)
    for loss in (3.0, 3.0):
        progress.observe(loss=loss, num_samples=8, elapsed_s=1.0)
    assert progress.loss == pytest.approx(3.0)  # the mean of the first LOSS_FIRST_BATCHES
    for _ in range(LOSS_FIRST_BATCHES - 4):
        progress.observe(loss=3.0, num_samples=8, elapsed_s=1.0)
    progress.observe(loss=4.0, num_samples=8, elapsed_s=1.0)
    assert progress.loss == pytest.approx(3.1)  # then the moving average
    progress.restart_loss()
    assert progress.loss is None and progress.loss_batches == 0
    for loss in (1.0, 2.0, 3.0, 6.0):
        progress.observe(loss=loss, num_samples=8, elapsed_s=1.0)
    assert progress.loss == pytest.approx(3.0)


def test_warns_once_after_consecutive_solo_steps_with_peers_online(caplog: pytest.LogCaptureFixture) -> None:
    progress = Progress()
    trainer = make_trainer(progress)
    with caplog.at_level(logging.WARNING):
        for _ in range(SOLO_EPOCHS_BEFORE_WARNING - 1):
            progress.num_local_steps += 1
            trainer._watch_averaging(num_peers=3)
        assert "training alone" not in caplog.text
        progress.num_local_steps += 1
        trainer._watch_averaging(num_peers=3)
        assert caplog.text.count("training alone") == 1
        progress.num_local_steps += 1
        trainer._watch_averaging(num_peers=3)
        assert caplog.text.count("training alone") == 1, "one warning per streak"


def test_no_warning_alone_or_when_averaging_works(caplog: pytest.LogCaptureFixture) -> None:
    progress = Progress()
    trainer = make_trainer(progress)
    with caplog.at_level(logging.WARNING):
        for _ in range(3 * SOLO_EPOCHS_BEFORE_WARNING):
            progress.num_local_steps += 1
            trainer._watch_averaging(num_peers=1)  # a lone founder steps alone by design
        for epoch in range(3 * SOLO_EPOCHS_BEFORE_WARNING):
            if epoch % 2:
                progress.num_local_steps += 1  # every other round fails: never a streak
            trainer._watch_averaging(num_peers=4)
    assert "training alone" not in caplog.text


def test_a_peer_still_starting_is_not_counted_as_averaging() -> None:
    # Seen on a GPU: a founder steps every 3 s, so it took 5 solo steps while a joiner was still measuring
    # itself and building its model, and warned that averaging failed although nothing was wrong.
    starting = proto.PeerStatus(peer_id="joiner", roles=["trainer"], epoch=0, samples_per_second=0.0)
    assert not has_started(starting)
    assert has_started(proto.PeerStatus(peer_id="joiner", epoch=0, samples_per_second=12.5))  # a new run's peer
    assert has_started(proto.PeerStatus(peer_id="aux", roles=["aggregator"], epoch=7))  # computes nothing
