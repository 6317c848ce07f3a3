"""A decoder LM cut into SkipPipe's pipeline stages, and its forward along any path of them.

SkipPipe (Gensyn et al. 2025) cuts a model's L decoder layers into S stages of consecutive layers. Stage 0
holds the embeddings, the first layers, the final norm and the head, so every microbatch starts and ends there;
stages 1..S-1 hold the rest. A microbatch's path is 0 followed by the stages it visits, in visiting order
(`planning.skippipe.Route.stages`); a skipped stage is not run, so it holds no activations and receives no
gradient from that microbatch. With x the token ids and p = (0, p_1, ..., p_V) the path:

    h      = embed(x)                                      [batch, sequence, hidden]
    h      = layers(stage 0)(h), then layers(p_1)(h), ..., layers(p_V)(h)
    logits = head(norm(h))                                 [batch, sequence, vocab]
    loss   = the model's own causal LM loss of logits against x, shifted by one token

Every layer gets the same rotary position embeddings and causal mask, built as transformers' own decoder builds
them; a layer moved by reordering is still the same function of its input. With the full ascending path
(0, 1, ..., S-1) this is the model's forward, op for op. Models whose layers need different masks (sliding
windows) or whose loss adds a router's auxiliary term are refused rather than silently computed otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from transformers.masking_utils import create_causal_mask

from crowdtrain.errors import BadInputError

_REQUIRED_PARTS = ("model.layers", "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")
"""The attributes of a transformers decoder LM (LlamaForCausalLM, OlmoeForCausalLM) that stages are cut from."""


def stage_layers(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: consecutive, every layer once, sizes differing by at most one.

    Stage 0 gets the first layers and, when the layers don't divide evenly, one of the smaller shares, because it
    also runs the embeddings and the head. `sizes`: each stage's number of layers instead (at least 1 each, all
    of the layers), e.g. a lighter stage 0, which every microbatch visits while it skips some of the others.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be between 1 and the {num_layers} layers, got {num_stages}")
    if sizes is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if stage >= num_stages - extra else 0) for stage in range(num_stages)]
    elif len(sizes) != num_stages or min(sizes) < 1 or sum(sizes) != num_layers:
        raise ValueError(
            f"stage sizes {list(sizes)} must give each of the {num_stages} stages at least one of the "
            f"{num_layers} layers, all of them"
        )
    starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def check_path(path: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """`path` as a tuple once it starts at stage 0, names only stages 0..S-1 and none twice; else ValueError."""
    stages = tuple(path)
    if not stages or stages[0] != 0:
        raise ValueError(f"a path must start at stage 0 (embeddings and first layers), got {list(stages)}")
    out_of_range = [stage for stage in stages if not 0 <= stage < num_stages]
    if out_of_range:
        raise ValueError(f"path {list(stages)} names stage {out_of_range[0]}, not one of 0..{num_stages - 1}")
    if len(set(stages)) != len(stages):
        raise ValueError(f"path {list(stages)} visits a stage twice; each stage runs at most once per microbatch")
    return stages


@dataclass(frozen=True, kw_only=True, slots=True)
class Activations:
    """What flows between stages: the hidden states, and what every layer needs beside them."""

    hidden_states: torch.Tensor
    """[batch, sequence, hidden]."""
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    """The rotary cosines and sines, each [1, sequence, head_dim]."""
    position_ids: torch.Tensor
    """[1, sequence]: 0..sequence-1."""
    attention_mask: Any
    """The causal mask in the form the model's attention implementation takes; None where it masks by itself."""


