"""hivemind.Optimizer configured from the run manifest: global batches, Moshpit keys, fp16 on the wire.

`gradients` mode (DeDLOC): peers accumulate gradients until the swarm reaches the target batch,
average them, and step together. `parameters` mode (Moshpit SGD): peers step locally and average
parameters once per global epoch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import hivemind
import torch
from hivemind.compression import CompressionBase, NoCompression
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.averaging.compression import compression_for
from crowdtrain.averaging.exact import ExactGradientAverager
from crowdtrain.averaging.grid import GroupSizeMixin, expected_group_size, initial_group_bits
from crowdtrain.averaging.partition import PlanSharesMixin
from crowdtrain.averaging.phases import Phase, PhaseAccumulator, wait_for_round
from crowdtrain.averaging.progress_bounds import BoundedProgressTracker, ProgressBounds
from crowdtrain.averaging.quarantine import Verdict
from crowdtrain.averaging.traffic import AggregationSettings, AveragingTraffic, TrafficCountingAverager
from crowdtrain.dht.admission import AdmissionGated
from crowdtrain.manifest import AveragingSpec, RunManifest
from crowdtrain.optimizer import build_optimizer, build_scheduler
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
from crowdtrain.state.template import StateTemplate, epoch_ceiling, optimizer_tensor_specs, parameter_specs

logger = logging.getLogger(__name__)

LOAD_STATE_TIMEOUT_S = 120.0
STATE_AVERAGING_EVERY_EPOCHS = 5
PROGRESS_REFRESH_TIMEOUT_S = 2.0
"""How long a step waits for a fresh reading of the swarm's progress before it would average alone."""
HIVEMIND_REQUEST_TIMEOUT_S = 3.0  # DecentralizedAverager's default wait for a potential leader's answer


class PlannedStateAverager(
    AdmissionGated,
    PlanSharesMixin,
    GroupSizeMixin,
    TrainingStateAverager,
    VerifiedStateDownloadMixin,
    TrafficCountingAverager,
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
        # training thread. The optimizer step inside it is measured on its own (_Optimizer's hooks), so not here.
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


class _Optimizer(hivemind.Optimizer):
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
        **kwargs: Any,
    ):
        self._requested_client_mode = client_mode
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
            wait_for_round(maybe_step_control, self.phases, self.averaging_timeout)
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
            stored.result(timeout=PROGRESS_REFRESH_TIMEOUT_S)
        except Exception as e:  # a DHT that does not answer: the download goes on, unannounced
            logger.debug(f"could not announce a state download: {e!r}")

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
        try:
            found = self.dht.get(catch_up_key(self.run_id), latest=True, return_future=True).result(READ_TIMEOUT_S)
        except Exception as e:
            logger.debug(f"could not read the swarm's catch-up announcements: {e!r}")
            return unanswered
        if not isinstance(found, ValueWithExpiration):
            return unanswered
        return parse_announcements(found.value, get_dht_time())

    def _still_downloading(self, announcements: dict[Any, Announcement], epoch: int) -> list[Any]:
        epochs = progress_epochs(self.tracker.last_records)
        return still_downloading(announcements, epochs, epoch, get_dht_time(), self.tracker.own_key)


