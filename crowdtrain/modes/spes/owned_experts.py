"""A node trains only the routed experts it owns: SPES's memory saving on transformers' fused expert tensors.

transformers 5 keeps a layer's routed experts in two fused parameters (OlmoeExperts, MixtralExperts, …):
`gate_up_proj` (E, 2F, H) and `down_proj` (E, H, F). Training a few of them as slices of those tensors would
give every step a full-size gradient and an optimizer that keeps state for all E experts. So the fused tensors
are frozen (`requires_grad = False`), and each owned expert's two slices become parameters of their own that
*share the fused tensors' storage* (views): the optimizer updates the fused tensors in place, gradients and
optimizer state exist for owned experts only, and the model's `state_dict` is unchanged. The layer's forward
is replaced by one that reads an owned expert through its parameters and any other one from the frozen
tensor; it computes what the layer's own forward computes (the one in transformers' OlmoeExperts), which the
tests check against the original.

An expert is a *unit*: (layer, expert) numbered layer by layer, `unit = layer * E + expert`.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from crowdtrain.errors import BadInputError


@dataclass(slots=True)
class FusedExperts:
    """One layer's routed experts as transformers fuses them, and the slices this node trains."""

    layer: int
    module: Any
    """The transformers module (its `gate_up_proj`, `down_proj`, `act_fn` and `forward` are what is used)."""
    owned: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)
    """Expert index → its (gate_up, down) slices as parameters that view the fused tensors."""

    @property
    def num_experts(self) -> int:
        return int(self.module.gate_up_proj.shape[0])

    def expert(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `index`'s (gate_up, down) weights: views of the fused tensors."""
        return self.module.gate_up_proj[index], self.module.down_proj[index]


def find_fused_experts(model: nn.Module) -> list[FusedExperts]:
    """Every layer's fused expert module, in module order; BadInputError when the model has none."""
    layers = [
        FusedExperts(layer=index, module=module)
        for index, module in enumerate(module for module in model.modules() if _is_fused_experts(module))
    ]
    if not layers:
        raise BadInputError(
            f"{type(model).__name__} has no fused routed experts (gate_up_proj and down_proj of shape [experts, ...]); "
            "SPES needs a mixture-of-experts model such as OlmoeForCausalLM."
        )
    sizes = {layer.num_experts for layer in layers}
    if len(sizes) != 1:
        raise BadInputError(f"SPES needs the same number of experts in every layer, got {sorted(sizes)}.")
    return layers


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and hasattr(module, "act_fn")
    )


def expert_parameter_ids(layers: Sequence[FusedExperts]) -> set[int]:
    """id() of every fused expert tensor: what is not dense."""
    return {id(tensor) for layer in layers for tensor in (layer.module.gate_up_proj, layer.module.down_proj)}


def units_of(layers: Sequence[FusedExperts]) -> int:
    """How many (layer, expert) units the model has."""
    return len(layers) * layers[0].num_experts


def unit_experts(layers: Sequence[FusedExperts], unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit `unit`'s (gate_up, down) weights, views of the fused tensors."""
    per_layer = layers[0].num_experts
    return layers[unit // per_layer].expert(unit % per_layer)


def own(layers: Sequence[FusedExperts], units: Iterable[int]) -> list[nn.Parameter]:
    """Train exactly `units` from now on: freeze the fused tensors, make each owned slice a parameter, and route
    the layers' forward through them. Returns the owned parameters, two per unit in unit order (kept objects
    for units owned before, so that optimizer state carries over)."""
    wanted = sorted(set(units))
    per_layer = layers[0].num_experts
    if wanted and not 0 <= wanted[0] <= wanted[-1] < units_of(layers):
        raise ValueError(f"units must be in [0, {units_of(layers)}), got {wanted[0]}..{wanted[-1]}")
    for layer in layers:
        layer.module.gate_up_proj.requires_grad_(False)
        layer.module.down_proj.requires_grad_(False)
        mine = {unit % per_layer for unit in wanted if unit // per_layer == layer.layer}
        for index in list(layer.owned):
            if index not in mine:
                del layer.owned[index]
        for index in sorted(mine - layer.owned.keys()):
            gate_up, down = layer.expert(index)
            layer.owned[index] = (nn.Parameter(gate_up.detach()), nn.Parameter(down.detach()))
        if not isinstance(getattr(layer.module, "forward", None), types.MethodType) or (
            layer.module.forward.__func__ is not _owned_forward  # type: ignore[attr-defined]
        ):
            layer.module._crowdtrain_owned = layer.owned
            layer.module.forward = types.MethodType(_owned_forward, layer.module)
    return [parameter for unit in wanted for parameter in layers[unit // per_layer].owned[unit % per_layer]]


def _owned_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' fused-experts forward, with owned experts read through their own parameters."""
    owned: dict[int, tuple[nn.Parameter, nn.Parameter]] = self._crowdtrain_owned  # type: ignore[assignment]
    num_experts = int(self.gate_up_proj.shape[0])
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        # one class more, as transformers: routers may mark a dropped slot with index E
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for row in hit:
        index = int(row[0])
        if index == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[index])
        gate_up, down = owned.get(index) or (self.gate_up_proj[index], self.down_proj[index])
        gate, up = nn.functional.linear(hidden_states[token_idx], gate_up).chunk(2, dim=-1)
        out = nn.functional.linear(self.act_fn(gate) * up, down) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final