class StagedModel:
    """A transformers decoder LM cut into `num_stages` stages; runs microbatches along paths of stages.

    It holds the model's own modules, not copies: training along paths trains the model.
    """

    def __init__(self, model: torch.nn.Module, num_stages: int, sizes: Sequence[int] | None = None) -> None:
        _check_decoder_lm(model)
        self.model: Any = cast(Any, model)
        self.stages = tuple(stage_layers(len(self.model.model.layers), num_stages, sizes))
        """The decoder layers of each stage, by stage."""

    @property
    def num_stages(self) -> int:
        """S, the number of stages."""
        return len(self.stages)

    @property
    def full_path(self) -> tuple[int, ...]:
        """Every stage in ascending order: the path that computes the model's own forward."""
        return tuple(range(self.num_stages))

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: tensors given to the methods below are moved there (hops carry them on
        the CPU)."""
        return cast(torch.device, next(self.model.parameters()).device)

    def stage_parameters(self, stage: int) -> list[torch.nn.Parameter]:
        """The parameters a stage trains; stage 0's include the embeddings, final norm and head (tied ones once)."""
        self._check_stage(stage)
        inner = self.model.model
        modules = [inner.layers[index] for index in self.stages[stage]]
        if stage == 0:
            modules += [inner.embed_tokens, inner.norm, self.model.lm_head]
        unique = {id(parameter): parameter for module in modules for parameter in module.parameters()}
        return list(unique.values())

    def embed(self, input_ids: torch.Tensor) -> Activations:
        """The token embeddings of `input_ids` [batch, sequence], with the positions and mask every layer uses."""
        return self.activations(self.model.model.embed_tokens(input_ids.to(self.device)))

    def activations(self, hidden_states: torch.Tensor) -> Activations:
        """`hidden_states` [batch, sequence, hidden] with the positions and mask every layer uses: what a stage
        that received only the hidden states of a microbatch (a pipeline hop) runs its layers on."""
        inner = self.model.model
        hidden_states = hidden_states.to(self.device)
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        # As LlamaModel.forward builds them: no padding mask, no cache.
        attention_mask = create_causal_mask(
            config=inner.config, inputs_embeds=hidden_states, attention_mask=None, cache=None, position_ids=position_ids
        )
        return Activations(
            hidden_states=hidden_states,
            position_embeddings=inner.rotary_emb(hidden_states, position_ids=position_ids),
            position_ids=position_ids,
            attention_mask=attention_mask,
        )

    def run_stage(self, stage: int, activations: Activations) -> Activations:
        """The activations after `stage`'s decoder layers, in order."""
        self._check_stage(stage)
        hidden_states = activations.hidden_states
        for index in self.stages[stage]:
            hidden_states = self.model.model.layers[index](
                hidden_states,
                attention_mask=activations.attention_mask,
                position_embeddings=activations.position_embeddings,
                position_ids=activations.position_ids,
                cache=None,
                use_cache=False,
            )
        return replace(activations, hidden_states=hidden_states)

    def head(self, activations: Activations) -> torch.Tensor:
        """Logits [batch, sequence, vocab] of the final norm and the LM head."""
        return cast(torch.Tensor, self.model.lm_head(self.model.model.norm(activations.hidden_states)))

    def head_loss(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The causal LM loss of the hidden states [batch, sequence, hidden] after a path's last stage, against
        `input_ids` (the microbatch's tokens): the final norm, the head and the model's loss function."""
        logits = self.model.lm_head(self.model.model.norm(hidden_states.to(self.device)))
        labels = input_ids.to(self.device)
        return cast(
            torch.Tensor,
            self.model.loss_function(logits=logits, labels=labels, vocab_size=self.model.config.vocab_size),
        )

    def logits(self, input_ids: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """Logits [batch, sequence, vocab] of `input_ids` [batch, sequence] run along `path`."""
        activations = self.embed(input_ids)
        for stage in check_path(path, self.num_stages):
            activations = self.run_stage(stage, activations)
        return self.head(activations)

    def loss(self, input_ids: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """The causal LM loss of `input_ids` [batch, sequence] along `path`: the model's loss function, labels
        the inputs (it shifts them), as `model(input_ids=..., labels=...)` computes it."""
        activations = self.embed(input_ids)
        for stage in check_path(path, self.num_stages):
            activations = self.run_stage(stage, activations)
        return self.head_loss(activations.hidden_states, input_ids)

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is not one of 0..{self.num_stages - 1}")


def _check_decoder_lm(model: torch.nn.Module) -> None:
    """BadInputError unless `model` is a decoder LM whose layers all take one causal mask and whose loss is LM only."""
    name = type(model).__name__
    for part in _REQUIRED_PARTS:
        owner: Any = model
        for attribute in part.split("."):
            owner = getattr(owner, attribute, None)
        if owner is None:
            raise BadInputError(
                f"{name} has no {part}, so it cannot be cut into SkipPipe stages; use a decoder LM such as "
                "LlamaForCausalLM or OlmoeForCausalLM."
            )
    config: Any = cast(Any, model).config
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) is not None or any(kind != "full_attention" for kind in layer_types):
        raise BadInputError(
            f"{name} uses sliding-window attention, which SkipPipe stages do not build masks for; "
            "set its config's sliding_window to None."
        )
    if getattr(config, "output_router_logits", False):
        raise BadInputError(
            f"{name} adds the router's auxiliary loss, which a path of stages does not compute; "
            "set its config's output_router_logits to False."
        )
