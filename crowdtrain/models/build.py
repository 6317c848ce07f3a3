"""Build a transformers model from a ModelSpec, and compute its training loss.

Every peer builds the same initial weights from the same seed, so a joiner's replica starts
where the founder's did even before it downloads the latest state.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

import torch

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import ModelSpec

logger = logging.getLogger(__name__)

ModelKind = Literal["causal", "masked"]
MASKING_FRACTION = 0.15
"""Fraction of non-pad tokens a masked LM predicts (BERT's 15%)."""
IGNORED_LABEL = -100
"""The label transformers' losses skip."""


def model_kind(spec: ModelSpec) -> ModelKind:
    """`causal` for *ForCausalLM architectures, `masked` for *ForMaskedLM ones."""
    if spec.architecture.endswith("ForCausalLM"):
        return "causal"
    if spec.architecture.endswith("ForMaskedLM"):
        return "masked"
    raise BadInputError(
        f"Model architecture {spec.architecture} is neither a *ForCausalLM nor a *ForMaskedLM transformers class."
    )


def check_model_spec(spec: ModelSpec, tokenizer_vocab_size: int) -> None:
    """Raise BadInputError unless `spec` builds (architecture, config keys, vocabulary), without the weights."""
    model_class = _resolve_architecture(spec.architecture)
    _check_vocab_size(_build_config(model_class, spec), tokenizer_vocab_size)


def build_model(spec: ModelSpec, tokenizer_vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model in training mode; the same `seed` gives the same weights."""
    model_class = _resolve_architecture(spec.architecture)
    config = _build_config(model_class, spec)
    _check_vocab_size(config, tokenizer_vocab_size)
    # fork_rng keeps the caller's global RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = model_class(config)
        except Exception as e:  # a config the class accepted but cannot build, e.g. zero layers
            raise BadInputError(f"Cannot build {spec.architecture} from its config: {e}".rstrip(".") + ".") from None
    model.train()
    logger.info("Built %s with %d parameters (seed %d)", spec.architecture, count_parameters(model), seed)
    return model


def _check_vocab_size(config: Any, tokenizer_vocab_size: int) -> None:
    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < tokenizer_vocab_size:
        raise BadInputError(
            f"Model config vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} tokens; "
            f"set model.config.vocab_size to at least {tokenizer_vocab_size}."
        )


def spec_parameter_count(spec: ModelSpec, tokenizer_vocab_size: int) -> int:
    """Number of trainable scalars of the model `spec` describes, without allocating its weights."""
    with torch.device("meta"):
        return count_parameters(build_model(spec, tokenizer_vocab_size))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of trainable scalars; tied weights count once."""
    return sum(parameter.numel() for parameter in model.parameters())


def training_loss(
    model: torch.nn.Module,
    batch: torch.Tensor,
    kind: ModelKind,
    *,
    generator: torch.Generator | None = None,
    mask_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """The language-modelling loss of `batch` [batch, sequence] of token ids.

    causal: next-token prediction (transformers shifts the labels itself).
    masked: 15% of non-pad tokens are replaced by `mask_token_id` (or, without one, by a random
    token drawn from `generator`) and predicted; the other positions are ignored.
    """
    if kind == "causal":
        return model(input_ids=batch, labels=batch).loss
    inputs, labels = mask_tokens(
        batch,
        vocab_size=int(cast(Any, model).config.vocab_size),
        generator=generator,
        mask_token_id=mask_token_id,
        pad_token_id=pad_token_id,
    )
    attention_mask = None if pad_token_id is None else (batch != pad_token_id).long()
    return model(input_ids=inputs, attention_mask=attention_mask, labels=labels).loss


def mask_tokens(
    batch: torch.Tensor,
    *,
    vocab_size: int,
    generator: torch.Generator | None = None,
    mask_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with 15% of non-pad tokens masked, and labels that are -100 except at those tokens."""
    device = batch.device
    maskable = torch.ones_like(batch, dtype=torch.bool) if pad_token_id is None else batch != pad_token_id
    draws = torch.rand(batch.shape, generator=generator, device=device)
    masked = maskable & (draws < MASKING_FRACTION)
    if not masked.any() and maskable.any():
        # An all-ignored batch would make the loss NaN; predict at least one token.
        masked.view(-1)[maskable.view(-1).nonzero()[0]] = True
    if mask_token_id is None:
        replacements = torch.randint(0, vocab_size, batch.shape, generator=generator, device=device)
    else:
        replacements = torch.full_like(batch, mask_token_id)
    inputs = torch.where(masked, replacements, batch)
    labels = torch.where(masked, batch, torch.full_like(batch, IGNORED_LABEL))
    return inputs, labels


def _resolve_architecture(name: str) -> Any:
    """The transformers class named `name`: a PreTrainedModel ending in ForCausalLM or ForMaskedLM."""
    import transformers

    try:
        model_class = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        model_class = None
    is_model = isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
    if not is_model or not name.endswith(("ForCausalLM", "ForMaskedLM")):
        raise BadInputError(
            f"Model architecture {name} is not a transformers *ForCausalLM or *ForMaskedLM class "
            "(e.g. LlamaForCausalLM, AlbertForMaskedLM)."
        )
    return model_class


def _build_config(model_class: Any, spec: ModelSpec) -> Any:
    """The architecture's config from `spec.config`; unknown keys and rejected values are BadInputError."""
    config_class = model_class.config_class
    try:
        config = config_class(**spec.config)
    except Exception as e:  # configs raise ValueError, TypeError or huggingface_hub's validation errors
        raise BadInputError(f"Model config for {spec.architecture} is invalid: {_one_line(e)}.") from None
    # Configs keep unknown keys as attributes instead of rejecting them, so a typo would be silently
    # ignored. Keys a config consumes (legacy aliases such as rope_theta) do not survive in to_dict().
    known = set(config_class().to_dict()) | set(config_class.attribute_map)
    unknown = sorted(key for key in spec.config if key not in known and key in config.to_dict())
    if unknown:
        raise BadInputError(f"Model config key {unknown[0]} is not a {config_class.__name__} setting.")
    return config


def _one_line(error: Exception) -> str:
    """An exception's message squeezed onto one line, without a trailing period."""
    return " ".join(str(error).split()).rstrip(".")
