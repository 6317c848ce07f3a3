"""This node's roles: what it measured about itself, the swarm's plan, and re-measuring as time goes on.

At start the node measures its training throughput and, when it has peers, its links and whether they
can dial it back; the plan over every peer's published capabilities then decides whether it computes,
what share it aggregates, and whether it is a client. The trainer asks for a new plan at every epoch.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from crowdtrain import proto
from crowdtrain.dht.records import MAX_OBSERVED_UPLOADS
from crowdtrain.links.probes import MAX_PROBED_PEERS
from crowdtrain.planning.plan import PlanProblem
from crowdtrain.planning.planner import OwnCapabilities, Planner, takes_part_in_averaging
from crowdtrain.roles import Role

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0
"""Bound on one round of link probes against up to 3 peers."""
NO_PEERS_RETRY_S = 30.0
"""How soon a node with no peers to probe against, or with more peers than its last round asked, probes again."""
PLAN_ROLES = (Role.TRAINER, Role.AGGREGATOR, Role.CLIENT)
"""`--role` values the plan honours as overrides; `auto` leaves the choice to the plan."""


class LinkReport(Protocol):
    """What a round of bandwidth and dial-back probes against peers found (node/probes.py's ProbeReport)."""

    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool | None
    failures: Sequence[str]


class NodeRoles:
    """This node's measured capabilities and its part of the current plan; thread-safe."""

    def __init__(
        self,
        *,
        peer_id: str,
        problem: PlanProblem,
        role: Role | None,
        list_statuses: Callable[[], Sequence[proto.PeerStatus]],
        aggregate_only: bool = True,
        observed_uploads: Callable[[], Mapping[str, float]] = dict,
    ):
        """`role`: the one `--role` fixed (None: auto); `aggregate_only`: whether the run lets a peer aggregate
        without computing (gradients mode); `observed_uploads`: the rates this node timed receiving peers' probe
        streams, Mbit/s by peer (links/observations.py), published with its status."""
        self.peer_id, self.list_statuses = peer_id, list_statuses
        self.observed_uploads = observed_uploads
        self.planner = Planner(peer_id, problem, aggregate_only=aggregate_only)
        override = role.value if role in PLAN_ROLES else ""  # the status record's field: a string
        self.own = OwnCapabilities(
            samples_per_second=None,
            upload_mbps=None,
            download_mbps=None,
            reachable=override != Role.CLIENT,
            role_override=override,
        )
        self.reachability_measured = False
        self.running_auxiliary: bool | None = None
        """Whether the trainer runs as an auxiliary aggregator (set once it is built)."""
        self._lock = threading.Lock()

    def record_throughput(self, samples_per_second: float) -> None:
        """The throughput probe's result for the run's model on this device."""
        with self._lock:
            self.own = replace(self.own, samples_per_second=samples_per_second)

    def record_links(self, report: LinkReport) -> None:
        """A round of link probes; what nobody could measure keeps its previous value."""
        with self._lock:
            own = self.own
            if report.upload_mbps is not None:
                own = replace(own, upload_mbps=report.upload_mbps)
            if report.download_mbps is not None:
                own = replace(own, download_mbps=report.download_mbps)
            if report.reachable is not None and own.role_override != Role.CLIENT:
                if self.reachability_measured and report.reachable != own.reachable:
                    logger.warning(
                        f"peers {'can' if report.reachable else 'can no longer'} dial this node; its averaging "
                        "mode is fixed at start, so restart it to act on this (see `crowdtrain check`)"
                    )
                own = replace(own, reachable=report.reachable)
                self.reachability_measured = True
            self.own = own

    def replan(self) -> float | None:
        """Update the plan from the peers' latest statuses; this node's share of each round (None: no plan)."""
        statuses = self.list_statuses()
        with self._lock:
            own = self.own
        before = self.planner.plan
        plan = self.planner.update(own, statuses)
        # only a dialable node of a run with auxiliary aggregators can switch between computing and aggregating
        switchable = self.running_auxiliary is not None and self.planner.aggregate_only and not self.is_client
        if before is not None and plan is not before and switchable:
            if self.running_auxiliary == plan.computes.get(self.peer_id, True):
                wanted = "compute gradients" if self.running_auxiliary else "only aggregate"
                logger.info(
                    f"the plan now has this node {wanted}; "
                    "its mode is chosen at start, so this takes effect when it restarts (shares apply now)"
                )
        return self.planner.own_share()

    @property
    def is_client(self) -> bool:
        """Peers can't dial this node (measured or declared): it trains but never aggregates."""
        return not self.own.reachable

    @property
    def computes(self) -> bool:
        """Whether the plan has this node compute gradients (True before any plan)."""
        plan = self.planner.plan
        return True if plan is None else plan.computes.get(self.peer_id, True)

    def roles(self) -> tuple[str, ...]:
        """This node's roles as published: the plan's, or the override's before any plan."""
        roles = self.planner.own_roles()
        if roles:
            return roles
        return (self.own.role_override,) if self.own.role_override else (Role.TRAINER,)

    def fill_status(self, status: proto.PeerStatus) -> None:
        """Write this node's capabilities, observations of peers, roles and share into its status record.

        The observations written are the ones this node's next plans use (as every other node reads them)."""
        others = sorted((peer_id, mbps) for peer_id, mbps in self.observed_uploads().items() if peer_id != self.peer_id)
        observed = dict(others[:MAX_OBSERVED_UPLOADS])  # more and every reader would refuse the record
        with self._lock:
            self.own = own = replace(self.own, observed_upload_mbps=observed)
            measured = self.reachability_measured
        status.ClearField("roles")
        status.roles.extend(self.roles())
        status.aggregation_share = self.planner.own_share() or 0.0
        status.plan_digest = self.planner.digest
        status.measured_samples_per_second = own.samples_per_second or 0.0
        if own.upload_mbps is not None:
            status.upload_mbps = own.upload_mbps
        if own.download_mbps is not None:
            status.download_mbps = own.download_mbps
        status.reachable, status.reachability_measured = own.reachable, measured
        status.role_override = own.role_override
        del status.observed_uploads[:]
        status.observed_uploads.extend(
            proto.ObservedUpload(peer_id=peer_id, upload_mbps=mbps) for peer_id, mbps in observed.items()
        )


class LinkService(Protocol):
    """The requester side of the probe RPCs (links/probes.py's ProbeService)."""

    def measure(
        self, peers: Mapping[str, Sequence[str]], own_multiaddrs: Sequence[str], timeout_s: float
    ) -> LinkReport: ...


class LinkProber:
    """Measures this node's links and reachability against a few peers: at start, then every interval."""

    def __init__(
        self,
        service: LinkService,
        roles: NodeRoles,
        list_statuses: Callable[[], Sequence[proto.PeerStatus]],
        peer_id: str,
        own_multiaddrs: Sequence[str],
        timeout_s: float = PROBE_TIMEOUT_S,
    ):
        self.service, self.roles, self.list_statuses = service, roles, list_statuses
        self.peer_id, self.own_multiaddrs, self.timeout_s = peer_id, tuple(own_multiaddrs), timeout_s
        self.peers_asked = 0
        """How many peers the last round asked (at most MAX_PROBED_PEERS)."""

    def probe_once(self) -> bool:
        """One round against up to 3 reachable peers (random, to spread the load); False if there were none."""
        peers = self._eligible_peers()
        if not peers:
            return False
        random.shuffle(peers)
        self.peers_asked = min(len(peers), MAX_PROBED_PEERS)
        addresses = {status.peer_id: list(status.multiaddrs) for status in peers}
        report = self.service.measure(addresses, self.own_multiaddrs, self.timeout_s)
        self.roles.record_links(report)
        logger.info(
            f"link probes: upload {_mbps(report.upload_mbps)}, download {_mbps(report.download_mbps)}, "
            f"reachable by peers: {'unknown' if report.reachable is None else 'yes' if report.reachable else 'NO'}"
        )
        if report.failures:
            others = f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else ""
            logger.info(f"link probes that failed: {report.failures[0]}{others}")
        if report.reachable is False:
            logger.warning(
                "peers could not dial this node on its announced addresses: it trains as a client and never "
                "aggregates; run `crowdtrain check` for how to open a port"
            )
        return True

    @property
    def measured(self) -> bool:
        """Whether both directions of this node's link have been measured, in this round or an earlier one: a
        direction a busy or failing peer left unmeasured is asked again within NO_PEERS_RETRY_S, not at the
        next interval."""
        own = self.roles.own
        return own.upload_mbps is not None and own.download_mbps is not None

    def more_peers_to_ask(self) -> bool:
        """True when a round now would ask more peers than the last one did: the swarm grew since, and a link
        faster than one peer's shows only against several (a founder first measures against one joiner)."""
        return min(len(self._eligible_peers()), MAX_PROBED_PEERS) > self.peers_asked

    def _eligible_peers(self) -> list[proto.PeerStatus]:
        return [
            s
            for s in self.list_statuses()
            if s.peer_id != self.peer_id and s.reachable and s.multiaddrs and takes_part_in_averaging(s)
        ]

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Re-measure every `interval_s` seconds, and sooner (within NO_PEERS_RETRY_S) while nothing is measured
        or more peers can be asked than last time, until `stop` is set."""
        last_round_at = time.monotonic()
        while not stop.wait(min(NO_PEERS_RETRY_S, interval_s)):
            due = time.monotonic() - last_round_at >= interval_s
            if self.measured and not due and not self.more_peers_to_ask():
                continue
            try:
                self.probe_once()
            except Exception as e:
                logger.warning(f"link probes failed: {e}; retrying later")
            last_round_at = time.monotonic()


def _mbps(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} Mbit/s"
