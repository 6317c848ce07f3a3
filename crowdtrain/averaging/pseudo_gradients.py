"""The averager of DiLoCo's outer rounds: pseudo-gradients averaged in Moshpit groups, the outer state served.

Each round the training mode writes this peer's pseudo-gradient (global parameters at the round's start minus
its parameters after the inner steps) into the averager's tensors, and one all-reduce averages them: exact
(a partial round raises), partitioned by the plan's shares, chunks checked and aggregated robustly. Between
rounds the averager serves the outer state a joiner needs (the global parameters, the outer optimizer's
momentum, the round) and downloads it verified (averaging/state_download.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
from hivemind.compression import CompressionInfo

from crowdtrain.averaging.exact import ExactRoundsMixin
from crowdtrain.averaging.grid import GroupSizeMixin
from crowdtrain.averaging.partition import PlanSharesMixin
from crowdtrain.averaging.state_download import StateTemplate, VerifiedStateDownloadMixin
from crowdtrain.averaging.traffic import TrafficCountingAverager
from crowdtrain.dht.admission import AdmissionGated

OuterState = tuple[dict[str, Any], list[torch.Tensor]]
"""(metadata with at least `epoch`, tensors) as a peer serves it and a joiner loads it."""


class PseudoGradientAverager(
    AdmissionGated,
    ExactRoundsMixin,
    PlanSharesMixin,
    GroupSizeMixin,
    VerifiedStateDownloadMixin,
    TrafficCountingAverager,
):
    """Averages pseudo-gradients; `outer_state` gives what joiners download, `template` what a download must match."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        *,
        partial_counter: Synchronized,
        outer_state: Callable[[], OuterState],
        template: Callable[[], StateTemplate],
        **kwargs: Any,
    ):
        self.partial_counter = partial_counter
        self._outer_state, self._template = outer_state, template
        super().__init__(averaged_tensors, **kwargs)

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], list[CompressionInfo]]:
        # hivemind's DecentralizedAverager.get_current_state (run in this, the host process, when a peer asks).
        metadata, tensors = self._outer_state()
        return (
            metadata,
            tensors,
            [CompressionInfo.from_tensor(tensor, key=index) for index, tensor in enumerate(tensors)],
        )

    def state_template(self) -> StateTemplate:
        return self._template()
