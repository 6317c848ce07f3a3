"""DiLoCo's settings: the run file's [diloco] section (also the dense part of a SPES run), and how it fits the run.

Torch-free and importing nothing above the manifest: the manifest reads it (modes/settings.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crowdtrain.manifest import RunManifest

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


def check_diloco_section(manifest: RunManifest) -> None:
    """A run's [diloco] section fits its averaging: raises ValueError with one sentence when it does not."""
    diloco = manifest.diloco
    if diloco is not None and diloco.compression == "topk" and manifest.averaging.aggregation != "mean":
        # a robust rule sees each peer's top-k values as outliers against the others' zeros: it drops them
        raise ValueError(
            f"diloco.compression 'topk' needs averaging.aggregation 'mean', not {manifest.averaging.aggregation!r}"
        )
