"""The one optimizer factory: every mode's optimizer, its learning-rate schedule and its gradient clipping.

Each run setting of `[optimizer]` means the same thing in every training mode because every mode builds its
optimizer here: `name` picks the optimizer, `weight_decay` is decoupled (AdamW) or L2 (SGD), `max_grad_norm`
clips the gradient an optimizer is about to take at every `step()` (a hook, so no caller can forget it), and the
schedule (`learning_rate_factor`) is counted in the mode's global steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

from crowdtrain.manifest import OptimizerSpec

SGD_MOMENTUM = 0.9
"""The momentum of `name = "sgd"` (heavy ball)."""


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    spec: OptimizerSpec,
    *,
    learning_rate: float | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (parameters or param groups), at `learning_rate` (default: the peak).

    Its every `step()` first clips the gradients it takes to `spec.max_grad_norm` (0: none); an fp16 GradScaler
    unscales before calling `step()`, so the norm is the true one.
    """
    lr = spec.learning_rate if learning_rate is None else learning_rate
    optimizer: torch.optim.Optimizer
    if spec.name == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay)
    if spec.max_grad_norm > 0:
        optimizer.register_step_pre_hook(functools.partial(_clip_before_step, max_norm=spec.max_grad_norm))
    return optimizer


def build_scheduler(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule as a torch scheduler, for hivemind's Optimizer (stepped once per global step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(learning_rate_factor, spec=spec))


def set_scheduled_learning_rate(optimizer: torch.optim.Optimizer, spec: OptimizerSpec, step: int) -> None:
    """Set every param group's learning rate to the schedule's at global step `step`."""
    learning_rate = spec.learning_rate * learning_rate_factor(step, spec)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate


def learning_rate_factor(step: int, spec: OptimizerSpec) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at `total_steps` (and 0 after it)."""
    if step < spec.warmup_steps:
        return (step + 1) / (spec.warmup_steps + 1)
    decay_steps = max(spec.total_steps - spec.warmup_steps, 1)
    progress = min((step - spec.warmup_steps) / decay_steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Scale the gradients `optimizer` is about to take so that their global norm is at most `max_norm` (0: leave
    them)."""
    if max_norm <= 0:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not parameters:
        return
    # One pass to read the norm; a second, to scale, only when it is over (torch's clip_grad_norm_ always scales).
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if float(norm) > max_norm:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)


def _clip_before_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any, *, max_norm: float) -> None:
    clip_gradients(optimizer, max_norm)
