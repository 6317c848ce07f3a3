"""Re-planning as the swarm changes: the DeDLOC plan as a pure function of the peers' published records.

Every node must derive the identical plan from the identical records, or one node idles while its
peer counts on it, and shares no longer sum to one. So a plan is computed from one snapshot: the
run's status records as listed from the DHT at the epoch boundary, this node's own entry taken as
it publishes it (never its fresher local measurement), each measurement rounded to a geometric grid
(QUANTUM_RATIO steps) so noise between two readings doesn't change the plan, and nothing from the
node's history (no hysteresis). A peer's self-reported upload counts for at most OBSERVED_SLACK times
the fastest rate another peer published having received from it (links/observations.py), and no
self-report for more than OUTLIER_RATIO times the swarm's median. `plan_digest` fingerprints a plan;
nodes publish it, and `status` shows whether they agree. Where records disagree for a moment (a record
refreshed between two nodes' readings), nothing breaks: a group's partition comes from the shares its
members sent at matchmaking (averaging/partition.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from crowdtrain import proto
from crowdtrain.codecs.compression import codec_for
from crowdtrain.dht.records import MIN_PEERS_FOR_OUTLIERS, OUTLIER_RATIO
from crowdtrain.manifest import RunManifest
from crowdtrain.planning.plan import (
    ROLES,
    PeerCapabilities,
    Plan,
    PlanProblem,
    compute_plan,
)
from crowdtrain.roles import Role

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_MBPS = 100.0
"""Taken for a peer whose links nobody has measured yet, when no peer has measured any."""
QUANTUM_RATIO = 2 ** (1 / 4)
"""Measurements enter the plan rounded to powers of this ratio (steps of ~19%): a probe that reads 5% more
than the last one rarely changes the plan, and two readings of one record always give the same plan."""
OBSERVED_SLACK = 4.0
"""A peer's self-reported upload counts for at most this many times the fastest rate another peer received from
it. What an honest observer times is a lower bound of the sender's upload: its own download, the path and a busy
moment (training traffic, a loaded CPU reading the stream) all slow it. And an honest node's own figure may be its
joint probe: MAX_PROBED_PEERS (3) streams at once, each timed by one of the receivers, so up to 3x the fastest
stream any receiver saw; 4 leaves a third more for rounds measured at different times. A liar observed by honest
peers gains at most this factor over its real link."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnCapabilities:
    """What this node measured about itself; None where it has not (yet)."""

    samples_per_second: float | None
    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool
    role_override: str = ""
    """The plan role this node was told to take (trainer, aggregator, client), or "" for the plan's choice."""
    observed_upload_mbps: Mapping[str, float] = field(default_factory=dict)
    """Other peers' uploads this node timed receiving their probe streams, Mbit/s by peer ID, as it publishes them
    (`PeerStatus.observed_uploads`)."""


def plan_problem(manifest: RunManifest, num_parameters: int) -> PlanProblem:
    """The vector the plan partitions: the gradient on the wire, in the bytes per value of the run's codec."""
    bytes_per_value = codec_for(manifest.averaging.compression).bytes_per_value
    return PlanProblem(vector_size_bytes=num_parameters * bytes_per_value, target_batch_size=manifest.target_batch_size)


