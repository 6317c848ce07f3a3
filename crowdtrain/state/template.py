"""What a downloaded state must look like: this node's own state as a template, and the checks against it.

A download is checked against a template of this node's own state: the number of tensors, every shape and dtype,
finiteness, the sign of quantities that can't be negative, the total bytes (bounded while streaming), and an epoch no
higher than the run could have reached since its manifest was created (`dht.records.epoch_ceiling`). A state that
does not fit raises UnacceptableStateError, and state/download.py goes on with the next donor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.optim.state_averager import dump_optimizer_state

NON_NEGATIVE_STATE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer_norm"})
"""Optimizer state entries that are never negative (a negative second moment makes Adam's step NaN)."""
STREAM_OVERHEAD_BYTES = 1 << 20
"""Serialization overhead allowed beyond the template's own bytes."""


class UnacceptableStateError(ValueError):
    """A downloaded state that does not fit this node's own: never loaded, and its donor is not asked again."""


class EpochTooHighError(UnacceptableStateError):
    """A state claiming an epoch beyond the bound: not loaded; the donor may be asked again later."""


class StaleStateError(UnacceptableStateError):
    """A state older than this node's own: not loaded; nothing wrong with the donor."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one tensor of a state must look like."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    non_negative: bool = False


@dataclass(frozen=True, slots=True)
class StateTemplate:
    """This node's own state as a download must match it, and the highest epoch it may claim."""

    tensors: tuple[TensorSpec, ...]
    epoch_ceiling: int
    epoch_floor: int = 0
    """A state older than this is of no use to this node (it is not held against the donor)."""

    @property
    def max_bytes(self) -> int:
        """Bytes the whole download may take on the wire."""
        return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in self.tensors) + STREAM_OVERHEAD_BYTES


def check_state(metadata: Any, tensors: Sequence[Any], template: StateTemplate) -> int:
    """The state's epoch when `metadata` and `tensors` fit `template`; else UnacceptableStateError."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if type(epoch) is not int or epoch < 0:
        raise UnacceptableStateError(f"epoch {epoch!r} is not a non-negative integer")
    if epoch > template.epoch_ceiling:
        raise EpochTooHighError(f"epoch {epoch} is beyond the {template.epoch_ceiling} this run can have reached")
    if epoch < template.epoch_floor:
        raise StaleStateError(f"epoch {epoch} is older than this node's {template.epoch_floor}")
    if len(tensors) != len(template.tensors):
        raise UnacceptableStateError(f"{len(tensors)} tensors where this node's state has {len(template.tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, template.tensors, strict=True)):
        _check_tensor(index, tensor, spec)
    return epoch


def _check_tensor(index: int, tensor: Any, spec: TensorSpec) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        found = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise UnacceptableStateError(f"tensor {index} is {found}, expected {spec.shape} {spec.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise UnacceptableStateError(f"tensor {index} holds NaN or infinite values")
    if spec.non_negative and tensor.numel() and bool((tensor < 0).any()):
        raise UnacceptableStateError(f"tensor {index} holds negative values where none can be")


def optimizer_tensor_specs(optimizer: torch.optim.Optimizer) -> list[TensorSpec]:
    """Specs of the optimizer's state tensors in the order hivemind streams them (`dump_optimizer_state`)."""
    names = [name for name, value in _flatten_named(optimizer.state_dict()) if isinstance(value, torch.Tensor)]
    _, tensors = dump_optimizer_state(optimizer)
    pairs = zip(names, tensors, strict=True)  # fails loudly if hivemind's flattening order ever changes
    return [TensorSpec(tuple(tensor.shape), tensor.dtype, name in NON_NEGATIVE_STATE) for name, tensor in pairs]


def _flatten_named(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    # The order of hivemind.utils.nested.nested_flatten (lists in order, dicts by sorted key), with each leaf's
    # innermost dict key, so a tensor's role (exp_avg_sq, step, ...) is known.
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten_named(item, name)
    elif isinstance(value, dict):
        for key, item in sorted(value.items()):
            yield from _flatten_named(item, str(key))
    else:
        yield name, value


def parameter_specs(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    """Specs of parameters or other plain tensors: shape and dtype, any sign."""
    return [TensorSpec(tuple(tensor.shape), tensor.dtype) for tensor in tensors]
