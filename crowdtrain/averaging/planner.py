"""Re-planning as the swarm changes: the DeDLOC plan from the peers' published statuses, with hysteresis.

Every node runs a Planner over the same records, so they reach (nearly) the same plan without a
coordinator; each applies only its own part. Where records disagree for a moment, nothing breaks: a
group's partition comes from the shares its members sent at matchmaking (averaging/partition.py).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from crowdtrain import proto
from crowdtrain.averaging.plan import (
    ROLES,
    PeerCapabilities,
    Plan,
    PlanProblem,
    allreduce_time_s,
    compute_plan,
    swarm_samples_per_second,
)
from crowdtrain.manifest import RunManifest

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_MBPS = 100.0
"""Taken for a peer whose links nobody has measured yet, when no peer has measured any."""
REPLAN_THRESHOLD = 0.1
"""With the same peers, a new plan replaces the current one only if its expected throughput is higher by
more than this fraction than the current plan's under the same measurements (hysteresis against flapping)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnCapabilities:
    """What this node measured about itself; None where it has not (yet)."""

    samples_per_second: float | None
    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool
    role_override: str = ""
    """The plan role this node was told to take (trainer, aggregator, client), or "" for the plan's choice."""


def plan_problem(manifest: RunManifest, num_parameters: int) -> PlanProblem:
    """The vector the plan partitions: the gradient on the wire, fp16 or fp32 as the manifest says."""
    bytes_per_value = 2 if manifest.averaging.compression == "fp16" else 4
    return PlanProblem(vector_size_bytes=num_parameters * bytes_per_value, target_batch_size=manifest.target_batch_size)


def swarm_capabilities(
    own_peer_id: str, own: OwnCapabilities, statuses: Sequence[proto.PeerStatus], *, aggregate_only: bool = True
) -> list[PeerCapabilities]:
    """Every online peer's capabilities for the plan, this node's from its own measurements.

    A peer that has not measured something yet is given the median of those who have (hivemind does
    the same for undeclared bandwidths), so one newcomer doesn't swing the plan. Without
    `aggregate_only` (parameters-mode runs, where every replica steps), no peer is left out of computing.
    """
    others = [status for status in statuses if status.peer_id != own_peer_id]
    measured = [_measured(status) for status in others] + [own]
    compute = _median([m.samples_per_second for m in measured], default=1.0)
    upload = _median([m.upload_mbps for m in measured], default=DEFAULT_BANDWIDTH_MBPS)
    download = _median([m.download_mbps for m in measured], default=DEFAULT_BANDWIDTH_MBPS)
    peers = {}
    for peer_id, m in [(status.peer_id, _measured(status)) for status in others] + [(own_peer_id, own)]:
        peers[peer_id] = PeerCapabilities(
            peer_id=peer_id,
            samples_per_second=compute if m.samples_per_second is None else m.samples_per_second,
            upload_mbps=upload if m.upload_mbps is None else m.upload_mbps,
            download_mbps=download if m.download_mbps is None else m.download_mbps,
            reachable=m.reachable,
            forced_role=_forced_role(m) or (None if aggregate_only or not m.reachable else "trainer"),
        )
    return list(peers.values())


def _measured(status: proto.PeerStatus) -> OwnCapabilities:
    measured_compute = status.measured_samples_per_second or status.samples_per_second
    return OwnCapabilities(
        samples_per_second=measured_compute if measured_compute > 0 else None,
        upload_mbps=status.upload_mbps if status.HasField("upload_mbps") else None,
        download_mbps=status.download_mbps if status.HasField("download_mbps") else None,
        reachable=status.reachable,
        role_override=status.role_override,
    )


def _forced_role(capabilities: OwnCapabilities) -> str | None:
    role = capabilities.role_override
    if role not in ROLES:
        return None
    if role == "aggregator" and not capabilities.reachable:
        return "client"  # nobody can send it parts; the plan may not make it aggregate
    return role


def _median(values: Sequence[float | None], default: float) -> float:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else default


class Planner:
    """Keeps the current plan; replaces it when membership changes or a new plan differs enough."""

    def __init__(
        self,
        own_peer_id: str,
        problem: PlanProblem,
        threshold: float = REPLAN_THRESHOLD,
        *,
        aggregate_only: bool = True,
    ):
        """`aggregate_only`: whether the plan may have a peer aggregate without computing (gradients mode)."""
        self.own_peer_id, self.problem, self.threshold = own_peer_id, problem, threshold
        self.aggregate_only = aggregate_only
        self.plan: Plan | None = None

    def update(self, own: OwnCapabilities, statuses: Sequence[proto.PeerStatus]) -> Plan:
        """The plan to follow now, from this node's measurements and the peers' latest statuses."""
        peers = swarm_capabilities(self.own_peer_id, own, statuses, aggregate_only=self.aggregate_only)
        candidate = compute_plan(peers, self.problem)
        current = self.plan
        if current is not None and current.roles.keys() == candidate.roles.keys():
            if candidate.samples_per_second <= self._throughput_of(current, peers) * (1 + self.threshold):
                return current  # same peers and no clear gain: keep roles steady rather than flap on noise
        self.plan = candidate
        self._log_change(current, candidate)
        return candidate

    def _throughput_of(self, plan: Plan, peers: Sequence[PeerCapabilities]) -> float:
        """What `plan`'s roles and shares would give under the latest measurements (0 if now infeasible)."""
        forced_clients = {peer.peer_id for peer in peers if peer.forced_role == "client" or not peer.reachable}
        if any(plan.shares.get(peer_id, 0.0) > 0 for peer_id in forced_clients):
            return 0.0
        time_s = allreduce_time_s(peers, self.problem, plan.computes, plan.shares)
        compute = sum(peer.samples_per_second for peer in peers if plan.computes.get(peer.peer_id, False))
        return swarm_samples_per_second(self.problem.target_batch_size, compute, time_s)

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
