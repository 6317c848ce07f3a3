"""crowdtrain's DMoE expert registered for `hivemind-server --custom_module_path scripts/moe_hivemind_expert.py`.

hivemind-server builds an expert as `cls(hidden_dim)` and its sample input as `sample_input(batch, hidden_dim)`,
so this module fixes the rest from the `demo-moe` preset: the expert's inner width and the sequence length.
bench_moe loads it into hivemind-server, which then hosts the same architecture a crowdtrain expert-host serves.
"""

from __future__ import annotations

import torch
from hivemind.moe.server.layers.custom_experts import register_expert_class

from crowdtrain.manifest import PRESETS
from crowdtrain.moe.experts import FeedForwardExpert

EXPERT_CLASS = "crowdtrain_ffn"
"""The name passed to hivemind-server as --expert_cls."""
PRESET = PRESETS["demo-moe"]()
assert PRESET.moe is not None
SEQUENCE_LENGTH = PRESET.data.sequence_length
EXPERT_HIDDEN_SIZE = PRESET.moe.expert_hidden_size


def sample_input(batch_size: int, hidden_size: int) -> torch.Tensor:
    """[batch, sequence_length, hidden]: what a DMoE layer sends an expert."""
    return torch.empty(batch_size, SEQUENCE_LENGTH, hidden_size)


@register_expert_class(EXPERT_CLASS, sample_input)
class DemoMoEExpert(FeedForwardExpert):
    """crowdtrain's FeedForwardExpert, with the one-argument constructor hivemind-server calls."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, EXPERT_HIDDEN_SIZE)
