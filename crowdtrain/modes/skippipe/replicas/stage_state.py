"""A stage's state on one node: its parameters and AdamW's moments, taken from a replica, served, and kept true.

Replicas that summed the same gradients hold the same parameters and AdamW moments; a joining replica takes them
from one (`join`, `rpc_stage_state`), checked: the stage's exact number of float32 values, finite, second moments
not negative. A replica whose parameters drifted from the others' (`drift`) takes a replica's state the same way,
right after its step (`_adopt`). The state a replica serves (a joiner's download, drift repair) and the fingerprint
it sends are the true state's: with `overlap_exchange` the node computes on a look-ahead of it
(`gradient_exchange`), and keeps the true state beside it (`_keep_true`, `_restore_true`).
"""

from __future__ import annotations

import logging
import typing
from concurrent.futures import Future

import torch

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.hop_wire import HopFailedError
from crowdtrain.modes.skippipe.hops.stage_service import StageService

if typing.TYPE_CHECKING:
    from crowdtrain.modes.skippipe.replicas.gradient_exchange import Gathered

logger = logging.getLogger(__name__)

STATE_PARTS = 3
"""A stage's state for a joiner: its parameters, AdamW's first moments, its second moments."""
STATE_RATE_FLOOR = 500_000
"""Bytes per second a stage's state download is given time for at least (4 Mbit/s, a slow home uplink): the state
of one of a 25M-parameter model's 4 stages (6.3M parameters and two moments, float32) is 76 MB, 2.5 minutes at
this rate, where a fixed 30-s bound needed 20 Mbit/s and a joiner behind a slower replica never got in."""
STATE_TIMEOUT_FLOOR_S = 30.0