def swarm_capabilities(
    own_peer_id: str, own: OwnCapabilities, statuses: Sequence[proto.PeerStatus], *, aggregate_only: bool = True
) -> list[PeerCapabilities]:
    """Every online peer's capabilities for the plan, in peer-ID order, each measurement quantized.

    This node's entry is `own`, which is what its heartbeat publishes, so every node reads the same values
    for it. A self-reported upload that other peers observed counts for at most OBSERVED_SLACK times the
    fastest of their observations. A peer that has not measured something yet is given the median of those
    who have (hivemind does the same for undeclared bandwidths), so one newcomer doesn't swing the plan.
    Without `aggregate_only` (parameters-mode runs, where every replica steps), no peer is left out of computing.
    """
    others = [status for status in statuses if status.peer_id != own_peer_id and takes_part_in_averaging(status)]
    entries = sorted([(status.peer_id, _measured(status)) for status in others] + [(own_peer_id, own)])
    observed = fastest_observed_uploads(own_peer_id, own, statuses)
    measured = [_quantized(_within_observations(m, observed.get(peer_id))) for peer_id, m in entries]
    compute = _median([m.samples_per_second for m in measured], default=1.0)
    upload = _median([m.upload_mbps for m in measured], default=DEFAULT_BANDWIDTH_MBPS)
    download = _median([m.download_mbps for m in measured], default=DEFAULT_BANDWIDTH_MBPS)
    if len(measured) >= MIN_PEERS_FOR_OUTLIERS:
        measured = [_within_outlier_ratio(m, compute, upload, download) for m in measured]
    return [
        PeerCapabilities(
            peer_id=peer_id,
            samples_per_second=compute if m.samples_per_second is None else m.samples_per_second,
            upload_mbps=upload if m.upload_mbps is None else m.upload_mbps,
            download_mbps=download if m.download_mbps is None else m.download_mbps,
            reachable=m.reachable,
            forced_role=_forced_role(m) or _every_replica_steps(m, aggregate_only),
        )
        for (peer_id, _), m in zip(entries, measured, strict=True)
    ]


def fastest_observed_uploads(
    own_peer_id: str, own: OwnCapabilities, statuses: Sequence[proto.PeerStatus]
) -> dict[str, float]:
    """The fastest upload each peer was observed sending by another peer, in Mbit/s, over every record.

    Every record counts as an observer, this node's as `own` publishes it (its record in the DHT may lag);
    what a peer says it saw of itself is no observation. Records are decoded: every rate is finite and within
    PHYSICAL_LIMITS.
    """
    observers = [
        (status.peer_id, {entry.peer_id: entry.upload_mbps for entry in status.observed_uploads})
        for status in statuses
        if status.peer_id != own_peer_id
    ]
    fastest: dict[str, float] = {}
    for observer, rates in [*observers, (own_peer_id, own.observed_upload_mbps)]:
        for peer_id, mbps in rates.items():
            if peer_id != observer:
                fastest[peer_id] = max(mbps, fastest.get(peer_id, 0.0))
    return fastest


def _within_observations(m: OwnCapabilities, fastest_observed_mbps: float | None) -> OwnCapabilities:
    if m.upload_mbps is None or fastest_observed_mbps is None:
        return m  # nobody observed it (or it measured nothing): its self-report, bounded by the outlier rule
    return replace(m, upload_mbps=min(m.upload_mbps, OBSERVED_SLACK * fastest_observed_mbps))


def _within_outlier_ratio(m: OwnCapabilities, compute: float, upload: float, download: float) -> OwnCapabilities:
    def capped(value: float | None, median: float) -> float | None:
        return value if value is None else min(value, OUTLIER_RATIO * median)

    return dataclasses.replace(
        m,
        samples_per_second=capped(m.samples_per_second, compute),
        upload_mbps=capped(m.upload_mbps, upload),
        download_mbps=capped(m.download_mbps, download),
    )


def quantize(value: float) -> float:
    """`value` rounded to the nearest power of QUANTUM_RATIO (0 and non-positive values stay as they are)."""
    if not value > 0 or not math.isfinite(value):
        return value
    return float(QUANTUM_RATIO ** round(math.log(value, QUANTUM_RATIO)))


def _quantized(capabilities: OwnCapabilities) -> OwnCapabilities:
    def rounded(value: float | None) -> float | None:
        return None if value is None else quantize(value)

    return replace(
        capabilities,
        samples_per_second=rounded(capabilities.samples_per_second),
        upload_mbps=rounded(capabilities.upload_mbps),
        download_mbps=rounded(capabilities.download_mbps),
    )


