"""The DMoE variant of a model: each chosen decoder layer's FFN becomes hivemind's RemoteMixtureOfExperts.

The gate (a linear layer scoring the grid) is a local parameter, averaged data-parallel like the rest
of the dense model; the experts live on expert hosts, are found by beam search over DHT prefixes,
and train on the hosts from the gradients sent back to them.
"""

from __future__ import annotations

import logging
from typing import Any

import hivemind
import torch
from hivemind.moe.client.moe import RemoteMixtureOfExperts
from hivemind.p2p import P2PDaemonError, P2PHandlerError
from torch import nn

from crowdtrain.errors import BadInputError, CrowdtrainError
from crowdtrain.manifest import MoESpec, RunManifest, expert_uid_prefix, moe_layers
from crowdtrain.models.build import build_model

logger = logging.getLogger(__name__)


class ExpertsUnavailableError(CrowdtrainError):
    """No expert of a DMoE layer answered in time (none hosted yet, or all their hosts gone)."""


class _MixtureOfExperts(RemoteMixtureOfExperts):
    """hivemind's RemoteMixtureOfExperts, minus NaN for a sequence none of whose experts answered.

    Symptom worked around: hivemind checks k_min over the whole batch, not per sequence, so when
    every expert chosen for one sequence failed (their host was just killed), that row's logits are
    all -inf, the softmax is NaN, and the NaN reaches the loss and the gate's gradient. Here such a
    row's mixture is zero instead: the FFN contributes nothing to that sequence for that step. The
    gate's gradient stays finite: the row's logits were all masked, and masking passes them zero.
    """

    def forward(self, input: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        output = super().forward(input, *args, **kwargs)
        answered = torch.isfinite(output.flatten(start_dim=1)).all(dim=1)
        if bool(answered.all()):
            return output
        shape = (-1,) + (1,) * (output.ndim - 1)
        return torch.where(answered.view(shape), output, torch.zeros((), dtype=output.dtype, device=output.device))


class DMoEFeedForward(nn.Module):
    """A decoder layer's FFN over remote experts: [batch, sequence, hidden] -> same shape.

    Routing is per sequence (hivemind gates on the mean over the sequence): each sequence goes to
    the k best live experts in parallel; experts that fail or are late are dropped from that step's
    mixture and the weights of the others renormalised (softmax over the answers only); a failed
    backward counts as a zero gradient for that expert.
    """

    def __init__(self, *, hidden_size: int, dht: hivemind.DHT, uid_prefix: str, spec: MoESpec):
        super().__init__()
        self.uid_prefix = uid_prefix
        self.experts = _MixtureOfExperts(
            in_features=hidden_size,
            grid_size=spec.grid,
            dht=dht,
            uid_prefix=uid_prefix,
            k_best=spec.k,
            k_min=spec.k_min,
            forward_timeout=spec.forward_timeout_s,
            timeout_after_k_min=spec.timeout_after_k_min_s,
            backward_k_min=0,
            backward_timeout=spec.backward_timeout_s,
            # Without it, a prefix found empty is cached as empty for minutes swarm-wide, so experts a
            # new host takes over stay invisible to trainers long after they are served again.
            negative_caching=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        try:
            return self.experts(hidden)
        except (TimeoutError, P2PDaemonError, P2PHandlerError) as e:
            raise ExpertsUnavailableError(f"no expert of {self.uid_prefix}* answered: {e}") from e
        except (RuntimeError, IndexError) as e:
            # hivemind's ways of saying that beam search found no expert at all
            if isinstance(e, IndexError) or "No responding experts" in str(e):
                raise ExpertsUnavailableError(f"no live expert of {self.uid_prefix}* was found") from e
            raise


def build_dmoe_model(manifest: RunManifest, tokenizer_vocab_size: int, dht: hivemind.DHT, seed: int = 0) -> nn.Module:
    """The run's model with the FFN of every DMoE layer replaced; the same `seed` gives the same gates."""
    assert manifest.moe is not None
    model = build_model(manifest.model, tokenizer_vocab_size, seed=seed)
    layers = _decoder_layers(model, manifest.model.architecture)
    hidden_size = int(manifest.model.config["hidden_size"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for index in moe_layers(manifest):
            layers[index].mlp = DMoEFeedForward(
                hidden_size=hidden_size, dht=dht, uid_prefix=expert_uid_prefix(manifest, index), spec=manifest.moe
            )
    model.train()
    return model


def _decoder_layers(model: nn.Module, architecture: str) -> Any:
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(layer, "mlp") for layer in layers):
        raise BadInputError(
            f"Model architecture {architecture} has no decoder layers with an `mlp` FFN to replace by experts; "
            "use a LLaMA-style architecture such as LlamaForCausalLM for a DMoE run."
        )
    return layers
