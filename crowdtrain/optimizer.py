"""The one optimizer factory: every mode's optimizer, its learning-rate schedule and its gradient clipping.

Each run setting of `[optimizer]` means the same thing in every training mode because every mode builds its
optimizer here: `name` picks the optimizer, `weight_decay` is decoupled (AdamW) or L2 (SGD), `max_grad_norm`
clips the gradient an optimizer is about to take at every `step()`, and the schedule (`learning_rate_factor`) is
counted in the mode's global steps.

Every `step()` first reads the gradient's global norm (`checked_step`, in place of the optimizer's own `step`, so
no caller can forget it): a gradient that holds a NaN or an infinity, or whose norm overflows, is never applied:
the step is skipped, said in one line, and the gradient zeroed. A step on it would write NaN into the weights for
good (clipping an infinite norm turns inf into NaN, and AdamW's moments keep it), whichever peer's hop or part
put it there.
"""

from __future__ import annotations

import functools
import logging
import math
import types
from collections.abc import Iterable
from typing import Any

import torch

from crowdtrain.manifest import OptimizerSpec

logger = logging.getLogger(__name__)

SGD_MOMENTUM = 0.9
"""The momentum of `name = "sgd"` (heavy ball)."""


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    spec: OptimizerSpec,
    *,
    learning_rate: float | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (parameters or param groups), at `learning_rate` (default: the peak).

    Its every `step()` is `checked_step`: skipped on a gradient that is not finite, else the gradient clipped to
    `spec.max_grad_norm` (0: none) first; an fp16 GradScaler unscales before calling `step()`, so the norm is the
    true one.
    """
    lr = spec.learning_rate if learning_rate is None else learning_rate
    optimizer: torch.optim.Optimizer
    if spec.name == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay)
    max_norm = spec.max_grad_norm

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return checked_step(self, max_norm, *args, **kwargs)

    # a bound method, as torch's LR schedulers wrap `optimizer.step` through its `__func__`
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    return optimizer


def checked_step(optimizer: torch.optim.Optimizer, max_norm: float, *args: Any, **kwargs: Any) -> Any:
    """`optimizer`'s step on its gradients clipped to `max_norm` (0: not clipped); None without a step, and the
    gradients zeroed, if their global norm is not finite (a NaN, an infinity, or an overflow)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if parameters:
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        norm = float(total_norm)
        if not math.isfinite(norm):
            for parameter in parameters:
                assert parameter.grad is not None
                parameter.grad.zero_()
            logger.warning(
                f"skipped an optimizer step: its gradient's norm is {norm} (NaN or infinite values, or an overflow); "
                "the weights stay as they were"
            )
            return None
        if 0 < max_norm < norm:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return type(optimizer).step(optimizer, *args, **kwargs)


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
