"""The run manifest's sections: the model, data, optimizer, averaging and DMoE's settings (each training mode's own
section is in its sub-package, `crowdtrain/modes/<mode>/settings.py`).

Each is a frozen dataclass validated in `__post_init__`; `RunManifest` (run.py) holds them and checks how they fit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from crowdtrain.modes.settings import DEFAULT_MODE, TRAINING_MODES

MAX_MODEL_CONFIG_BYTES = 16 * 1024
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The model: a transformers architecture built from its config, randomly initialised."""

    architecture: str = "LlamaForCausalLM"
    """A transformers model class name, e.g. LlamaForCausalLM or AlbertForMaskedLM."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the architecture's config class (treat as read-only)."""
    tokenizer: str = "bytes"
    """`bytes` for the built-in byte-level tokenizer, or a local directory with a saved tokenizer."""
    precision: str = "auto"
    """Compute precision of forward and backward passes: `auto` (bf16 on GPUs that have it, fp16 with loss
    scaling on older GPUs, fp32 on CPU), `fp32`, `bf16` or `fp16` (GPUs only). Weights and optimizer state
    stay fp32 whatever it is."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.architecture):
            raise ValueError(f"architecture must be a transformers class name, got {self.architecture!r}")
        try:
            config_json = json.dumps(self.config, allow_nan=False)
        except ValueError:
            raise ValueError("config must hold finite numbers only, not NaN or Infinity") from None
        if len(config_json) > MAX_MODEL_CONFIG_BYTES:
            raise ValueError(f"config is larger than {MAX_MODEL_CONFIG_BYTES} bytes as JSON")
        if not self.tokenizer:
            raise ValueError("tokenizer must be 'bytes' or a directory")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


DATA_SOURCES = ("embedded", "files", "hf")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """The training data and how it is cut into samples."""

    source: str = "embedded"
    """`embedded` (the text shipped with Python), `files` (local text/JSONL) or `hf` (HF datasets)."""
    path: str = ""
    """For `files`: a file or directory; for `hf`: a dataset name or local path."""
    text_field: str = "text"
    """For JSONL and HF datasets: the field that holds the text."""
    sequence_length: int = 128
    """Tokens per training sample."""

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"source must be one of {', '.join(DATA_SOURCES)}, got {self.source!r}")
        if self.source != "embedded" and not self.path:
            raise ValueError(f"path is required when source is {self.source!r}")
        if not 1 <= self.sequence_length <= 65536:
            raise ValueError(f"sequence_length must be between 1 and 65536, got {self.sequence_length}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """The optimizer and its learning-rate schedule, counted in global steps."""

    name: str = "adamw"
    """`adamw` or `sgd`."""
    learning_rate: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    warmup_steps: int = 10
    """Global steps of linear warm-up."""
    total_steps: int = 10_000
    """Global steps of the whole schedule (cosine decay after warm-up)."""
    max_grad_norm: float = 1.0
    """The global norm each step's gradient (the swarm's average, or a step's own) is clipped to before the
    optimizer takes it; 0: no clipping. Bounds what one accepted bad part can do to the weights and to Adam's
    second moments (a 1e6-scaled gradient would make every later update tiny for thousands of steps)."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"name must be 'adamw' or 'sgd', got {self.name!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must not be negative, got {self.weight_decay}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps must be between 0 and total_steps, got {self.warmup_steps}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be 0 (no clipping) or positive, got {self.max_grad_norm}")


AGGREGATION_RULES = ("mean", "trimmed_mean", "centered_clip")
"""The values of `averaging.aggregation` (crowdtrain.averaging.robust)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSpec:
    """How the swarm trains: the training mode, whose own settings are in its section ([diloco], [spes],
    [skippipe])."""

    mode: str = DEFAULT_MODE
    """`gradients` (DeDLOC: average gradients every global step), `parameters` (Moshpit SGD: local steps, then
    average parameters), `diloco`, `spes` or `skippipe` (docs/modes/)."""

    def __post_init__(self) -> None:
        if self.mode not in TRAINING_MODES:
            raise ValueError(f"mode must be {' or '.join(map(repr, TRAINING_MODES))}, got {self.mode!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingSpec:
    """How peers average, in every mode that averages: Moshpit groups, the wire encoding, timeouts, the rule."""

    group_size: int = 16
    """Peers per all-reduce group (M in Moshpit SGD)."""
    grid_dims: int = 2
    """Dimensions of the Moshpit grid (d): exact average after d rounds for M^d peers."""
    compression: str = "fp16"
    """Tensor encoding on the wire: `fp16` or `none`."""
    timeout_s: float = 20.0
    """Abandon an averaging round after this many seconds."""
    matchmaking_time_s: float = 5.0
    """Seconds spent gathering a group before an averaging round starts."""
    aggregation: str = "mean"
    """How each all-reduce chunk is aggregated from the group's parts: `mean` (weighted by samples, each weight
    at most the target batch), or the Byzantine-robust `trimmed_mean` or `centered_clip`. Malformed, non-finite
    and outsized parts are dropped under every rule (crowdtrain.averaging.robust)."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_RULES:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATION_RULES)}, got {self.aggregation!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if not 1 <= self.grid_dims <= 8:
            raise ValueError(f"grid_dims must be between 1 and 8, got {self.grid_dims}")
        if self.compression not in ("fp16", "none"):
            raise ValueError(f"compression must be 'fp16' or 'none', got {self.compression!r}")
        if not self.timeout_s > 0 or not self.matchmaking_time_s > 0:
            raise ValueError(
                f"timeout_s and matchmaking_time_s must be positive, got {self.timeout_s}, {self.matchmaking_time_s}"
            )
        if self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two (Moshpit grid keys are bits), got {self.group_size}")


