"""Moshpit SGD's virtual grid expressed as hivemind group keys.

Peers sit on a d-dimensional grid with M cells per side. In each round a peer averages with the
peers that share its coordinates in every dimension but the current one, then takes its index in
that group as its new coordinate there (Moshpit SGD, Ryabinin et al. 2021, Alg. 1): with M^d peers
and groups of M, every peer holds the exact global mean after d rounds.

hivemind's averager groups peers whose key bits are equal and, after each all-reduce, shifts its
own index in the group into the key (GroupKeyManager.update_key_on_group_assembled) — the Moshpit
rotation, once the key holds the (d-1) coordinates other than the current one. hivemind's Optimizer
never sets those bits, so every peer shares the empty key and all of them form one group. Here we
compute the initial bits.

hivemind's matchmaking closes a group early only once `target_group_size` peers joined it; short of that
the leader waits out its whole matchmaking time. A swarm smaller than a group would wait that long every
round, so the target follows the swarm: the number of peers this node knows to be in the run, capped at
the group size (GroupSizeMixin).
"""

from __future__ import annotations

import math
from typing import Any

from hivemind.utils.mpfuture import MPFuture


def bits_per_coordinate(group_size: int) -> int:
    """Bits encoding one coordinate: log2 of the group size (a power of two)."""
    return max(int(math.log2(group_size)), 0)


def initial_group_bits(rank: int, num_peers: int, group_size: int, grid_dims: int) -> str:
    """The starting group key of the peer at `rank` (0-based, in sorted peer-ID order).

    A swarm no larger than one group uses the empty key: everyone averages together. A larger
    swarm is laid out on the grid row by row, so groups are full before new ones open; the key
    holds the peer's coordinates in dimensions 1..d-1 (dimension 0 is the first round's group).
    """
    if num_peers <= group_size or grid_dims < 2:
        return ""
    if not 0 <= rank < num_peers:
        raise ValueError(f"rank must be in [0, {num_peers}), got {rank}")
    width = bits_per_coordinate(group_size)
    num_keys = group_size ** (grid_dims - 1)
    cell = (rank // group_size) % num_keys  # rank % group_size is the coordinate in dimension 0
    return format(cell, "b").zfill(width * (grid_dims - 1)) if width else ""


def expected_group_size(num_peers: int, group_size: int) -> int:
    """How many peers a round's group should hold: the run's peers this node knows of (itself included), at most
    a group. An overestimate only delays a round to the end of matchmaking; an underestimate would close a
    group before a live peer joined it, so callers count every peer that may average, started or not."""
    return max(2, min(num_peers, group_size))


class GroupSizeMixin:
    """Mixed into a hivemind DecentralizedAverager: the group size its matchmaking closes a group at can change
    while it runs (see `expected_group_size`). The key manager keeps the grid's group size: the Moshpit
    rotation after a round depends on it, not on how full the group was."""

    _outer_pipe: Any
    _matchmaking: Any
    target_group_size: int | None = None
    """The size last set (read in this process); None: the one the averager was built with."""

    def set_target_group_size(self, size: int) -> None:
        """From the next matchmaking on, close a group as soon as `size` peers are in it."""
        if size < 2:
            raise ValueError(f"a group holds at least 2 peers, got {size}")
        if size == self.target_group_size:
            return
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], {"size": size, "future": future}))
        future.result()
        self.target_group_size = size

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        # Runs in the averager's process, like hivemind's own _set_group_bits.
        try:
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)
