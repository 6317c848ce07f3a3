"""A DiLoCo round averaged in the background (`overlap`): the next round's inner steps go on meanwhile, and the outer
step lands when the average is in, with the replica moved by what the step moved the round's end point.

A mixin of DiLoCoMode (modes/diloco/mode.py).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from hivemind.averaging.control import StepControl

from crowdtrain.averaging.phases import Phase, wait_for_round
from crowdtrain.codecs.error_feedback import Kept

if TYPE_CHECKING:
    from crowdtrain.modes.diloco.internals import DiLoCoInternals

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RoundInFlight:
    """An outer round whose all-reduce runs in the background (`overlap`)."""

    control: StepControl
    round: int
    """The round it averages (the applied round then, `DiLoCoMode.round`)."""
    pseudo_gradients: list[torch.Tensor]
    """Δ = θ₀ − θ_end of the round's fragment's tensors, this peer's own, as it was at the round's end (float32, on
    the parameters' devices)."""
    kept: list[Kept] | None
    """top-k: what was sent of each tensor (its residual is committed once the round is averaged)."""
    started: float
    """time.monotonic() when its all-reduce started."""


class OverlappedRounds:
    """DiLoCoMode's rounds in flight (see the module's doc)."""

    _in_flight: _RoundInFlight | None

    def _start_round_in_flight(self: DiLoCoInternals, kept: list[Kept] | None) -> None:
        """Start the round's all-reduce in the background; the next round's inner steps begin now."""
        timeout = self.context.manifest.averaging.timeout_s
        with torch.no_grad():
            pseudo_gradients = list(self._pseudo_gradients(on_cpu=False))
        started = time.monotonic()
        control = self.averager.step(weight=float(self.samples), gather=self._gather(), timeout=timeout, wait=False)
        self._in_flight = _RoundInFlight(control, self.round, pseudo_gradients, kept, started)
        self.samples = 0
        self._begin_round()
        self.tracker.update_epoch(self.round + 1)

    def _finish_round_in_flight(self: DiLoCoInternals, wait: bool = False) -> None:
        """Apply the outer step of the round in flight, with its average or, when it failed, this peer's own Δ;
        then move the replica by what the step moved the round's end point. `wait`: block until the round is
        done (at most the averaging timeout), else it must be done already."""
        flight = self._in_flight
        assert flight is not None, "no round in flight"
        timeout = self.context.manifest.averaging.timeout_s
        gathered: dict[Any, Any] | None = None
        passed = functools.partial(self._passed_by_the_swarm, flight.round)
        if (
            wait
            and not flight.control.done()
            and not wait_for_round(flight.control, self.context.phases, timeout, passed, stop=self.context.stop)
        ):
            logger.warning(f"outer round {flight.round} found no group before the swarm moved on to round "
                           f"{self.tracker.global_epoch}: not averaged")  # fmt: skip
        else:
            gathered = self._round_gathered(flight.control, flight.round, timeout)
        averaged = gathered is not None
        if gathered is not None:
            self._note_round(gathered, time.monotonic() - flight.started)
        self._in_flight = None
        with self.tracker.pause_updates(), torch.no_grad():
            if averaged and flight.kept is not None:
                assert self.feedback is not None, "only top-k keeps something back"
                self.feedback.commit(iter(flight.pseudo_gradients), flight.kept)
            if not averaged:
                with self.averager.get_tensors() as buffers:
                    own = (delta.cpu() for delta in flight.pseudo_gradients)
                    self.fragments.write(buffers, self.round_fragment, own)
                    if self.feedback is not None:
                        self.feedback.flush_(buffers)
                self.num_local_rounds += 1
                self._stepped_alone()  # the others stepped without this peer: take their state next
            starts = [self.global_parameters[index] for index in self.fragment_members]
            ends = [start - delta for start, delta in zip(starts, flight.pseudo_gradients, strict=True)]
            with self.context.phases.measure(Phase.OPTIMIZER_STEP):
                self._outer_step(ends)
        self.averager.state_sharing_priority = self._priority()
        # numbered as without overlap: the round the outer step made (the epoch status shows)
        logger.info(f"outer round {self.round}: {'averaged with the swarm' if averaged else 'alone'} "
                    f"in the background, {self.inner_steps} inner steps so far")  # fmt: skip