EXPERT_ARCHITECTURES = ("ffn",)
UID_PREFIX_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
MAX_EXPERTS_PER_LAYER = 65536


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Decentralized Mixture-of-Experts: chosen FFNs become a gate over a grid of experts hosted by peers."""

    grid: tuple[int, ...] = (4, 4)
    """The expert grid's size per dimension; each DMoE layer has its own grid of prod(grid) experts."""
    layers: tuple[int, ...] = ()
    """Decoder layers (0-based) whose FFN becomes a DMoE layer; empty: every layer."""
    expert: str = "ffn"
    """Expert architecture: `ffn` (Linear, GELU, Linear on each token)."""
    expert_hidden_size: int = 128
    """Hidden units inside one expert."""
    k: int = 2
    """Experts each sequence is sent to: the k best live ones by the gate's scores."""
    k_min: int = 1
    """A forward pass fails unless at least this many experts answer."""
    forward_timeout_s: float = 10.0
    """An expert's forward answer later than this many seconds is dropped from the mixture."""
    backward_timeout_s: float = 10.0
    """An expert's backward answer later than this many seconds is dropped (its gradient counts as zero)."""
    timeout_after_k_min_s: float = 1.0
    """Once k_min experts answered, wait at most this many seconds for the others."""
    uid_prefix: str = "ffn"
    """Names the experts' kind in their uids `<run>-<uid_prefix><layer>.<i>.<j>`."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.grid) <= 4 or not all(1 <= size <= 256 for size in self.grid):
            raise ValueError(f"grid must have 1 to 4 dimensions of 1 to 256 experts each, got {list(self.grid)}")
        if math.prod(self.grid) > MAX_EXPERTS_PER_LAYER:
            raise ValueError(f"grid must hold at most {MAX_EXPERTS_PER_LAYER} experts, got {math.prod(self.grid)}")
        if len(set(self.layers)) != len(self.layers) or any(layer < 0 or layer > 1023 for layer in self.layers):
            raise ValueError(f"layers must be distinct layer indices from 0 to 1023, got {list(self.layers)}")
        if self.expert not in EXPERT_ARCHITECTURES:
            raise ValueError(f"expert must be one of {', '.join(EXPERT_ARCHITECTURES)}, got {self.expert!r}")
        if not 1 <= self.expert_hidden_size <= 65536:
            raise ValueError(f"expert_hidden_size must be between 1 and 65536, got {self.expert_hidden_size}")
        if not 1 <= self.k <= math.prod(self.grid):
            raise ValueError(f"k must be between 1 and the grid's {math.prod(self.grid)} experts, got {self.k}")
        if not 1 <= self.k_min <= self.k:
            raise ValueError(f"k_min must be between 1 and k ({self.k}), got {self.k_min}")
        timeouts = (self.forward_timeout_s, self.backward_timeout_s, self.timeout_after_k_min_s)
        if not all(timeout > 0 for timeout in timeouts):
            raise ValueError(
                "forward_timeout_s, backward_timeout_s and timeout_after_k_min_s must be positive, "
                f"got {', '.join(f'{timeout:g}' for timeout in timeouts)}"
            )
        if not UID_PREFIX_PATTERN.fullmatch(self.uid_prefix):
            raise ValueError(
                f"uid_prefix must be a letter then up to 31 letters, digits, '_' or '-', got {self.uid_prefix!r}"
            )
