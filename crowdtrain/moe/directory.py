"""Where each expert is served, read from the expert hosts' signed status records and nothing else.

hivemind's MoE client finds experts through the declarations `declare_experts` stores: unsigned records, uid and
prefix -> peer ID, where the latest writer wins. Any peer could claim to host any expert, or overwrite a host's
entry and draw the trainers' calls (and their activations and gradients) to itself. A trainer here reads the grid
from the peer statuses instead: stored under their owner's key, signed with it, and refused unless the peer ID they
name is their owner's (dht/records.py), so a peer declares only itself as a host. hivemind's declarations are still
written, for unmodified hivemind clients that choose to trust them; nothing of crowdtrain reads them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import hivemind

from crowdtrain.dht.registry import list_peer_statuses
from crowdtrain.manifest import RunManifest, expert_uids
from crowdtrain.roles import Role

logger = logging.getLogger(__name__)

REFRESH_S = 2.0
"""Seconds a look at the hosts' statuses serves the DMoE layers before the next one."""
LOOKUP_TIMEOUT_S = 5.0


class ExpertDirectory:
    """Each live expert of a run's grid, with the peer IDs of the hosts whose signed status says they serve it."""

    def __init__(
        self,
        dht: hivemind.DHT,
        manifest: RunManifest,
        *,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.dht, self.run_id, self.refresh_s, self.clock = dht, manifest.run_id, refresh_s, clock
        self.grid = frozenset(expert_uids(manifest))
        self._hosts: dict[str, tuple[str, ...]] = {}
        self._looked_at = -float("inf")

    def hosts(self) -> Mapping[str, tuple[str, ...]]:
        """uid -> the peer IDs serving it, sorted; looked up again once `refresh_s` has passed."""
        if self.clock() - self._looked_at >= self.refresh_s:
            self._hosts = self._look()
            self._looked_at = self.clock()
        return self._hosts

    def _look(self) -> dict[str, tuple[str, ...]]:
        hosts: dict[str, list[str]] = {}
        for status in list_peer_statuses(self.dht, self.run_id, LOOKUP_TIMEOUT_S):
            if Role.EXPERT_HOST in status.roles:
                for uid in set(status.experts) & self.grid:  # a uid off the run's grid is no expert of ours
                    hosts.setdefault(uid, []).append(status.peer_id)
        return {uid: tuple(sorted(peer_ids)) for uid, peer_ids in hosts.items()}
