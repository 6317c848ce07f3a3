"""Training modes: how the peers of a run combine their work, behind one interface.

registry       MODES: each `training.mode` of the manifest and its TrainingMode class; the one place naming them all
settings       MODE_SETTINGS: what each mode reads of a run file (its sections, how they fit the run); the
               manifest's layer, torch-free
base           TrainingMode (the seam), ModeContext (what a mode is built from), SwarmView (a re-planning read)
progress       Progress: what a node reports of its training, whichever mode runs
compute        LocalCompute: the seconds this node spent computing, for its compute utilisation
collaborative  `gradients` (DeDLOC) and `parameters` (Moshpit SGD), both on hivemind.Optimizer
diloco/        `diloco`: inner steps alone, then pseudo-gradients averaged and one outer Nesterov step
spes/          `spes`: DiLoCo rounds over the dense parameters; each node trains and serves only the experts it owns
skippipe/      `skippipe`: stages on different nodes, microbatches along scheduled paths that skip and reorder them

Each mode's code lives in its module or sub-package, its run-file section in the sub-package's `settings.py`. A new
mode is one more TrainingMode subclass in `registry.MODES` and one entry in `settings.MODE_SETTINGS`; the manifest,
the daemon, the training loop and `status` do not change.

May import: `averaging`, `planning`, `links`, `moe`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`,
`errors`; a `settings` module only what the manifest may.
"""
