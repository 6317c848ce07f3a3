"""The terminal's progress bar of the current global batch (off for JSON logs and non-terminals)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn


class GlobalBatchBar:
    """Samples the swarm has accumulated toward the target batch, with epoch, loss and throughput."""

    def __init__(self, *, enabled: bool, target: int):
        self.enabled, self.target = enabled, target
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> GlobalBatchBar:
        if self.enabled:
            self._bar = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.completed:.0f}/{task.total:.0f} samples · {task.fields[peers]} peers"),
                TextColumn("· loss {task.fields[loss]} · {task.fields[rate]:.1f} samples/s here"),
                console=Console(stderr=True),
                transient=True,
                redirect_stderr=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("global batch", total=self.target, epoch=0, peers=1, loss="?", rate=0.0)
        return self

    def update(self, progress: Any, swarm_samples: int, num_peers: int) -> None:
        if self._bar is None:
            return
        loss = "?" if progress.loss is None else f"{progress.loss:.3f}"
        self._bar.update(
            self._task,
            completed=min(swarm_samples, self.target),
            epoch=progress.epoch,
            peers=num_peers,
            loss=loss,
            rate=progress.samples_per_second,
        )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
