"""Who may call a stage node: its hops only from the iteration's sources, its done messages only from the roster.

Hops are source-routed (`driver`): every forward and backward of a microbatch comes from the microbatch's source, a
stage-0 node of the iteration's roster, and asks for a stage 1..S-1 (stage 0 runs at the source). So a stage node
serves a hop only from a stage-0 node of the roster it runs the iteration with (`IterationCallers`, set when it
opens the iteration), for a microbatch 0..M-1, in the run's wire dtype; it answers a backward only for a forward it
ran for the same caller, once per microbatch. It does not check that its own schedule routes that microbatch of that
source through its stage: the nodes' schedules differ wherever their suspicions do (a source that suspects a peer
routes around it, renumbering the microbatches), and a source's gradient for its own microbatches is its to choose
anyway; what a source sends is bounded instead (finite values in the wire dtype, and a step skipped where the sum is
not finite: `optimizer.checked_step`).

A done message (`rpc_stage_done`) is kept only from a node of a roster this node knows (`members`), and its loss
only where it is a cross-entropy an honest source can report (finite, 0..MAX_DONE_LOSS) over at most the
iteration's microbatches.

A refusal for the caller's place (not a source, not a member) is logged once per peer (`RefusalLog`): an outsider
that keeps calling fills no log.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.hop_wire import WIRE_DTYPES

MAX_DONE_LOSS = 1e4
"""The largest loss a done message may report: a cross-entropy past it is no honest source's (a uniform guess over a
million-token vocabulary scores 13.8, and a diverged model's loss is NaN before it gets there)."""
MAX_LOGGED_PEERS = 1024
"""Peers whose refusals `RefusalLog` remembers having logged; past them it starts afresh."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationCallers:
    """Who may send a stage node its hops in one iteration, from the roster it runs the iteration with."""

    iteration: int
    """The iteration these are the callers of."""
    sources: frozenset[str]
    """Peer IDs of the roster's stage-0 nodes: the only callers of a microbatch's hops."""
    num_microbatches: int
    """M, the iteration's microbatches (numbered 0..M-1)."""
    wire_dtype: str
    """The run's wire dtype (`SkipPipeSpec.wire_dtype`): a hop in another is refused before its payload is read."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {self.wire_dtype!r}")

    @classmethod
    def of(
        cls, iteration: int, stage_zero: Collection[str], num_microbatches: int, wire_dtype: str
    ) -> IterationCallers:
        """The callers of `iteration`: the roster's `stage_zero` nodes."""
        return cls(
            iteration=iteration, sources=frozenset(stage_zero), num_microbatches=num_microbatches, wire_dtype=wire_dtype
        )


def hop_refusal(callers: IterationCallers | None, peer: str, header: proto.StageHop) -> str | None:
    """Why a hop `header` from `peer` is not served in the iteration of `callers` (None: any caller, as a tool's
    service, not a daemon's); None if it is."""
    if header.stage == 0:
        return "stage 0 runs at each microbatch's source: no hop asks another node for it"
    if callers is None:
        return None
    if peer not in callers.sources:
        return f"peer {peer[-8:]} is no source of iteration {callers.iteration} in this node's roster"
    if not 0 <= header.microbatch < callers.num_microbatches:
        return f"microbatch {header.microbatch} is not one of the iteration's 0..{callers.num_microbatches - 1}"
    return None


def done_refusal(members: Collection[str] | None, peer: str) -> str | None:
    """Why a done message from `peer` is not kept (`members`: the roster's nodes; None: any); None if it is."""
    if members is not None and peer not in members:
        return f"peer {peer[-8:]} is in no roster this node knows"
    return None


def done_loss(request: proto.StageHop, max_microbatches: int) -> tuple[float, int] | None:
    """The (mean loss, microbatches) a done message reports, if an honest source could report it; else None."""
    loss, count = request.loss, request.microbatches
    if math.isfinite(loss) and 0.0 <= loss <= MAX_DONE_LOSS and 0 < count <= max_microbatches:
        return loss, count
    return None


class RefusalLog:
    """Which peers' refusals were logged already, so that each is logged once (at most MAX_LOGGED_PEERS held)."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def first(self, peer: str) -> bool:
        """Whether `peer`'s refusal is the first to log (and remember it)."""
        if peer in self._logged:
            return False
        if len(self._logged) >= MAX_LOGGED_PEERS:
            self._logged.clear()
        self._logged.add(peer)
        return True
