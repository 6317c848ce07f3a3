"""The training loop of a node: build the run's model and data, train with the swarm, checkpoint."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.averaging.collaboration import (
    clear_micro_batch_gradients,
    discard_local_gradients,
    make_optimizer,
    moshpit_bits,
    refresh_moshpit_bits,
    set_plan_share,
)
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.averaging.phases import Phase, PhaseAccumulator, PhaseTimes
from crowdtrain.averaging.traffic import AveragingTraffic
from crowdtrain.data import BatchPrefetcher, WindowSampler, load_token_stream, peer_seed_from_peer_id
from crowdtrain.manifest import RunManifest
from crowdtrain.models import (
    ExpertsUnavailableError,
    MicroStep,
    Precision,
    apply_tf32,
    autocast,
    build_dmoe_model,
    build_model,
    load_tokenizer,
    model_kind,
    precision_for_device,
    training_loss,
)
from crowdtrain.training.checkpoint import load_latest_checkpoint
from crowdtrain.training.checkpoint_writer import CheckpointSchedule, CheckpointWriter, take_snapshot
from crowdtrain.training.progress_bar import GlobalBatchBar

logger = logging.getLogger(__name__)

THROUGHPUT_EMA_ALPHA = 0.1
SOLO_EPOCHS_BEFORE_WARNING = 5
AUXILIARY_STEP_INTERVAL_S = 0.5
"""How often an auxiliary peer steps its optimizer, which joins an averaging round once one is due."""
EXPERT_RETRY_S = 1.0
EXPERT_WARNING_INTERVAL_S = 60.0
FINAL_CHECKPOINT_TIMEOUT_S = 10.0
"""Bound on the checkpoint at shutdown (the write in flight, then the final one): the daemon leaves within
LEAVE_DEADLINE_S (28 s), which must also cover the last micro-step, the optimizer's shutdown and the status
withdrawal."""


@dataclass(slots=True)
class Progress:
    """What the heartbeat publishes about this node's training; written by the trainer thread only."""

    epoch: int = 0
    samples_accumulated: int = 0
    samples_per_second: float = 0.0
    loss: float | None = None
    num_partial_averages: int = 0
    """Averaging rounds rejected because some parts came back un-averaged."""
    num_local_steps: int = 0
    """Global steps taken with this node's gradients alone (averaging failed or found no peer)."""
    phase_times: PhaseTimes | None = None
    """Where the time of the last completed global step went; None until one completed."""
    num_peers: int = 0
    """Peers training in this run as hivemind's progress tracker last saw them, this node included."""
    averaging_bytes_sent: int = 0
    """Serialized tensor-part bytes this node sent in averaging rounds since it started, B."""
    averaging_bytes_received: int = 0
    """Serialized tensor-part bytes this node received in averaging rounds since it started, B."""

    def observe(self, loss: float, num_samples: int, elapsed_s: float) -> None:
        """Fold one micro-step into the exponential moving averages."""
        rate = num_samples / max(elapsed_s, 1e-6)
        alpha = THROUGHPUT_EMA_ALPHA
        self.samples_per_second = (
            rate if self.samples_per_second == 0 else (1 - alpha) * self.samples_per_second + alpha * rate
        )
        self.loss = loss if self.loss is None else (1 - alpha) * self.loss + alpha * loss


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmView:
    """What one re-planning read of the DHT found."""

    share: float | None
    """This node's share of each averaging round under the plan; None: no plan."""
    statuses: list[proto.PeerStatus]
    """The run's peers that average."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerOptions:
    """Node-local training settings (the run-wide ones live in the manifest)."""

    micro_batch_size: int
    """Samples per forward/backward pass on this node."""
    checkpoint_dir: Path
    """Where this run's checkpoints live."""
    checkpoint_keep: int
    """How many checkpoints to keep."""
    checkpoint_interval_s: float = 600.0
    """Seconds between two checkpoints while training (taken at the first new epoch after); one more at exit."""
    data_cache_dir: Path
    """Where the tokenised corpus is cached."""
    client_mode: bool
    """True when peers can't dial this node: it trains but never aggregates."""
    show_bar: bool
    """Draw a progress bar of the global batch in the terminal."""
    num_threads: int = 0
    """CPU threads for torch; 0 keeps torch's default."""
    device: str = "cpu"
    """The torch device the model trains on: cpu or cuda:N."""
    auxiliary: bool = False
    """True when the plan makes this node an aggregator that computes nothing: it only helps average."""


