"""Byzantine-robust aggregation of each all-reduce part (issue 14): one peer's bad gradients must not steer the step.

hivemind's reducer adds every sender's part into one sum weighted by the sender's own claim: a part of the
wrong shape is broadcast over the whole chunk, a NaN or a part scaled by 1e6 goes straight into everyone's
step, and a claimed weight of 1e9 makes one peer the average. Here each reducer collects the parts of a
chunk and, before aggregating:
- drops a part that is not a floating tensor of the chunk's shape, or holds NaN or infinities;
- with three or more senders, drops a part whose norm exceeds NORM_LIMIT times the median norm, allowing for
  the samples behind it: a *mean* over fewer samples than the median sender's is noisier (gradients), a *sum*
  over more samples is longer (DiLoCo and SPES pseudo-gradients, θ₀ − θ after as many inner steps as the peer
  took, which differ several-fold between honest peers of one round);
- leaves out parts of weight 0 (peers tagging along without gradients);
- caps every claimed weight (samples accumulated) at the run's target batch: no peer's share of the average
  can exceed the global batch, whatever it claims;
then aggregates by the manifest's `averaging.aggregation` rule: `mean` (the weighted mean, as hivemind),
`trimmed_mean` (coordinate-wise, the TRIM_FRACTION highest and lowest dropped) or `centered_clip`
(CenteredClip as in BTARD-SGD: from the coordinate-wise median, a few steps of the mean of clipped
differences). Every dropped part is logged with its sender, once per round.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.partition import TensorPartReducer

from crowdtrain.manifest import AGGREGATION_RULES

logger = logging.getLogger(__name__)

NORM_LIMIT = 100.0
"""A part whose norm exceeds this many times the median of its chunk's norms is dropped (3+ senders).

Honest gradients are heavy-tailed chunk by chunk (attention projections most: a few sequences give them gradients
many times the usual). Measured on llama-20m 11 steps in (sequence 32, 2-sample micro-batches, chunks of 2**17
values; see issue 12's notes): among four honest senders of 8 samples each, a part reached
13.6x the median (57 of 156,000 parts above 10x, about one honest peer dropped every few rounds of a four-peer
swarm); a sender of 2 samples among them reached 40x (20x after its allowance). At 10x, a four-peer swarm on
llama-20m quarantined an honest peer for 10 minutes at its 11th round. 100x leaves five times the largest honest
ratio seen. The price: under the default `mean` rule a poisoner staying just below it moves a chunk's average
by up to about NORM_LIMIT / senders typical parts (10 / senders before), bounded after averaging only by the
run's `max_grad_norm` clipping; a run that expects poisoners should choose `trimmed_mean` or `centered_clip`,
which bound every sender's pull whatever its norm."""
TRIM_FRACTION = 0.2
"""trimmed_mean drops this fraction of the senders from each end, at least one each with 3+ senders."""
CENTERED_CLIP_ITERATIONS = 3


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], rule: str, max_weight: float) -> torch.Tensor:
    """The aggregate of already checked parts of one chunk (all of one shape), by `rule`; `mean` weighs each part by
    its sender's claim, capped at `max_weight`, the robust rules weigh senders alike."""
    if not parts:
        raise ValueError("no part to aggregate")
    stacked = torch.stack([part.float() for part in parts])
    if rule == "mean":
        bounded = torch.tensor(bounded_weights(weights, max_weight), dtype=stacked.dtype)
        if float(bounded.sum()) <= 0:
            bounded = torch.ones_like(bounded)
        return torch.tensordot(bounded / bounded.sum(), stacked, dims=1)
    if rule == "trimmed_mean":
        return trimmed_mean(stacked)
    if rule == "centered_clip":
        return centered_clip(stacked)
    raise ValueError(f"unknown aggregation rule {rule!r}")


def bounded_weights(weights: Sequence[float], max_weight: float) -> list[float]:
    """Claimed weights, non-finite or negative ones as 0, each capped at `max_weight`."""
    return [min(float(weight), max_weight) if math.isfinite(weight) and weight > 0 else 0.0 for weight in weights]


