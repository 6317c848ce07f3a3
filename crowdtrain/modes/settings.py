"""What each training mode reads of a run file: its sections, and how they must fit the rest of the run.

The manifest checks every run against `MODE_SETTINGS`; each mode's own section lives in its sub-package
(`modes/<mode>/settings.py`). This module and those belong to the manifest's layer: torch-free, importing nothing
above it, so the manifest can import them (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crowdtrain import proto
from crowdtrain.modes.diloco.settings import check_diloco_section
from crowdtrain.modes.skippipe.settings import check_skippipe_run, stage_detail, stages_summary
from crowdtrain.modes.spes.settings import check_spes_run, owned_experts_detail

if TYPE_CHECKING:
    from crowdtrain.manifest import RunManifest


def _fits(manifest: RunManifest) -> None:
    """A mode with no section of its own fits any run that passes the manifest's own checks."""


def _check_spes_run(manifest: RunManifest) -> None:
    check_diloco_section(manifest)
    check_spes_run(manifest)


RunSummarizer = Callable[["RunManifest", Sequence[proto.TrainingStatus]], tuple[dict[str, Any], str, bool]]


@dataclass(frozen=True, slots=True)
class ModeSettings:
    """What one training mode reads of a run file."""

    sections: tuple[str, ...] = ()
    """The run file's mode sections this mode reads (RunManifest fields of the same name); any other is refused."""
    check: Callable[[RunManifest], None] = _fits
    """Raises ValueError with one sentence when the run's other sections don't fit this mode."""
    run_summary: RunSummarizer | None = None
    """What `status` shows of a run of this mode beside what every run shows (a JSON object under the mode's name,
    a line, whether all is well), from the manifest and the peers' training statuses; None: nothing more."""
    peer_detail: Callable[[proto.TrainingStatus], str] | None = None
    """What `status`'s mode cell adds for a peer of this mode, from its training status (", owns 4/32 experts");
    None: nothing."""


MODE_SETTINGS: dict[str, ModeSettings] = {
    "gradients": ModeSettings(),
    "parameters": ModeSettings(),
    "diloco": ModeSettings(sections=("diloco",), check=check_diloco_section),
    "spes": ModeSettings(sections=("diloco", "spes"), check=_check_spes_run, peer_detail=owned_experts_detail),
    "skippipe": ModeSettings(
        sections=("skippipe",), check=check_skippipe_run, run_summary=stages_summary, peer_detail=stage_detail
    ),
}
"""Each value of `training.mode` (one per class in modes/registry.py's MODES) and what it reads of a run file."""

TRAINING_MODES = tuple(MODE_SETTINGS)
DEFAULT_MODE = TRAINING_MODES[0]
"""The mode of a run file that names none."""
MODE_SECTIONS = tuple(dict.fromkeys(section for mode in MODE_SETTINGS.values() for section in mode.sections))
"""Every mode's section of a run file, in the order the modes list them."""
SUMMARIZED_MODES = tuple(name for name, mode in MODE_SETTINGS.items() if mode.run_summary is not None)
"""The modes whose runs `status --json` shows an object of their own for (null for a run of another mode)."""


def check_mode_sections(manifest: RunManifest) -> None:
    """The run's mode sections are those its training mode reads, and fit the rest of the run: raises ValueError
    with one sentence when they do not."""
    mode = manifest.training.mode
    settings = MODE_SETTINGS[mode]
    for section in MODE_SECTIONS:
        if getattr(manifest, section) is not None and section not in settings.sections:
            readers = " or ".join(repr(name) for name, other in MODE_SETTINGS.items() if section in other.sections)
            raise ValueError(f"a [{section}] section needs training.mode = {readers}, not {mode!r}")
    settings.check(manifest)
