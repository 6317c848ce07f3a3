"""hivemind.Optimizer and its two averagers, subclassed: workarounds, phase times, verified state, catch-up holds.

`CrowdtrainOptimizer` honours an explicit client mode, times each phase of a global step, works around hivemind's
pre-scheduled rounds that expire or go alone, replaces a replica that stepped alone, and holds its global step for
a peer that announces it downloads the swarm's state (state/catch_up.py), announcing its own downloads likewise.
Its state averager (`PlannedStateAverager`) partitions rounds by the plan and verifies a downloaded state
(state/download.py); its gradient averager (`CountingGradientAverager`) is exact and counts its bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import hivemind
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.utils import ValueWithExpiration, get_dht_time

from crowdtrain.averaging.authored import AuthoredAverager
from crowdtrain.averaging.exact import ExactGradientAverager
from crowdtrain.averaging.grid import GroupSizeMixin
from crowdtrain.averaging.partition import PlanSharesMixin
from crowdtrain.averaging.phases import Phase, PhaseAccumulator, wait_for_round
from crowdtrain.averaging.progress_bounds import BoundedProgressTracker, ProgressBounds
from crowdtrain.averaging.traffic import AggregationSettings, AveragingTraffic, TrafficCountingAverager
from crowdtrain.dht.calls import DHTCallFailed, dht_answer
from crowdtrain.dht.gate import AdmissionGated
from crowdtrain.dht.records import epoch_ceiling
from crowdtrain.rpc.service import NodeStopping
from crowdtrain.state.catch_up import (
    ANNOUNCE_EVERY_S,
    ANNOUNCE_FOR_S,
    CATCH_UP_MATCHMAKING_S,
    HOLD_POLL_S,
    READ_TIMEOUT_S,
    Announcement,
    HoldBudget,
    catch_up_key,
    parse_announcements,
    progress_epochs,
    still_downloading,
)
from crowdtrain.state.download import VerifiedStateDownloadMixin
from crowdtrain.state.serving import StateServingMixin
from crowdtrain.state.template import StateTemplate, optimizer_tensor_specs, parameter_specs

logger = logging.getLogger(__name__)

PROGRESS_REFRESH_TIMEOUT_S = 2.0
"""How long a step waits for a fresh reading of the swarm's progress before it would average alone."""


class PlannedStateAverager(
    AdmissionGated,
    StateServingMixin,
    PlanSharesMixin,
    GroupSizeMixin,
    TrainingStateAverager,
    VerifiedStateDownloadMixin,
    TrafficCountingAverager,
    AuthoredAverager,
):
    """hivemind's TrainingStateAverager whose all-reduce partition follows the plan's shares; its rounds count
    their bytes, the time the training thread waits for one is a phase of the step, and a state downloaded
    from a peer is verified against this node's own before it is loaded (state/download.py)."""

    def __init__(
        self,
        *args: Any,
        phases: PhaseAccumulator | None = None,
        run_created_at: float = 0.0,
        states_agree_at_epoch: bool = True,
        **kwargs: Any,
    ):
        self.phases = PhaseAccumulator() if phases is None else phases
        self.run_created_at = run_created_at
        """When the run's manifest was created (unix seconds): bounds the epoch a downloaded state may claim."""
        self.states_agree_at_epoch = states_agree_at_epoch
        super().__init__(*args, **kwargs)

    def step(self, **kwargs: Any) -> Any:
        # Wraps TrainingStateAverager.step: a parameter-averaging round it runs in line (not delayed) blocks the
        # training thread. The optimizer step inside it is measured on its own (CrowdtrainOptimizer's hooks).
        if kwargs.get("averaging_round") and not kwargs.get("delay_averaging"):
            with self.phases.measure(Phase.STATE_AVERAGING):
                return super().step(**kwargs)
        return super().step(**kwargs)

    def state_template(self) -> StateTemplate:
        parameters = [parameter for group in self.optimizer.param_groups for parameter in group["params"]]
        specs = parameter_specs([*parameters, *self.extra_tensors]) + optimizer_tensor_specs(self.optimizer)
        return StateTemplate(tuple(specs), epoch_ceiling(self.run_created_at, time.time()))

    def _update_scheduler(self) -> None:
        # Symptom worked around: hivemind's TrainingStateAverager._update_scheduler steps the scheduler once per
        # epoch up to the local epoch: after loading a state of epoch 2**62 it never returned. One step, same end.
        scheduler = self.scheduler
        if scheduler is not None and scheduler._step_count <= self.local_epoch:
            scheduler.last_epoch, scheduler._step_count = self.local_epoch - 1, self.local_epoch
            scheduler.step()

    def trusted_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        # The optimizer's hyperparameters (learning rate, betas, weight decay) are this run's, never a donor's;
        # only its tensors (checked) are taken. The learning rate then follows the schedule to the new epoch.
        own_metadata, _ = dump_optimizer_state(self.optimizer)
        return {**metadata, "optimizer_metadata": own_metadata}