class Trainer:
    """Trains this node's replica with the swarm until `stop` is set, then checkpoints and shuts down."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        manifest: RunManifest,
        peer_id: str,
        private_key: RSAPrivateKey,
        options: TrainerOptions,
        progress: Progress,
        known_peers: Callable[[], list[proto.PeerStatus]],
        plan_share: Callable[[], float | None] = lambda: None,
    ):
        """`known_peers` gives the run's peers that average (expert hosts left out); `plan_share` is asked at
        the start and at every new epoch for this node's share of each round."""
        self.dht, self.manifest, self.peer_id, self.private_key = dht, manifest, peer_id, private_key
        self.options, self.progress, self.known_peers = options, progress, known_peers
        self.plan_share = plan_share
        self._replanner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="replan")
        self._pending_view: concurrent.futures.Future[SwarmView] | None = None
        self.partial_counter = new_partial_counter()
        self.phases = PhaseAccumulator()
        self.traffic = AveragingTraffic.new()
        self._local_steps_seen = 0
        self._solo_epochs_in_a_row = 0
        self._next_expert_warning_at = 0.0
        self._checkpoint_writer: CheckpointWriter | None = None
        self._checkpoint_schedule: CheckpointSchedule | None = None

    def run(self, stop: threading.Event) -> None:
        manifest = self.manifest
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        tokenizer = load_tokenizer(manifest.model)
        if manifest.moe is None:
            model = build_model(manifest.model, tokenizer.vocab_size, seed=run_seed(manifest))
        else:
            model = build_dmoe_model(manifest, tokenizer.vocab_size, self.dht, seed=run_seed(manifest))
        model = model.to(self.options.device)
        kind = model_kind(manifest.model)
        tokens = load_token_stream(manifest.data, tokenizer, self.options.data_cache_dir)
        sampler = WindowSampler(tokens, manifest.data.sequence_length, peer_seed_from_peer_id(self.peer_id))
        restored = load_latest_checkpoint(self.options.checkpoint_dir, model)
        if restored is not None:
            model.load_state_dict(restored.model_state)
            logger.info(f"resuming from checkpoint {restored.path.name} (epoch {restored.epoch})")
        optimizer = make_optimizer(
            dht=self.dht,
            manifest=manifest,
            parameters=model.parameters(),
            micro_batch_size=self.options.micro_batch_size,
            client_mode=self.options.client_mode,
            auxiliary=self.options.auxiliary,
            group_bits=moshpit_bits(
                self.peer_id, [status.peer_id for status in self.known_peers()], manifest.averaging
            ),
            private_key=self.private_key,
            partial_counter=self.partial_counter,
            phases=self.phases,
            traffic=self.traffic,
            # .grad accumulates the global batch, unless a loss scaler must unscale each micro-batch on its own.
            reuse_grad_buffers=manifest.averaging.mode == "gradients"
            and not self.options.auxiliary
            and not self._precision().uses_grad_scaler,
        )
        if not self.options.auxiliary:  # an auxiliary peer's weights never train: nothing worth resuming
            self._checkpoint_writer = CheckpointWriter(
                directory=self.options.checkpoint_dir, keep=self.options.checkpoint_keep
            )
            self._checkpoint_schedule = CheckpointSchedule(interval_s=self.options.checkpoint_interval_s)
        try:
            if restored is not None:
                optimizer.load_state_dict(restored.optimizer_state)
            self.progress.epoch = optimizer.local_epoch
            set_plan_share(optimizer, self.plan_share())
            if self.options.auxiliary:
                self._assist(optimizer, stop)
            else:
                self._train(model, kind, sampler, optimizer, stop)
        finally:
            self._final_checkpoint(model, optimizer)
            optimizer.shutdown()
            self._replanner.shutdown(wait=False, cancel_futures=True)

    def _train(
        self,
        model: torch.nn.Module,
        kind: str,
        sampler: WindowSampler,
        optimizer: hivemind.Optimizer,
        stop: threading.Event,
    ) -> None:
        micro_batch_size, progress, device = self.options.micro_batch_size, self.progress, self.options.device
        generator = torch.Generator(device=device).manual_seed(peer_seed_from_peer_id(self.peer_id))
        last_epoch, step = optimizer.local_epoch, 0
        micro_step = MicroStep(self._precision(), device)
        apply_tf32(micro_step.precision)
        logger.info(f"training in {micro_step.precision.name} on {device} (weights and optimizer state in fp32)")
        batches = BatchPrefetcher(sampler, micro_batch_size, self.options.device)
        with (
            contextlib.closing(batches),
            GlobalBatchBar(enabled=self.options.show_bar, target=self.manifest.target_batch_size) as bar,
        ):
            while not stop.is_set():
                started = time.monotonic()
                batch = batches.get(optimizer.local_epoch, step)
                step += 1  # before the check below: a batch with a non-finite loss must not be drawn again
                compute_began = self.phases.clock()
                try:
                    with autocast(micro_step.precision, device):
                        loss = training_loss(model, batch, kind, generator=generator)  # type: ignore[arg-type]
                except ExpertsUnavailableError as e:
                    self._wait_for_experts(e, stop)  # the forward pass failed: no gradient was added
                    continue
                micro_step.backward(loss)
                # One wait for the device per micro-batch, after the backward pass is queued (reading the loss
                # before it stalled the GPU between forward and backward).
                loss_value = loss.item()
                self.phases.add(Phase.COMPUTE, self.phases.clock() - compute_began)
                if not math.isfinite(loss_value):
                    logger.warning(f"skipped a micro-batch with a non-finite loss ({loss_value})")
                    discard_local_gradients(optimizer)
                    continue
                if not micro_step.step(optimizer):
                    continue  # fp16 gradients overflowed: not counted, nothing sent; MicroStep zeroed them
                clear_micro_batch_gradients(optimizer)
                progress.observe(loss_value, micro_batch_size, time.monotonic() - started)
                if optimizer.local_epoch > last_epoch + 1:
                    # This step caught up by loading the swarm's state: the losses so far were those of weights
                    # this node no longer has, so its published loss starts afresh with the next micro-batch.
                    progress.loss = None
                progress.epoch = optimizer.local_epoch
                progress.samples_accumulated = optimizer.tracker.local_progress.samples_accumulated
                progress.num_partial_averages = self.partial_counter.value
                progress.num_local_steps = getattr(optimizer, "num_local_gradient_steps", 0)
                global_progress = optimizer.tracker.global_progress
                bar.update(progress, global_progress.samples_accumulated, global_progress.num_peers)
                self._observe_averaging(optimizer)
                if optimizer.local_epoch != last_epoch:
                    last_epoch = optimizer.local_epoch
                    self._on_new_epoch(model, optimizer)

    def _precision(self) -> Precision:
        return precision_for_device(self.manifest.model.precision, self.options.device)

    def _assist(self, optimizer: hivemind.Optimizer, stop: threading.Event) -> None:
        """Aggregate for the swarm without computing: each auxiliary step joins the round when one is due."""
        last_epoch = optimizer.local_epoch
        while not stop.wait(AUXILIARY_STEP_INTERVAL_S):
            optimizer.step()
            self.progress.epoch = optimizer.local_epoch
            self.progress.num_partial_averages = self.partial_counter.value
            self._observe_averaging(optimizer)
            if optimizer.local_epoch != last_epoch:
                last_epoch = optimizer.local_epoch
                self.progress.phase_times = self.phases.complete_step()
                logger.info(
                    f"epoch {optimizer.local_epoch}: aggregated for the swarm; {self.progress.phase_times.describe()}"
                )
                self._replan(optimizer)

    def _wait_for_experts(self, error: ExpertsUnavailableError, stop: threading.Event) -> None:
        """A DMoE step found no expert: say so (once a minute at most) and retry shortly, not in a hot loop."""
        if time.monotonic() >= self._next_expert_warning_at:
            self._next_expert_warning_at = time.monotonic() + EXPERT_WARNING_INTERVAL_S
            logger.warning(f"skipped a micro-batch: {error}; waiting for expert hosts")
        stop.wait(EXPERT_RETRY_S)

    def _observe_averaging(self, optimizer: hivemind.Optimizer) -> None:
        """Copy the swarm's size and this node's averaging traffic into `progress`, for status and metrics."""
        self.progress.num_peers = optimizer.tracker.global_progress.num_peers
        self.progress.averaging_bytes_sent, self.progress.averaging_bytes_received = self.traffic.totals()

    def _on_new_epoch(self, model: torch.nn.Module, optimizer: hivemind.Optimizer) -> None:
        loss = "?" if self.progress.loss is None else f"{self.progress.loss:.3f}"
        self.progress.phase_times = phases = self.phases.complete_step()
        logger.info(
            f"epoch {optimizer.local_epoch}: loss {loss}, {self.progress.samples_per_second:.1f} samples/s on this node"
            f"; {phases.describe()}"
        )
        self._checkpoint_if_due(model, optimizer)
        self._replan_in_background(optimizer)

    def _replan(self, optimizer: hivemind.Optimizer) -> None:
        self._apply_swarm_view(optimizer, self._read_swarm())

    def _read_swarm(self) -> SwarmView:
        """The plan's share for this node and the peers that average, from the DHT (one or two DHT reads)."""
        return SwarmView(share=self.plan_share(), statuses=self.known_peers())

    def _replan_in_background(self, optimizer: hivemind.Optimizer) -> None:
        """At a new epoch: apply what the last background read found, and start the next read. A step never
        waits for the DHT; the plan read at one epoch boundary applies from the next, on every node alike."""
        pending = self._pending_view
        if pending is not None and not pending.done():
            return  # the DHT is slow: keep the current plan one more epoch rather than queue reads
        if pending is not None:
            try:
                self._apply_swarm_view(optimizer, pending.result())
            except Exception as e:
                logger.warning(f"could not read the swarm's records to re-plan: {e}; keeping the current plan")
        self._pending_view = self._replanner.submit(self._read_swarm)

    def _apply_swarm_view(self, optimizer: hivemind.Optimizer, view: SwarmView) -> None:
        set_plan_share(optimizer, view.share)
        statuses = view.statuses
        refresh_moshpit_bits(optimizer, self.peer_id, [status.peer_id for status in statuses], self.manifest.averaging)
        # A peer still starting (measuring itself, building its model) is online but can't average yet.
        started = {status.peer_id for status in statuses if has_started(status)}
        self._watch_averaging(len(started | {self.peer_id}))

    def _watch_averaging(self, num_peers: int) -> None:
        """Warn when the swarm has peers that average but this node keeps stepping alone: the run is not
        training together. `num_peers` counts this node and the peers that have started."""
        solo = self.progress.num_local_steps > self._local_steps_seen and num_peers > 1
        self._local_steps_seen = self.progress.num_local_steps
        self._solo_epochs_in_a_row = self._solo_epochs_in_a_row + 1 if solo else 0
        if self._solo_epochs_in_a_row == SOLO_EPOCHS_BEFORE_WARNING:
            logger.warning(
                f"averaging failed {SOLO_EPOCHS_BEFORE_WARNING} global steps in a row with {num_peers} peers training: "
                "this node is training alone (see 'solo steps' in crowdtrain status); restart it if this persists"
            )

    def _checkpoint_if_due(self, model: torch.nn.Module, optimizer: hivemind.Optimizer) -> None:
        """Once the interval has passed, hand a snapshot to the background writer: the step waits for a copy
        in memory, never for the disk. While the previous write is still running, skip (and retry next epoch)."""
        writer, schedule = self._checkpoint_writer, self._checkpoint_schedule
        if writer is None or schedule is None or optimizer.local_epoch == 0 or not schedule.is_due():
            return  # epoch 0: nothing learned together yet; the swarm's state is what a restart should load
        if writer.busy:
            logger.debug(f"checkpoint of epoch {optimizer.local_epoch} skipped: the last one is still being written")
            return
        writer.submit(take_snapshot(optimizer.local_epoch, model.state_dict(), optimizer.state_dict()))
        schedule.restart()

    def _final_checkpoint(self, model: torch.nn.Module, optimizer: hivemind.Optimizer) -> None:
        """At exit: let the write in flight finish, then write the state as it is now, within a bound."""
        writer = self._checkpoint_writer
        if writer is None:
            return
        final = None
        if optimizer.local_epoch > 0:
            final = take_snapshot(optimizer.local_epoch, model.state_dict(), optimizer.state_dict())
        writer.close(final, timeout_s=FINAL_CHECKPOINT_TIMEOUT_S)


def run_seed(manifest: RunManifest) -> int:
    """One initialisation seed per run, so every peer starts from the same weights."""
    digest = hashlib.blake2b(f"{manifest.run_id}:{manifest.created_at}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**31)


def has_started(status: proto.PeerStatus) -> bool:
    """Whether a peer's status shows it trains or aggregates already: it computed samples, or it completed a
    global step (an auxiliary aggregator computes none; a joiner's epoch jumps to the swarm's when it loads
    the swarm's state)."""
    return status.samples_per_second > 0 or status.epoch > 0
