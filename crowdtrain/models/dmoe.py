"""The DMoE variant of a model: each chosen decoder layer's FFN becomes hivemind's RemoteMixtureOfExperts.

The gate (a linear layer scoring the grid) is a local parameter, averaged data-parallel like the rest
of the dense model; the experts live on expert hosts and train there from the gradients sent back to
them. Which hosts serve which experts comes from `find_hosts` (the run's signed records, read by
`crowdtrain.moe.directory`), never from hivemind's unsigned declarations.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import hivemind
import numpy as np
import torch
from hivemind.moe.client.expert import RemoteExpert, batch_create_remote_experts
from hivemind.moe.client.moe import RemoteMixtureOfExperts
from hivemind.moe.expert_uid import ExpertInfo
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID
from torch import nn

from crowdtrain.errors import BadInputError, CrowdtrainError
from crowdtrain.manifest import MoESpec, RunManifest, expert_uid_prefix, moe_layers
from crowdtrain.models.build import build_model

logger = logging.getLogger(__name__)

FindHosts = Callable[[], Mapping[str, Sequence[str]]]
"""Every live expert's uid -> the peer IDs (base58) of the hosts serving it."""


class ExpertsUnavailableError(CrowdtrainError):
    """No expert of a DMoE layer answered in time (none hosted yet, or all their hosts gone)."""


class _TrustedExpertSearch:
    """Stands in for hivemind's MoEBeamSearcher: each sequence's best live experts of one layer's grid, by the
    gate's scores, among those `find_hosts` lists. The search is exact (every live expert is scored), and a
    replicated expert is called on one of its hosts at random."""

    def __init__(self, dht: hivemind.DHT, uid_prefix: str, grid_size: Sequence[int], find_hosts: FindHosts):
        self.dht, self.uid_prefix, self.grid_size, self.find_hosts = dht, uid_prefix, tuple(grid_size), find_hosts
        self.total_grid_size = sum(self.grid_size)
        cells = itertools.product(*(range(size) for size in self.grid_size))
        self._cells = {uid_prefix + ".".join(map(str, cell)): cell for cell in cells}

    def batch_find_best_experts(
        self, batch_grid_scores: Sequence[np.ndarray], beam_size: int
    ) -> list[list[RemoteExpert]]:
        """For each sequence, up to `beam_size` live experts, best first; `batch_grid_scores[d]` is [batch, grid[d]]."""
        live = [(uid, self._cells[uid], hosts) for uid, hosts in self.find_hosts().items() if uid in self._cells]
        chosen = []
        for scores in zip(*batch_grid_scores, strict=True):  # one sequence: a score per cell of each dimension
            best = heapq.nlargest(
                beam_size, live, key=lambda expert: sum(s[c] for s, c in zip(scores, expert[1], strict=True))
            )
            chosen.append([ExpertInfo(uid, PeerID.from_base58(random.choice(hosts))) for uid, _, hosts in best])
        return batch_create_remote_experts(chosen, self.dht)


class _MixtureOfExperts(RemoteMixtureOfExperts):
    """hivemind's RemoteMixtureOfExperts over `_TrustedExpertSearch`, minus NaN for a sequence none of whose
    experts answered.

    Symptom worked around: hivemind checks k_min over the whole batch, not per sequence, so when
    every expert chosen for one sequence failed (their host was just killed), that row's logits are
    all -inf, the softmax is NaN, and the NaN reaches the loss and the gate's gradient. Here such a
    row's mixture is zero instead: the FFN contributes nothing to that sequence for that step. The
    gate's gradient stays finite: the row's logits were all masked, and masking passes them zero.
    """

    def __init__(self, *, find_hosts: FindHosts, **kwargs: Any):
        super().__init__(**kwargs)
        self.beam_search = _TrustedExpertSearch(self.dht, kwargs["uid_prefix"], kwargs["grid_size"], find_hosts)  # type: ignore[assignment]

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

    def __init__(self, *, hidden_size: int, dht: hivemind.DHT, uid_prefix: str, spec: MoESpec, find_hosts: FindHosts):
        super().__init__()
        self.uid_prefix = uid_prefix
        self.experts = _MixtureOfExperts(
            find_hosts=find_hosts,
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


def build_dmoe_model(
    manifest: RunManifest, tokenizer_vocab_size: int, dht: hivemind.DHT, find_hosts: FindHosts, seed: int = 0
) -> nn.Module:
    """The run's model with the FFN of every DMoE layer replaced; the same `seed` gives the same gates.

    `find_hosts` says where the experts live: pass a trusted source (`crowdtrain.moe.directory.ExpertDirectory`).
    """
    assert manifest.moe is not None
    model = build_model(manifest.model, tokenizer_vocab_size, seed=seed)
    layers = _decoder_layers(model, manifest.model.architecture)
    hidden_size = int(manifest.model.config["hidden_size"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for index in moe_layers(manifest):
            layers[index].mlp = DMoEFeedForward(
                hidden_size=hidden_size,
                dht=dht,
                uid_prefix=expert_uid_prefix(manifest, index),
                spec=manifest.moe,
                find_hosts=find_hosts,
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
