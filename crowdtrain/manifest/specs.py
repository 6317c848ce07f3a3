"""The run manifest's sections: the model, data, optimizer, averaging and each training mode's settings.

Each is a frozen dataclass validated in `__post_init__`; `RunManifest` (run.py) holds them and checks how they fit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

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


TRAINING_MODES = ("gradients", "parameters", "diloco", "spes", "skippipe")
"""The values of `training.mode`: one per training mode (crowdtrain.modes.MODES)."""
AGGREGATION_RULES = ("mean", "trimmed_mean", "centered_clip")
"""The values of `averaging.aggregation` (crowdtrain.averaging.robust)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSpec:
    """How the swarm trains: the training mode, whose own settings are in its section ([diloco], [spes],
    [skippipe])."""

    mode: str = "gradients"
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


MAX_FRAGMENTS = 64
"""The most fragments a streaming DiLoCo run may cut its parameters into."""
DILOCO_COMPRESSIONS = ("fp16", "int8", "topk", "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class DiLoCoSpec:
    """DiLoCo runs (`training.mode = "diloco"`): local inner steps, then an outer step on averaged pseudo-gradients."""

    inner_steps: int = 50
    """H: an outer round ends when the swarm has processed H global batches (`target_batch_size` samples each)
    in inner steps; each peer takes as many inner steps of its micro-batches as it manages meanwhile."""
    outer_learning_rate: float = 0.7
    """The outer Nesterov SGD's learning rate on the averaged pseudo-gradient (DiLoCo's default)."""
    outer_momentum: float = 0.9
    """The outer Nesterov SGD's momentum (DiLoCo's default)."""
    compression: str = "fp16"
    """Pseudo-gradients on the wire: `fp16`, `int8` (uniform 8-bit, per-part scale), `topk` (each tensor's largest
    `topk_fraction` of values in fp16 with their indices, the rest kept back and added to the next round: error
    feedback, crowdtrain.codecs.error_feedback) or `none`."""
    topk_fraction: float = 0.02
    """`topk` only: the fraction of each tensor's values a peer sends per round, in (0, 1]."""
    overlap: bool = True
    """Average a round's pseudo-gradients in the background while the next round's inner steps run, and apply
    the outer step when the average is in (one round late, as in overlapped and streaming DiLoCo); false: inner
    steps wait for the round's all-reduce."""
    min_inner_steps: int | None = None
    """Adaptive H (with `max_inner_steps`): the peers choose H from their measured compute and all-reduce times,
    so that a round's all-reduce costs at most 5% of its compute (modes/diloco/adaptive_h.py), starting from
    `inner_steps`, never below this. None (both): H stays `inner_steps`."""
    max_inner_steps: int | None = None
    """Adaptive H: the largest H the peers may agree on (see `min_inner_steps`)."""
    fragments: int = 1
    """Streaming DiLoCo: cut the parameters into this many fragments of consecutive layers (modes/diloco/fragments.py);
    an outer round then lasts H / fragments global batches and averages one fragment, in turn, so each fragment is
    still averaged every H global batches while a round sends (and with `overlap` holds in flight) 1/fragments of
    the model. 1: the whole model every round. H must be a multiple; not with adaptive H or `topk`."""

    def __post_init__(self) -> None:
        if not 1 <= self.inner_steps <= 1_000_000:
            raise ValueError(f"inner_steps must be between 1 and 1000000, got {self.inner_steps}")
        if not (math.isfinite(self.outer_learning_rate) and 0 < self.outer_learning_rate <= 10):
            raise ValueError(f"outer_learning_rate must be in (0, 10], got {self.outer_learning_rate}")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.compression not in DILOCO_COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(DILOCO_COMPRESSIONS)}, got {self.compression!r}")
        if not (math.isfinite(self.topk_fraction) and 0 < self.topk_fraction <= 1):
            raise ValueError(f"topk_fraction must be in (0, 1], got {self.topk_fraction}")
        if (self.min_inner_steps is None) != (self.max_inner_steps is None):
            raise ValueError("min_inner_steps and max_inner_steps go together (adaptive H), or neither")
        self._check_fragments()
        if self.min_inner_steps is not None and self.max_inner_steps is not None:
            if not 1 <= self.min_inner_steps <= self.inner_steps <= self.max_inner_steps <= 1_000_000:
                raise ValueError(
                    "adaptive H needs 1 <= min_inner_steps <= inner_steps <= max_inner_steps <= 1000000, got "
                    f"{self.min_inner_steps}, {self.inner_steps}, {self.max_inner_steps}"
                )

    def _check_fragments(self) -> None:
        if not 1 <= self.fragments <= MAX_FRAGMENTS:
            raise ValueError(f"fragments must be between 1 and {MAX_FRAGMENTS}, got {self.fragments}")
        if self.fragments == 1:
            return
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must be a multiple of fragments ({self.fragments}): "
                "each fragment is averaged every inner_steps global batches"
            )
        if self.min_inner_steps is not None or self.compression == "topk":
            raise ValueError("fragments > 1 works with a fixed H (no min_inner_steps) and fp16, int8 or none, not topk")

    @property
    def inner_steps_range(self) -> tuple[int, int]:
        """The H peers may agree on: (min, max), both `inner_steps` when H is fixed."""
        if self.min_inner_steps is None or self.max_inner_steps is None:
            return self.inner_steps, self.inner_steps
        return self.min_inner_steps, self.max_inner_steps