def plan_digest(plan: Plan) -> str:
    """A short fingerprint of the plan's roles and shares (shares to 1e-6): equal on nodes that agree."""
    text = ";".join(
        f"{peer_id}:{','.join(roles)}:{plan.shares.get(peer_id, 0.0):.6f}" for peer_id, roles in plan.roles.items()
    )
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def takes_part_in_averaging(status: proto.PeerStatus) -> bool:
    """Whether a peer trains or aggregates the dense model (expert hosts only serve DMoE experts)."""
    return Role.EXPERT_HOST not in status.roles


def _measured(status: proto.PeerStatus) -> OwnCapabilities:
    # The throughput probe's value only: the live training rate changes between two nodes' readings.
    measured_compute = status.measured_samples_per_second
    return OwnCapabilities(
        samples_per_second=measured_compute if measured_compute > 0 else None,
        upload_mbps=status.upload_mbps if status.HasField("upload_mbps") else None,
        download_mbps=status.download_mbps if status.HasField("download_mbps") else None,
        reachable=status.reachable,
        role_override=status.role_override,
    )


def _every_replica_steps(capabilities: OwnCapabilities, aggregate_only: bool) -> str | None:
    """Without `aggregate_only` every peer computes: a trainer, or a client (it computes, never aggregates) when
    peers can't dial it; with it, the plan chooses."""
    if aggregate_only:
        return None
    return Role.TRAINER if capabilities.reachable else Role.CLIENT


def _forced_role(capabilities: OwnCapabilities) -> str | None:
    role = capabilities.role_override
    if role not in ROLES:
        return None
    if role == Role.AGGREGATOR and not capabilities.reachable:
        return Role.CLIENT  # nobody can send it parts; the plan may not make it aggregate
    return role


def _median(values: Sequence[float | None], default: float) -> float:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else default


class Planner:
    """Computes the plan from the records at every epoch and keeps it; logs when this node's part changes."""

    def __init__(self, own_peer_id: str, problem: PlanProblem, *, aggregate_only: bool = True):
        """`aggregate_only`: whether the plan may have a peer aggregate without computing (gradients mode)."""
        self.own_peer_id, self.problem = own_peer_id, problem
        self.aggregate_only = aggregate_only
        self.plan: Plan | None = None
        self.digest = ""
        """`plan_digest` of the current plan; "" before any."""

    def update(self, own: OwnCapabilities, statuses: Sequence[proto.PeerStatus]) -> Plan:
        """The plan to follow now: a pure function of this node's published capabilities and the peers' records."""
        peers = swarm_capabilities(self.own_peer_id, own, statuses, aggregate_only=self.aggregate_only)
        candidate = compute_plan(peers, self.problem)
        current, self.plan, self.digest = self.plan, candidate, plan_digest(candidate)
        if current is None or current.roles != candidate.roles or current.shares != candidate.shares:
            self._log_change(current, candidate)
        return candidate

    def own_share(self) -> float | None:
        """This node's share of the vector under the current plan; None before any plan."""
        return None if self.plan is None else self.plan.shares.get(self.own_peer_id, 0.0)

    def own_roles(self) -> tuple[str, ...]:
        """This node's roles under the current plan."""
        return () if self.plan is None else self.plan.roles.get(self.own_peer_id, ())

    def _log_change(self, old: Plan | None, new: Plan) -> None:
        roles, share = self.own_roles(), self.own_share() or 0.0
        if not roles:
            logger.warning(
                "the plan leaves this node idle: averaging the run's gradients over these links costs more time "
                "than its compute saves (a larger target batch would put it to work); it stands by"
            )
        before = "" if old is None else f" (was {', '.join(old.roles.get(self.own_peer_id, ())) or 'none'})"
        logger.info(
            f"plan for {len(new.roles)} peers ({new.solver}): this node is {', '.join(roles) or 'idle'}{before}, "
            f"aggregates {share:.1%} of each round; expected averaging {new.averaging_time_s:.2f} s, "
            f"swarm {new.samples_per_second:.1f} samples/s"
        )
