"""One micro-batch's forward and backward pass on this node's replica: the part every training mode shares."""

from __future__ import annotations

import torch

from crowdtrain.averaging.phases import Phase, PhaseAccumulator
from crowdtrain.models import MicroStep, autocast, training_loss


class LocalCompute:
    """Forward and backward passes of the local model in the run's precision, timed as the compute phase.

    A training mode calls `forward_backward` for each micro-batch it trains locally, then steps through
    `micro_step` (which scales and unscales fp16 losses). DMoE models raise `ExpertsUnavailableError` from the
    forward pass when no expert answers: nothing was added to the gradients then.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        kind: str,
        micro_step: MicroStep,
        device: str,
        generator: torch.Generator,
        phases: PhaseAccumulator,
    ):
        self.model, self.kind, self.micro_step, self.device = model, kind, micro_step, device
        self.generator, self.phases = generator, phases

    def forward_backward(self, batch: torch.Tensor) -> float:
        """The micro-batch's loss (possibly non-finite), its gradients added to `.grad`."""
        began = self.phases.clock()
        with autocast(self.micro_step.precision, self.device):
            loss = training_loss(self.model, batch, self.kind, generator=self.generator)  # type: ignore[arg-type]
        self.micro_step.backward(loss)
        # One wait for the device per micro-batch, after the backward pass is queued (reading the loss before it
        # stalled the GPU between forward and backward).
        value = loss.item()
        self.phases.add(Phase.COMPUTE, self.phases.clock() - began)
        return value
