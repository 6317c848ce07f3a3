"""The training loop of a node: build the run's model and data, train with the swarm through its mode, checkpoint.

The loop is the same for every training mode: it draws micro-batches, hands each to the mode (modes),
keeps the published progress, re-plans at epoch boundaries and checkpoints on an interval.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.averaging.phases import PhaseAccumulator, PhaseTimes
from crowdtrain.averaging.traffic import AveragingTraffic
from crowdtrain.data import BatchPrefetcher, WindowSampler, load_token_stream, peer_seed_from_peer_id
from crowdtrain.manifest import RunManifest
from crowdtrain.models import (
    ExpertsUnavailableError,
    MicroStep,
    apply_tf32,
    build_dmoe_model,
    build_model,
    load_tokenizer,
    model_kind,
    precision_for_device,
)
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.compute import LocalCompute
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.registry import mode_class
from crowdtrain.moe.directory import ExpertDirectory
from crowdtrain.rpc.service import NodeStopping
from crowdtrain.training.checkpoint import load_latest_checkpoint
from crowdtrain.training.checkpoint_writer import CheckpointSchedule, CheckpointWriter, take_snapshot
from crowdtrain.training.held_out import HeldOutScorer
from crowdtrain.training.progress_bar import GlobalBatchBar

logger = logging.getLogger(__name__)

SOLO_EPOCHS_BEFORE_WARNING = 5
AUXILIARY_STEP_INTERVAL_S = 0.5
"""How often an auxiliary peer steps its optimizer, which joins an averaging round once one is due."""
EXPERT_RETRY_S = 1.0
EXPERT_WARNING_INTERVAL_S = 60.0
START_WAIT_S = 600.0
"""`start_with_peers` waits at most this long, then trains with whoever is there."""
START_POLL_S = 2.0
FINAL_CHECKPOINT_TIMEOUT_S = 10.0
"""Bound on the checkpoint at shutdown (the write in flight, then the final one): the daemon leaves within
LEAVE_DEADLINE_S (28 s), which must also cover the last micro-step, the mode's shutdown and the status
withdrawal."""


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
    start_with_peers: int = 1
    """At epoch 0, wait for this many planned nodes (this one included) before the first micro-batch; 1 never waits."""
    eval_every: int = 0
    """Score the replica on the held-out windows at every epoch divisible by this (training/held_out.py); 0 never."""
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
    upload_mbps: float | None = None
    """This node's measured upload before training, Mbit/s (None: not measured), for the modes that weigh links."""
    download_mbps: float | None = None
    """This node's measured download before training, Mbit/s (None: not measured)."""


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
        read_plan_share: Callable[[], float | None] = lambda: None,
    ):
        """`known_peers` gives the run's peers that synchronise (expert hosts left out); `read_plan_share` is
        asked at the start and at every new epoch for this node's share of each averaging round under the plan."""
        self.dht, self.manifest, self.peer_id, self.private_key = dht, manifest, peer_id, private_key
        self.options, self.progress, self.known_peers = options, progress, known_peers
        self.read_plan_share = read_plan_share
        self._replanner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="replan")
        self._pending_view: concurrent.futures.Future[SwarmView] | None = None
        self.phases = PhaseAccumulator()
        self._local_steps_seen = 0
        self._solo_epochs_in_a_row = 0
        self._next_expert_warning_at = 0.0
        self._checkpoint_writer: CheckpointWriter | None = None
        self._checkpoint_schedule: CheckpointSchedule | None = None
        self._held_out: HeldOutScorer | None = None
        self._round_started_at = time.monotonic()
        self._round_bytes_at_start = 0

    def run(self, stop: threading.Event) -> None:
        manifest, options = self.manifest, self.options
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        tokenizer = load_tokenizer(manifest.model)
        if manifest.moe is None:
            model = build_model(manifest.model, tokenizer.vocab_size, seed=run_seed(manifest))
        else:
            directory = ExpertDirectory(self.dht, manifest)  # the hosts' signed statuses, not hivemind's records
            model = build_dmoe_model(manifest, tokenizer.vocab_size, self.dht, directory.hosts, seed=run_seed(manifest))
        model = model.to(options.device)
        restored = load_latest_checkpoint(options.checkpoint_dir, model)
        if restored is not None:
            model.load_state_dict(restored.model_state)
            logger.info(f"resuming from checkpoint {restored.path.name} (epoch {restored.epoch})")
        sampler = None
        if not options.auxiliary:  # before the mode joins the swarm: the first tokenisation can take a while
            tokens = load_token_stream(manifest.data, tokenizer, options.data_cache_dir)
            sampler = WindowSampler(tokens, manifest.data.sequence_length, peer_seed_from_peer_id(self.peer_id))
        mode = self._make_mode(model, sampler, stop)
        if sampler is not None and options.eval_every:
            self._held_out = self._held_out_scorer(model, mode, sampler)
        if not options.auxiliary:  # an auxiliary peer's weights never train: nothing worth resuming
            self._checkpoint_writer = CheckpointWriter(directory=options.checkpoint_dir, keep=options.checkpoint_keep)
            self._checkpoint_schedule = CheckpointSchedule(interval_s=options.checkpoint_interval_s)
        try:
            if restored is not None:
                mode.load_state_dict(restored.optimizer_state)
            self.progress.epoch = mode.epoch
            self.progress.mode, self.progress.compression = mode.name, mode.compression
            self._round_started_at = time.monotonic()
            if sampler is None:
                self._assist(mode, stop)
            else:
                if mode.epoch == 0 and options.start_with_peers > 1:
                    self._await_start_peers(stop)
                    mode.apply_swarm_view(self._watched(self._read_swarm()))  # the peers it waited for
                self._train(model, mode, sampler, stop)
        finally:
            self._final_checkpoint(model, mode)
            mode.close()
            self._replanner.shutdown(wait=False, cancel_futures=True)

    def _await_start_peers(self, stop: threading.Event) -> None:
        """Wait until `start_with_peers` nodes have planned (or trained), START_WAIT_S at most, saying so."""
        wanted, deadline, said = self.options.start_with_peers, time.monotonic() + START_WAIT_S, -1
        while not stop.is_set():
            peers = self.known_peers()
            if any(status.epoch > 0 for status in peers):
                return  # the run has begun: this node joins it as any joiner
            ready = sum(1 for status in peers if status.plan_digest or has_started(status))
            if ready >= wanted:
                logger.info(f"{ready} nodes are ready: starting to train")
                return
            if time.monotonic() >= deadline:
                logger.warning(f"starting to train with {ready} of the {wanted} nodes start_with_peers waits for")
                return
            if ready != said:
                logger.info(f"waiting for {wanted} nodes before the first step (start_with_peers): {ready} ready")
                said = ready
            stop.wait(START_POLL_S)

    def _make_mode(self, model: torch.nn.Module, sampler: WindowSampler | None, stop: threading.Event) -> TrainingMode:
        """The run's training mode over this replica, with the plan and the peers as the DHT has them now."""
        options, device = self.options, self.options.device
        compute = None
        if not options.auxiliary:
            micro_step = MicroStep(precision_for_device(self.manifest.model.precision, device), device)
            apply_tf32(micro_step.precision)
            logger.info(f"training in {micro_step.precision.name} on {device} (weights and optimizer state in fp32)")
            compute = LocalCompute(
                model=model,
                kind=model_kind(self.manifest.model),
                micro_step=micro_step,
                device=device,
                generator=torch.Generator(device=device).manual_seed(peer_seed_from_peer_id(self.peer_id)),
                phases=self.phases,
            )
        context = ModeContext(
            dht=self.dht,
            manifest=self.manifest,
            peer_id=self.peer_id,
            private_key=self.private_key,
            parameters=list(model.parameters()),
            compute=compute,
            micro_batch_size=options.micro_batch_size,
            client_mode=options.client_mode,
            auxiliary=options.auxiliary,
            upload_mbps=options.upload_mbps,
            download_mbps=options.download_mbps,
            swarm=self._read_swarm(),
            partial_counter=new_partial_counter(),
            sampler=sampler,
            phases=self.phases,
            traffic=AveragingTraffic.new(),
            stop=stop,
        )
        return mode_class(self.manifest)(context)

    def _train(self, model: torch.nn.Module, mode: TrainingMode, sampler: WindowSampler, stop: threading.Event) -> None:
        micro_batch_size, progress = self.options.micro_batch_size, self.progress
        last_epoch, step = mode.epoch, 0
        batches = BatchPrefetcher(sampler, micro_batch_size, self.options.device)
        with (
            contextlib.closing(batches),
            GlobalBatchBar(enabled=self.options.show_bar, target=self.manifest.target_batch_size) as bar,
        ):
            while not stop.is_set():
                started = time.monotonic()
                batch = batches.get(mode.epoch, step)
                step += 1  # before training on it: a batch with a non-finite loss must not be drawn again
                try:
                    loss = mode.train_micro_batch(batch)
                except ExpertsUnavailableError as e:
                    self._wait_for_experts(e, stop)
                    continue
                except NodeStopping:
                    logger.info("stopped mid-step: the step under way is dropped, the last whole one is kept")
                    break
                if loss is None:
                    continue  # skipped: not counted, nothing of it reached the swarm
                progress.observe(loss, mode.samples_of_last_call(micro_batch_size), time.monotonic() - started)
                if mode.epoch > last_epoch + 1:
                    # This step caught up by loading the swarm's state: the losses so far were those of weights
                    # this node no longer has, so its published loss starts afresh with the next micro-batches.
                    progress.restart_loss()
                mode.report(progress)
                bar.update(progress, progress.swarm_samples_accumulated, progress.num_peers)
                if mode.epoch != last_epoch:
                    last_epoch = mode.epoch
                    self._on_new_epoch(model, mode)

    def _assist(self, mode: TrainingMode, stop: threading.Event) -> None:
        """Aggregate for the swarm without computing: each auxiliary step joins the round when one is due."""
        last_epoch = mode.epoch
        while not stop.wait(AUXILIARY_STEP_INTERVAL_S):
            mode.assist()
            mode.report(self.progress)
            if mode.epoch != last_epoch:
                last_epoch = mode.epoch
                logger.info(f"epoch {mode.epoch}: aggregated for the swarm; {self._complete_round().describe()}")
                mode.apply_swarm_view(self._watched(self._read_swarm()))

    def _wait_for_experts(self, error: ExpertsUnavailableError, stop: threading.Event) -> None:
        """A DMoE step found no expert: say so (once a minute at most) and retry shortly, not in a hot loop."""
        if time.monotonic() >= self._next_expert_warning_at:
            self._next_expert_warning_at = time.monotonic() + EXPERT_WARNING_INTERVAL_S
            logger.warning(f"skipped a micro-batch: {error}; waiting for expert hosts")
        stop.wait(EXPERT_RETRY_S)

    def _on_new_epoch(self, model: torch.nn.Module, mode: TrainingMode) -> None:
        loss = "?" if self.progress.loss is None else f"{self.progress.loss:.3f}"
        phases = self._complete_round()
        logger.info(
            f"epoch {mode.epoch}: loss {loss}, {self.progress.samples_per_second:.1f} samples/s on this node"
            f"; {phases.describe()}; computing {self.progress.compute_utilisation:.0%} of the time"
        )
        self._score_if_due(mode.epoch)
        self._checkpoint_if_due(model, mode)
        self._replan_in_background(mode)

    def _held_out_scorer(
        self, model: torch.nn.Module, mode: TrainingMode, sampler: WindowSampler
    ) -> HeldOutScorer | None:
        if not mode.holds_whole_model:
            logger.warning(
                f"eval_every is ignored in {mode.name} runs: a node holds a part of the model (use crowdtrain eval)"
            )
            return None
        kind, device = model_kind(self.manifest.model), self.options.device
        return HeldOutScorer.for_sampler(model, kind, sampler, self.options.eval_every, device)

    def _score_if_due(self, epoch: int) -> None:
        scorer = self._held_out
        if scorer is None or not scorer.due(epoch):
            return
        started = time.monotonic()
        loss = scorer.score_at(epoch)
        self.progress.held_out_loss, self.progress.held_out_epoch = loss, epoch
        logger.info(
            f"epoch {epoch}: held-out loss {loss:.4f} on {scorer.num_windows} windows "
            f"({time.monotonic() - started:.2f} s)"
        )

    def _complete_round(self) -> PhaseTimes:
        """Close the round (global step or outer round) that just completed: its phases, the share of its wall
        time spent computing, the averaging bytes sent during it."""
        now, progress = time.monotonic(), self.progress
        progress.phase_times = phases = self.phases.complete_step()
        progress.complete_round(
            compute_s=phases.compute_s,
            wall_s=now - self._round_started_at,
            bytes_sent=progress.averaging_bytes_sent - self._round_bytes_at_start,
        )
        self._round_started_at, self._round_bytes_at_start = now, progress.averaging_bytes_sent
        return phases

    def _read_swarm(self) -> SwarmView:
        """The plan's share for this node and the peers that synchronise, from the DHT (one or two DHT reads)."""
        return SwarmView(plan_share=self.read_plan_share(), statuses=self.known_peers())

    def _replan_in_background(self, mode: TrainingMode) -> None:
        """At a new epoch: apply what the last background read found, and start the next read. A step never
        waits for the DHT; the plan read at one epoch boundary applies from the next, on every node alike."""
        pending = self._pending_view
        if pending is not None and not pending.done():
            return  # the DHT is slow: keep the current plan one more epoch rather than queue reads
        if pending is not None:
            try:
                mode.apply_swarm_view(self._watched(pending.result()))
            except Exception as e:
                logger.warning(f"could not read the swarm's records to re-plan: {e}; keeping the current plan")
        self._pending_view = self._replanner.submit(self._read_swarm)

    def _watched(self, view: SwarmView) -> SwarmView:
        # A peer still starting (measuring itself, building its model) is online but can't average yet.
        started = {status.peer_id for status in view.statuses if has_started(status)}
        self._watch_averaging(len(started | {self.peer_id}))
        return view

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

    def _checkpoint_if_due(self, model: torch.nn.Module, mode: TrainingMode) -> None:
        """Once the interval has passed, hand a snapshot to the background writer: the step waits for a copy
        in memory, never for the disk. While the previous write is still running, skip (and retry next epoch)."""
        writer, schedule = self._checkpoint_writer, self._checkpoint_schedule
        if writer is None or schedule is None or mode.epoch == 0 or not schedule.is_due():
            return  # epoch 0: nothing learned together yet; the swarm's state is what a restart should load
        if writer.busy:
            logger.debug(f"checkpoint of epoch {mode.epoch} skipped: the last one is still being written")
            return
        writer.submit(take_snapshot(mode.epoch, mode.checkpoint_model_state(model.state_dict()), mode.state_dict()))
        schedule.restart()

    def _final_checkpoint(self, model: torch.nn.Module, mode: TrainingMode) -> None:
        """At exit: let the write in flight finish, then write the state as it is now, within a bound."""
        writer = self._checkpoint_writer
        if writer is None:
            return
        final = None
        if mode.epoch > 0:
            final = take_snapshot(mode.epoch, mode.checkpoint_model_state(model.state_dict()), mode.state_dict())
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
