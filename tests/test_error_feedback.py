"""DiLoCo's top-k with error feedback: what a peer does not send in a round it sends later, and nothing is lost."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from crowdtrain.codecs.error_feedback import ErrorFeedback, keep_top_k_, num_kept
from crowdtrain.manifest import DiLoCoSpec, RunManifest, TrainingSpec, demo

SHAPES = [torch.Size([64, 32]), torch.Size([32]), torch.Size([7, 3, 5])]


def rounds_of_pseudo_gradients(num_rounds: int, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) * 1e-2 for shape in SHAPES] for _ in range(num_rounds)]


def test_what_was_sent_over_the_rounds_plus_the_residual_is_every_pseudo_gradient() -> None:
    feedback = ErrorFeedback(SHAPES, fraction=0.05)
    rounds = rounds_of_pseudo_gradients(20)
    sent_total = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    for deltas in rounds:
        buffers = [delta.clone() for delta in deltas]
        kept = feedback.sparsify_(buffers)
        feedback.commit((delta.clone() for delta in deltas), kept)
        for total, buffer, shape, sent in zip(sent_total, buffers, SHAPES, kept, strict=True):
            # exactly k values went on the wire, each one exact in fp16, and nothing else
            assert int(torch.count_nonzero(buffer)) <= num_kept(shape.numel(), 0.05) == sent.indices.numel()
            assert torch.equal(buffer.view(-1)[sent.indices], sent.values)
            assert torch.equal(sent.values.half().float(), sent.values)
            total += buffer.double()
    for index, (total, residual) in enumerate(zip(sent_total, feedback.residuals, strict=True)):
        expected = sum(deltas[index].double() for deltas in rounds)
        assert torch.allclose(total + residual.double(), expected, rtol=0, atol=1e-6)
        assert float(residual.abs().max()) > 0, "most values are still kept back after 20 rounds of 5%"


def test_a_small_value_kept_back_is_sent_once_its_residual_has_grown() -> None:
    feedback = ErrorFeedback([torch.Size([4])], fraction=0.25)  # one value of four per round
    delta = torch.tensor([1.0, 0.3, 0.0, 0.0])
    sent_by_round = []
    for _ in range(4):
        buffer = delta.clone()
        kept = feedback.sparsify_([buffer])
        feedback.commit([delta.clone()], kept)
        sent_by_round.append(buffer.clone())
    # the large value goes every round; the small one waits in the residual until it outgrows the large one
    assert [int(sent.nonzero()[0]) for sent in sent_by_round] == [0, 0, 0, 1]
    assert float(sent_by_round[3][1]) == pytest.approx(1.2, abs=1e-3)
    assert torch.allclose(sum(sent_by_round) + feedback.residuals[0], 4 * delta, atol=1e-6)


def test_an_unaveraged_round_applies_everything_kept_back_and_empties_the_residual() -> None:
    feedback = ErrorFeedback(SHAPES, fraction=0.1)
    first = rounds_of_pseudo_gradients(1, seed=1)[0]
    feedback.commit([delta.clone() for delta in first], feedback.sparsify_([delta.clone() for delta in first]))
    residuals = feedback.state_dict()
    second = rounds_of_pseudo_gradients(1, seed=2)[0]
    buffers = [delta.clone() for delta in second]
    feedback.flush_(buffers)
    for buffer, delta, residual in zip(buffers, second, residuals, strict=True):
        assert torch.equal(buffer, delta + residual)
    assert all(int(torch.count_nonzero(residual)) == 0 for residual in feedback.residuals)


def test_residuals_survive_a_state_dict_and_bad_ones_are_refused() -> None:
    feedback = ErrorFeedback(SHAPES, fraction=0.1)
    deltas = rounds_of_pseudo_gradients(1)[0]
    feedback.commit([delta.clone() for delta in deltas], feedback.sparsify_([delta.clone() for delta in deltas]))
    restored = ErrorFeedback(SHAPES, fraction=0.1)
    restored.load_state_dict(feedback.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.residuals, feedback.residuals, strict=True))
    with pytest.raises(ValueError, match="another shape"):
        restored.load_state_dict(feedback.state_dict()[:-1])
    poisoned = feedback.state_dict()
    poisoned[1][0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        restored.load_state_dict(poisoned)


def test_keep_top_k_keeps_the_largest_magnitudes_at_least_one() -> None:
    tensor = torch.tensor([0.5, -3.0, 2.0, -0.1, 0.0])
    kept = keep_top_k_(tensor, 0.4)
    assert sorted(kept.indices.tolist()) == [1, 2]
    assert tensor.tolist() == [0.0, -3.0, 2.0, 0.0, 0.0]
    assert num_kept(1000, 1e-9) == 1 and num_kept(10, 1.0) == 10 and num_kept(0, 0.5) == 0


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_a_kept_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="topk_fraction"):
        DiLoCoSpec(compression="topk", topk_fraction=fraction)


def test_topk_needs_the_mean_aggregation() -> None:
    base = demo()
    training, averaging = TrainingSpec(mode="diloco"), dataclasses.replace(base.averaging, aggregation="trimmed_mean")
    with pytest.raises(ValueError, match="needs averaging.aggregation 'mean'"):
        RunManifest(run_id="x", training=training, averaging=averaging, diloco=DiLoCoSpec(compression="topk"))
    run = dataclasses.replace(
        base,
        training=training,
        averaging=dataclasses.replace(averaging, aggregation="mean"),
        diloco=DiLoCoSpec(compression="topk", topk_fraction=0.05),
    )
    assert RunManifest.from_bytes(run.to_bytes()).diloco == run.diloco
