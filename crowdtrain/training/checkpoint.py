"""Checkpoints of a node's training state: written atomically, the last K kept, corrupt ones skipped.

A checkpoint is one torch file `epoch-<N>.pt` holding the model and optimizer state, the local
epoch and the parameter shapes; a SHA-256 of its bytes sits beside it in `epoch-<N>.pt.sha256`, so a
truncated or bit-flipped file is detected before torch reads it. A state holding a NaN or an infinity (weights or
optimizer moments) is never written, and a checkpoint holding one is refused at load: a node whose weights a
poisoned step ruined would otherwise keep them across a restart.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crowdtrain.files import ChecksumError, read_checksummed, remove_checksummed, write_atomically, write_checksummed

logger = logging.getLogger(__name__)

_NAME = re.compile(r"epoch-(\d{8})\.pt")


class CheckpointError(ValueError):
    """A checkpoint that can't be used (corrupt, truncated, for another model, not finite), or a state that can't
    be saved (not finite)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint."""

    epoch: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    path: Path


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The model's schema: every state tensor's name and shape."""
    return _shapes(model.state_dict())


def save_checkpoint(
    directory: Path, epoch: int, model: torch.nn.Module, optimizer_state: dict[str, Any], keep: int
) -> Path:
    """Write epoch-<epoch>.pt atomically with its checksum, then delete all but the newest `keep`."""
    return write_checkpoint(directory, epoch, model.state_dict(), optimizer_state, keep=keep)


def write_checkpoint(
    directory: Path,
    epoch: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    *,
    keep: int,
    write_file: Callable[[Path, bytes | memoryview], None] | None = None,
) -> Path:
    """Write epoch-<epoch>.pt of these states atomically with its checksum, then delete all but the newest
    `keep`. `write_file` (default: an atomic write with fsync) is a seam for tests. On an error the older
    checkpoints are untouched; a state that is not finite is CheckpointError, and nothing is written."""
    unfit = _not_finite(model_state) or _not_finite(optimizer_state)
    if unfit is not None:
        raise CheckpointError(f"the state of epoch {epoch} holds NaN or infinite values ({unfit}): not saved")
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    payload = {"epoch": epoch, "model": model_state, "optimizer": optimizer_state, "shapes": _shapes(model_state)}
    torch.save(payload, buffer)
    data = buffer.getbuffer()  # a view, not a copy: the bytes of a real model's state are a gigabyte
    path = directory / f"epoch-{epoch:08d}.pt"
    write_checksummed(path, data, write_file or write_atomically)
    for old in list_checkpoints(directory)[:-keep]:
        remove_checksummed(old)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if _NAME.fullmatch(path.name))


def load_checkpoint(path: Path, model: torch.nn.Module) -> Checkpoint:
    """Read and verify one checkpoint against its checksum and the model's shapes."""
    try:
        data = read_checksummed(path)
    except ChecksumError as e:
        raise CheckpointError(f"checkpoint {e}") from None
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} can't be read by torch: {e}") from None
    if payload.get("shapes") != parameter_shapes(model):
        raise CheckpointError(f"checkpoint {path} is for a model of another shape")
    unfit = _not_finite(payload["model"]) or _not_finite(payload["optimizer"])
    if unfit is not None:
        raise CheckpointError(f"checkpoint {path} holds NaN or infinite values ({unfit}), so it is not used")
    return Checkpoint(
        epoch=int(payload["epoch"]), model_state=payload["model"], optimizer_state=payload["optimizer"], path=path
    )


def load_latest_checkpoint(directory: Path, model: torch.nn.Module) -> Checkpoint | None:
    """The newest usable checkpoint; unusable newer ones are reported and skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, model)
        except CheckpointError as e:
            logger.warning(f"{e}; trying the previous checkpoint")
    return None


def remove_temporaries(directory: Path) -> None:
    """Delete what writes cut short (by a crash or a kill) left staged in `directory`."""
    for path in directory.glob(".epoch-*.tmp"):
        path.unlink(missing_ok=True)


def _not_finite(state: Any, name: str = "") -> str | None:
    """The name of the first floating-point tensor in `state` (nested dicts and lists, as a state_dict holds them)
    that holds a NaN or an infinity; None if none does."""
    if isinstance(state, torch.Tensor):
        finite = not state.is_floating_point() or bool(torch.isfinite(state).all())
        return None if finite else name or "a tensor"
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        found = _not_finite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in state.items()}
