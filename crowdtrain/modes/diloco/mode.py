"""`diloco`: each peer trains alone for a while, then the swarm averages pseudo-gradients and takes one outer step.

DiLoCo (Douillard et al.), peer to peer: every peer keeps the round's global parameters θ₀ and takes inner
AdamW steps on its own micro-batches. A round ends when the swarm has processed H global batches (hivemind's
progress tracker counts the samples every peer reports, so fast peers take more inner steps than slow ones);
then each peer's pseudo-gradient θ₀ − θ is averaged in Moshpit groups (exact, plan-partitioned, robustly
aggregated, compressed on the wire) and every peer applies the same outer Nesterov SGD step to θ₀ and starts
the next round from it. Communication: one model-sized all-reduce per H global batches, instead of one per
global batch in `gradients` mode.

With `compression = "topk"` each peer sends only the largest `topk_fraction` of each tensor's pseudo-gradient
and keeps the rest in a residual added to the next round's (error feedback, codecs/error_feedback.py); the
residual is saved in checkpoints and dropped when the peer takes the swarm's state.

With `overlap` (the default) the all-reduce runs in the background: at a round's end the peer writes its
pseudo-gradient Δ = θ₀ − θ_end into the averager's buffers, starts the round's all-reduce and goes straight on
with the next round's inner steps from θ_end. When the average is in (checked before each micro-batch; at the
latest at the next round's end, which waits for it), the outer step makes θ₀' from θ₀ and the average, and
the peer's replica is moved by what the step moved its round's end point: θ ← θ₀' + (θ − θ_end). The outer
update is one round late, as in the overlapped and streaming DiLoCo variants, and compute never waits for the
network unless a round takes longer than the next round's inner steps. A round that fails is applied with
this peer's own Δ, as without overlap. It costs one model-sized copy (Δ, kept until the average is in).

A joiner, or a peer whose round failed while the swarm has others, downloads θ₀, the outer momentum and the
round from a peer (verified, state/download.py) before its next micro-batch (a round still in
flight is applied first). With overlap the donor's newest round is usually still being averaged; a state one or
two rounds behind the swarm's is followed by another download a second later, and the node joins the rounds
once the donors have moved on (CATCH_UP_RETRY_S). `crowdtrain status` shows the inner step of H, the bytes of the
last round and the compute utilisation.

With `min_inner_steps` and `max_inner_steps` set, H adapts (modes/diloco/adaptive_h.py): each peer proposes the H
that keeps its last all-reduce within 5% of a round's compute, the proposals travel in the round's gathered
data, and every member of the group takes the same H (their lower median) from the next round it starts. A
joiner takes the H in force with the swarm's state.

With `fragments` F > 1 (Streaming DiLoCo, modes/diloco/fragments.py) the parameters are cut into F fragments of
consecutive layers, a round lasts H / F global batches and averages one fragment, round r fragment r mod F, whose
pseudo-gradient θ₀ − θ spans its last F rounds; the outer step moves that fragment's θ₀ (and momentum) only, and its
replica restarts from (or, with overlap, is re-based on) it, while the other fragments' inner steps go on. Each
fragment is still averaged every H global batches; a round sends, and holds in flight, 1/F of the model. A round's
weight is the samples of that round, the same share of each peer's span as its rounds'.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from hivemind.averaging.control import StepControl

from crowdtrain.averaging.groups import chunk_timeout_s, join_request_timeout_s, moshpit_bits, refresh_groups
from crowdtrain.averaging.partition import EXPECTED_ROUND_FAILURES
from crowdtrain.averaging.phases import Phase, wait_for_round
from crowdtrain.averaging.progress_bounds import BoundedProgressTracker, ProgressBounds
from crowdtrain.averaging.traffic import AggregationSettings
from crowdtrain.codecs.compression import codec_for
from crowdtrain.codecs.error_feedback import ErrorFeedback, Kept
from crowdtrain.collaboration.factory import keep_sigint_handler
from crowdtrain.dht.records import epoch_ceiling
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import DiLoCoSpec
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.diloco.adaptive_h import agreed_round_batches, proposed_round_batches
from crowdtrain.modes.diloco.fragments import Fragments
from crowdtrain.modes.diloco.joining import RoundSync
from crowdtrain.modes.diloco.overlap import OverlappedRounds, _RoundInFlight
from crowdtrain.modes.diloco.pseudo_gradients import MAX_GATHERED, OuterState, PseudoGradientAverager, gathered_round
from crowdtrain.modes.progress import Progress
from crowdtrain.optimizer import build_optimizer, set_scheduled_learning_rate
from crowdtrain.state.template import StateTemplate, parameter_specs

logger = logging.getLogger(__name__)


class DiLoCoMode(RoundSync, OverlappedRounds, TrainingMode):
    """DiLoCo behind the training-mode seam (see the module's doc)."""

    name = "diloco"

    def __init__(self, context: ModeContext):
        super().__init__(context)
        manifest = context.manifest
        self.spec = manifest.diloco if manifest.diloco is not None else DiLoCoSpec()
        self.parameters = self._synchronised_parameters()
        try:
            self.fragments = Fragments.split([parameter.shape for parameter in self.parameters], self.spec.fragments)
        except ValueError as e:
            raise BadInputError(f"This run's diloco.fragments doesn't fit its model: {e}.") from None
        self.round, self.samples, self.inner_steps, self.num_local_rounds = 0, 0, 0, 0
        self.diverged = False
        self.round_group: list[str] | None = None
        """The peers (base58, sorted) whose pseudo-gradients the last outer round averaged; None when it was not
        averaged (alone, failed) or none ended yet."""
        self.round_gathered: dict[str, Any] = {}
        """What each member of the last averaged round gathered (`_gather`), by peer (base58); unchecked."""
        self._in_flight: _RoundInFlight | None = None
        self._sync_not_before = 0.0
        self._catching_up_until = 0.0  # while later: the last state taken was one round behind the swarm's
        self._catch_up_round: int | None = None  # the round of the first such state
        self._catch_up_tries = 0
        self._said_left_behind = False
        self._said_waiting_for_state = False
        self._resync = False
        """This peer's θ₀ differed from its group's in its last averaged round: take a state, corroborated (a member
        lying about its digest must not make honest peers take its state unchecked)."""
        self._resync_tries = 0
        self._lock = threading.Lock()  # the outer state, between the training thread and a joiner's request
        with torch.no_grad():
            self.global_parameters = [parameter.detach().clone().float() for parameter in self.parameters]
        self.outer_optimizer = torch.optim.SGD(
            self.global_parameters,
            lr=self.spec.outer_learning_rate,
            momentum=self.spec.outer_momentum,
            nesterov=self.spec.outer_momentum > 0,
        )
        self.inner_optimizer = build_optimizer(self.parameters, manifest.optimizer)
        self.codec = codec_for(self.spec.compression)
        self.feedback: ErrorFeedback | None = None
        if self.codec.error_feedback:
            self.feedback = ErrorFeedback([parameter.shape for parameter in self.parameters], self.spec.topk_fraction)
        self.round_batches = self.spec.inner_steps
        """H in force: global batches per outer round (the manifest's, or as the peers last agreed)."""
        self._next_round_batches: int | None = None  # agreed, from the next round this peer starts
        self._proposal = self.spec.inner_steps  # what this peer proposes in the data its next round gathers
        self._seconds_per_batch = math.nan  # of the last round's inner steps
        self._round_started_at = time.monotonic()
        run_prefix = f"crowdtrain-{manifest.run_id}_diloco"
        averaging = manifest.averaging
        with keep_sigint_handler():
            self.averager = PseudoGradientAverager(
                [torch.zeros(shape, dtype=torch.float32) for shape in self.fragments.buffer_shapes()],
                dht=context.dht,
                prefix=run_prefix,
                target_group_size=averaging.group_size,
                initial_group_bits=moshpit_bits(
                    context.peer_id, [status.peer_id for status in context.swarm.statuses], averaging
                ),
                min_matchmaking_time=averaging.matchmaking_time_s,
                request_timeout=join_request_timeout_s(averaging),
                allreduce_timeout=averaging.timeout_s,
                next_chunk_timeout=chunk_timeout_s(averaging),
                compression=self.codec.make(),
                client_mode=context.client_mode,
                partial_counter=context.partial_counter,
                traffic=context.traffic,
                aggregation=AggregationSettings(
                    rule=averaging.aggregation,
                    max_weight=float(manifest.target_batch_size * self.spec.inner_steps_range[1]),
                    sums=True,  # θ₀ − θ grows with the inner steps a peer took in the round
                ),
                outer_state=self._outer_state,
                template=self._template,
                author=context.private_key,
                start=True,
            )
        self.apply_swarm_view(context.swarm)  # the plan's share, the group size
        # Peers' progress claims are bounded before they count (averaging/progress_bounds.py): a liar can't end
        # a round early by claiming its samples, nor make every peer download state with a far later round.
        self.tracker = BoundedProgressTracker(
            dht=context.dht,
            prefix=run_prefix,
            target_batch_size=self.round_samples,
            client_mode=context.client_mode,
            private_key=context.private_key,
            start=True,
            bounds=ProgressBounds(target_batch_size=self.round_samples, run_created_at=manifest.created_at),
        )

    @property
    def epoch(self) -> int:
        return self.round

    @property
    def batches_per_round(self) -> int:
        """Global batches in one outer round: H, or H / fragments when the rounds stream fragments."""
        return self.round_batches // self.fragments.count

    @property
    def round_samples(self) -> int:
        """Samples the swarm processes in an outer round: H (/ fragments) global batches."""
        return self.context.manifest.target_batch_size * self.batches_per_round

    @property
    def round_fragment(self) -> int:
        """The fragment the round now ending (`round`) averages: 0 without fragments."""
        return self.fragments.of_round(self.round)

    @property
    def fragment_members(self) -> tuple[int, ...]:
        """The indices of the synchronised tensors the round now ending averages."""
        return self.fragments.members[self.round_fragment]

    @property
    def adaptive(self) -> bool:
        low, high = self.spec.inner_steps_range
        return low < high

    @property
    def overlapped(self) -> bool:
        """Whether a round's all-reduce runs in the background while the next round's inner steps go on."""
        return self.spec.overlap

    def _synchronised_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose pseudo-gradients the outer rounds average: every trainable one."""
        return [parameter for parameter in self.context.parameters if parameter.requires_grad]

    @property
    def training_round(self) -> int:
        """The round the inner steps now count toward: one past `round` while a round's average is in flight."""
        return self.round + (self._in_flight is not None)

    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        compute = self.context.compute
        assert compute is not None, "a DiLoCo peer always computes"
        if self._in_flight is not None and self._in_flight.control.done():
            self._finish_round_in_flight()
        if self._behind_the_swarm():
            self._load_state_from_peers()
        loss = compute.forward_backward(batch)
        if not math.isfinite(loss):
            logger.warning(f"skipped a micro-batch with a non-finite loss ({loss})")
            self.inner_optimizer.zero_grad(set_to_none=False)
            return None
        self._set_inner_learning_rate()
        if not compute.micro_step.step(self.inner_optimizer):
            return None  # fp16 gradients overflowed: the inner step was skipped; MicroStep zeroed them
        self.inner_optimizer.zero_grad(set_to_none=False)
        self.samples += self.context.micro_batch_size
        self.inner_steps += 1
        self.tracker.report_local_progress(self.training_round, self.samples)
        if self.tracker.ready_to_update_epoch and not self._catching_up() and not self._left_behind():
            self._outer_round()
        return loss

    def assist(self) -> None:
        raise NotImplementedError("a DiLoCo run has no aggregators that compute nothing")

    def apply_swarm_view(self, view: SwarmView) -> None:
        self.averager.set_share(view.plan_share)
        peer_ids = [status.peer_id for status in view.statuses]
        refresh_groups(self.averager, self.context.peer_id, peer_ids, self.context.manifest.averaging)

    @property
    def compression(self) -> str:
        return self.codec.name

    def report(self, progress: Progress) -> None:
        progress.epoch = self.round
        progress.inner_steps = self.batches_per_round
        global_batches = self.tracker.global_progress.samples_accumulated // self.context.manifest.target_batch_size
        progress.inner_step = min(global_batches, self.batches_per_round)
        progress.samples_accumulated = self.samples
        progress.num_partial_averages = self.context.partial_counter.value
        progress.num_local_steps = self.num_local_rounds
        progress.num_peers = self.tracker.global_progress.num_peers
        progress.swarm_samples_accumulated = self.tracker.global_progress.samples_accumulated
        progress.averaging_bytes_sent, progress.averaging_bytes_received = self.context.traffic.totals()
        progress.excluded_peers = self.averager.excluded_peers()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "round": self.round,
                "global_parameters": [tensor.detach().clone() for tensor in self.global_parameters],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "residuals": [] if self.feedback is None else self.feedback.state_dict(),
                "round_batches": self.round_batches,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock, torch.no_grad():
            for mine, saved in zip(self.global_parameters, state["global_parameters"], strict=True):
                mine.copy_(saved)
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
            self.round = int(state["round"])
            self._load_residuals(state.get("residuals") or [])
        self._take_round_batches(state.get("round_batches"))
        with self.tracker.pause_updates():
            self.tracker.update_epoch(self.round)

    def close(self) -> None:
        if self._in_flight is not None:  # a checkpoint holds the last applied round; this one is lost
            if not self._in_flight.control.done():  # a stop cancelled it already (a second cancel raises)
                self._in_flight.control.cancel()
            self._in_flight = None
        self.tracker.shutdown()
        self.averager.shutdown()

    # the outer round

    def _outer_round(self) -> None:
        """Average this peer's pseudo-gradient with a group, apply the outer step, start the next round; with
        `overlap`, start the average and return, the outer step follows when it is in."""
        self._seconds_per_batch = (time.monotonic() - self._round_started_at) / self.batches_per_round
        self.round_group = None
        if self._in_flight is not None:
            self._finish_round_in_flight(wait=True)  # at most one round in flight
        with self.tracker.pause_updates():
            together = self.tracker.global_progress.num_peers > 1
            self._write_pseudo_gradient()
            kept = self._sparsify() if together else None
            if together and self.overlapped:
                self._start_round_in_flight(kept)
                return
            averaged = together and self._average()
            if averaged and kept is not None:
                self._commit_residuals(kept)
            if not averaged:
                # a failed round may have left parts of others' in the buffers; alone, top-k would save nothing
                self._write_pseudo_gradient(flush_residuals=True)
                if together:
                    self.num_local_rounds += 1
                    self._stepped_alone()  # the others stepped without this peer: take their state next
            with self.context.phases.measure(Phase.OPTIMIZER_STEP):
                self._outer_step()
            self.samples = 0
            self._begin_round()
            self.tracker.update_epoch(self.round)
        self.averager.state_sharing_priority = self._priority()
        logger.info(f"outer round {self.round}: {'averaged with the swarm' if averaged else 'alone'}, "
                    f"{self.inner_steps} inner steps so far")  # fmt: skip

    def _write_pseudo_gradient(self, flush_residuals: bool = False) -> None:
        """θ₀ − θ into the averager's buffers; with `flush_residuals` (top-k only), plus the residuals, emptied."""
        with torch.no_grad(), self.averager.get_tensors() as buffers:
            self.fragments.write(buffers, self.round_fragment, self._pseudo_gradients())
            if flush_residuals and self.feedback is not None:
                self.feedback.flush_(buffers)

    def _pseudo_gradients(self, on_cpu: bool = True) -> Iterator[torch.Tensor]:
        """θ₀ − θ of each tensor of the round's fragment (every tensor without fragments), in float32, one at a time,
        on the CPU or, with `on_cpu` false, on the parameters' devices."""
        for index in self.fragment_members:
            delta = self.global_parameters[index] - self.parameters[index].detach().float()
            yield delta.cpu() if on_cpu else delta

    def _sparsify(self) -> list[Kept] | None:
        """Top-k only: the buffers' pseudo-gradients plus residuals, all but each tensor's largest values zeroed."""
        if self.feedback is None:
            return None
        with torch.no_grad(), self.averager.get_tensors() as buffers:
            return self.feedback.sparsify_(buffers)

    def _commit_residuals(self, kept: list[Kept]) -> None:
        assert self.feedback is not None, "only top-k keeps something back"
        with torch.no_grad():
            self.feedback.commit(self._pseudo_gradients(), kept)

    def _load_residuals(self, residuals: list[torch.Tensor]) -> None:
        """A checkpoint's residuals; none (an older checkpoint, or one of another compression) or unusable: zeros."""
        if self.feedback is None:
            return
        if not residuals:
            self.feedback.reset()
            return
        try:
            self.feedback.load_state_dict(residuals)
        except ValueError as e:
            logger.warning(f"the checkpoint's top-k residuals are not used: {e}")
            self.feedback.reset()

    def _average(self) -> bool:
        """One all-reduce of the pseudo-gradients; False when it failed, found no group or mixed rounds."""
        timeout = self.context.manifest.averaging.timeout_s
        started = time.monotonic()
        control = self.averager.step(weight=float(self.samples), gather=self._gather(), timeout=timeout, wait=False)
        wait_for_round(control, self.context.phases, timeout, stop=self.context.stop)
        gathered = self._round_gathered(control, self.round, timeout)
        if gathered is not None:
            self._note_round(gathered, time.monotonic() - started)
        return gathered is not None

    def _round_gathered(self, control: StepControl, round_: int, timeout: float) -> dict[Any, Any] | None:
        """What the members of a finished all-reduce of round `round_` gathered, by peer; None when it failed,
        found no group, mixed rounds or is still running (then it is cancelled)."""
        if not control.done():
            control.cancel()
            logger.warning(f"outer round {round_} was not averaged within {timeout:g} s")
            return None
        try:
            gathered = control.result()
        except EXPECTED_ROUND_FAILURES as e:
            logger.warning(f"outer round {round_} was not averaged: {e}")
            return None
        except Exception as e:
            logger.warning(f"outer round {round_} was not averaged: {e!r}")
            return None
        if not gathered or len(gathered) < 2:
            return None
        rounds = {gathered_round(value) for value in gathered.values()}
        if rounds != {round_}:
            logger.warning(f"outer round {round_} met peers in rounds {sorted(map(str, rounds))}: not applied")
            return None
        return dict(gathered)

    # adaptive H

    def _gather(self) -> Any:
        """What this peer's round gathers: its round, the H it proposes (adaptive H; else None) and a digest of the
        round's θ₀ (`_check_lineage`)."""
        return [self.round, self._proposal if self.adaptive else None, self._start_digest()]

    def _note_round(self, gathered: dict[Any, Any], allreduce_s: float) -> None:
        """After an averaged round: its group (`round_group`), the H the group agreed on (from the next round on)
        and this peer's next proposal, from the round's measured all-reduce time and its inner steps' seconds per
        global batch."""
        self.round_gathered = {_base58(peer): value for peer, value in gathered.items()}
        self.round_group = sorted(self.round_gathered)
        self._check_lineage()
        if not self.adaptive:
            return
        low, high = self.spec.inner_steps_range
        proposals = (_gathered_proposal(value) for value in gathered.values())
        self._next_round_batches = agreed_round_batches(proposals, low, high, self.round_batches)
        self._proposal = proposed_round_batches(allreduce_s, self._seconds_per_batch, low, high)

    def _begin_round(self) -> None:
        """A new round starts: with the H last agreed on, if any."""
        agreed, self._next_round_batches = self._next_round_batches, None
        if agreed is not None and agreed != self.round_batches:
            logger.info(f"outer rounds are now {agreed} global batches (were {self.round_batches}), as agreed")
            self.round_batches = agreed
        self._set_tracker_target()
        self._round_started_at = time.monotonic()

    def _take_round_batches(self, value: Any) -> None:
        """The H of a checkpoint or of the swarm's state, when adaptive and within bounds (else kept)."""
        low, high = self.spec.inner_steps_range
        if self.adaptive and isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
            self.round_batches, self._next_round_batches = value, None
            self._set_tracker_target()

    def _set_tracker_target(self) -> None:
        """The progress tracker's round, and the cap on any peer's claim toward it, follow H."""
        self.tracker.target_batch_size = self.round_samples
        self.tracker.bounds.target_batch_size = self.round_samples

    def _outer_step(self, ends: list[torch.Tensor] | None = None) -> None:
        """θ₀ ← the outer step of θ₀ with the buffers' (averaged) pseudo-gradient, for the round's fragment's tensors
        (the others have no gradient: SGD leaves them and their momentum alone). Their replica restarts from θ₀;
        with `ends` (the round's end points, when inner steps went on meanwhile), it moves by θ₀' − θ_end."""
        members = self.fragment_members
        with self._lock, torch.no_grad(), self.averager.get_tensors() as buffers:
            for index, pseudo_gradient in zip(members, self.fragments.read(buffers, self.round_fragment), strict=True):
                start = self.global_parameters[index]
                start.grad = pseudo_gradient.to(start.device, copy=True)
            self.outer_optimizer.step()
            for position, index in enumerate(members):
                start, parameter = self.global_parameters[index], self.parameters[index]
                if ends is None:
                    parameter.copy_(start)
                else:
                    parameter.add_((start - ends[position]).to(parameter.dtype))
                start.grad = None
            self.round += 1

    def _swarm_inner_step(self) -> int:
        """The swarm's inner step, counted in global batches over all rounds: the learning-rate schedule's step."""
        return self.training_round * self.batches_per_round + min(
            self.batches_per_round - 1,
            self.tracker.global_progress.samples_accumulated // self.context.manifest.target_batch_size,
        )

    def _set_inner_learning_rate(self) -> None:
        set_scheduled_learning_rate(self.inner_optimizer, self.context.manifest.optimizer, self._swarm_inner_step())

    # the state this peer serves

    def _outer_state(self) -> OuterState:
        with self._lock:
            momenta = [self._momentum(start) for start in self.global_parameters]
            tensors = [start.detach().cpu().clone() for start in self.global_parameters] + momenta
            alone = self._alone_round == self.round  # a state of its own: no witness of another's (`_stepped_alone`)
            return {"epoch": self.round, "inner_steps": self.round_batches, "alone": alone}, tensors

    def _momentum(self, start: torch.Tensor) -> torch.Tensor:
        buffer = self.outer_optimizer.state.get(start, {}).get("momentum_buffer")
        return torch.zeros(start.shape) if buffer is None else buffer.detach().cpu().clone()

    def _template(self) -> StateTemplate:
        specs = parameter_specs(self.global_parameters) * 2  # the global parameters, then their outer momenta
        ceiling = epoch_ceiling(self.context.manifest.created_at, time.time())
        return StateTemplate(tuple(specs), ceiling, epoch_floor=self.round)


def _base58(peer: Any) -> str:
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


def _gathered_proposal(value: Any) -> Any:
    """The H a peer proposed in its gathered data (checked by agreed_round_batches); None without one."""
    return value[1] if isinstance(value, list | tuple) and 2 <= len(value) <= MAX_GATHERED else None
