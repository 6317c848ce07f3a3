"""Bound what peers claim about their training progress before hivemind's tracker adds it up.

hivemind.Optimizer learns the swarm's epoch and how full the global batch is from every peer's progress record
(epoch, samples accumulated, samples/s, time), signed but self-reported, and trusts them whole: the global epoch
is the largest epoch any peer claims, and a batch is full when the claimed samples reach the target (or when the
samples plus each peer's rate times its record's age do, by hivemind's estimate of the time left). One peer
claiming a far later epoch made every gradient-mode peer download the swarm's state at every step (it never
reached that epoch, so it was always "out of sync"); one claiming an infinite rate, a time in the past or the
whole batch a second after the epoch began made the batch look full at once.

Here each claim is bounded before the tracker sees it:
- an epoch beyond what the run can have reached since its signed manifest was created is ignored whole;
- once a state download could not back the claims (this node downloaded the swarm's newest state and it was
  still older than the epoch claimed), for DISTRUST_S no epoch more than one ahead of this node's own counts:
  honest peers that are really ahead serve their state, so a download catches up with them (and a node that
  stepped alone downloads again); a lie costs each node one download per DISTRUST_S, not one per step;
- samples accumulated count at most the target batch, a time at most now, a rate at most the physical limit
  of a status record and, with MIN_PEERS_FOR_OUTLIERS peers or more, OUTLIER_RATIO times the swarm's median;
- the samples a peer has accumulated toward an epoch, as hivemind estimates them now (samples + rate x the
  record's age), count at most what it can have computed since this node saw that epoch begin:

      plausible = peak rate x (now - epoch start + PLAUSIBLE_SLACK_S)

  with `peak rate` the highest (bounded) rate the peer claimed at this epoch, and `now` and `epoch start` this
  node's own clock (EpochStarts), never the claimant's `time`. A liar thus counts as much as an honest peer
  computing at the rate it claims, no more; that rate is bounded only as above. An epoch this node did not see
  begin (the one it joined at) has no start: there, claims are bounded by the target batch alone.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from crowdtrain.dht.calls import DHTCallFailed, dht_answer
from crowdtrain.dht.records import MIN_PEERS_FOR_OUTLIERS, OUTLIER_RATIO, PHYSICAL_LIMITS, epoch_ceiling

logger = logging.getLogger(__name__)

DISTRUST_S = 300.0
"""How long epochs that a state download could not back are ignored."""
MAX_SAMPLES_PER_SECOND = PHYSICAL_LIMITS["samples_per_second"]
PLAUSIBLE_SLACK_S = 10.0
"""Seconds of its own rate a peer may claim beyond its rate times the time since this node saw its epoch begin.
An honest claim can exceed that product by: its epoch having begun before this node saw it begin (the peers of
one round finish their steps a few seconds apart; a record takes a DHT round trip to arrive), and its clock
being a few seconds behind this node's (hivemind adds the claimed rate times the record's age)."""


def plausible_samples(samples_per_second: float, elapsed_s: float, slack_s: float = PLAUSIBLE_SLACK_S) -> float:
    """The most samples a peer computing `samples_per_second` can have accumulated `elapsed_s` seconds after its
    epoch began, with `slack_s` seconds of its rate to spare."""
    return samples_per_second * (max(elapsed_s, 0.0) + slack_s)


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
class EpochStarts:
    """When this node saw the swarm's recent epochs begin, by its own clock (a claimant's `time` plays no part).

    An epoch begins here when this node steps into it, or when a look at the swarm first shows it right after a
    look that showed the epoch before: then at that earlier look, as the first peer to step can have begun any
    time after it. The first look (a joiner's) and a jump of several epochs show no beginning."""

    started_at: dict[int, float] = field(default_factory=dict)
    """Epoch -> the DHT time this node saw it begin; the swarm's epoch and the one before only."""
    _last_look: tuple[int, float] | None = None

    def observe(self, epoch: int, now: float, *, stepped: bool = False) -> None:
        """This node believes the swarm is at `epoch` at `now`; `stepped`: because it has just stepped into it."""
        if self._last_look is not None and epoch == self._last_look[0] + 1 and epoch not in self.started_at:
            self.started_at[epoch] = now if stepped else self._last_look[1]
        self._last_look = (epoch, now)
        for old in [known for known in self.started_at if known < epoch - 1]:
            del self.started_at[old]


@dataclass(slots=True)
class ProgressBounds:
    """What bounds the progress claims of one run's peers."""

    target_batch_size: int
    run_created_at: float
    distrust: EpochDistrust = field(default_factory=EpochDistrust)
    starts: EpochStarts = field(default_factory=EpochStarts)
    _ignored: set[bytes] = field(default_factory=set)
    _peak_rates: dict[Any, tuple[int, float]] = field(default_factory=dict)
    _cut: set[tuple[Any, int]] = field(default_factory=set)

    def bounded(
        self, claims: Mapping[Any, Mapping[str, Any]], now: float, local_epoch: int, own_key: Any = None
    ) -> dict[Any, dict[str, Any]]:
        """`claims` (a progress record's fields by subkey) with each claim bounded, for a node at `local_epoch`
        whose own record is under `own_key` (not cut to its rate: this node knows its own samples); claims of
        unbelievable epochs left out, with one warning per peer."""
        ceiling = epoch_ceiling(self.run_created_at, now)
        distrusted_above = self.distrust.ceiling(now, local_epoch)
        kept = {}
        for key, claim in claims.items():
            epoch = claim["epoch"]
            if epoch > ceiling or (distrusted_above is not None and epoch > distrusted_above):
                self._warn_once(claim["peer_id"], epoch, ceiling if epoch > ceiling else distrusted_above)
                continue
            kept[key] = dict(claim)
        swarm_epoch = _swarm_epoch(kept.values(), local_epoch)
        self.starts.observe(swarm_epoch, now)
        rates = [_finite_rate(claim["samples_per_second"]) for claim in kept.values()]
        rate_cap = MAX_SAMPLES_PER_SECOND
        if len(rates) >= MIN_PEERS_FOR_OUTLIERS:
            rate_cap = min(rate_cap, OUTLIER_RATIO * statistics.median(rates))
        for (key, claim), rate in zip(kept.items(), rates, strict=True):
            claim["samples_per_second"] = min(rate, rate_cap)
            claim["samples_accumulated"] = min(claim["samples_accumulated"], self.target_batch_size)
            claim["time"] = min(claim["time"], now) if math.isfinite(claim["time"]) else now
            peak_rate = self._peak_rate(key, claim["epoch"], claim["samples_per_second"])
            if key != own_key:
                self._cut_to_throughput(key, claim, peak_rate, now)
        self._forget_before(swarm_epoch - 1)
        return kept

    def _cut_to_throughput(self, key: Any, claim: dict[str, Any], peak_rate: float, now: float) -> None:
        # hivemind estimates a peer's samples now as its samples plus its rate times its record's age: both parts
        # together count at most the plausible samples, the claimed samples first, then the age.
        started_at = self.starts.started_at.get(claim["epoch"])
        if started_at is None:
            return
        limit = plausible_samples(peak_rate, now - started_at)
        claimed, rate = claim["samples_accumulated"], claim["samples_per_second"]
        if claimed + (now - claim["time"]) * rate <= limit:
            return
        claim["samples_accumulated"] = min(claimed, int(limit))
        claim["time"] = now - (limit - claim["samples_accumulated"]) / rate if rate > 0 else now
        if claimed <= limit:
            # Only hivemind's extrapolation (rate x the record's age) was over: bounded, but no sign of a liar. This
            # node may have seen the epoch begin late (it caught up by a state download, or looked at the swarm
            # seldom), and then an honest peer's record made earlier in the epoch extrapolates past the bound.
            return
        if (key, claim["epoch"]) not in self._cut:
            self._cut.add((key, claim["epoch"]))
            logger.warning(
                f"counting {claim['samples_accumulated']} of the {claimed} samples peer {_short(claim['peer_id'])} "
                f"claims toward epoch {claim['epoch']}: at its {peak_rate:.3g} samples/s it can have computed no "
                f"more in the {now - started_at:.1f} s since the epoch began here (a faulty or malicious peer; "
                "said once per peer and epoch)"
            )

    def _peak_rate(self, key: Any, epoch: int, rate: float) -> float:
        # The highest rate claimed at this epoch: an honest peer that slowed down (a machine shared with other
        # jobs) computed its earlier samples at its earlier rate; a liar gains nothing it could not claim anyway.
        known = self._peak_rates.get(key)
        peak = max(rate, known[1]) if known is not None and known[0] == epoch else rate
        self._peak_rates[key] = (epoch, peak)
        return peak

    def _forget_before(self, epoch: int) -> None:
        self._peak_rates = {key: known for key, known in self._peak_rates.items() if known[0] >= epoch}
        self._cut = {mark for mark in self._cut if mark[1] >= epoch}

    def _warn_once(self, peer_id: bytes, epoch: int, believed: int | None) -> None:
        if peer_id in self._ignored:
            return
        self._ignored.add(peer_id)
        logger.warning(
            f"ignoring the progress of a peer that claims epoch {epoch}: the swarm's state backs no epoch above "
            f"{believed} (a faulty or malicious peer; said once per peer)"
        )


def _swarm_epoch(claims: Iterable[Mapping[str, Any]], local_epoch: int) -> int:
    # As hivemind's tracker computes the global epoch: client-mode peers' epochs do not raise it.
    return max([local_epoch, *(claim["epoch"] for claim in claims if not claim["client_mode"])])


def _finite_rate(value: float) -> float:
    return value if math.isfinite(value) else MAX_SAMPLES_PER_SECOND


def _short(peer_id: bytes) -> str:
    return "…" + PeerID(peer_id).to_base58()[-8:]


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

    @property
    def last_records(self) -> Any:
        """The swarm's progress records as last read, before bounding (subkey -> value with expiration), or None."""
        return self._last_metadata

    @property
    def own_key(self) -> Any:
        """The subkey of this node's own progress record (its signed owner marker)."""
        return self._local_public_key

    def update_epoch(self, new_epoch: int | None = None) -> int:
        """hivemind's update_epoch; the moment this node steps is when it sees the new epoch begin."""
        epoch = int(super().update_epoch(new_epoch))
        self.bounds.starts.observe(epoch, get_dht_time(), stepped=True)
        return epoch

    def refresh_global_progress(self, timeout: float) -> None:
        """Read the swarm's progress records now, not at the next scheduled fetch (up to a refresh period away);
        on a DHT that does not answer within `timeout` seconds the last reading stays. Called with updates paused
        (`pause_updates`, as hivemind.Optimizer's global step runs), so the tracker's own fetch can't interleave."""
        assert self.lock_global_progress.locked(), "pause the tracker's updates first"
        future = self.dht.get(self.training_progress_key, latest=True, return_future=True)
        try:
            found = dht_answer(future, timeout, "the swarm's progress")
        except DHTCallFailed as e:  # a timeout or a DHT shutting down: the periodic fetch goes on
            logger.debug(f"could not read {e}")
            return
        metadata = found.value if isinstance(found, ValueWithExpiration) else None
        self.global_progress = self._parse_swarm_progress_data(metadata)

    def distrust_unbacked_epochs(
        self, local_epoch: int, loaded_epoch: int | None, claimed_at_start: int | None = None
    ) -> None:
        """After a state download that loaded `loaded_epoch` (None: no donor answered) and left this node at
        `local_epoch`: if the swarm's epoch is still further ahead, no donor backs it, and epochs more than one
        ahead of this node's are ignored for DISTRUST_S, from now on (see EpochDistrust). `claimed_at_start`: the
        swarm's epoch when the download began; a donor whose state is within one epoch of it backed the claims,
        and the epochs the swarm reached while the state travelled are not held against it."""
        if loaded_epoch is None or local_epoch >= self.global_epoch - 1:
            return  # no donor answered (nothing says the claims are false), or the download caught up with them
        if claimed_at_start is not None and loaded_epoch >= claimed_at_start - 1:
            # An honest swarm moves on during a slow download (a home link, a hold that began late): distrusting
            # it left a joiner ignoring the founder for 300 s, each stepping alone and downloading the other's
            # state in turn (the WAN-lab catch-up test, once).
            return
        self.bounds.distrust.begin(get_dht_time())
        with self.lock_global_progress:
            self.global_progress = self._parse_swarm_progress_data(self._last_metadata)

    def _bounded_metadata(self, metadata: dict[Any, Any]) -> dict[Any, Any]:
        claims = {key: entry.value for key, entry in metadata.items() if entry.value is not None}
        bounded = self.bounds.bounded(claims, get_dht_time(), self.local_progress.epoch, self._local_public_key)
        return {key: ValueWithExpiration(bounded[key], metadata[key].expiration_time) for key in bounded}
