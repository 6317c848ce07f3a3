"""Bound what peers claim about their training progress before hivemind's tracker adds it up.

hivemind.Optimizer learns the swarm's epoch and how full the global batch is from every peer's progress record
(epoch, samples accumulated, samples/s, time), signed but self-reported, and trusts them whole: the global epoch
is the largest epoch any peer claims, and a batch is full when the claimed samples reach the target. One peer
claiming a far later epoch made every gradient-mode peer download the swarm's state at every step (it never
reached that epoch, so it was always "out of sync"); one claiming an infinite rate or a time in the past made
the batch look full at once.

Here each claim is bounded before the tracker sees it:
- an epoch beyond what the run can have reached since its signed manifest was created is ignored whole;
- once a state download could not back the claims (this node downloaded the swarm's newest state and it was
  still older than the epoch claimed), for DISTRUST_S no epoch more than one ahead of this node's own counts:
  honest peers that are really ahead serve their state, so a download catches up with them (and a node that
  stepped alone downloads again); a lie costs each node one download per DISTRUST_S, not one per step;
- samples accumulated count at most the target batch, a time at most now, a rate at most the physical limit
  of a status record and, with MIN_PEERS_FOR_OUTLIERS peers or more, OUTLIER_RATIO times the swarm's median.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time

from crowdtrain.averaging.state_download import epoch_ceiling
from crowdtrain.dht.records import MIN_PEERS_FOR_OUTLIERS, OUTLIER_RATIO, PHYSICAL_LIMITS

logger = logging.getLogger(__name__)

DISTRUST_S = 300.0
"""How long epochs that a state download could not back are ignored."""
MAX_SAMPLES_PER_SECOND = PHYSICAL_LIMITS["samples_per_second"]


@dataclass(slots=True)
class EpochDistrust:
    """Until `until` (a DHT time), no claim of an epoch more than one ahead of this node's own counts."""

    until: float = -math.inf

    def begin(self, now: float) -> None:
        """Distrust claims far ahead for DISTRUST_S from `now`."""
        self.until = now + DISTRUST_S

    def ceiling(self, now: float, local_epoch: int) -> int | None:
        """The highest epoch believed now, or None when nothing is distrusted. hivemind lets a peer one epoch
        behind the swarm catch up without a download; that much is believed at any time."""
        return local_epoch + 1 if now < self.until else None


@dataclass(slots=True)
class ProgressBounds:
    """What bounds the progress claims of one run's peers."""

    target_batch_size: int
    run_created_at: float
    distrust: EpochDistrust = field(default_factory=EpochDistrust)
    _ignored: set[bytes] = field(default_factory=set)

    def bounded(
        self, claims: Mapping[Any, Mapping[str, Any]], now: float, local_epoch: int
    ) -> dict[Any, dict[str, Any]]:
        """`claims` (a progress record's fields by subkey) with each claim bounded, for a node at `local_epoch`;
        claims of unbelievable epochs left out, with one warning per peer."""
        ceiling = epoch_ceiling(self.run_created_at, now)
        distrusted_above = self.distrust.ceiling(now, local_epoch)
        kept = {}
        for key, claim in claims.items():
            epoch = claim["epoch"]
            if epoch > ceiling or (distrusted_above is not None and epoch > distrusted_above):
                self._warn_once(claim["peer_id"], epoch, ceiling if epoch > ceiling else distrusted_above)
                continue
            kept[key] = dict(claim)
        rates = [_finite_rate(claim["samples_per_second"]) for claim in kept.values()]
        rate_cap = MAX_SAMPLES_PER_SECOND
        if len(rates) >= MIN_PEERS_FOR_OUTLIERS:
            rate_cap = min(rate_cap, OUTLIER_RATIO * statistics.median(rates))
        for claim, rate in zip(kept.values(), rates, strict=True):
            claim["samples_per_second"] = min(rate, rate_cap)
            claim["samples_accumulated"] = min(claim["samples_accumulated"], self.target_batch_size)
            claim["time"] = min(claim["time"], now) if math.isfinite(claim["time"]) else now
        return kept

    def _warn_once(self, peer_id: bytes, epoch: int, believed: int | None) -> None:
        if peer_id in self._ignored:
            return
        self._ignored.add(peer_id)
        logger.warning(
            f"ignoring the progress of a peer that claims epoch {epoch}: the swarm's state backs no epoch above "
            f"{believed} (a faulty or malicious peer; said once per peer)"
        )


def _finite_rate(value: float) -> float:
    return value if math.isfinite(value) else MAX_SAMPLES_PER_SECOND


class BoundedProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker over bounded claims (see the module's docstring)."""

    def __init__(self, *args: Any, bounds: ProgressBounds, **kwargs: Any):
        self.bounds = bounds  # before start: the tracker's thread reads it
        self._last_metadata: Any = None
        super().__init__(*args, **kwargs)

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        # Wraps ProgressTracker._parse_swarm_progress_data: the same records, each claim bounded first.
        self._last_metadata = metadata
        if isinstance(metadata, dict) and metadata:
            metadata = self._bounded_metadata(metadata)
        return super()._parse_swarm_progress_data(metadata)

    def distrust_unbacked_epochs(self, local_epoch: int, loaded_epoch: int | None) -> None:
        """After a state download that loaded `loaded_epoch` (None: no donor answered) and left this node at
        `local_epoch`: if the swarm's epoch is still further ahead, no donor backs it, and epochs more than one
        ahead of this node's are ignored for DISTRUST_S, from now on (see EpochDistrust)."""
        if loaded_epoch is None or local_epoch >= self.global_epoch - 1:
            return  # no donor answered (nothing says the claims are false), or the download caught up with them
        self.bounds.distrust.begin(get_dht_time())
        with self.lock_global_progress:
            self.global_progress = self._parse_swarm_progress_data(self._last_metadata)

    def _bounded_metadata(self, metadata: dict[Any, Any]) -> dict[Any, Any]:
        claims = {key: entry.value for key, entry in metadata.items() if entry.value is not None}
        bounded = self.bounds.bounded(claims, get_dht_time(), self.local_progress.epoch)
        return {key: ValueWithExpiration(bounded[key], metadata[key].expiration_time) for key in bounded}
