"""Held-out scores while training (training/held_out.py): the run's fixed windows, eval mode, nothing trained."""

from __future__ import annotations

import math

import pytest
import torch

from crowdtrain.data import WindowSampler
from crowdtrain.manifest import PRESETS
from crowdtrain.models import build_model, load_tokenizer, training_loss
from crowdtrain.training.held_out import HeldOutScorer


def tiny_scorer(every: int) -> tuple[HeldOutScorer, WindowSampler]:
    manifest = PRESETS["demo"]()
    spec = manifest.model
    model = build_model(spec, load_tokenizer(spec).vocab_size, seed=1)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0)).numpy()
    sampler = WindowSampler(tokens, 32, peer_seed=5)
    return HeldOutScorer.for_sampler(model, "causal", sampler, every, "cpu"), sampler


def test_the_score_is_the_mean_loss_of_the_held_out_windows_in_eval_mode_without_gradients() -> None:
    scorer, sampler = tiny_scorer(every=3)
    model = scorer.model
    model.train()
    assert scorer.num_windows == 32
    score = scorer.score()
    assert model.training, "the training mode is restored"
    assert all(parameter.grad is None for parameter in model.parameters())
    model.eval()
    with torch.no_grad():
        expected = [float(training_loss(model, window, "causal")) for window in sampler.eval_batches(8, 4)]
    assert score == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert math.isfinite(score)
    # the windows are the sampler's held-out tail, whatever the peer's seed: every node scores the same ones
    other = WindowSampler(sampler.tokens, 32, peer_seed=99)
    assert all(torch.equal(a, b) for a, b in zip(scorer.windows, other.eval_batches(8, 4), strict=True))


def test_scores_are_due_at_every_nth_epoch_or_the_first_past_it() -> None:
    scorer, _ = tiny_scorer(every=3)
    assert [epoch for epoch in range(10) if scorer.due(epoch) and scorer.score_at(epoch)] == [3, 6, 9]
    scorer.last_scored = 3
    assert not scorer.due(5)
    assert scorer.due(7), "a node that jumped from epoch 5 to 7 (the swarm's state) scores at 7"
    scorer.score_at(7)
    assert not scorer.due(8) and scorer.due(9)
