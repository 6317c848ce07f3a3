"""Where the time of a global step goes: per-phase seconds, accumulated by the training thread and hivemind's hooks.

Every phase is time the training process spent *blocked* in it, measured where it is spent: the trainer times
forward/backward, `collaboration.hivemind_optimizer.CrowdtrainOptimizer` the phases inside hivemind.Optimizer.
Work that overlaps training (a parameter-averaging round hivemind runs in the background) shows in no phase.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Protocol

from hivemind.averaging.control import AveragingStage

from crowdtrain import proto
from crowdtrain.dht.records import MAX_PHASE_SECONDS
from crowdtrain.rpc.service import NodeStopping

ROUND_POLL_S = 0.005
"""How often the wait for a gradient round reads the round's stage: the error of the matchmaking/all-reduce split."""


class Phase(enum.Enum):
    """A phase of a global step; the value is its name in status JSON, log lines and metrics."""

    COMPUTE = "compute"
    WAIT = "wait"
    MATCHMAKING = "matchmaking"
    ALLREDUCE = "allreduce"
    STATE_AVERAGING = "state_averaging"
    OPTIMIZER_STEP = "optimizer_step"
    STATE_DOWNLOAD = "state_download"


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTimes:
    """Seconds the training process spent in each phase of one global step (from the previous one to it)."""

    compute_s: float = 0.0
    """Forward and backward passes of this node's micro-batches, s."""
    wait_s: float = 0.0
    """In hivemind's step() while the swarm fills the batch, outside every phase below: accumulating
    gradients, reporting progress, scheduling rounds, and holding the step for a peer that downloads the
    swarm's state (state/catch_up.py), s."""
    matchmaking_s: float = 0.0
    """Waiting for the gradient round's group, from the step's trigger until the group is found, s."""
    allreduce_s: float = 0.0
    """Waiting for the gradient round's all-reduce, from the group found until its result arrived, s."""
    state_averaging_s: float = 0.0
    """Waiting for a parameter-averaging round the step ran in line (gradients mode, every few epochs):
    matchmaking and all-reduce as one, since hivemind drives that round from its own thread, s."""
    optimizer_step_s: float = 0.0
    """The torch optimizer's step and hivemind's bookkeeping around the global step, s."""
    state_download_s: float = 0.0
    """Downloading the swarm's state (load_state_from_peers) to catch up, s."""

    def __post_init__(self) -> None:
        for field in fields(self):
            seconds = getattr(self, field.name)
            if not seconds >= 0:  # also refuses NaN
                raise ValueError(f"{field.name} must be a non-negative number of seconds, got {seconds}")

    def by_phase(self) -> dict[Phase, float]:
        """Seconds per phase, in the order of `Phase`."""
        return {phase: getattr(self, _field_name(phase)) for phase in Phase}

    def to_json(self) -> dict[str, float]:
        """Phase name -> seconds, as `crowdtrain status --json` shows it."""
        return {phase.value: seconds for phase, seconds in self.by_phase().items()}

    def describe(self) -> str:
        """Compact, for a log line: the phases that took any time, e.g. "compute 3.1 s, allreduce 1.4 s"."""
        parts = [f"{phase.value} {seconds:.1f} s" for phase, seconds in self.by_phase().items() if seconds >= 0.05]
        return ", ".join(parts) or "all phases under 0.05 s"

    def to_proto(self) -> proto.PhaseTimes:
        """The PeerStatus message, each value clamped to what readers accept (MAX_PHASE_SECONDS)."""
        clamped = {field.name: min(getattr(self, field.name), MAX_PHASE_SECONDS) for field in fields(self)}
        return proto.PhaseTimes(**clamped)

    @classmethod
    def from_proto(cls, message: proto.PhaseTimes) -> PhaseTimes:
        """From a peer's status, which the record validation has checked (finite, within the cap)."""
        return cls(**{field.name: getattr(message, field.name) for field in fields(cls)})

    @classmethod
    def from_phases(cls, seconds: dict[Phase, float]) -> PhaseTimes:
        return cls(**{_field_name(phase): value for phase, value in seconds.items()})


def _field_name(phase: Phase) -> str:
    return f"{phase.value}_s"


class PhaseAccumulator:
    """Sums the seconds of each phase until the step completes; thread-safe (hivemind steps the optimizer from
    its own thread). `clock` is injected so tests need no sleeps."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(Phase, 0.0)
        self._total_added = 0.0
        self.last: PhaseTimes | None = None
        """The phases of the last completed global step; None until one completed."""

    def add(self, phase: Phase, seconds: float) -> None:
        """Count `seconds` (clamped at 0: clocks are monotonic, but a caller's difference may not be) to `phase`."""
        seconds = max(seconds, 0.0)
        with self._lock:
            self._seconds[phase] += seconds
            self._total_added += seconds

    def seconds(self, phase: Phase) -> float:
        """The seconds counted to `phase` in the step under way."""
        with self._lock:
            return self._seconds[phase]

    @contextmanager
    def measure(self, phase: Phase) -> Iterator[None]:
        """Count the time the block takes to `phase`, less what the block counted to phases of its own (so
        nested measurements never count a second twice)."""
        started, added_before = self.clock(), self._added()
        try:
            yield
        finally:
            self.add(phase, self.clock() - started - (self._added() - added_before))

    def complete_step(self) -> PhaseTimes:
        """Close the current global step: its phases become `last`, and the next step starts from zero."""
        with self._lock:
            completed = PhaseTimes.from_phases(self._seconds)
            self._seconds = dict.fromkeys(Phase, 0.0)
        self.last = completed
        return completed

    def _added(self) -> float:
        with self._lock:
            return self._total_added


class RoundControl(Protocol):
    """What `wait_for_round` reads of a hivemind StepControl (a future shared with the averager process)."""

    @property
    def stage(self) -> AveragingStage: ...

    @property
    def began_allreduce(self) -> bool: ...

    def done(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def cancel(self) -> bool: ...


def wait_for_round(
    control: RoundControl,
    phases: PhaseAccumulator,
    timeout_s: float,
    give_up: Callable[[], bool] | None = None,
    poll_s: float = ROUND_POLL_S,
    stop: threading.Event | None = None,
) -> bool:
    """Wait until an averaging round is done or `timeout_s` passed, counting each poll interval to matchmaking
    or all-reduce by the stage the averager process reports at its end; a retry's new matchmaking counts as
    matchmaking again. `give_up`: asked at each poll while the round looks for its group; once it says so, the
    round is cancelled and False returned (else True). `stop`: the node's stop event; once it is set the round
    is cancelled and NodeStopping raised, so a Ctrl-C never waits out a round (up to the averaging timeout)."""
    deadline = phases.clock() + timeout_s
    previous = phases.clock()
    while not control.done() and previous < deadline:
        if stop is not None and stop.is_set():
            control.cancel()
            raise NodeStopping("the node is stopping: the averaging round under way was cancelled")
        if give_up is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP and give_up():
            control.cancel()
            return False
        try:
            control.exception(timeout=poll_s)
        except (TimeoutError, CancelledError):
            pass  # not done yet, or cancelled: the loop's condition decides
        now = phases.clock()
        running = control.stage == AveragingStage.RUNNING_ALLREDUCE
        in_allreduce = running or (control.done() and control.began_allreduce)
        phases.add(Phase.ALLREDUCE if in_allreduce else Phase.MATCHMAKING, now - previous)
        previous = now
    return True
