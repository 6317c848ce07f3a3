"""The learning-rate schedule, counted in global steps (epochs of the collaboration)."""

from __future__ import annotations

import math

from crowdtrain.manifest import OptimizerSpec


def learning_rate_factor(step: int, spec: OptimizerSpec) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at `total_steps` (and 0 after it)."""
    if step < spec.warmup_steps:
        return (step + 1) / (spec.warmup_steps + 1)
    decay_steps = max(spec.total_steps - spec.warmup_steps, 1)
    progress = min((step - spec.warmup_steps) / decay_steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
