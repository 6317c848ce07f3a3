"""Moshpit group keys and the timeouts of looking for a group, fitted to the swarm and the run's averaging spec.

A peer's initial group key comes from its rank among the peers it knows of (`moshpit_bits`); the key and the group
size are refitted when the swarm crosses the group size (`refresh_moshpit_groups`). The join request and chunk
timeouts bound how long matchmaking and a round wait for one peer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import hivemind

from crowdtrain.averaging.grid import expected_group_size, initial_group_bits
from crowdtrain.manifest import AveragingSpec

logger = logging.getLogger(__name__)

HIVEMIND_REQUEST_TIMEOUT_S = 3.0  # DecentralizedAverager's default wait for a potential leader's answer


def moshpit_bits(own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec) -> str:
    """This peer's initial Moshpit group key from its rank among the peers it knows of."""
    ranked = sorted(set(peer_ids) | {own_peer_id})
    return initial_group_bits(ranked.index(own_peer_id), len(ranked), averaging.group_size, averaging.grid_dims)


def refresh_moshpit_groups(
    optimizer: hivemind.Optimizer, own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec
) -> bool:
    """Fit the optimizer's averaging groups to the swarm of `own_peer_id` and `peer_ids` (every peer that may
    average, started or not): the group size matchmaking closes a group at, and the group key, re-seeded when
    the swarm crossed the group size (one group <-> a grid). True if the key was re-seeded.

    Within one regime the key is left alone: hivemind rotates it after every round, which is the
    Moshpit schedule, and resetting it would undo that.
    """
    peer_ids = set(peer_ids)
    if optimizer.use_local_updates:
        return refresh_groups(optimizer.state_averager, own_peer_id, peer_ids, averaging)
    # Gradients mode: the key is the gradient rounds'; the parameter rounds every few epochs (one group, no grid
    # key) also close as soon as the swarm is in.
    size = expected_group_size(len(peer_ids | {own_peer_id}), averaging.group_size)
    optimizer.state_averager.set_target_group_size(size)
    return refresh_groups(optimizer.grad_averager, own_peer_id, peer_ids, averaging)


def refresh_groups(averager: Any, own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec) -> bool:
    """`refresh_moshpit_groups` for one hivemind averager (a GroupSizeMixin)."""
    peers = set(peer_ids) | {own_peer_id}
    averager.set_target_group_size(expected_group_size(len(peers), averaging.group_size))
    wanted = moshpit_bits(own_peer_id, peers, averaging)
    current = averager.get_group_bits()
    if len(wanted) == len(current):
        return False
    averager.set_group_bits(wanted)
    logger.info(f"swarm size changed: Moshpit group key {current or '(one group)'} -> {wanted or '(one group)'}")
    return True


def join_request_timeout_s(averaging: AveragingSpec) -> float:
    """How long a peer looking for a group waits for a potential leader's answer: at most hivemind's default,
    and always well below the matchmaking time.

    Symptom worked around: hivemind's matchmaking deadlocks when two peers ask each other to lead at once; only
    this timeout breaks it. With a timeout at or above the matchmaking time (hivemind's 3 s against a 2 s
    matchmaking time), each break came after both declarations expired, the two asked each other again, and a
    round of two peers on loopback found no group for its whole 20 s.
    """
    return min(HIVEMIND_REQUEST_TIMEOUT_S, averaging.matchmaking_time_s / 2)


def chunk_timeout_s(averaging: AveragingSpec) -> float:
    """How long a group member may take to send its first part (or the next one) before the round goes on
    without it: half the round's timeout, never less than the matchmaking time."""
    return max(averaging.matchmaking_time_s, averaging.timeout_s / 2)
