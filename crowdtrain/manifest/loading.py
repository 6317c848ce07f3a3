"""Run files: TOML that extends a preset (`preset = "NAME"`, `demo` when it names none) and names only what
differs; and a preset printed as a complete run file to start from (`crowdtrain preset NAME`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from crowdtrain.errors import BadInputError
from crowdtrain.manifest.presets import PRESETS, preset_manifest, preset_summaries
from crowdtrain.manifest.run import RunManifest
from crowdtrain.structured import FieldError, from_mapping

logger = logging.getLogger(__name__)


def preset_run_file(name: str) -> str:
    """The preset `name` as a complete TOML run file to start from: `preset = "NAME"`, then all its tables."""
    if name not in PRESETS:
        raise BadInputError(f"Unknown preset {name!r} (presets: {', '.join(PRESETS)}).")
    tables = _as_plain_dict(PRESETS[name]())
    del tables["protocol_version"]  # the running crowdtrain's: a copied number would refuse the next release
    del tables["created_at"]  # stamped by the founder
    header = f"# {name}: {preset_summaries()[name]}\n# Keep `preset`, change what differs and delete the rest.\n\n"
    return header + tomli_w.dumps({"preset": name, **_without_none(tables)})


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: a None field is left out, so it loads back as the preset's own None.

    `model.config` is kept whole: a file's config replaces the preset's, so nothing in it may be left out."""
    return {
        key: _without_none(value) if isinstance(value, dict) and key != "config" else value
        for key, value in table.items()
        if value is not None
    }


def load_run_file(name_or_path: str, *, run_id: str | None = None) -> RunManifest:
    """Resolve `--run-file`: a preset name, or a TOML file extending the preset it names (`demo` by default)."""
    if name_or_path in PRESETS:
        manifest = PRESETS[name_or_path]()
        try:
            return manifest if run_id is None else dataclasses.replace(manifest, run_id=run_id)
        except ValueError as e:
            raise BadInputError(f"Invalid --run-id: {e}.") from None
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise BadInputError(
            f"--run-file {name_or_path} is neither a file nor a preset (presets: {', '.join(PRESETS)})."
        )
    try:
        overrides = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"Cannot read run file {path}: {getattr(e, 'strerror', None) or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInputError(f"Run file {path} is not valid TOML: {e}.") from None
    if run_id is not None:
        overrides["run_id"] = run_id
    try:
        return manifest_from_overrides(overrides)
    except FieldError as e:
        raise BadInputError(f"Run file {path} is invalid: {e}.") from None


def manifest_from_overrides(overrides: Mapping[str, Any]) -> RunManifest:
    """Layer a run file's tables over the preset its `preset` key names (`demo` when it names none); raises
    FieldError naming the field. `preset` itself is no manifest field: it only chooses the base."""
    tables = _renamed_mode(dict(overrides))
    preset = tables.pop("preset", "demo")
    base = _as_plain_dict(preset_manifest(preset))
    model = tables.get("model")
    architecture = base["model"]["architecture"]
    if isinstance(model, Mapping) and model.get("architecture", architecture) != architecture:
        if "config" not in model:
            raise FieldError(f"model.config is required when model.architecture differs from the {preset} preset's")
        base["model"]["config"] = {}
    return from_mapping(RunManifest, _merge(base, tables))


def _renamed_mode(tables: dict[str, Any]) -> dict[str, Any]:
    """A run file written before `training.mode` named the mode `averaging.mode`: it is read as `training.mode`,
    with one line saying what to write instead."""
    averaging = tables.get("averaging")
    if not isinstance(averaging, Mapping) or "mode" not in averaging:
        return tables
    training = tables.get("training", {})
    if isinstance(training, Mapping) and "mode" in training:
        raise FieldError("averaging.mode is the old name of training.mode: set the mode once, as training.mode")
    mode = averaging["mode"]
    logger.warning(f"run file: averaging.mode is now training.mode; write [training] mode = {mode!r} instead")
    averaging = {key: value for key, value in averaging.items() if key != "mode"}
    training = {**training, "mode": mode} if isinstance(training, Mapping) else training
    return {**tables, "averaging": averaging, "training": training}


def _as_plain_dict(manifest: RunManifest) -> dict[str, Any]:
    return copy.deepcopy(dataclasses.asdict(manifest))


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge tables, except that `model.config` given in the file replaces the preset's."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and key != "config":
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged
