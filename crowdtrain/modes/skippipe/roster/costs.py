"""What a node's visit costs the scheduler: its link's seconds per hop, and its declared compute, counted at most
MAX_SPEEDUP times the median's.

A node declares its own seconds per microbatch (`declaration`), and the scheduler gives a replica about 1/c of its
stage's visits (`schedule`), so a node that declares 5e-324 s would draw every visit of its stage, and with them the
stage's gradient and the iteration's pace. Every node bounds the declared costs alike before it schedules: a cost
counts as at least the median of the iteration's live nodes over MAX_SPEEDUP (the rule SPES uses for a peer's compute,
`modes/spes/ownership.py`). An honest node more than MAX_SPEEDUP times faster than the median is given less than its
share, the price of the bound. A pure function of the membership, so every node computes the same schedule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crowdtrain.modes.skippipe.roster.schedule import NodeInfo

MAX_SECONDS_PER_HOP = 600.0
"""Cap on a node's link seconds per hop (a node that slow gets no microbatch anyway)."""
MAX_SECONDS_PER_MICROBATCH = 600.0
"""Cap on a node's declared seconds per microbatch: one slower trains nothing useful, and a declared 1e308 (half a
pair's members) would raise the others' counted costs with it (`counted_compute`)."""
MAX_SPEEDUP = 4.0
"""A node's compute counts as at most this many times the median node's."""


def counted_compute(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """`nodes`, in their order, each with its seconds per microbatch raised to at least the median's / MAX_SPEEDUP (of
    an even count the higher middle one, so that a liar in a pair can't move its own bound)."""
    if not nodes:
        return []
    floor = statistics.median_high([node.seconds_per_microbatch for node in nodes]) / MAX_SPEEDUP
    return [
        node if node.seconds_per_microbatch >= floor else replace(node, seconds_per_microbatch=floor) for node in nodes
    ]


def seconds_per_hop(payload_bytes: int, upload_mbps: float | None, download_mbps: float | None) -> float:
    """A node's `NodeInfo.seconds_per_hop`: `payload_bytes` (one microbatch's hidden states on the wire) at the slower
    of its upload and download, at most MAX_SECONDS_PER_HOP; 0 where either is not measured (None or not > 0)."""
    if upload_mbps is None or download_mbps is None or not (upload_mbps > 0 and download_mbps > 0):
        return 0.0
    return min(8 * payload_bytes / (min(upload_mbps, download_mbps) * 1e6), MAX_SECONDS_PER_HOP)