class CountingGradientAverager(ExactGradientAverager, TrafficCountingAverager):
    """The exact, plan-partitioned gradient averager, counting the bytes of its rounds."""

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> None:
        # hivemind.Optimizer.load_state_from_peers also downloads a peer's gradient buffers and throws them away
        # (GradientAverager has no state to load): a model-sized download per join, from any peer that offers.
        return None


class CrowdtrainOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that honours an explicit `client_mode`.

    Symptom worked around: hivemind 1.1.12 reads `client_mode if client_mode is None else
    dht.client_mode`, so an explicit client_mode is replaced by the DHT's. The progress tracker is
    built first, so restoring the value there reaches the tracker and both averagers.
    """

    def __init__(
        self,
        *,
        client_mode: bool,
        phases: PhaseAccumulator | None = None,
        traffic: AveragingTraffic | None = None,
        aggregation: AggregationSettings | None = None,
        run_created_at: float = 0.0,
        use_local_updates: bool = False,
        stop: threading.Event | None = None,
        **kwargs: Any,
    ):
        self._requested_client_mode = client_mode
        self.node_stop = stop
        """The node's stop event: once set, the gradient round a step waits for is cancelled (NodeStopping)."""
        # Gradients mode: every peer takes the same averaged step, so peers at one epoch hold one state and other
        # donors can corroborate a downloaded one. Parameters mode: peers step alone between averaging rounds.
        self._states_agree_at_epoch = not use_local_updates
        self.phases = PhaseAccumulator() if phases is None else phases
        self.traffic = AveragingTraffic.new() if traffic is None else traffic
        self.aggregation = AggregationSettings() if aggregation is None else aggregation
        self.run_created_at = run_created_at
        self.hold_budget = HoldBudget()
        self._announced_expiration = 0.0
        super().__init__(client_mode=client_mode, use_local_updates=use_local_updates, **kwargs)
        # The torch optimizer steps in hivemind's own thread, inside state_averager.step: hooks time just the step.
        torch_optimizer = self.state_averager.optimizer
        torch_optimizer.register_step_pre_hook(self._on_optimizer_step_begins)
        torch_optimizer.register_step_post_hook(self._on_optimizer_step_ends)
        self._optimizer_step_began = 0.0

    def _on_optimizer_step_begins(self, *_: Any) -> None:
        self._optimizer_step_began = self.phases.clock()

    def _on_optimizer_step_ends(self, *_: Any) -> None:
        self.phases.add(Phase.OPTIMIZER_STEP, self.phases.clock() - self._optimizer_step_began)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        # Wraps hivemind.Optimizer.step: its time outside the phases measured within (the global step, a state
        # download, the optimizer's own step) is spent while the swarm fills the batch.
        with self.phases.measure(Phase.WAIT):
            return super().step(*args, **kwargs)

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        # Wraps hivemind.Optimizer._update_global_epoch, the global step: its time outside the averaging phases
        # measured within is hivemind's bookkeeping around the optimizer step, counted with it.
        with self.phases.measure(Phase.OPTIMIZER_STEP):
            super()._update_global_epoch(grad_scaler)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        # Wraps hivemind.Optimizer._average_gradients_and_load_into_optimizer, which blocks on the gradient round's
        # result: waiting for it here first, reading the stage the averager process reports, splits that wait into
        # matchmaking and all-reduce; hivemind's call then finds the result ready.
        if maybe_step_control is not None:
            try:
                wait_for_round(maybe_step_control, self.phases, self.averaging_timeout, stop=self.node_stop)
            except NodeStopping:
                scheduled: Any = self.scheduled_grads  # type: ignore[has-type]  # a hivemind StepControl
                if scheduled is maybe_step_control:
                    self.scheduled_grads = None  # cancelled: shutdown() must not cancel it again (that raises)
                raise
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def _make_state_averager(self, **kwargs: Any) -> Any:
        # hivemind's own construction (Optimizer._make_state_averager), with the plan-driven partition.
        return PlannedStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            phases=self.phases,
            traffic=self.traffic,
            aggregation=self.aggregation,
            run_created_at=self.run_created_at,
            states_agree_at_epoch=self._states_agree_at_epoch,
            **kwargs,
        )

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
        # hivemind's own construction (Optimizer._make_progress_tracker), over bounded progress claims.
        self.client_mode = self._requested_client_mode
        self.num_local_gradient_steps = 0
        self.replica_diverged = False
        return BoundedProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            bounds=ProgressBounds(target_batch_size=target_batch_size, run_created_at=self.run_created_at),
            **kwargs,
        )

    def _load_local_gradients_into_optimizer(self) -> None:
        # Reached when a gradient averaging round failed or found nobody: the step uses this peer's
        # gradients alone. Counted so `status` shows a swarm whose averaging is not happening.
        self.num_local_gradient_steps += 1
        if self.tracker.global_progress.num_peers > 1:
            # A step alone while the swarm has other peers leaves this replica unlike theirs, and every later
            # averaged step would keep the difference (hivemind re-aligns replicas only at state averaging, where
            # averaging two diverged models made the loss jump). The next step() downloads the swarm's state.
            self.replica_diverged = True
        super()._load_local_gradients_into_optimizer()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        # Symptom worked around: hivemind pre-schedules a round when the swarm's ETA is near, and that round gives
        # up `averaging_timeout` later. When the batch fills later than predicted (a joiner's first slow steps
        # skew the rates), the round has expired before the step, and hivemind then steps alone without looking
        # for a group at all: both peers of a two-peer swarm did so in turn, every epoch. An expired round is
        # dropped here, so the step looks for a group now, as it does when nothing was scheduled.
        #
        # Symptom worked around: hivemind cancels a pre-scheduled round when its view of the swarm counts no other
        # peer, and that view is up to a refresh period old (10 s and more). At a join, the first shared round
        # then went one way on each side: the peer whose view predated the joiner's first report cancelled its
        # round (hivemind tells no one) and stepped alone, while the other, already in a group with it, waited
        # out a sender timeout (30 s on llama-85m) and its round came back partial. The view is read again first.
        #
        # A peer downloading the swarm's state is waited for first (state/catch_up.py).
        self._hold_for_catching_up_peers()
        scheduled: Any = self.scheduled_grads  # type: ignore[has-type]  # a hivemind StepControl
        if scheduled is not None and scheduled.done() and not scheduled.triggered:
            self.scheduled_grads = None
        elif scheduled is not None and not scheduled.done() and self.tracker.global_progress.num_peers <= 1:
            self.tracker.refresh_global_progress(timeout=PROGRESS_REFRESH_TIMEOUT_S)
            if self.tracker.global_progress.num_peers > 1:
                logger.info(f"{self.tracker.global_progress.num_peers} peers report progress now (this node's view "
                            "of the swarm was older): averaging this batch with them, not alone")  # fmt: skip
        return bool(super()._begin_averaging_gradients(grad_scaler))

    def _should_load_state_from_peers(self) -> bool:
        # Symptom worked around: hivemind counts a peer one epoch behind as synchronized and lets it step at
        # once (the global epoch is ahead of its own), alone, and stay one epoch behind for good. A joiner whose
        # first step came as the swarm stepped did so from its initial weights; its gradients then went into
        # every round computed on other weights. Here a replica that stepped alone is replaced first.
        if self.replica_diverged and self.tracker.global_progress.num_peers > 1:
            logger.info("this node stepped alone while the swarm has peers: downloading the swarm's state")
            return True
        return bool(super()._should_load_state_from_peers())

    def load_state_from_peers(self, **kwargs: Any) -> None:
        # Also wraps hivemind.Optimizer.load_state_from_peers to time the download, a phase of its own.
        # Then, when the swarm's newest state was older than the epoch some peer claims, that claim is ignored for
        # a while: otherwise this node would download again at every step (averaging/progress_bounds.py).
        # Announced first and renewed while it lasts, so the swarm holds its next step until this node reports the
        # epoch of the state (state/catch_up.py); a node that dies mid-download stops renewing and is soon not
        # waited for. The last says which epoch this node loaded: the swarm waits for its progress record to show it.
        claimed_at_start = self.tracker.global_epoch
        self._announce_catch_up(Announcement(until=get_dht_time() + ANNOUNCE_FOR_S))
        downloaded = threading.Event()
        renewals = threading.Thread(target=self._renew_announcement, args=(downloaded,), daemon=True)
        renewals.start()
        try:
            with self.phases.measure(Phase.STATE_DOWNLOAD):
                super().load_state_from_peers(**kwargs)
        finally:
            downloaded.set()
            renewals.join()
            self._announce_catch_up(Announcement(until=get_dht_time() + ANNOUNCE_FOR_S, loaded=self.local_epoch))
        self.replica_diverged = False
        self.tracker.distrust_unbacked_epochs(
            self.local_epoch, self.state_averager.last_loaded_epoch, claimed_at_start=claimed_at_start
        )
        # The swarm may be holding its step for this node: read its progress now, not at the next scheduled fetch
        # (up to a refresh period away), so that the next micro-batch already sees the batch full and averages it.
        with self.tracker.pause_updates():
            self.tracker.refresh_global_progress(timeout=PROGRESS_REFRESH_TIMEOUT_S)

    def _renew_announcement(self, downloaded: threading.Event) -> None:
        while not downloaded.wait(ANNOUNCE_EVERY_S):
            self._announce_catch_up(Announcement(until=get_dht_time() + ANNOUNCE_FOR_S))

    def _announce_catch_up(self, announcement: Announcement) -> None:
        # The DHT keeps, per subkey, the value that expires last: each announcement expires after the one before.
        expiration = max(announcement.until, get_dht_time() + 1.0, self._announced_expiration + 1e-3)
        self._announced_expiration = expiration
        stored = self.dht.store(
            catch_up_key(self.run_id),
            subkey=self.tracker.own_key,
            value=announcement.to_record(),
            expiration_time=expiration,
            return_future=True,
        )
        try:
            dht_answer(stored, PROGRESS_REFRESH_TIMEOUT_S, "a state download's announcement")
        except DHTCallFailed as e:  # a DHT that does not answer: the download goes on, unannounced
            logger.debug(f"could not store {e}")

    def _hold_for_catching_up_peers(self) -> None:
        # Called in hivemind's global step, with the tracker's updates paused (refresh_global_progress needs it).
        epoch = self.local_epoch
        began = time.monotonic()
        allowance = self.hold_budget.available(began)
        announcements = self._read_announcements(unanswered={})
        waiting = self._still_downloading(announcements, epoch)
        if not waiting or allowance < HOLD_POLL_S:
            return
        logger.info(f"{len(waiting)} peer(s) download the swarm's state: holding the step of epoch {epoch} for "
                    f"them, {allowance:.0f} s at most, so that they average this batch with the swarm")  # fmt: skip
        announcers = waiting
        with self.phases.measure(Phase.WAIT):
            while waiting and time.monotonic() - began < allowance:
                time.sleep(HOLD_POLL_S)
                self.tracker.refresh_global_progress(timeout=PROGRESS_REFRESH_TIMEOUT_S)
                # A read that fails (the announcer's link is busy with its download) keeps the last one.
                announcements = self._read_announcements(unanswered=announcements)
                waiting = self._still_downloading(announcements, epoch)
        held = time.monotonic() - began
        self.hold_budget.spend(held, time.monotonic())
        now = get_dht_time()
        lapsed = [key for key in announcers if key not in announcements or announcements[key].until <= now]
        caught_up = len(announcers) - len(lapsed) - len(waiting)
        if caught_up:
            self._schedule_round_for_catching_up_peers()
        outcome = f"{caught_up} of {len(announcers)} caught up"
        outcome += f", {len(lapsed)} announcement(s) lapsed" if lapsed else ""
        outcome += f", stepping without {len(waiting)} still downloading (the hold's limit)" if waiting else ""
        logger.info(f"held the step of epoch {epoch} for {held:.1f} s: {outcome}")

    def _schedule_round_for_catching_up_peers(self) -> None:
        # A round that looks for its group CATCH_UP_MATCHMAKING_S, not the manifest's matchmaking time: a peer that
        # has just loaded the state must still learn the batch is full, compute a micro-batch and look for the group,
        # over its own link. With the manifest's 2 s a joiner on a 0.5 Mbit/s link missed the round, this node
        # stepped alone, and each then downloaded the other's state. A round scheduled before the hold and still
        # live is kept: it is still looking for its group, and cancelling it left its search running in the averager
        # ("Another look_for_group is already in progress"), which held the new round back until it failed.
        scheduled: Any = self.scheduled_grads  # type: ignore[has-type]  # a hivemind StepControl
        if scheduled is None or scheduled.done():
            self.scheduled_grads = self.grad_averager.schedule_step(
                get_dht_time() + CATCH_UP_MATCHMAKING_S, timeout=self.averaging_timeout
            )

    def _read_announcements(self, unanswered: dict[Any, Announcement]) -> dict[Any, Announcement]:
        # The swarm's catch-up announcements; `unanswered` when the DHT does not answer in time or holds none.
        future = self.dht.get(catch_up_key(self.run_id), latest=True, return_future=True)
        try:
            found = dht_answer(future, READ_TIMEOUT_S, "the swarm's catch-up announcements")
        except DHTCallFailed as e:
            logger.debug(f"could not read {e}")
            return unanswered
        if not isinstance(found, ValueWithExpiration):
            return unanswered
        return parse_announcements(found.value, get_dht_time())

    def _still_downloading(self, announcements: dict[Any, Announcement], epoch: int) -> list[Any]:
        epochs = progress_epochs(self.tracker.last_records)
        return still_downloading(announcements, epochs, epoch, get_dht_time(), self.tracker.own_key)
