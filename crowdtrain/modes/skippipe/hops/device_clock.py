"""What a node's device costs per microbatch, as its iterations find it: the cost a SkipPipe node should publish.

A node measures its stage once at start (`SkipPipeMode._measure_stage`: one forward and backward on an idle
node). Its device in a running swarm is another: it shares its cores with the node's own exchange in the
background, a GPU's first steps differ from its steady ones, a laptop throttles. The WAN lab's trace found the
devices held 1.2-1.5x as long as their nodes had published, and the scheduler, costing each node at its
published figure, gave the fast source too many microbatches (BENCHMARKS.md, "SkipPipe's hops traced").

So each node times the holds of its model lock (`DeviceClock.timed`: from taking it to letting it go, so a device
slower than its caller counts whole and the wait for the lock does not) per microbatch it computes. On a GPU a hold
first waits for the kernels it queued (`finish_of`): CUDA runs them after the call that queued them returns, and a
hold that ended there would time the launches, not the device. One sample is a visit of its stage (a forward and
its backward, `StageService`), or a source's microbatch (its three holds: stage 0 forward, head and loss with their
backward, stage 0's backward, `PipelineDriver`). `DeviceClock.median` is the median of
the last DEVICE_SAMPLES; `to_declare` says when a published cost is far enough from it (`drifted`) to publish it
again. The leader's next roster then schedules the node at it (`membership.follow_cost`).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

DEVICE_SAMPLES = 32
"""Microbatches the median is over: the newest ones."""
MIN_SAMPLES = 8
"""Microbatches timed before a median is given (a first hold includes the allocator's warm-up)."""
COST_DRIFT = 0.2
"""A published cost is published again when the device's median differs from it by more than this share"""
MIN_DRIFT_S = 0.005
"""and by more than this many seconds: a few milliseconds more or less move no schedule (a tiny model's costs swing
by more than COST_DRIFT from one median to the next)."""
FOLLOW_EVERY_S = 60.0
"""A node declares its cost again at most this often (each new figure is a new roster)."""


class DeviceClock:
    """The seconds this node's device was held per microbatch, over the last DEVICE_SAMPLES (thread-safe)."""

    def __init__(self, keep: int = DEVICE_SAMPLES, finish: Callable[[], None] | None = None) -> None:
        self._samples: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.finish = finish
        """Waits for the device to finish what was queued on it (`finish_of`); None where a call's return means it
        has."""

    @contextmanager
    def timed(self, lock: AbstractContextManager[object], spent: list[float]) -> Iterator[None]:
        """Hold `lock`; append to `spent` the seconds from having taken it to having let it go, the device's queued
        work done (`finish`). A hold that raised is not counted."""
        with lock:
            began = time.perf_counter()
            yield
            if self.finish is not None:
                self.finish()
        spent.append(time.perf_counter() - began)

    def record(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def median(self, at_least: int = MIN_SAMPLES) -> float | None:
        """The median seconds per microbatch; None before `at_least` were timed."""
        with self._lock:
            samples = list(self._samples)
        return statistics.median(samples) if len(samples) >= max(at_least, 1) else None

    def to_declare(self, declared: float) -> float | None:
        """The median to declare in place of the `declared` seconds per microbatch where they drifted from it by
        more than COST_DRIFT; None where they did not, or before MIN_SAMPLES were timed."""
        measured = self.median()
        return measured if measured is not None and drifted(declared, measured) else None

    def clear(self) -> None:
        """Forget the samples (the node serves another stage: its cost is another)."""
        with self._lock:
            self._samples.clear()


def finish_of(device: torch.device) -> Callable[[], None] | None:
    """What waits for `device` to finish the work queued on it: `torch.cuda.synchronize` on a CUDA device; None on
    others (a CPU's work is done when the call returns)."""
    return functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None


def drifted(published: float, measured: float, share: float = COST_DRIFT) -> bool:
    """Whether `measured` seconds differ from the `published` ones by more than `share` of them and MIN_DRIFT_S."""
    return abs(measured - published) > max(share * published, MIN_DRIFT_S)
