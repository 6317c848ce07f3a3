"""Training modes: how the peers of a run combine their work, behind one interface.

base           TrainingMode (the seam), ModeContext (what a mode is built from), SwarmView (a re-planning read)
progress       Progress: what a node reports of its training, whichever mode runs
compute        LocalCompute: the seconds this node spent computing, for its compute utilisation
collaborative  `gradients` (DeDLOC) and `parameters` (Moshpit SGD), both on hivemind.Optimizer
diloco/        `diloco`: inner steps alone, then pseudo-gradients averaged and one outer Nesterov step
spes/          `spes`: DiLoCo rounds over the dense parameters; each node trains and serves only the experts it owns
skippipe/      `skippipe`: stages on different nodes, microbatches along scheduled paths that skip and reorder them

Each mode's code lives in its module or sub-package; only this registry names them all. A new mode is one more
TrainingMode subclass registered in MODES and a value of the manifest's `training.mode`; the daemon and the
training loop do not change.

May import: `averaging`, `planning`, `links`, `moe`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`,
`errors`.
"""

from __future__ import annotations

from crowdtrain.manifest import RunManifest
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.collaborative import GradientsMode, ParametersMode
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.skippipe.mode import SkipPipeMode
from crowdtrain.modes.spes.mode import SPESMode

MODES: dict[str, type[TrainingMode]] = {
    mode.name: mode for mode in (GradientsMode, ParametersMode, DiLoCoMode, SPESMode, SkipPipeMode)
}


def mode_class(manifest: RunManifest) -> type[TrainingMode]:
    """The training mode a run's manifest names (the manifest's own validation admits only these)."""
    return MODES[manifest.training.mode]


__all__ = [
    "MODES",
    "DiLoCoMode",
    "GradientsMode",
    "ModeContext",
    "ParametersMode",
    "SPESMode",
    "SkipPipeMode",
    "SwarmView",
    "TrainingMode",
    "mode_class",
]
