"""Held-out loss while training: every N epochs a node scores the run's fixed held-out windows with its replica.

The windows are the same on every node and in `crowdtrain eval` (WindowSampler.eval_batches: spread over the last
1% of the token stream, which training never samples), so a researcher can compare nodes, runs and modes by one
number. The score is taken on the training thread between two micro-batches (it pauses this node's compute, and
the pause counts as wall time, not compute, in the node's utilisation) with the replica as this node holds it: in
`gradients` mode the swarm's weights after the step; in `diloco` and `spes` the node's replica after the outer
step of the round (or, with `overlap`, one round late).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crowdtrain.data import WindowSampler
from crowdtrain.models import training_loss
from crowdtrain.models.build import ModelKind

HELD_OUT_BATCHES = 4
HELD_OUT_BATCH_SIZE = 8
"""32 windows: at sequence 512 a few forward passes of a micro-batch's size, small beside a global step."""


@dataclass(slots=True)
class HeldOutScorer:
    """Scores a model on fixed held-out windows (already on the model's device)."""

    model: torch.nn.Module
    kind: ModelKind
    windows: list[torch.Tensor]
    every: int
    """Score at every epoch divisible by this (> 0), or the first epoch past one (a node that took the swarm's state
    may jump over it)."""
    last_scored: int = 0

    @classmethod
    def for_sampler(
        cls, model: torch.nn.Module, kind: ModelKind, sampler: WindowSampler, every: int, device: str
    ) -> HeldOutScorer:
        windows = sampler.eval_batches(HELD_OUT_BATCH_SIZE, HELD_OUT_BATCHES)
        return cls(model=model, kind=kind, windows=[window.to(device) for window in windows], every=every)

    @property
    def num_windows(self) -> int:
        return sum(len(window) for window in self.windows)

    def due(self, epoch: int) -> bool:
        return epoch // self.every > self.last_scored // self.every

    def score_at(self, epoch: int) -> float:
        """`score()`, remembered as the score of `epoch`."""
        self.last_scored = epoch
        return self.score()

    def score(self) -> float:
        """The mean loss over the windows, in eval mode and without gradients; the model's mode is restored."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                losses = window_losses(self.model, self.kind, self.windows)
        finally:
            self.model.train(was_training)
        return sum(losses) / len(losses)


def window_losses(model: torch.nn.Module, kind: ModelKind, windows: list[torch.Tensor]) -> list[float]:
    """The loss of each batch of windows (call without gradients); masked LMs mask the same positions every call."""
    generator = torch.Generator().manual_seed(0)
    return [float(training_loss(model, window, kind, generator=generator)) for window in windows]
