"""Choosing the run a command reads when the swarm may hold several: shared by `status` and `check`."""

from __future__ import annotations

from collections.abc import Mapping

from crowdtrain.dht.registry import RunListing
from crowdtrain.errors import BadInputError, CrowdtrainError


def choose_run(runs: Mapping[str, RunListing], run_id: str, *, founder: str | None = None, empty_note: str = "") -> str:
    """The run named `run_id`, or the swarm's only run; a sentence (ending in `empty_note`) otherwise. `runs`
    holds only runs `founder` signed when the user gave a run key."""
    if not runs and founder is not None:
        raise BadInputError(f"The swarm holds no run founded by {founder} (--run-key); check the key you were given.")
    if run_id:
        if run_id not in runs:
            raise BadInputError(
                f"The swarm holds no run named {run_id!r}; runs here: {', '.join(sorted(runs)) or 'none'}."
            )
        return run_id
    if not runs:
        raise CrowdtrainError(f"The swarm answered but holds no run yet{empty_note}.")
    if len(runs) > 1:
        raise BadInputError(
            f"The swarm holds {len(runs)} runs: {', '.join(sorted(runs))}; pass --run-id to choose one."
        )
    return next(iter(runs))
