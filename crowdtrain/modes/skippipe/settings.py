"""SkipPipe's settings: the run file's [skippipe] section, what a SkipPipe run needs of its model and optimizer, and
what `status` says of a SkipPipe run (its stages and their replicas).

Torch-free and importing nothing above the manifest: the manifest reads it (modes/settings.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crowdtrain import proto

if TYPE_CHECKING:
    from crowdtrain.manifest import RunManifest

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


def skippipe_spec(manifest: RunManifest) -> SkipPipeSpec:
    """A SkipPipe run's settings: its [skippipe] section, or the defaults."""
    return manifest.skippipe if manifest.skippipe is not None else SkipPipeSpec()


def check_skippipe_run(manifest: RunManifest) -> None:
    """A SkipPipe run's model and optimizer are ones it can cut into stages and step per stage: raises ValueError
    with one sentence when they are not."""
    if manifest.moe is not None:
        raise ValueError("a SkipPipe run cuts a dense decoder into stages: it can't have a [moe] section (DMoE)")
    if manifest.model.architecture not in SKIPPIPE_ARCHITECTURES:
        raise ValueError(
            f"a SkipPipe run needs model.architecture {' or '.join(SKIPPIPE_ARCHITECTURES)}, "
            f"not {manifest.model.architecture!r}"
        )
    stages, layers = skippipe_spec(manifest).stages, manifest.model.config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < stages:
        raise ValueError(f"a SkipPipe run of {stages} stages needs model.config.num_hidden_layers >= {stages}")
    if manifest.optimizer.name != "adamw":
        raise ValueError(
            "a SkipPipe run keeps each stage's AdamW state to repair drift and look ahead: "
            f"optimizer.name must be 'adamw', not {manifest.optimizer.name!r}"
        )


def stages_summary(
    manifest: RunManifest, trainings: Sequence[proto.TrainingStatus]
) -> tuple[dict[str, Any], str, bool]:
    """What `status` shows of a SkipPipe run from its manifest and its nodes' training statuses: the JSON object (the
    stages, the skip ratio and order in force, how many nodes serve each stage, how a stage's replicas exchange
    their gradients), its line under the run's, and whether every stage is served (a stage no node serves is
    skipped by every microbatch)."""
    spec = skippipe_spec(manifest)
    replicas = [0] * spec.stages
    for training in trainings:
        if training.HasField("skippipe_stage") and training.skippipe_stage < spec.stages:
            replicas[training.skippipe_stage] += 1
    summary = {
        "stages": spec.stages,
        "skip_ratio": spec.skip_ratio,
        "reorder": spec.reorder,
        "replicas": replicas,
        "gradient_dtype": spec.gradient_dtype,
        "overlap_exchange": spec.overlap_exchange,
    }
    order = ", reordered" if spec.reorder else ""
    exchange = f", gradients in {spec.gradient_dtype}" + (" overlapped" if spec.overlap_exchange else "")
    line = (
        f"{spec.stages} stages (replicas {'/'.join(map(str, replicas))}), skipping {spec.skip_ratio:.0%}"
        f"{order}{exchange}"
    )
    return summary, line, min(replicas) > 0


def stage_detail(training: proto.TrainingStatus) -> str:
    """`status`'s mode cell for a SkipPipe node: the stage it serves and its iteration."""
    if not training.HasField("skippipe_stage"):
        return ""
    return f", stage {training.skippipe_stage}, iteration {training.skippipe_iteration}"
