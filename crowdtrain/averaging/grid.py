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
"""

from __future__ import annotations

import math


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
