"""Never accept a partial average: an all-reduce missing any part is a failed round, and counted.

hivemind's all-reduce substitutes a peer's own values for the parts a failed reducer never sent back,
logs "received 99.5% results" and reports success. Training on such a mixture silently breaks the
equality of replicas. Here a round with any missing part raises instead, so hivemind's Optimizer falls
back to this peer's local gradients for the step (and the next state averaging re-aligns the replicas),
and a counter shared with the daemon process records it for `crowdtrain status`.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.grad_averager import GradientAverager

from crowdtrain.averaging.authored import AuthoredAverager
from crowdtrain.averaging.grid import GroupSizeMixin
from crowdtrain.averaging.partition import PartialAverageError, PlanSharesMixin
from crowdtrain.dht.gate import AdmissionGated


def new_partial_counter() -> Synchronized:
    """A counter in shared memory: created before hivemind forks its averager process, read after."""
    return mp.Value("l", 0)


def require_complete(num_missing: int, num_total: int, others: Sequence[str] = ()) -> None:
    """Raise PartialAverageError when any of the `num_total` elements came back un-averaged; `others` names the
    group's other members (short peer ids), one of whom failed to aggregate its part."""
    if num_missing:
        group = f" in a group with {', '.join(others)}" if others else ""
        raise PartialAverageError(
            f"{num_missing} of {num_total} elements ({num_missing / max(num_total, 1):.2%}) were not averaged{group}"
        )


class ExactRoundsMixin:
    """Mixed into a hivemind DecentralizedAverager subclass: a round with any un-averaged part raises
    PartialAverageError (counted in `partial_counter`) instead of returning a partial average."""

    partial_counter: Synchronized
    peer_id: Any
    _running_groups: dict[bytes, Any]

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)  # type: ignore[misc]
        container = self._running_groups[group_id].result().tensor_part_container
        try:
            others = [str(peer_id)[-8:] for peer_id in group_info.peer_ids if peer_id != self.peer_id]  # type: ignore[attr-defined]
            require_complete(container.failed_size, container.total_size, others)
        except PartialAverageError:
            with self.partial_counter.get_lock():
                self.partial_counter.value += 1
            raise


class ExactGradientAverager(
    AdmissionGated, ExactRoundsMixin, PlanSharesMixin, GroupSizeMixin, GradientAverager, AuthoredAverager
):
    """hivemind's GradientAverager that fails a round instead of returning a partial average, and splits
    each round by the plan's shares."""

    def __init__(self, *args: Any, partial_counter: Synchronized, **kwargs: Any):
        self.partial_counter = partial_counter
        super().__init__(*args, **kwargs)
