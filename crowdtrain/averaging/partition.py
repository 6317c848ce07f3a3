"""The all-reduce partition from the DeDLOC plan: each group member aggregates its plan share of the vector.

hivemind splits a group's vector by `load_balance_peers` over *declared* bandwidths. Here every peer
sends its plan share at matchmaking instead (in the slot hivemind gathers the bandwidth in), and every
member of the assembled group turns the gathered shares into the same fractions: the shares
renormalised over the group, since a Moshpit group holds only some of the plan's aggregators.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any

from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils.asyncio import enter_asynchronously

from crowdtrain.averaging.authored import AuthoredAverager, UnauthoredEntryError
from crowdtrain.dht.gate import AdmissionGated

logger = logging.getLogger(__name__)


class PartialAverageError(RuntimeError):
    """An all-reduce round in which some parts of the vector were never averaged."""


EXPECTED_ROUND_FAILURES: tuple[type[Exception], ...] = (
    PartialAverageError,
    UnauthoredEntryError,
    AllreduceException,
    MatchmakingException,
    asyncio.TimeoutError,
)
"""Ways a round fails when peers leave, are late or send too little: logged as one line, not a traceback."""


def group_fractions(
    shares: Sequence[float | None], modes: Sequence[AveragingMode], total_size: int, min_vector_size: int = 0
) -> tuple[float, ...]:
    """Each member's fraction of the vector: its share renormalised over the group's aggregating members.

    A client-mode member gets nothing. When no member sent a positive share (no plan yet, or a group of
    peers the plan gave no share), the non-client members split the vector equally. As in hivemind's
    `min_size`, a member whose part would hold fewer than `min_vector_size` elements gets nothing, unless
    that would leave nobody to aggregate.
    """
    if len(shares) != len(modes):
        raise ValueError(f"{len(shares)} shares for {len(modes)} group members")
    can_aggregate = [mode != AveragingMode.CLIENT for mode in modes]
    if not any(can_aggregate):
        raise ValueError("no member of the group can aggregate: every one is a client")
    weights = [_valid_share(share) if able else 0.0 for share, able in zip(shares, can_aggregate, strict=True)]
    if sum(weights) <= 0:
        weights = [1.0 if able else 0.0 for able in can_aggregate]
    fractions = _normalized(weights)
    if min_vector_size > 0:
        kept = [fraction if fraction * total_size >= min_vector_size else 0.0 for fraction in fractions]
        if sum(kept) > 0:
            fractions = _normalized(kept)
    return fractions


def _valid_share(share: float | None) -> float:
    # Gathered values come from peers: anything but a finite non-negative number counts as no share.
    if isinstance(share, int | float) and math.isfinite(share) and share > 0:
        return float(share)
    return 0.0


def _check_share(share: float | None) -> None:
    if share is not None and not (math.isfinite(share) and 0.0 <= share <= 1.0):
        raise ValueError(f"a plan share must be within [0, 1], got {share}")


def _normalized(weights: Sequence[float]) -> tuple[float, ...]:
    total = sum(weights)
    return tuple(weight / total for weight in weights)


class PlanSharesMixin:
    """Partition each all-reduce by the plan shares the group's members sent at matchmaking.

    Mixed into an `AuthoredAverager` (averaging/authored.py): the share travels in the slot hivemind gathers
    `bandwidth` in, signed by its member with the rest of its entry, so peers running this class must all be
    crowdtrain peers of one run.
    """

    total_size: int

    def set_share(self, share: float | None) -> None:
        """The fraction of the vector this peer aggregates from the next round on; None: no plan yet."""
        _check_share(share)
        self._authored.set_bandwidth(share)  # read by `step()` in this process when it signs what it gathers

    @property
    def _authored(self) -> AuthoredAverager:
        assert isinstance(self, AuthoredAverager), "PlanSharesMixin goes with AuthoredAverager"
        return self

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        # hivemind's DecentralizedAverager._aggregate_with_group with its load balancing replaced.
        try:
            entries = self._authored.authored_entries(group_info)
            user_gathered = {peer: entry.value for peer, entry in zip(group_info.peer_ids, entries, strict=True)}
            modes = tuple(AveragingMode(entry.mode) for entry in entries)
            fractions = group_fractions([entry.share for entry in entries], modes, self.total_size, min_vector_size)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:  # type: ignore[attr-defined]
                await self._run_allreduce_inplace_(  # type: ignore[attr-defined]
                    local_tensors, group_info, peer_fractions=fractions, **kwargs
                )
                return user_gathered
        except BaseException as e:
            # hivemind's own version logs every failure here with a traceback, and again where it catches the
            # MatchmakingException; a round failing because a peer left or sent too little is an expected event:
            # it reaches the log once, as one warning line (node/logs.py). Unexpected errors keep their traceback.
            if isinstance(e, Exception) and not isinstance(e, EXPECTED_ROUND_FAILURES):
                logger.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e


class PlannedAverager(AdmissionGated, PlanSharesMixin, AuthoredAverager):
    """A DecentralizedAverager whose all-reduce partition follows the DeDLOC plan's shares."""

    def __init__(self, *args: Any, share: float | None = None, **kwargs: Any):
        if "bandwidth" in kwargs:
            raise TypeError("PlannedAverager takes `share`, not `bandwidth`")
        _check_share(share)
        super().__init__(*args, bandwidth=share, **kwargs)
