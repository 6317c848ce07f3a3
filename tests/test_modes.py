"""The training-mode seam: every manifest mode has one implementation, and the loop drives any mode alike."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crowdtrain import proto
from crowdtrain.data import WindowSampler
from crowdtrain.manifest import TRAINING_MODES, demo
from crowdtrain.modes.base import SwarmView, TrainingMode
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.registry import MODES
from crowdtrain.training.loop import Trainer, TrainerOptions

PACKAGE = Path(__file__).resolve().parent.parent / "crowdtrain"


def test_every_manifest_mode_has_exactly_one_training_mode() -> None:
    assert set(MODES) == set(TRAINING_MODES)
    assert all(mode.name == name for name, mode in MODES.items())
    assert MODES["gradients"].has_auxiliary_aggregators and not MODES["parameters"].has_auxiliary_aggregators


def test_the_daemon_and_the_loop_never_branch_on_the_mode_name() -> None:
    # A new mode is a TrainingMode subclass: nothing above the seam compares `training.mode` to a name.
    names = "|".join(MODES)
    comparison = re.compile(rf"training\.mode\s*(==|!=|in\b)|\.name\s*(==|!=|in\b)|\"({names})\"")
    places = [
        *(PACKAGE / "node").glob("*.py"),
        *(PACKAGE / "training").glob("*.py"),
        *(PACKAGE / "averaging").glob("*.py"),
    ]
    lines = [(path.name, number, line) for path in places for number, line in enumerate(path.read_text().split("\n"))]
    assert not [f"{name}:{number + 1}" for name, number, line in lines if comparison.search(line)]


def test_outside_the_modes_no_source_names_a_mode() -> None:
    # The registry and each mode's settings say what a mode is and reads; the manifest, `status`, `eval`, the daemon
    # and the loop ask them. The presets are runs of a mode, so they name theirs.
    names = "|".join(MODES)
    naming = re.compile(rf"training\.mode\s*(==|!=|in\b)|\"({names})\"")
    sources = [path for path in PACKAGE.rglob("*.py") if "modes" not in path.relative_to(PACKAGE).parts[:1]]
    sources = [path for path in sources if path.name != "presets.py" and not path.name.endswith("_pb2.py")]
    assert len(sources) > 50
    lines = [(path, number, line) for path in sources for number, line in enumerate(path.read_text().split("\n"))]
    assert not [f"{path}:{number + 1}" for path, number, line in lines if naming.search(line)]


class ScriptedMode(TrainingMode):
    """A mode that steps the global epoch every 4 micro-batches, skips every 5th, and records what the loop did."""

    name = "scripted"

    def __init__(self, stop: threading.Event, stop_after: int, before_epoch: Callable[[], object] = lambda: None):
        self.stop, self.stop_after, self.before_epoch = stop, stop_after, before_epoch
        self.trained = self.epoch_now = 0
        self.views: list[SwarmView] = []
        self.batches: list[tuple[int, ...]] = []

    @property
    def epoch(self) -> int:
        return self.epoch_now

    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        self.trained += 1
        self.batches.append(tuple(batch.shape))
        if self.trained >= self.stop_after:
            self.stop.set()
        if self.trained % 5 == 0:
            return None
        if self.trained % 4 == 0:
            self.before_epoch()
            self.epoch_now += 1
        return float(self.trained)

    def assist(self) -> None:
        raise AssertionError("a computing node never assists")

    def apply_swarm_view(self, view: SwarmView) -> None:
        self.views.append(view)

    def report(self, progress: Progress) -> None:
        progress.epoch = self.epoch_now
        progress.samples_accumulated = self.trained
        progress.num_peers = 3

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch_now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_now = state["epoch"]

    def close(self) -> None:
        pass


def test_the_loop_drives_a_mode_through_micro_batches_epochs_and_replans(tmp_path: Path) -> None:
    stop, progress = threading.Event(), Progress()
    peers = [proto.PeerStatus(peer_id="other", epoch=1)]
    trainer = Trainer(
        dht=None,  # type: ignore[arg-type]
        manifest=dataclasses.replace(demo(), target_batch_size=8),
        peer_id="me",
        private_key=None,  # type: ignore[arg-type]
        options=TrainerOptions(
            micro_batch_size=2,
            checkpoint_dir=tmp_path,
            checkpoint_keep=1,
            data_cache_dir=tmp_path,
            client_mode=False,
            show_bar=False,
        ),
        progress=progress,
        known_peers=lambda: peers,
        read_plan_share=lambda: 0.25,
    )
    # The read a boundary started has finished by the next one: the loop keeps the current plan one more epoch
    # while a read is still running (a slow DHT), which a loaded machine would otherwise make happen here.
    mode = ScriptedMode(
        stop, stop_after=13, before_epoch=lambda: trainer._pending_view and trainer._pending_view.result(10)
    )
    sampler = WindowSampler(np.arange(4096, dtype=np.int64) % 251, sequence_length=16, peer_seed=7)
    trainer._train(torch.nn.Linear(1, 1), mode, sampler, stop)
    assert mode.batches == [(2, 16)] * 13
    # what the mode reported after the last micro-batch reached the progress the heartbeat publishes
    assert progress.samples_accumulated == 13 and progress.epoch == 3 and progress.num_peers == 3
    assert progress.loss is not None and progress.samples_per_second > 0
    # each completed epoch closed a round: its share of time computing, its bytes (this mode sends none)
    assert progress.compute_utilisation is not None and 0 <= progress.compute_utilisation <= 1
    assert progress.round_bytes_sent == 0
    # epochs 1, 2, 3: the first starts a background read, the later ones apply what the previous one found
    trainer._replanner.shutdown(wait=True)
    assert [view.plan_share for view in mode.views] == [0.25, 0.25]
    assert list(mode.views[0].statuses) == peers


def waiting_trainer(tmp_path: Path, reads: list[list[proto.PeerStatus]]) -> tuple[Trainer, list[int]]:
    """A trainer with start_with_peers = 3 whose DHT reads return `reads` one after another (the last repeats)."""
    calls: list[int] = []

    def known_peers() -> list[proto.PeerStatus]:
        calls.append(1)
        return reads[min(len(calls), len(reads)) - 1]

    options = TrainerOptions(
        micro_batch_size=2, checkpoint_dir=tmp_path, checkpoint_keep=1, data_cache_dir=tmp_path, client_mode=False,
        show_bar=False, start_with_peers=3,
    )  # fmt: skip
    trainer = Trainer(
        dht=None,  # type: ignore[arg-type]
        manifest=demo(),
        peer_id="me",
        private_key=None,  # type: ignore[arg-type]
        options=options,
        progress=Progress(),
        known_peers=known_peers,
    )
    return trainer, calls


def test_a_node_waits_for_start_with_peers_planned_nodes_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("crowdtrain.training.loop.START_POLL_S", 0.01)
    planned, probing = proto.PeerStatus(plan_digest="ab12"), proto.PeerStatus()
    reads = [[planned, probing, probing], [planned, planned, probing], [planned, planned, planned]]
    trainer, calls = waiting_trainer(tmp_path, reads)
    trainer._await_start_peers(threading.Event())
    assert len(calls) == 3, "it waited until the third node had planned"
    # a run that has begun (a peer past epoch 0) is joined at once, whoever is ready
    trainer, calls = waiting_trainer(tmp_path, [[planned, proto.PeerStatus(epoch=4)]])
    trainer._await_start_peers(threading.Event())
    assert len(calls) == 1
    # the wait ends with the node's stop, and at START_WAIT_S at the latest
    stop = threading.Event()
    stop.set()
    trainer, calls = waiting_trainer(tmp_path, [[planned]])
    trainer._await_start_peers(stop)
    assert calls == []
    monkeypatch.setattr("crowdtrain.training.loop.START_WAIT_S", 0.05)
    trainer, calls = waiting_trainer(tmp_path, [[planned]])
    trainer._await_start_peers(threading.Event())
    assert len(calls) >= 2