class StageState:
    """Takes, serves and keeps a `SkipPipeNode`'s stage state (see the module's doc); the node sets what it reads."""

    service: StageService
    parameters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    overlap_exchange: bool
    last_iteration: int
    _true: tuple[int, list[torch.Tensor]] | None
    _pending: tuple[int, Future[Gathered]] | None

    def state_timeout_s(self) -> float:
        """How long this stage's state may take to download (`state_timeout_s`)."""
        return state_timeout_s(STATE_PARTS * sum(parameter.numel() for parameter in self.parameters))

    def join(self, peer_id: str, timeout_s: float | None = None) -> int:
        """Take the stage's state from `peer_id`, a replica of it: parameters and AdamW moments, so that this node
        steps as the replica does from now on; the iteration to run next. HopFailedError if it is not had within
        `timeout_s` (default: what the state's size may take, `state_timeout_s`)."""
        header, values = self._fetch_state(peer_id, self.state_timeout_s() if timeout_s is None else timeout_s)
        self._load_state(header, values)
        self._pending = None  # its first step sums the others' gradients of the iteration it took the state of
        logger.info(f"took stage {self.service.stage}'s state of iteration {header.iteration} from {peer_id[-8:]}")
        return header.iteration + 1

    def _fetch_state(self, peer_id: str, timeout_s: float, since: int = 0) -> tuple[proto.StageHop, torch.Tensor]:
        numel = sum(parameter.numel() for parameter in self.parameters)
        header, values = self.service.fetch_state(peer_id, STATE_PARTS * numel, timeout_s, since=since)
        if bool((values[2 * numel :] < 0).any()):
            raise HopFailedError(f"peer {peer_id[-8:]} sent a stage state with negative second moments")
        return header, values

    def _load_state(self, header: proto.StageHop, values: torch.Tensor) -> None:
        """Make `values` (parameters, first moments, second moments) this node's stage state, of `header`'s
        iteration and optimizer steps (with overlap_exchange its true state too: no look-ahead until its next step)."""
        with self.service.model_lock:
            self._set_state(header.optimizer_steps, values)
            if self.overlap_exchange:
                self._keep_true()
        self.last_iteration = header.iteration

    def _set_state(self, steps: int, values: torch.Tensor, parameters: bool = True) -> None:
        """Make `values` (parameters, first moments, second moments) the stage's parameters (unless `parameters` is
        False) and AdamW's state after `steps` steps; the caller holds the model lock."""
        numel = sum(parameter.numel() for parameter in self.parameters)
        params, exp_avg, exp_avg_sq = values.split(numel)
        with torch.no_grad():
            offset = 0
            for parameter in self.parameters:
                count = parameter.numel()
                if parameters:
                    parameter.copy_(params[offset : offset + count].view_as(parameter))
                self.optimizer.state[parameter] = {
                    "step": torch.tensor(float(steps)),
                    "exp_avg": exp_avg[offset : offset + count].view_as(parameter).to(parameter.device, copy=True),
                    "exp_avg_sq": exp_avg_sq[offset : offset + count]
                    .view_as(parameter)
                    .to(parameter.device, copy=True),
                }
                offset += count

    def _state(self) -> tuple[int, int, torch.Tensor]:
        """(the last finished iteration, AdamW's steps, parameters then first then second moments), float32: with
        overlap_exchange the true state, not the look-ahead the node computes on."""
        if self._true is not None:
            steps, tensors = self._true
            return self.last_iteration, steps, torch.cat([tensor.reshape(-1).cpu() for tensor in tensors]).float()
        return self.last_iteration, *self._live_state()

    def _live_state(self) -> tuple[int, torch.Tensor]:
        """(AdamW's steps, the stage's parameters then first then second moments as they are now), float32."""
        parts: list[list[torch.Tensor]] = [[], [], []]
        steps = 0
        for parameter in self.parameters:
            state = self.optimizer.state.get(parameter, {})
            steps = int(state.get("step", 0))
            parts[0].append(parameter.detach().reshape(-1).cpu())
            for index, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                parts[index].append(state[key].reshape(-1).cpu() if key in state else torch.zeros(parameter.numel()))
        return steps, torch.cat([torch.cat(part) for part in parts]).float()

    def _keep_true(self) -> None:
        """With overlap_exchange: make the stage's state now (parameters and AdamW's) its true state, copied into
        the true state's tensors (allocated the first time). The caller holds the model lock."""
        steps, live = 0, [parameter.detach() for parameter in self.parameters]
        for key in ("exp_avg", "exp_avg_sq"):
            for parameter in self.parameters:
                state = self.optimizer.state.get(parameter, {})
                steps = int(state.get("step", 0))
                live.append(state[key] if key in state else torch.zeros_like(parameter))
        if self._true is None:
            self._true = (steps, [tensor.clone() for tensor in live])
        else:
            torch._foreach_copy_(self._true[1], live)
            self._true = (steps, self._true[1])

    def _restore_true(self, parameters: bool = True) -> None:
        """With overlap_exchange: make the true state the stage's parameters (unless `parameters` is False) and
        AdamW's state, copied in place. The caller holds the model lock."""
        assert self._true is not None
        steps, tensors = self._true
        count = len(self.parameters)
        with torch.no_grad():
            if parameters:
                torch._foreach_copy_([parameter.detach() for parameter in self.parameters], tensors[:count])
            for parameter, exp_avg, exp_avg_sq in zip(
                self.parameters, tensors[count : 2 * count], tensors[2 * count :], strict=True
            ):
                state = self.optimizer.state.get(parameter)
                if state and "exp_avg" in state and "exp_avg_sq" in state:
                    state["step"] = torch.tensor(float(steps))
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)
                else:
                    self.optimizer.state[parameter] = {
                        "step": torch.tensor(float(steps)),
                        "exp_avg": exp_avg.clone(),
                        "exp_avg_sq": exp_avg_sq.clone(),
                    }

    def true_parameters(self) -> list[torch.Tensor]:
        """The stage's parameters of its true state: the state its replicas agree on and its AdamW moments go with
        (with overlap_exchange the node computes on a look-ahead of them; the parameters otherwise)."""
        if self._true is None:
            return [parameter.detach() for parameter in self.parameters]
        return self._true[1][: len(self.parameters)]

    def _adopt(self, peer_id: str, iteration: int) -> str | None:
        """Take `peer_id`'s state of `iteration` (this node's drifted from it); `peer_id`, or None if it was not
        had (this node goes on with its own, and tries again when it next sees the drift)."""
        stage = self.service.stage
        try:
            header, values = self._fetch_state(peer_id, self.state_timeout_s(), since=iteration)
        except HopFailedError as e:
            logger.warning(f"stage {stage}'s replicas have drifted apart, and {e}: going on with this node's own")
            return None
        if header.iteration != iteration:
            logger.warning(
                f"stage {stage}'s replicas have drifted apart, but peer {peer_id[-8:]} sent its state of iteration "
                f"{header.iteration}, not {iteration}: going on with this node's own"
            )
            return None
        self._load_state(header, values)
        logger.warning(
            f"stage {stage}'s replicas had drifted apart (a gradient exchange was lost): took peer "
            f"{peer_id[-8:]}'s state of iteration {iteration}"
        )
        return peer_id


def state_timeout_s(num_values: int) -> float:
    """How long a download of `num_values` float32 values of a stage's state may take: STATE_TIMEOUT_FLOOR_S, and
    the time the bytes take at STATE_RATE_FLOOR."""
    return STATE_TIMEOUT_FLOOR_S + 4 * num_values / STATE_RATE_FLOOR