def make_optimizer(
    *,
    dht: hivemind.DHT,
    manifest: RunManifest,
    parameters: Iterable[torch.nn.Parameter],
    micro_batch_size: int,
    client_mode: bool,
    auxiliary: bool = False,
    group_bits: str,
    private_key: RSAPrivateKey,
    partial_counter: Synchronized,
    phases: PhaseAccumulator | None = None,
    traffic: AveragingTraffic | None = None,
    reuse_grad_buffers: bool = False,
    use_local_updates: bool = False,
) -> hivemind.Optimizer:
    """The collaborative optimizer of this node for the run described by `manifest`.

    `private_key` must be the key of the DHT's signature validator: hivemind merges every
    RSASignatureValidator added to a DHT into the first one, so progress records signed with any
    other key (hivemind's default, a process-wide random key) go out unsigned and every peer
    rejects them: peers then never see each other's epoch and never resynchronise.
    `auxiliary` (gradients mode only): this peer computes nothing and only aggregates its plan share.
    `phases` receives the time of each phase of a global step; `traffic` counts the bytes of averaging rounds.
    `reuse_grad_buffers` (gradients mode, no loss scaler): the parameters' `.grad` is the accumulator of the
    global batch, which saves a copy of every gradient per micro-batch and one model-sized buffer; the caller
    must then never zero gradients itself (see `discard_local_gradients`, `clear_micro_batch_gradients`).
    `use_local_updates` (Moshpit SGD): every peer steps its own replica and the swarm averages parameters; else
    the swarm averages gradients and every peer takes the same step (DeDLOC).
    """
    traffic = AveragingTraffic.new() if traffic is None else traffic
    if auxiliary and (client_mode or use_local_updates):
        raise ValueError("only a reachable peer that averages gradients can be an auxiliary aggregator")
    averaging = manifest.averaging
    compression = _compression(averaging)
    request_timeout = join_request_timeout_s(averaging)
    averager_opts = {
        "target_group_size": averaging.group_size,
        "initial_group_bits": group_bits,
        "request_timeout": request_timeout,
    }
    # No peer's claimed weight (its samples) counts for more than the global batch (averaging/robust.py).
    aggregation = AggregationSettings(rule=averaging.aggregation, max_weight=float(manifest.target_batch_size))
    extra: dict[str, Any] = {}
    if not use_local_updates:
        extra["grad_averager_factory"] = functools.partial(
            CountingGradientAverager,
            partial_counter=partial_counter,
            traffic=traffic,
            aggregation=aggregation,
            **averager_opts,
        )
        extra["grad_compression"] = compression
        extra["reuse_grad_buffers"] = reuse_grad_buffers
    elif reuse_grad_buffers:
        raise ValueError("only a gradients-mode run accumulates gradients: parameters mode steps every micro-batch")
    with keep_sigint_handler():
        return _Optimizer(
            dht=dht,
            run_id=f"crowdtrain-{manifest.run_id}",
            target_batch_size=manifest.target_batch_size,
            # An auxiliary peer (the plan's aggregator that computes nothing) only helps average.
            batch_size_per_step=None if auxiliary else micro_batch_size,
            auxiliary=auxiliary,
            params=list(parameters),
            optimizer=functools.partial(build_optimizer, spec=manifest.optimizer),
            scheduler=functools.partial(build_scheduler, spec=manifest.optimizer),
            matchmaking_time=averaging.matchmaking_time_s,
            averaging_timeout=averaging.timeout_s,
            # hivemind's default (the matchmaking time, 5 s) bans a group member as a sender when its first part comes
            # later than that: a peer still finishing a micro-batch of a large model, and both peers' rounds came
            # back half un-averaged. A dead peer is still dropped well within the round's timeout.
            next_chunk_timeout=chunk_timeout_s(averaging),
            load_state_timeout=LOAD_STATE_TIMEOUT_S,
            use_local_updates=use_local_updates,
            # Gradient mode: every peer applies the same averaged gradient, so parameters only drift when a
            # peer misses a round; average them every few epochs, in step, never in the background (hivemind's
            # default), where a late result overwrites parameters that moved on and training diverges.
            delay_state_averaging=use_local_updates,
            average_state_every=1 if use_local_updates else STATE_AVERAGING_EVERY_EPOCHS,
            offload_optimizer=False,
            client_mode=client_mode,
            phases=phases,
            traffic=traffic,
            aggregation=aggregation,
            run_created_at=manifest.created_at,
            # Parameters averaged every few epochs in gradient mode travel uncompressed, so rounding never
            # erases small updates; a downloaded state always does: fp16 flushes Adam's tiny second moments
            # to zero, and the next step divides by ~eps and blows the weights up.
            state_averaging_compression=compression if use_local_updates else NoCompression(),
            load_state_compression=NoCompression(),
            averager_opts=averager_opts
            if use_local_updates
            else {"target_group_size": averaging.group_size, "request_timeout": request_timeout},
            tracker_opts={"private_key": private_key},
            verbose=False,
            **extra,
        )


@contextlib.contextmanager
def keep_sigint_handler() -> Iterator[None]:
    """Start hivemind averagers inside: the SIGINT handler is as before when the block ends.

    Symptom worked around: hivemind's averagers set SIGINT to SIG_IGN in the *calling* process when they start
    (DecentralizedAverager.run_in_background), so Ctrl-C would no longer stop the daemon.
    """
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def reuses_grad_buffers(optimizer: hivemind.Optimizer) -> bool:
    """Whether the parameters' `.grad` accumulates the global batch (see make_optimizer)."""
    averager = getattr(optimizer, "grad_averager", None)
    return averager is not None and bool(averager.reuse_grad_buffers)


def clear_micro_batch_gradients(optimizer: hivemind.Optimizer) -> None:
    """After a micro-batch's `optimizer.step()`: zero `.grad` for the next one, unless `.grad` is the accumulator.

    Zeroed in place: freeing and re-allocating a model-sized buffer every micro-batch costs page faults on a CPU.
    """
    if not reuses_grad_buffers(optimizer):
        optimizer.zero_grad(set_to_none=False)


