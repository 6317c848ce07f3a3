"""A node's device clock (pure logic): the median seconds per microbatch, the wait for the lock left out, and when a
declared cost is declared again."""

from __future__ import annotations

import threading

import pytest
import torch

from crowdtrain.modes.skippipe.hops.device_clock import (
    COST_DRIFT,
    DEVICE_SAMPLES,
    MIN_DRIFT_S,
    MIN_SAMPLES,
    DeviceClock,
    drifted,
    finish_of,
)


def test_the_clock_gives_the_median_of_the_newest_samples_once_it_has_enough() -> None:
    clock = DeviceClock()
    for _ in range(MIN_SAMPLES - 1):
        clock.record(1.0)
    assert clock.median() is None and clock.median(at_least=1) == 1.0
    clock.record(50.0)  # one outlier (a first hold's warm-up) moves no median
    assert clock.median() == 1.0
    for _ in range(DEVICE_SAMPLES):
        clock.record(2.0)
    assert clock.median() == 2.0  # the older samples are gone
    clock.clear()
    assert clock.median(at_least=1) is None


def test_a_cost_is_declared_again_only_past_the_drift() -> None:
    clock = DeviceClock()
    for _ in range(MIN_SAMPLES):
        clock.record(1.0)
    assert clock.to_declare(1.0 / (1 + COST_DRIFT / 2)) is None  # a small swing: the roster stays
    assert clock.to_declare(0.7) == 1.0  # the device is slower than declared
    assert clock.to_declare(1.5) == 1.0  # or faster
    assert DeviceClock().to_declare(0.1) is None  # nothing timed yet
    assert drifted(1.0, 1.0 + 2 * COST_DRIFT) and not drifted(1.0, 1.0 + COST_DRIFT / 2)
    assert not drifted(0.002, 0.004)  # twice as long, but by milliseconds that move no schedule
    assert drifted(0.002, 0.002 + 2 * MIN_DRIFT_S)


def test_a_hold_is_timed_from_taking_the_lock_not_from_asking_for_it() -> None:
    lock, spent = threading.Lock(), []
    taken, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            taken.set()
            release.wait(10.0)

    thread = threading.Thread(target=holder)
    thread.start()
    taken.wait(10.0)
    threading.Timer(0.3, release.set).start()  # the other thread lets go 0.3 s after this one asks
    clock = DeviceClock()
    with clock.timed(lock, spent):
        pass
    thread.join(10.0)
    assert len(spent) == 1 and spent[0] < 0.1
    with pytest.raises(RuntimeError), clock.timed(lock, spent):
        raise RuntimeError("a hold that failed")
    assert len(spent) == 1 and not lock.locked()  # not counted, and let go


def test_a_hold_ends_when_the_device_has_finished_what_it_queued() -> None:
    """CUDA runs kernels after the call that queued them returns: a hold waits for them (`finish`), inside the lock."""
    lock, spent, finished_while_held = threading.Lock(), [], []

    def finish() -> None:  # a device still busy 0.1 s after the caller returned
        finished_while_held.append(lock.locked())
        threading.Event().wait(0.1)

    with DeviceClock(finish=finish).timed(lock, spent):
        pass
    assert finished_while_held == [True] and spent[0] >= 0.1
    assert finish_of(torch.device("cpu")) is None, "a CPU's work is done when the call returns"
    cuda = finish_of(torch.device("cuda", 1))  # not called: this machine may have no GPU
    assert cuda is not None and cuda.func is torch.cuda.synchronize and cuda.args == (torch.device("cuda", 1),)
