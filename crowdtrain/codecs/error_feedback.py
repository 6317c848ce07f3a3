"""Top-k sparsification with error feedback: what a peer does not send this round, it sends in a later one.

DiLoCo's `topk` compression, after SparseLoCo and DeMo (error feedback as in Karimireddy et al., EF-SGD). Per
tensor of the model, with Δ this round's pseudo-gradient and e the residual this peer kept back so far:

    g = Δ + e
    s = fp16(top_k(g))      k = ⌈fraction · numel⌉ of g's largest magnitudes kept, the rest set to 0
    e ← g − s               only once s was averaged with the swarm

so over rounds Σ s + e = Σ Δ: nothing is lost, only delayed. s is rounded to fp16 here rather than by the wire
codec (codecs/compression.py, exact for fp16 values), so the rounding, too, stays in e and is sent later.

Per tensor, not per wire part: the all-reduce cuts the flattened tensors into parts only after matchmaking (by
the group's shares), and s must be fixed before. Per tensor, every tensor sends its fraction; a global top-k
would give the whole budget to the tensors with the largest updates (embeddings) and starve the rest (norms).

A round that is not averaged (this peer alone, or the round failed) applies the dense g locally and empties e:
everything was used. A peer that takes the swarm's state (on joining, or after a failed round) drops e, which
belongs to the trajectory it abandons (`reset`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True, slots=True)
class Kept:
    """What top-k kept of one tensor: flat indices and their values (fp16-exact float32)."""

    indices: torch.Tensor
    values: torch.Tensor


def num_kept(numel: int, fraction: float) -> int:
    """k for a tensor of `numel` values: ⌈fraction · numel⌉, at least 1 (0 for an empty tensor)."""
    return min(numel, max(1, math.ceil(fraction * numel)))


def keep_top_k_(tensor: torch.Tensor, fraction: float) -> Kept:
    """In place: all but the `num_kept` largest magnitudes of `tensor` set to 0, those rounded to fp16."""
    flat = tensor.view(-1)
    indices = flat.abs().topk(num_kept(flat.numel(), fraction), sorted=False).indices
    values = flat[indices].clamp(-_FP16_MAX, _FP16_MAX).half().float()
    flat.zero_()
    flat[indices] = values
    return Kept(indices, values)


class ErrorFeedback:
    """The residuals of one peer's pseudo-gradients (one float32 tensor per parameter) and the steps above."""

    def __init__(self, shapes: Sequence[torch.Size], fraction: float):
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise ValueError(f"the kept fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.residuals = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    def sparsify_(self, pseudo_gradients: Sequence[torch.Tensor]) -> list[Kept]:
        """In place: each Δ becomes s = fp16(top_k(Δ + e)). The residuals are unchanged until `commit`."""
        kept = []
        for tensor, residual in zip(pseudo_gradients, self.residuals, strict=True):
            tensor.add_(residual)
            kept.append(keep_top_k_(tensor, self.fraction))
        return kept

    def commit(self, pseudo_gradients: Iterable[torch.Tensor], kept: Sequence[Kept]) -> None:
        """After s was averaged: e ← Δ + e − s, from the same Δ (without e) that `sparsify_` was given."""
        for residual, delta, sent in zip(self.residuals, pseudo_gradients, kept, strict=True):
            residual.add_(delta)  # Δ + e, bit for bit the g of sparsify_ (float addition commutes)
            residual.view(-1)[sent.indices] -= sent.values

    def flush_(self, pseudo_gradients: Sequence[torch.Tensor]) -> None:
        """In place: each Δ becomes the dense Δ + e, applied locally; the residuals are emptied."""
        for tensor, residual in zip(pseudo_gradients, self.residuals, strict=True):
            tensor.add_(residual)
        self.reset()

    def reset(self) -> None:
        """Drop what was kept back: it belongs to a trajectory this peer abandons for the swarm's state."""
        for residual in self.residuals:
            residual.zero_()

    def state_dict(self) -> list[torch.Tensor]:
        return [residual.clone() for residual in self.residuals]

    def load_state_dict(self, residuals: Sequence[torch.Tensor]) -> None:
        """Take saved residuals; refused (ValueError) unless they match this model's shapes and are finite."""
        shapes = [tuple(residual.shape) for residual in self.residuals]
        if [tuple(saved.shape) for saved in residuals] != shapes:
            raise ValueError("saved residuals are for a model of another shape")
        if not all(bool(torch.isfinite(saved).all()) for saved in residuals):
            raise ValueError("saved residuals hold NaN or infinite values")
        for residual, saved in zip(self.residuals, residuals, strict=True):
            residual.copy_(saved)
