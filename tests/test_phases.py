"""Where the time of a global step goes: the phase accumulator and the round-stage split."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hivemind.averaging.control import AveragingStage

from crowdtrain.averaging.phases import Phase, PhaseAccumulator, PhaseTimes, wait_for_round
from crowdtrain.dht.records import MAX_PHASE_SECONDS


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- the accumulator ---------------------------------------------------------------------------


def test_phases_sum_until_the_step_completes_then_start_afresh() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    assert phases.last is None
    phases.add(Phase.COMPUTE, 1.5)
    phases.add(Phase.COMPUTE, 0.5)
    phases.add(Phase.STATE_DOWNLOAD, 3.0)
    completed = phases.complete_step()
    assert completed == PhaseTimes(compute_s=2.0, state_download_s=3.0) == phases.last
    assert phases.complete_step() == PhaseTimes()


def test_nested_measurements_count_each_second_once() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    with phases.measure(Phase.WAIT):  # hivemind's step(): 10 s in all
        clock.advance(1.0)
        with phases.measure(Phase.OPTIMIZER_STEP):  # the global step: 8 s in all
            clock.advance(0.5)
            phases.add(Phase.MATCHMAKING, 2.0)  # measured by the round's stage, as the clock moved on
            phases.add(Phase.ALLREDUCE, 3.0)
            clock.advance(5.0)
            with phases.measure(Phase.STATE_AVERAGING):
                clock.advance(2.0)
                phases.add(Phase.OPTIMIZER_STEP, 0.25)  # the torch step, timed by its hooks
            clock.advance(0.5)
        clock.advance(1.0)
    times = phases.complete_step()
    assert times.matchmaking_s == 2.0 and times.allreduce_s == 3.0
    assert times.state_averaging_s == pytest.approx(1.75)
    assert times.optimizer_step_s == pytest.approx(0.25 + 0.5 + 0.5)
    assert times.wait_s == pytest.approx(2.0)
    assert sum(times.by_phase().values()) == pytest.approx(10.0)


def test_a_measurement_counts_even_when_the_block_raises() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    with pytest.raises(RuntimeError), phases.measure(Phase.STATE_DOWNLOAD):
        clock.advance(4.0)
        raise RuntimeError("no peer had the state")
    assert phases.complete_step().state_download_s == 4.0


def test_negative_durations_count_as_zero() -> None:
    phases = PhaseAccumulator(FakeClock())
    phases.add(Phase.COMPUTE, -1.0)
    assert phases.complete_step().compute_s == 0.0


def test_phase_times_refuse_negative_or_nan_and_describe_themselves() -> None:
    with pytest.raises(ValueError, match="compute_s"):
        PhaseTimes(compute_s=-0.1)
    with pytest.raises(ValueError, match="wait_s"):
        PhaseTimes(wait_s=float("nan"))
    times = PhaseTimes(compute_s=3.14, wait_s=0.2, allreduce_s=1.4, optimizer_step_s=0.01)
    assert times.describe() == "compute 3.1 s, wait 0.2 s, allreduce 1.4 s"
    assert times.to_json()["compute"] == 3.14 and set(times.to_json()) == {phase.value for phase in Phase}
    assert PhaseTimes.from_proto(times.to_proto()) == times
    assert PhaseTimes(compute_s=1e9).to_proto().compute_s == MAX_PHASE_SECONDS  # clamped to what readers accept


# --- the matchmaking / all-reduce split --------------------------------------------------------


@dataclass
class FakeRound:
    """A StepControl whose averager process moves through `stages`, one per poll."""

    clock: FakeClock
    stages: list[AveragingStage]
    poll_s: float = 1.0
    began_allreduce: bool = False
    polls: list[float] = field(default_factory=list)
    cancelled: bool = False

    @property
    def stage(self) -> AveragingStage:
        return self.stages[0] if self.stages else AveragingStage.FINISHED

    def done(self) -> bool:
        return not self.stages

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.polls.append(self.clock())
        self.clock.advance(self.poll_s)
        self.stages.pop(0)
        if self.stage == AveragingStage.RUNNING_ALLREDUCE:
            self.began_allreduce = True
        if self.stages:
            raise TimeoutError
        return None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_the_wait_for_a_round_splits_by_the_stage_the_averager_reports() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    looking, running = AveragingStage.LOOKING_FOR_GROUP, AveragingStage.RUNNING_ALLREDUCE
    control = FakeRound(clock, [looking, looking, looking, running, running])
    wait_for_round(control, phases, timeout_s=60.0)
    times = phases.complete_step()
    assert (times.matchmaking_s, times.allreduce_s) == (2.0, 3.0)  # the last poll ends with the round done


def test_a_retried_round_counts_its_new_matchmaking_as_matchmaking() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    looking, running = AveragingStage.LOOKING_FOR_GROUP, AveragingStage.RUNNING_ALLREDUCE
    control = FakeRound(clock, [looking, running, running, looking, looking, running])
    wait_for_round(control, phases, timeout_s=60.0)
    times = phases.complete_step()
    assert (times.matchmaking_s, times.allreduce_s) == (2.0, 4.0)


def test_the_wait_for_a_round_gives_up_at_its_timeout() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    control = FakeRound(clock, [AveragingStage.LOOKING_FOR_GROUP] * 100)
    wait_for_round(control, phases, timeout_s=5.0)
    assert len(control.polls) == 5 and phases.complete_step().matchmaking_s == 5.0


def test_a_rounds_compute_utilisation_and_bytes_reach_the_status_message() -> None:
    from crowdtrain.modes.progress import Progress

    progress = Progress(mode="diloco", compression="int8", inner_steps=8, inner_step=2)
    assert progress.training_status() is None  # no round completed yet
    progress.complete_round(compute_s=9.0, wall_s=10.0, bytes_sent=1234)
    message = progress.training_status()
    assert message is not None
    assert (message.mode, message.compression, message.inner_step, message.inner_steps) == ("diloco", "int8", 2, 8)
    assert message.round_bytes_sent == 1234 and message.compute_utilisation == pytest.approx(0.9)
    progress.complete_round(compute_s=12.0, wall_s=10.0, bytes_sent=0)  # clocks of two threads: never over 1
    assert progress.compute_utilisation == 1.0


def test_a_round_still_looking_for_its_group_is_cancelled_once_the_caller_gives_up_and_not_while_reducing() -> None:
    clock = FakeClock()
    phases = PhaseAccumulator(clock)
    looking, running = AveragingStage.LOOKING_FOR_GROUP, AveragingStage.RUNNING_ALLREDUCE
    control = FakeRound(clock, [looking] * 100)
    assert not wait_for_round(control, phases, timeout_s=60.0, give_up=lambda: clock() >= 103.0)
    assert control.cancelled and len(control.polls) == 3 and phases.complete_step().matchmaking_s == 3.0
    # a round already reducing with its group is waited for: the give-up is about finding one
    control = FakeRound(clock, [looking, running, running, running])
    assert wait_for_round(control, phases, timeout_s=60.0, give_up=lambda: clock() >= 104.0)
    assert not control.cancelled and control.done()