MAX_SPES_REPLICAS = 8
"""The most owners a SPES run may give each expert."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SPESSpec:
    """SPES runs (`training.mode = "spes"`): each node trains the dense parameters (averaged as in DiLoCo, with the
    [diloco] settings) and only the routed experts it owns; the others come from their owners every round."""

    merge_every: int = 0
    """M: every M inner steps, each owner pulls each of its experts toward its most similar experts (the
    expert-merging warm-up); 0: no warm-up."""
    merge_neighbours: int = 2
    """How many most similar experts (cosine similarity of their weights, same layer) an expert is pulled toward."""
    merge_alpha: float = 0.1
    """The pull's weight at the first inner step: θ ← (1 − α)·θ + α·mean(neighbours); it decays linearly to 0."""
    merge_warmup_steps: int = 500
    """The swarm's inner steps (global batches) over which α decays to 0; no merging after them."""
    replicas: int = 1
    """How many owners train each expert (as many as there are peers when fewer): each round's copy of the expert
    is the mean of theirs, so an owner that vanishes mid-round costs its experts that owner's share of the round,
    not the round. Each replica costs every owner the expert's gradients and moments and every node its fetch."""

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_SPES_REPLICAS:
            raise ValueError(f"replicas must be between 1 and {MAX_SPES_REPLICAS}, got {self.replicas}")
        if not 0 <= self.merge_every <= 1_000_000:
            raise ValueError(f"merge_every must be between 0 (no warm-up) and 1000000, got {self.merge_every}")
        if not 1 <= self.merge_neighbours <= 64:
            raise ValueError(f"merge_neighbours must be between 1 and 64, got {self.merge_neighbours}")
        if not (math.isfinite(self.merge_alpha) and 0 <= self.merge_alpha <= 1):
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if not 1 <= self.merge_warmup_steps <= 10_000_000:
            raise ValueError(f"merge_warmup_steps must be between 1 and 10000000, got {self.merge_warmup_steps}")


SKIPPIPE_WIRE_DTYPES = ("float16", "bfloat16", "float32")
SKIPPIPE_GRADIENT_DTYPES = ("bfloat16", "float32", "int8")
MAX_SKIPPIPE_STAGES = 64
SKIPPIPE_ARCHITECTURES = ("LlamaForCausalLM",)
"""Decoder LMs whose layers `models.stages.StagedModel` cuts into stages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SkipPipeSpec:
    """SkipPipe runs (`training.mode = "skippipe"`): the model's layers cut into stages held by different nodes;
    each microbatch visits stage 0 and a share of the others, in an order a scheduler picks
    (crowdtrain/modes/skippipe)."""

    stages: int = 4
    """S: stage 0 holds the embeddings, the first layers and the head; the layers are cut as evenly as they go."""
    skip_ratio: float = 0.25
    """k: the share of stages 1..S-1 each microbatch skips (SkipPipe trains the model to tolerate it), in [0, 1)."""
    reorder: bool = True
    """Whether a microbatch may visit its stages in another order than ascending (the node free first goes first)."""
    microbatches: int = 8
    """M: the whole swarm's microbatches per iteration; each stage steps its optimizer once per iteration."""
    wire_dtype: str = "float16"
    """How hidden states and their gradients travel between stages: `float16`, `bfloat16` or `float32`."""
    gradient_dtype: str = "bfloat16"
    """How a stage's replicas exchange their iteration's gradient: `bfloat16` (half of float32's bytes, float32's
    range; every replica sums the rounded values, so they stay bit-identical), `float32`, or `int8` (blocks of 4096
    values with a float32 scale each: a quarter of float32's bytes; what rounding leaves out of a replica's gradient
    is added to its next one). Not float16: a gradient's small values would underflow without a scale."""
    overlap_exchange: bool = False
    """Whether the replicas' gradient exchange runs during the next iteration instead of between the two, leaving
    the iteration's critical path (on home links it was a third of a SkipPipe iteration). The replicas' true state
    still takes every iteration's exact sum, one iteration later; meanwhile each replica computes on that state
    stepped by its own share of the gradient (a look-ahead, crowdtrain/modes/skippipe/replicas/gradient_exchange.py)."""

    def __post_init__(self) -> None:
        if not 2 <= self.stages <= MAX_SKIPPIPE_STAGES:
            raise ValueError(f"stages must be between 2 and {MAX_SKIPPIPE_STAGES}, got {self.stages}")
        if not (math.isfinite(self.skip_ratio) and 0 <= self.skip_ratio < 1):
            raise ValueError(f"skip_ratio must be in [0, 1), got {self.skip_ratio}")
        if not 1 <= self.microbatches <= 4096:
            raise ValueError(f"microbatches must be between 1 and 4096, got {self.microbatches}")
        if self.wire_dtype not in SKIPPIPE_WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {', '.join(SKIPPIPE_WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if self.gradient_dtype not in SKIPPIPE_GRADIENT_DTYPES:
            raise ValueError(
                f"gradient_dtype must be one of {', '.join(SKIPPIPE_GRADIENT_DTYPES)}, got {self.gradient_dtype!r}"
            )


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