def discard_local_gradients(optimizer: hivemind.Optimizer) -> None:
    """A micro-batch's gradients are unusable (a non-finite loss) and must not reach the swarm's average.

    When `.grad` accumulates the global batch, the bad gradients are already summed into it and can't be taken
    out alone: this node's whole contribution since the last global step is dropped, and its reported samples
    go back to zero, as hivemind does on an fp16 overflow.
    """
    if reuses_grad_buffers(optimizer):
        optimizer.grad_averager.reset_accumulated_grads_()
        optimizer.tracker.report_local_progress(optimizer.local_epoch, 0)
    else:
        optimizer.zero_grad(set_to_none=False)


def excluded_peers(optimizer: hivemind.Optimizer) -> dict[str, Verdict]:
    """The peers this node's gradient and state averagers keep out of their groups (averaging/quarantine.py)."""
    excluded: dict[str, Verdict] = {}
    for averager in (getattr(optimizer, "grad_averager", None), optimizer.state_averager):
        if isinstance(averager, TrafficCountingAverager):
            excluded.update(averager.excluded_peers())
    return excluded


def set_plan_share(optimizer: hivemind.Optimizer, share: float | None) -> None:
    """Aggregate `share` of every later averaging round (gradients and state); None: no plan, equal split."""
    for averager in (getattr(optimizer, "grad_averager", None), optimizer.state_averager):
        if isinstance(averager, PlanSharesMixin):
            averager.set_share(share)


def moshpit_bits(own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec) -> str:
    """This peer's initial Moshpit group key from its rank among the peers it knows of."""
    ranked = sorted(set(peer_ids) | {own_peer_id})
    return initial_group_bits(ranked.index(own_peer_id), len(ranked), averaging.group_size, averaging.grid_dims)


def refresh_moshpit_groups(
    optimizer: hivemind.Optimizer, own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec
) -> bool:
    """Fit the optimizer's averaging groups to the swarm of `own_peer_id` and `peer_ids` (every peer that may
    average, started or not): the group size matchmaking closes a group at, and the group key, re-seeded when
    the swarm crossed the group size (one group <-> a grid). True if the key was re-seeded.

    Within one regime the key is left alone: hivemind rotates it after every round, which is the
    Moshpit schedule, and resetting it would undo that.
    """
    peer_ids = set(peer_ids)
    if optimizer.use_local_updates:
        return refresh_groups(optimizer.state_averager, own_peer_id, peer_ids, averaging)
    # Gradients mode: the key is the gradient rounds'; the parameter rounds every few epochs (one group, no grid
    # key) also close as soon as the swarm is in.
    size = expected_group_size(len(peer_ids | {own_peer_id}), averaging.group_size)
    optimizer.state_averager.set_target_group_size(size)
    return refresh_groups(optimizer.grad_averager, own_peer_id, peer_ids, averaging)


def refresh_groups(averager: Any, own_peer_id: str, peer_ids: Iterable[str], averaging: AveragingSpec) -> bool:
    """`refresh_moshpit_groups` for one hivemind averager (a GroupSizeMixin)."""
    peers = set(peer_ids) | {own_peer_id}
    averager.set_target_group_size(expected_group_size(len(peers), averaging.group_size))
    wanted = moshpit_bits(own_peer_id, peers, averaging)
    current = averager.get_group_bits()
    if len(wanted) == len(current):
        return False
    averager.set_group_bits(wanted)
    logger.info(f"swarm size changed: Moshpit group key {current or '(one group)'} -> {wanted or '(one group)'}")
    return True


def join_request_timeout_s(averaging: AveragingSpec) -> float:
    """How long a peer looking for a group waits for a potential leader's answer: at most hivemind's default,
    and always well below the matchmaking time.

    Symptom worked around: hivemind's matchmaking deadlocks when two peers ask each other to lead at once; only
    this timeout breaks it. With a timeout at or above the matchmaking time (hivemind's 3 s against a 2 s
    matchmaking time), each break came after both declarations expired, the two asked each other again, and a
    round of two peers on loopback found no group for its whole 20 s.
    """
    return min(HIVEMIND_REQUEST_TIMEOUT_S, averaging.matchmaking_time_s / 2)


def chunk_timeout_s(averaging: AveragingSpec) -> float:
    """How long a group member may take to send its first part (or the next one) before the round goes on
    without it: half the round's timeout, never less than the matchmaking time."""
    return max(averaging.matchmaking_time_s, averaging.timeout_s / 2)


def _compression(averaging: AveragingSpec) -> CompressionBase:
    return compression_for(averaging.compression)
