"""SPES's settings: the run file's [spes] section (its dense part is averaged with the [diloco] settings), and how
a SPES run's sections fit, and what `status` says of a SPES peer.

Torch-free and importing nothing above the manifest: the manifest reads it (modes/settings.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crowdtrain import proto

if TYPE_CHECKING:
    from crowdtrain.manifest import RunManifest

MAX_SPES_REPLICAS = 8
"""The most owners a SPES run may give each expert."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SPESSpec:
    """SPES runs (`training.mode = "spes"`): each node trains the dense parameters (averaged as in DiLoCo, with the
    [diloco] settings) and only the routed experts it owns; the others come from their owners every round."""

    merge_every: int = 0
    """M: every M inner steps, each owner pulls each of its experts toward its most similar experts (the
    expert-merging warm-up); 0: no warm-up."""
    merge_neighbours: int = 2
    """How many most similar experts (cosine similarity of their weights, same layer) an expert is pulled toward."""
    merge_alpha: float = 0.1
    """The pull's weight at the first inner step: θ ← (1 − α)·θ + α·mean(neighbours); it decays linearly to 0."""
    merge_warmup_steps: int = 500
    """The swarm's inner steps (global batches) over which α decays to 0; no merging after them."""
    replicas: int = 1
    """How many owners train each expert (as many as there are peers when fewer): each round's copy of the expert
    is the mean of theirs, so an owner that vanishes mid-round costs its experts that owner's share of the round,
    not the round. Each replica costs every owner the expert's gradients and moments and every node its fetch."""

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_SPES_REPLICAS:
            raise ValueError(f"replicas must be between 1 and {MAX_SPES_REPLICAS}, got {self.replicas}")
        if not 0 <= self.merge_every <= 1_000_000:
            raise ValueError(f"merge_every must be between 0 (no warm-up) and 1000000, got {self.merge_every}")
        if not 1 <= self.merge_neighbours <= 64:
            raise ValueError(f"merge_neighbours must be between 1 and 64, got {self.merge_neighbours}")
        if not (math.isfinite(self.merge_alpha) and 0 <= self.merge_alpha <= 1):
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if not 1 <= self.merge_warmup_steps <= 10_000_000:
            raise ValueError(f"merge_warmup_steps must be between 1 and 10000000, got {self.merge_warmup_steps}")


def check_spes_run(manifest: RunManifest) -> None:
    """A SPES run's sections fit: raises ValueError with one sentence when they do not."""
    if manifest.diloco is not None and manifest.diloco.fragments > 1:
        raise ValueError("a SPES run averages its dense part every round: diloco.fragments must be 1")
    if manifest.moe is not None:
        raise ValueError("a SPES run trains the model's own experts: it can't have a [moe] section (DMoE)")


def owned_experts_detail(training: proto.TrainingStatus) -> str:
    """`status`'s mode cell for a SPES peer: the experts it owns, and its room when that caps them."""
    if not training.experts_total:
        return ""
    owned = f", owns {training.experts_owned}/{training.experts_total} experts"
    if training.HasField("experts_capacity") and training.experts_capacity < training.experts_total:
        owned += f" (room for {training.experts_capacity})"
    return owned
