"""One process doing what SkipPipe's nodes do with `overlap_exchange` (modes/skippipe/replicas/gradient_exchange.py):
each stage's true state steps on the replicas' summed gradient one iteration late, and each replica computes on its
look-ahead, the true state stepped on its own gradient times the stage's microbatches over its own, AdamW's moments
kept.

The reference the pipeline test checks the nodes against, and the benchmark's one-process arm of the overlap
(scripts/bench_skippipe_swarm.py). Pure torch: no network.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Hashable, Sequence

import torch

from crowdtrain.modes.skippipe.stages import StagedModel

Visit = tuple[int, Hashable]
"""A microbatch's visit: the stage, and whatever names the replica that ran it."""


class LookAheadReference:
    """A staged model's true state, each replica's look-ahead, and the replicas' sum still to be stepped on."""

    def __init__(
        self, staged: StagedModel, optimizers: Sequence[torch.optim.Optimizer], max_grad_norm: float = 1.0
    ) -> None:
        """`optimizers`: one per stage, over `staged.stage_parameters(stage)`."""
        self.staged, self.optimizers, self.max_grad_norm = staged, optimizers, max_grad_norm
        self.params = [staged.stage_parameters(stage) for stage in range(staged.num_stages)]
        self.ahead: dict[Visit, list[torch.Tensor]] = {}
        """The parameters each replica computes on next, where it looks ahead (the others compute on the true
        state)."""
        self.pending: list[list[torch.Tensor]] | None = None
        """Each stage's summed gradient of the last iteration, which the true state steps on at the next one's end."""

    def iteration(self, microbatches: Sequence[tuple[torch.Tensor, Sequence[Visit]]], scale: float) -> list[float]:
        """One iteration: each microbatch (its tokens; the stage and replica of each visit, stage 0 first) through
        the parameters of the replicas it visits, its loss times `scale` into their gradients; then each stage's true
        state steps on the sum of the iteration before, and each replica that holds a part of this one's looks ahead.
        The microbatches' losses; the model holds the true state after it."""
        true = [[p.detach().clone() for p in params] for params in self.params]
        grads: dict[Visit, list[torch.Tensor]] = {}
        counts: collections.Counter[Visit] = collections.Counter()
        losses = []
        for tokens, visits in microbatches:
            for visit in visits:
                copy_into(self.params[visit[0]], self.ahead.get(visit, true[visit[0]]))
                counts[visit] += 1
            loss = self.staged.loss(tokens, [stage for stage, _ in visits])
            (loss * scale).backward()
            losses.append(float(loss.detach()))
            for visit in visits:
                mine = grads.setdefault(visit, [torch.zeros_like(p) for p in self.params[visit[0]]])
                for total, parameter in zip(mine, self.params[visit[0]], strict=True):
                    if parameter.grad is not None:
                        total += parameter.grad
                    parameter.grad = None
        self.ahead = {}
        for stage, optimizer in enumerate(self.optimizers):
            copy_into(self.params[stage], true[stage])
            if self.pending is not None:
                self._step(optimizer, self.params[stage], self.pending[stage])
            own = {visit: gradient for visit, gradient in grads.items() if visit[0] == stage}
            self._look_ahead(optimizer, self.params[stage], own, counts)
        self.pending = [
            [sum(parts) for parts in zip(*(g for visit, g in grads.items() if visit[0] == stage), strict=True)]
            or [torch.zeros_like(p) for p in self.params[stage]]
            for stage in range(len(self.params))
        ]
        return losses

    def stepped(self) -> StagedModel:
        """A copy of the model whose true state took the pending sum's step: what the nodes will hold."""
        staged, optimizers = copy.deepcopy((self.staged, self.optimizers))
        for stage, optimizer in enumerate(optimizers):
            if self.pending is not None:
                self._step(optimizer, staged.stage_parameters(stage), [g.clone() for g in self.pending[stage]])
        return staged

    def _look_ahead(
        self,
        optimizer: torch.optim.Optimizer,
        parameters: Sequence[torch.nn.Parameter],
        own: dict[Visit, list[torch.Tensor]],
        counts: collections.Counter[Visit],
    ) -> None:
        """Each replica's look-ahead from the stage's true state (`parameters` now; left so): a step on its own
        gradient times the stage's microbatches over its own, AdamW's state as it was."""
        true = [p.detach().clone() for p in parameters]
        visits = sum(counts[visit] for visit in own)
        for visit, gradient in own.items():
            kept = copy.deepcopy(optimizer.state_dict())
            self._step(optimizer, parameters, [g * (visits / counts[visit]) for g in gradient])
            self.ahead[visit] = [p.detach().clone() for p in parameters]
            optimizer.load_state_dict(kept)
            copy_into(parameters, true)

    def _step(
        self, optimizer: torch.optim.Optimizer, parameters: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]
    ) -> None:
        for parameter, gradient in zip(parameters, grads, strict=True):
            parameter.grad = gradient
        torch.nn.utils.clip_grad_norm_(parameters, self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()


def copy_into(parameters: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor]) -> None:
    """Set `parameters` to `values`, in place."""
    with torch.no_grad():
        for parameter, value in zip(parameters, values, strict=True):
            parameter.copy_(value)
