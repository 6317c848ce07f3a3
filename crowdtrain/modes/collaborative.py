"""The two modes on hivemind.Optimizer: `gradients` (DeDLOC) and `parameters` (Moshpit SGD).

`gradients`: peers accumulate gradients until the swarm reaches the target batch, average them in Moshpit
groups partitioned by the plan, and step together; a joiner downloads parameters and optimizer state.
`parameters`: peers step on every micro-batch and average parameters once per global epoch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import hivemind
import torch

from crowdtrain.averaging.groups import moshpit_bits, refresh_moshpit_groups
from crowdtrain.collaboration.factory import (
    clear_micro_batch_gradients,
    discard_local_gradients,
    excluded_peers,
    make_optimizer,
    set_plan_share,
)
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.progress import Progress

logger = logging.getLogger(__name__)


class CollaborativeMode(TrainingMode):
    """A training mode whose synchronisation is hivemind.Optimizer's, configured from the manifest."""

    def __init__(self, context: ModeContext):
        super().__init__(context)
        compute = context.compute
        self.optimizer: hivemind.Optimizer = make_optimizer(
            dht=context.dht,
            manifest=context.manifest,
            parameters=context.parameters,
            micro_batch_size=context.micro_batch_size,
            client_mode=context.client_mode,
            auxiliary=context.auxiliary,
            group_bits=moshpit_bits(
                context.peer_id, [status.peer_id for status in context.swarm.statuses], context.manifest.averaging
            ),
            private_key=context.private_key,
            partial_counter=context.partial_counter,
            phases=context.phases,
            traffic=context.traffic,
            # .grad accumulates the global batch, unless a loss scaler must unscale each micro-batch on its own.
            reuse_grad_buffers=self.accumulates_gradients
            and compute is not None
            and not compute.micro_step.precision.uses_grad_scaler,
            use_local_updates=not self.accumulates_gradients,
            stop=context.stop,
        )
        self.apply_swarm_view(context.swarm)  # the plan's share, the group size

    accumulates_gradients = False
    """Whether micro-batches' gradients add up to the global batch before the optimizer steps."""

    @property
    def epoch(self) -> int:
        return int(self.optimizer.local_epoch)

    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        compute = self.context.compute
        assert compute is not None, "an auxiliary peer computes nothing"
        loss = compute.forward_backward(batch)
        if not math.isfinite(loss):
            logger.warning(f"skipped a micro-batch with a non-finite loss ({loss})")
            discard_local_gradients(self.optimizer)
            return None
        if not compute.micro_step.step(self.optimizer):
            return None  # fp16 gradients overflowed: not counted, nothing sent; MicroStep zeroed them
        clear_micro_batch_gradients(self.optimizer)
        return loss

    def assist(self) -> None:
        self.optimizer.step()

    def apply_swarm_view(self, view: SwarmView) -> None:
        set_plan_share(self.optimizer, view.plan_share)
        peer_ids = [status.peer_id for status in view.statuses]
        refresh_moshpit_groups(self.optimizer, self.context.peer_id, peer_ids, self.context.manifest.averaging)

    def report(self, progress: Progress) -> None:
        optimizer = self.optimizer
        progress.epoch = optimizer.local_epoch
        progress.samples_accumulated = optimizer.tracker.local_progress.samples_accumulated
        progress.num_partial_averages = self.context.partial_counter.value
        progress.num_local_steps = getattr(optimizer, "num_local_gradient_steps", 0)
        global_progress = optimizer.tracker.global_progress
        progress.num_peers = global_progress.num_peers
        progress.swarm_samples_accumulated = global_progress.samples_accumulated
        progress.averaging_bytes_sent, progress.averaging_bytes_received = self.context.traffic.totals()
        progress.excluded_peers = excluded_peers(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.optimizer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        self.optimizer.shutdown()


class GradientsMode(CollaborativeMode):
    """DeDLOC: one global batch accumulated by the swarm, gradients averaged, every peer steps alike."""

    name = "gradients"
    has_auxiliary_aggregators = True
    accumulates_gradients = True


class ParametersMode(CollaborativeMode):
    """Moshpit SGD: every peer steps its own replica, parameters averaged in Moshpit groups every epoch."""

    name = "parameters"
