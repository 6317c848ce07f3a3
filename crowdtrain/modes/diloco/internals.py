"""What DiLoCoMode's mixins (joining.py, overlap.py) read and call on the mode: their methods take a `self` of this
protocol, so the type checker follows them and checks DiLoCoMode against it wherever they are called."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from hivemind.averaging.control import StepControl

from crowdtrain.averaging.progress_bounds import BoundedProgressTracker
from crowdtrain.codecs.error_feedback import ErrorFeedback
from crowdtrain.modes.base import ModeContext
from crowdtrain.modes.diloco.fragments import Fragments
from crowdtrain.modes.diloco.pseudo_gradients import PseudoGradientAverager

if TYPE_CHECKING:
    from crowdtrain.modes.diloco.overlap import _RoundInFlight


class DiLoCoInternals(Protocol):
    """DiLoCoMode's state and steps, as its mixins see them (modes/diloco/mode.py documents each)."""

    context: ModeContext
    tracker: BoundedProgressTracker
    averager: PseudoGradientAverager
    round: int
    samples: int
    inner_steps: int
    num_local_rounds: int
    diverged: bool
    parameters: list[torch.nn.Parameter]
    global_parameters: list[torch.Tensor]
    outer_optimizer: torch.optim.SGD
    feedback: ErrorFeedback | None
    fragments: Fragments
    round_gathered: dict[str, Any]
    _lock: threading.Lock
    _in_flight: _RoundInFlight | None
    _sync_not_before: float
    _catching_up_until: float
    _catch_up_round: int | None
    _catch_up_tries: int
    _said_left_behind: bool
    _said_waiting_for_state: bool
    _resync: bool
    _resync_tries: int
    _alone_round: int | None

    @property
    def training_round(self) -> int: ...

    @property
    def round_fragment(self) -> int: ...

    @property
    def fragment_members(self) -> tuple[int, ...]: ...

    def _rank(self) -> float: ...

    def _stepped_alone(self) -> None: ...

    def _priority(self) -> float: ...

    def _passed_by_the_swarm(self, round_: int) -> bool: ...

    def _catching_up(self) -> bool: ...

    def _enter_round(self, outer_round: int) -> None: ...

    def _note_catch_up(self) -> None: ...

    def _left_without_state(self) -> None: ...

    def _take_round_batches(self, value: Any) -> None: ...

    def _finish_round_in_flight(self, wait: bool = False) -> None: ...

    def _round_gathered(self, control: StepControl, round_: int, timeout: float) -> dict[Any, Any] | None: ...

    def _note_round(self, gathered: dict[Any, Any], allreduce_s: float) -> None: ...

    def _pseudo_gradients(self, on_cpu: bool = True) -> Iterator[torch.Tensor]: ...

    def _outer_step(self, ends: list[torch.Tensor] | None = None) -> None: ...

    def _gather(self) -> Any: ...

    def _begin_round(self) -> None: ...
