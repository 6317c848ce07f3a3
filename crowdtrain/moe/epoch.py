"""The swarm's epoch as an expert host believes it: what the experts' learning-rate schedule counts.

Trainers publish the last global epoch they completed in their signed status records, but each writes its own
number. The host used to take the largest claim and never go back: one peer claiming epoch 10**12 drove every
expert's learning rate to the end of its schedule for good. Here, at each look at the trainers' claims:
- a claim beyond what the run can have reached since its signed manifest was created is ignored, with one
  warning per peer (the same bound as a state download's, `dht.records.epoch_ceiling`);
- the swarm's epoch is the median of the others, the lower middle one of an even count: one liar among two or
  more trainers moves nothing, and it takes half of them to move it;
- after the first look, it advances past the host's own view by at most what the run can do in the time since
  the last look (MAX_GLOBAL_STEPS_PER_S), plus MAX_EPOCH_LEAD: a lying majority walks the schedule at the
  fastest honest pace, never jumps to its end;
- it never goes back: trainers gone for a while don't restart the warm-up.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from crowdtrain.dht.records import MAX_GLOBAL_STEPS_PER_S, epoch_ceiling

logger = logging.getLogger(__name__)

MAX_EPOCH_LEAD = 100
"""Epochs the host's view may advance at one look beyond the time bound: clocks and look periods that disagree."""


@dataclass(slots=True)
class ExpertEpoch:
    """An expert host's view of the swarm's epoch, moved by trainers' claims within bounds (see the module)."""

    run_created_at: float
    """The signed manifest's `created_at`, in Unix seconds."""
    epoch: int = 0
    """The host's current view."""
    _looked_at: float | None = None
    _ignored: set[str] = field(default_factory=set)
    _held_back: bool = False

    def update(self, claims: Mapping[str, int], now: float) -> int:
        """The new view after a look at `claims` (each trainer's epoch, by peer ID) at `now` (Unix seconds)."""
        ceiling = epoch_ceiling(self.run_created_at, now)
        believable = []
        for peer_id, epoch in claims.items():
            if epoch <= ceiling:
                believable.append(epoch)
            elif peer_id not in self._ignored:
                self._ignored.add(peer_id)
                logger.warning(
                    f"ignoring the epoch of peer {peer_id[-8:]} for the experts' learning rate: it claims {epoch}, "
                    f"beyond the {ceiling} this run can have reached (said once per peer)"
                )
        if believable:
            self.epoch = max(self.epoch, self._bounded(statistics.median_low(believable), now))
        self._looked_at = now
        return self.epoch

    def _bounded(self, swarm_epoch: int, now: float) -> int:
        if self._looked_at is None:
            return swarm_epoch  # no view of its own yet: a host joining a late run starts where the run is
        elapsed_s = max(0.0, now - self._looked_at)
        limit = self.epoch + MAX_EPOCH_LEAD + math.ceil(elapsed_s * MAX_GLOBAL_STEPS_PER_S)
        held_back = swarm_epoch > limit
        if held_back and not self._held_back:
            logger.warning(
                f"the trainers' epoch jumped to {swarm_epoch}, faster than a run can step: the experts' schedule "
                f"follows it at that pace from epoch {self.epoch}"
            )
        self._held_back = held_back
        return min(swarm_epoch, limit)
