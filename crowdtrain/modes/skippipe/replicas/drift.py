"""Whether a stage's replicas drifted apart: fingerprints of their parameters, compared at each gradient exchange.

Each gradient carries a fingerprint of its replica's parameters before the step (`fingerprint`: the parameters at
MAX_FINGERPRINT fixed positions). A replica whose fingerprint differs by more than DRIFT_TOLERANCE (relative; the
last bits of different hardware differ by far less, a missed gradient by far more) from that of the replica most of
the summed fingerprints agree with (`reference_replica`: ties, and two replicas, to the lowest peer ID) takes that
replica's state of the iteration (parameters and AdamW moments, as a joiner does: `stage_state`) right after its
step: replicas that parted (a lost exchange) are one again within an iteration of seeing each other's gradients.
The work the other replica did alone since they parted is dropped (it was done on a copy that no other replica
follows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from crowdtrain.modes.skippipe.hops.hop_wire import MAX_FINGERPRINT

DRIFT_TOLERANCE = 1e-4
"""Replicas whose fingerprints differ by more than this, relative to the fingerprint's norm, have drifted apart.
An AdamW step moves each parameter by about the learning rate (1e-4 to 1e-3 of a typical weight's 0.02 or more,
so a missed gradient shows as ~1e-2); rounding differences between devices stay near 1e-7 per step."""


def fingerprint_positions(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For each parameter, the flat positions of it that `fingerprint` reads: MAX_FINGERPRINT spread over the
    stage at random, the same on every replica (seeded by the stage's size)."""
    sizes = [parameter.numel() for parameter in parameters]
    total = sum(sizes)
    generator = torch.Generator().manual_seed(total)
    chosen = torch.randint(total, (min(MAX_FINGERPRINT, total),), generator=generator).sort().values
    positions, offset = [], 0
    for size in sizes:
        inside = chosen[(chosen >= offset) & (chosen < offset + size)] - offset
        positions.append(inside)
        offset += size
    return positions


def fingerprint(parameters: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' values at `positions` (float32, on the CPU): replicas with the same parameters have the
    same fingerprint; replicas that drifted apart differ in nearly every value."""
    values = [
        parameter.detach().reshape(-1)[where.to(parameter.device)]
        for parameter, where in zip(parameters, positions, strict=True)
    ]
    return torch.cat(values).float().cpu()


def reference_replica(fingerprints: Mapping[str, torch.Tensor | None]) -> str | None:
    """The replica whose state the others follow, from the fingerprints of those summed (by peer ID; None: sent
    none): the lowest peer ID among those the most fingerprints agree with (`drifted`). With two replicas that is
    the lower; with more, a replica whose parameters differ from the others' is outvoted, drifted or lying."""
    known = {peer: mine for peer, mine in fingerprints.items() if mine is not None}
    support = {peer: sum(not drifted(mine, theirs) for theirs in known.values()) for peer, mine in known.items()}
    if not support:
        return None
    most = max(support.values())
    return min(peer for peer, count in support.items() if count == most)


def drifted(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether two replicas' fingerprints show parameters that drifted apart (DRIFT_TOLERANCE); a fingerprint of
    another size (a replica of another version) shows nothing."""
    if mine.shape != theirs.shape or mine.numel() == 0:
        return False
    scale = float(mine.norm())
    return float((mine - theirs).norm()) > DRIFT_TOLERANCE * max(scale, 1e-12)
