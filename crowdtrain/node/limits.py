"""What a volunteer's machine accepts from a run it joins: the volunteer decides, not the remote manifest.

A joiner learns the run's manifest from the DHT, where anyone can publish one. Before anything is read or
allocated, the manifest is checked against this node's own settings:
- it never reads a local path the manifest names (`data.path` of a `files` run, or a local `hf` dataset)
  unless the path is inside one of the node's `data_paths` (a manifest naming ~/.ssh would otherwise have
  this node train on, and send gradients of, the volunteer's private files);
- it never builds a model with more parameters than the node's `max_parameters`, or one whose training
  state (weights, gradients, optimizer moments) would not fit in the memory the machine has available.
A founder's own run file is the volunteer's own choice and is not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import RunManifest
from crowdtrain.models import load_tokenizer, spec_parameter_count

TRAINING_BYTES_PER_PARAMETER = 16
"""fp32 weights, gradients and two Adam moments: what training needs per parameter, at least."""


def check_remote_manifest(
    manifest: RunManifest, *, data_paths: Sequence[str], max_parameters: int, available_bytes: int | None
) -> None:
    """Raise BadInputError, one sentence, when the joined run asks for what this node does not give."""
    _check_data_path(manifest, data_paths)
    if manifest.model.tokenizer != "bytes":
        _check_allowed(manifest, "model.tokenizer", manifest.model.tokenizer, data_paths)
    num_parameters = spec_parameter_count(manifest.model, load_tokenizer(manifest.model).vocab_size)
    if num_parameters > max_parameters:
        raise BadInputError(
            f"Run {manifest.run_id!r} trains a model of {num_parameters:,} parameters; this node accepts at most "
            f"{max_parameters:,} (max_parameters); raise it in the node's config if this machine can take it."
        )
    needed = num_parameters * TRAINING_BYTES_PER_PARAMETER
    if available_bytes is not None and needed > available_bytes:
        raise BadInputError(
            f"Run {manifest.run_id!r} needs about {needed / 2**30:.1f} GiB to train its {num_parameters:,} "
            f"parameters, and this machine has {available_bytes / 2**30:.1f} GiB available."
        )


def _check_data_path(manifest: RunManifest, data_paths: Sequence[str]) -> None:
    data = manifest.data
    if data.source == "files" or (data.source == "hf" and Path(data.path).expanduser().exists()):
        _check_allowed(manifest, "data.path", data.path, data_paths)


def _check_allowed(manifest: RunManifest, setting: str, path: str, data_paths: Sequence[str]) -> None:
    wanted = Path(path).expanduser().resolve()
    for allowed in data_paths:
        root = Path(allowed).expanduser().resolve()
        if wanted == root or root in wanted.parents:
            return
    raise BadInputError(
        f"Run {manifest.run_id!r} asks this node to read the local path {path!r} ({setting}); a joiner reads only "
        "paths inside its data_paths setting: add the folder there if you meant to share it."
    )
