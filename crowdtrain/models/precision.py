"""Mixed precision: the manifest's `precision` resolved for a device, and the micro-step that honours it.

Autocast only: weights, gradients and optimizer state stay fp32 (the model is never `.half()`-ed), so
what leaves the node for the swarm's average is an fp32 gradient whatever the compute precision.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from crowdtrain.errors import BadInputError

logger = logging.getLogger(__name__)

SKIPPED_STEP_WARNING_INTERVAL_S = 60.0
"""Overflowing fp16 micro-steps are logged at most once per this many seconds."""
_AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """The compute precision resolved for one device."""

    name: str
    """What forward and backward passes compute in: `fp32`, `bf16` or `fp16`."""
    autocast_dtype: torch.dtype | None
    """The dtype of `torch.autocast` around the forward pass; None: no autocast (plain fp32)."""
    uses_grad_scaler: bool
    """Whether the loss is scaled before backward (fp16, whose small gradients underflow otherwise) and a
    micro-step whose gradients overflowed is skipped."""
    allows_tf32: bool
    """Whether fp32 matmuls may run as TensorFloat-32 (CUDA devices of compute capability 8.0 and newer)."""

    def __post_init__(self) -> None:
        if self.name not in _AUTOCAST_DTYPES:
            raise ValueError(f"name must be one of {', '.join(_AUTOCAST_DTYPES)}, got {self.name!r}")
        if self.autocast_dtype != _AUTOCAST_DTYPES[self.name]:
            raise ValueError(f"{self.name} autocasts to {_AUTOCAST_DTYPES[self.name]}, got {self.autocast_dtype}")
        if self.uses_grad_scaler != (self.name == "fp16"):
            raise ValueError("a gradient scaler is used with fp16 and only with fp16")


def resolve_precision(setting: str, device: str, *, bf16_supported: bool) -> Precision:
    """The precision the manifest's `setting` means on `device` (cpu or cuda:N); pure.

    `bf16_supported`: whether the CUDA device computes in bf16 natively (ignored on CPU; see
    `device_supports_bf16`). Raises BadInputError for a setting the device can't run.
    """
    device_type = device.partition(":")[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    if device_type == "cpu":
        if setting == "fp16":
            raise BadInputError(
                "The run's precision is fp16, which needs a CUDA GPU; on CPU, join a run whose precision is auto, "
                "fp32 or bf16."
            )
        name = "fp32" if setting == "auto" else setting
        return _precision(name, allows_tf32=False)
    if setting == "bf16" and not bf16_supported:
        raise BadInputError(
            f"The run's precision is bf16, which {device} does not support; use a run whose precision is auto or fp16."
        )
    if setting == "auto":
        setting = "bf16" if bf16_supported else "fp16"
    # Explicit fp32 means exact fp32 (the reference to compare against); GPUs with bf16 also have TF32.
    return _precision(setting, allows_tf32=bf16_supported and setting != "fp32")


def _precision(name: str, *, allows_tf32: bool) -> Precision:
    if name not in _AUTOCAST_DTYPES:
        raise BadInputError(f"Unknown precision {name!r}; use auto, fp32, bf16 or fp16.")
    return Precision(
        name=name, autocast_dtype=_AUTOCAST_DTYPES[name], uses_grad_scaler=name == "fp16", allows_tf32=allows_tf32
    )


def device_supports_bf16(device: str) -> bool:
    """Whether `device` computes in bf16 natively: False on CPU (autocast works there, but `auto` means fp32)."""
    if not device.startswith("cuda"):
        return False
    with torch.cuda.device(device):
        # Without emulation: pre-Ampere GPUs emulate bf16 slower than they run fp16.
        return torch.cuda.is_bf16_supported(including_emulation=False)


def precision_for_device(setting: str, device: str) -> Precision:
    """`resolve_precision` with the device's bf16 support read from torch."""
    return resolve_precision(setting, device, bf16_supported=device_supports_bf16(device))


def apply_tf32(precision: Precision) -> None:
    """Let fp32 matmuls use TF32 when the precision allows it (a process-wide torch setting)."""
    if precision.allows_tf32:
        torch.set_float32_matmul_precision("high")


def autocast(precision: Precision, device: str) -> contextlib.AbstractContextManager[object]:
    """The context of a forward pass: torch.autocast in the precision's dtype, or nothing for fp32."""
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.partition(":")[0], dtype=precision.autocast_dtype)


class SteppableOptimizer(Protocol):
    """What a micro-step needs of hivemind.Optimizer (and of a test's stand-in)."""

    @property
    def param_groups(self) -> object: ...

    def step(self) -> object: ...

    def zero_grad(self) -> None: ...


class MicroStep:
    """Backward and optimizer step of one micro-batch in the run's precision (`backward`, then `step`).

    fp16: the loss is scaled (torch.amp.GradScaler) and the gradients are unscaled in place before
    `optimizer.step()`, because hivemind.Optimizer accumulates `.grad` inside step(): gradients must leave
    unscaled, or peers with different loss scales would average incommensurable vectors. A micro-step whose
    gradients overflowed never calls step(), so its samples are not counted and nothing of it reaches the
    swarm's average; its gradients are zeroed and the scale backs off.
    """

    def __init__(self, precision: Precision, device: str, *, clock: Callable[[], float] = time.monotonic):
        self.precision = precision
        # GradScaler.unscale_ works with hivemind.Optimizer as is: its param_groups are the model's parameters.
        self.scaler = torch.amp.GradScaler(device.partition(":")[0]) if precision.uses_grad_scaler else None
        self.num_skipped = 0
        """Micro-steps skipped because their fp16 gradients overflowed."""
        self._clock = clock
        self._next_warning_at = 0.0
        self._skipped_since_warning = 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled first under fp16."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: SteppableOptimizer) -> bool:
        """`optimizer.step()` with unscaled gradients; False when it was skipped (gradients overflowed, now zero)."""
        if self.scaler is None:
            optimizer.step()
            return True
        scaler = self.scaler
        scaler.unscale_(optimizer)  # type: ignore[arg-type]
        scale_before = scaler.get_scale()
        scaler.step(optimizer)  # type: ignore[arg-type]  # calls optimizer.step() only if every gradient is finite
        scaler.update()
        # GradScaler.update() multiplies the scale by backoff_factor (< 1) exactly when it found an inf or NaN.
        if scaler.get_scale() >= scale_before:
            return True
        optimizer.zero_grad()
        self._note_skip(scaler.get_scale())
        return False

    def _note_skip(self, new_scale: float) -> None:
        self.num_skipped += 1
        self._skipped_since_warning += 1
        now = self._clock()
        if now < self._next_warning_at:
            return
        self._next_warning_at = now + SKIPPED_STEP_WARNING_INTERVAL_S
        logger.warning(
            f"skipped {self._skipped_since_warning} micro-step(s) whose fp16 gradients overflowed "
            f"(loss scale now {new_scale:g}); they were not sent to the swarm"
        )
        self._skipped_since_warning = 0
