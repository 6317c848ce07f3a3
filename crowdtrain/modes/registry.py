"""The training modes by name: the one place that names every mode's class (`training.mode` of the manifest)."""

from __future__ import annotations

from crowdtrain.manifest import RunManifest
from crowdtrain.modes.base import TrainingMode
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


__all__ = ["MODES", "mode_class"]
