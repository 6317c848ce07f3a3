"""Checkpoints off the training path: a snapshot taken between steps, written by one background thread.

The training thread asks `CheckpointSchedule` whether a checkpoint is due (a wall-clock interval), copies
the state with `take_snapshot` (memory bandwidth only: a fraction of a second per gigabyte) and hands the
copy to `CheckpointWriter`, whose thread serialises, hashes, writes and rotates it with `write_checkpoint`.
At most one snapshot is in flight: one that finds the previous still being written is dropped, so memory
never holds more than one copy of the state besides the live one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crowdtrain.files import write_atomically
from crowdtrain.training.checkpoint import CheckpointError, remove_temporaries, write_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSnapshot:
    """A copy of a node's training state on the CPU that nothing else changes: safe to write from a thread."""

    epoch: int
    """The global epoch (number of optimizer steps) the state is at."""
    model_state: dict[str, torch.Tensor]
    """The model's state_dict, its tensors copied."""
    optimizer_state: dict[str, Any]
    """The optimizer's state_dict, its tensors copied."""

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must not be negative, got {self.epoch}")


def take_snapshot(
    epoch: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> CheckpointSnapshot:
    """Copy the states' tensors to the CPU, so training may change the originals as soon as this returns.

    Tensors that share memory (tied weights) stay shared in the copy. CUDA tensors are copied to pinned
    memory without blocking, then the devices are synchronised once.
    """
    copier = _Copier()
    snapshot = CheckpointSnapshot(
        epoch=epoch, model_state=copier.copy(model_state), optimizer_state=copier.copy(optimizer_state)
    )
    for device in copier.cuda_devices:
        torch.cuda.synchronize(device)
    return snapshot


class CheckpointSchedule:
    """Whether a periodic checkpoint is due: once `interval_s` passed since the start or the last one."""

    def __init__(self, *, interval_s: float, clock: Callable[[], float] = time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s, self._clock = interval_s, clock
        self._last_s = clock()

    def is_due(self) -> bool:
        """True once the interval has passed since the start or the last `restart`."""
        return self._clock() - self._last_s >= self.interval_s

    def restart(self) -> None:
        """A checkpoint was taken now: the next one is due an interval from now."""
        self._last_s = self._clock()


class CheckpointWriter:
    """One background thread writing the snapshots handed to it, one at a time: atomic, checksummed, the
    last `keep` kept. A failed write is one WARNING line; the older checkpoints stay as they were."""

    def __init__(
        self,
        *,
        directory: Path,
        keep: int,
        write_file: Callable[[Path, bytes | memoryview], None] = write_atomically,
    ):
        """`write_file` writes one file atomically; a seam for tests."""
        if keep < 1:
            raise ValueError(f"keep must be positive, got {keep}")
        self.directory, self.keep, self._write_file = directory, keep, write_file
        self.num_written = 0
        """Checkpoints written so far."""
        self.num_failed = 0
        """Writes that failed (and were logged)."""
        self._condition = threading.Condition()
        self._pending: CheckpointSnapshot | None = None
        self._busy = False
        self._closing = False
        with contextlib.suppress(OSError):  # a directory we can't clean is reported by the first write
            remove_temporaries(directory)
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a snapshot is being written (a `submit` now would be dropped)."""
        with self._condition:
            return self._busy

    def submit(self, snapshot: CheckpointSnapshot) -> bool:
        """Hand `snapshot` to the writer thread and return at once; False (the snapshot dropped) while the
        previous one is still being written."""
        with self._condition:
            assert not self._closing, "submit after close"
            if self._busy:
                logger.debug(
                    f"skipped the checkpoint of epoch {snapshot.epoch}: the previous one is still being written"
                )
                return False
            self._pending, self._busy = snapshot, True
            self._condition.notify_all()
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no write is in flight; False if one still is after `timeout_s`."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._busy, timeout_s)

    def close(self, final: CheckpointSnapshot | None, *, timeout_s: float) -> bool:
        """Wait for the write in flight, write `final` (if any) and stop the thread, all within `timeout_s`.
        Past it, warn and give up: the write goes on in the background until done or the process exits,
        which leaves the older checkpoints intact. True when everything finished in time."""
        deadline_s = time.monotonic() + timeout_s
        finished = self.wait_idle(timeout_s)
        if finished and final is not None:
            self.submit(final)
            finished = self.wait_idle(max(0.0, deadline_s - time.monotonic()))
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        if not finished:
            what = "the final checkpoint" if final is not None else "the checkpoint in flight"
            logger.warning(f"gave up waiting for {what}: writing it took longer than {timeout_s:g} s")
            return False
        self._thread.join(max(0.0, deadline_s - time.monotonic()))
        return True

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending is not None or self._closing)
                snapshot, self._pending = self._pending, None
            if snapshot is None:
                return
            self._write(snapshot)
            del snapshot  # free the copy before waiting for the next one
            with self._condition:
                self._busy = False
                self._condition.notify_all()

    def _write(self, snapshot: CheckpointSnapshot) -> None:
        started_s = time.monotonic()
        try:
            path = write_checkpoint(
                self.directory,
                snapshot.epoch,
                snapshot.model_state,
                snapshot.optimizer_state,
                keep=self.keep,
                write_file=self._write_file,
            )
        except CheckpointError as e:
            self.num_failed += 1
            logger.warning(f"{e}; training goes on and the older checkpoints are kept")
        except OSError as e:
            self.num_failed += 1
            logger.warning(
                f"could not write the checkpoint of epoch {snapshot.epoch} to {self.directory}: {e.strerror or e}; "
                "training goes on and the older checkpoints are kept"
            )
        except Exception:
            self.num_failed += 1  # a bug, not the disk: keep the traceback, and keep training
            logger.exception(f"could not write the checkpoint of epoch {snapshot.epoch}")
        else:
            self.num_written += 1
            logger.info(f"wrote checkpoint {path.name} in {time.monotonic() - started_s:.1f} s")


class _Copier:
    """Deep-copies a state_dict's containers and tensors to the CPU, keeping tensors that share memory shared."""

    def __init__(self) -> None:
        self.cuda_devices: set[torch.device] = set()
        self._copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value)
        if isinstance(value, dict):
            copied = type(value)((key, self.copy(item)) for key, item in value.items())
            if hasattr(value, "_metadata"):  # a module's state_dict: load_state_dict reads versions from it
                copied._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
            return copied
        if isinstance(value, list | tuple):
            return type(value)(self.copy(item) for item in value)
        return value  # numbers, strings, None: immutable

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if key in self._copies:
            return self._copies[key]
        if tensor.device.type == "cpu":
            copied = tensor.clone()
        elif tensor.device.type == "cuda":
            copied = torch.empty_like(tensor, device="cpu", pin_memory=True)
            copied.copy_(tensor, non_blocking=True)  # completed by take_snapshot's synchronize
            self.cuda_devices.add(tensor.device)
        else:
            copied = tensor.to("cpu", copy=True)
        self._copies[key] = copied
        return copied
