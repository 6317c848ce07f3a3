"""Which experts a host serves: uncovered experts first, then the fewest replicas; and the grid's coverage.

Pure functions of the peers' published status records, so every host reaches its choice without a
coordinator, and a host that re-runs the choice takes over experts whose hosts vanished.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from hivemind.moe.expert_uid import UID_DELIMITER


def choose_experts(
    grid: Sequence[str],
    others: Mapping[str, Collection[str]],
    own_peer_id: str,
    capacity: int,
    *,
    current: Collection[str] = (),
    checkpoints: Collection[str] = (),
) -> tuple[str, ...]:
    """The up to `capacity` experts of `grid` this host should serve, in grid order.

    `others` maps every other live host's peer ID to the experts it serves. Experts are ranked by
    how many other hosts serve them (none first), then this host keeps what it serves (no churn),
    then prefers what it holds a checkpoint of, then a per-host hash of the expert's grid cell
    breaks ties, so hosts that choose at the same moment spread over the grid. The hash leaves out
    the layer: a host takes the same cells in every DMoE layer, so losing it thins every layer
    instead of emptying one (which would stop training). Of several hosts serving one expert, the one
    whose hash is lowest keeps it as if alone, so the others move on to uncovered experts instead
    of all leaving it at once.
    """
    in_grid = set(grid)
    holders: dict[str, list[str]] = {}
    for peer_id, uids in others.items():
        for uid in set(uids) & in_grid:
            holders.setdefault(uid, []).append(peer_id)
    current_set, checkpoint_set = set(current), set(checkpoints)

    def rank(uid: str) -> tuple[int, bool, bool, bytes]:
        num_replicas = len(holders.get(uid, ()))
        if uid in current_set and _is_keeper(own_peer_id, uid, holders.get(uid, ())):
            num_replicas = 0
        return num_replicas, uid not in current_set, uid not in checkpoint_set, _tie_break(own_peer_id, uid)

    position = {uid: index for index, uid in enumerate(grid)}
    chosen = sorted(grid, key=rank)[: max(capacity, 0)]
    return tuple(sorted(chosen, key=position.__getitem__))


def _is_keeper(own_peer_id: str, uid: str, other_holders: Collection[str]) -> bool:
    return all(_tie_break(own_peer_id, uid) < _tie_break(peer_id, uid) for peer_id in other_holders)


def _tie_break(peer_id: str, uid: str) -> bytes:
    cell = uid.split(UID_DELIMITER, 1)[-1]  # "run-ffn3.1.2" -> "1.2"
    return hashlib.blake2b(f"{peer_id}/{cell}".encode(), digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class GridCoverage:
    """How much of a run's expert grid is served right now."""

    num_live: int
    """Experts served by at least one live host."""
    num_total: int
    """Experts in the grid (every DMoE layer)."""
    replicas: dict[str, int]
    """Hosts serving each live expert."""

    def to_json(self) -> dict[str, object]:
        counts = self.replicas.values()
        return {
            "live": self.num_live,
            "total": self.num_total,
            "min_replicas": min(counts) if len(counts) == self.num_total and counts else 0,
            "max_replicas": max(counts, default=0),
            "replicas": dict(sorted(self.replicas.items())),
        }


def grid_coverage(grid: Sequence[str], hosted: Sequence[Collection[str]]) -> GridCoverage:
    """Coverage of `grid` by hosts each serving the experts in one entry of `hosted`."""
    in_grid = set(grid)
    replicas = Counter(uid for uids in hosted for uid in set(uids) & in_grid)
    return GridCoverage(num_live=len(replicas), num_total=len(in_grid), replicas=dict(replicas))