def trimmed_mean(stacked: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise mean of the senders (dim 0) without the TRIM_FRACTION highest and lowest values."""
    count = stacked.shape[0]
    trim = max(1, int(TRIM_FRACTION * count)) if count >= 3 else 0
    ordered = stacked.sort(dim=0).values
    return ordered[trim : count - trim].mean(dim=0)


def centered_clip(stacked: torch.Tensor) -> torch.Tensor:
    """CenteredClip: v <- v + mean_i clip(x_i - v, tau), from the coordinate-wise median, tau the median distance."""
    center = stacked.median(dim=0).values
    distances = (stacked - center).flatten(1).norm(dim=1)
    tau = float(distances.median())
    if tau <= 0:
        return center
    for _ in range(CENTERED_CLIP_ITERATIONS):
        differences = stacked - center
        norms = differences.flatten(1).norm(dim=1).clamp_min(1e-12)
        scale = (tau / norms).clamp(max=1.0).view(-1, *([1] * (stacked.dim() - 1)))
        center = center + (differences * scale).mean(dim=0)
    return center


def checked_parts(
    parts: Sequence[tuple[int, Any, float]], shape: torch.Size, *, sums: bool = False
) -> tuple[list[torch.Tensor], list[float], dict[int, str]]:
    """Split (sender, part, weight) into the usable parts with their weights and the dropped senders' reasons.

    A part of weight 0 (a peer tagging along without gradients) is left out: it carries nothing. The norm test
    allows for the samples behind a part (`norm_allowance`), so neither a straggler with a few samples nor, with
    `sums`, a fast peer whose pseudo-gradient spans many inner steps is mistaken for an attacker.
    """
    usable: list[tuple[int, torch.Tensor, float]] = []
    dropped: dict[int, str] = {}
    for sender, part, weight in parts:
        if not isinstance(part, torch.Tensor) or not part.is_floating_point() or part.shape != shape:
            found = f"{tuple(part.shape)} {part.dtype}" if isinstance(part, torch.Tensor) else type(part).__name__
            dropped[sender] = f"a part of {found}, expected {tuple(shape)}"
        elif not bool(torch.isfinite(part).all()):
            dropped[sender] = "a part with NaN or infinite values"
        elif math.isfinite(weight) and weight > 0:
            usable.append((sender, part, weight))
    if len(usable) < 3:
        return [part for _, part, _ in usable], [weight for _, _, weight in usable], dropped
    norms = [float(part.float().norm()) for _, part, _ in usable]
    median_norm = statistics.median_low(norms)
    median_weight = statistics.median_low([weight for _, _, weight in usable])
    kept: list[tuple[int, torch.Tensor, float]] = []
    for (sender, part, weight), norm in zip(usable, norms, strict=True):
        allowed = NORM_LIMIT * median_norm * norm_allowance(weight, median_weight, sums=sums)
        if median_norm > 0 and norm > allowed:
            dropped[sender] = f"a part {norm / median_norm:.3g}x the median norm"
        else:
            kept.append((sender, part, weight))
    return [part for _, part, _ in kept], [weight for _, _, weight in kept], dropped


def norm_allowance(weight: float, median_weight: float, *, sums: bool) -> float:
    """How many times the median norm an honest part over `weight` samples may reach, per NORM_LIMIT.

    A mean over n samples is noisier than the median sender's by at most sqrt(n_median / n). A sum over n samples
    (a pseudo-gradient after n / micro-batch inner steps) is at most n / n_median times longer than the median's
    when every step points the same way, and shorter otherwise; a sum over fewer samples is shorter still. The
    weight is the sender's claim, capped at the run's maximum before it gets here: a liar claiming the cap gains
    that much allowance, no more, and the mean then weighs its part as an honest peer of that weight.
    """
    if sums:
        return max(1.0, weight / median_weight)
    return math.sqrt(max(1.0, median_weight / weight))


class _PartCollector:
    """Stands in for the reducer's sum of one chunk: hivemind's TensorPartReducer calls `add_` once per sender
    and `div_` when all have sent; here `add_` keeps the (sender, part) and `div_` checks and aggregates."""

    def __init__(self, reducer: RobustPartReducer, shape: torch.Size):
        self.reducer, self.shape = reducer, shape
        self.parts: list[tuple[int, Any, float]] = []

    def add_(self, tagged_part: tuple[int, Any], alpha: float = 1.0) -> _PartCollector:
        sender, part = tagged_part
        self.parts.append((sender, part, alpha))  # the claim, capped in div_ before the norm test uses it
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        claims = bounded_weights([weight for _, _, weight in self.parts], self.reducer.max_weight)
        capped = [(sender, part, claim) for (sender, part, _), claim in zip(self.parts, claims, strict=True)]
        usable, weights, dropped = checked_parts(capped, self.shape, sums=self.reducer.sums)
        self.reducer.note_dropped(dropped)
        if not usable:  # nothing usable (only zero-weight parts, or all bad): as hivemind, a zero chunk
            return torch.zeros(self.shape)
        return aggregate(usable, weights, self.reducer.rule, self.reducer.max_weight)


class RobustPartReducer(TensorPartReducer):
    """hivemind's TensorPartReducer with each chunk checked and aggregated by a robust rule (see module doc)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        rule: str,
        max_weight: float,
        sums: bool = False,
        senders: Sequence[str] = (),
        on_dropped: Callable[[str, str], None] | None = None,
    ):
        if rule not in AGGREGATION_RULES:
            raise ValueError(f"unknown aggregation rule {rule!r}")
        self.rule, self.max_weight, self.sums, self.senders = rule, max_weight, sums, list(senders)
        self.on_dropped = on_dropped
        self.dropped_senders: dict[int, str] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartCollector(self, self.part_shapes[self.current_part_index])

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind's accumulate_part passes `tensor_part` only to the accumulator's add_: tagged with its sender.
        tagged: Any = (sender_index, tensor_part)
        return await super().accumulate_part(sender_index, part_index, tagged, weight=weight)

    def note_dropped(self, dropped: dict[int, str]) -> None:
        """Log each sender whose parts were dropped and report it to `on_dropped(peer, reason)`, once per round."""
        for sender, reason in dropped.items():
            if sender not in self.dropped_senders:
                self.dropped_senders[sender] = reason
                name = self.senders[sender] if sender < len(self.senders) else f"sender {sender}"
                logger.warning(f"dropped the parts of peer {name} from this round: it sent {reason}")
                if self.on_dropped is not None and sender < len(self.senders):
                    self.on_dropped(name, reason)
