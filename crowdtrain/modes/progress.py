"""What a node's training publishes: its progress, written by the trainer thread, read by heartbeats and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from crowdtrain import proto
from crowdtrain.averaging.phases import PhaseTimes
from crowdtrain.averaging.quarantine import Verdict

THROUGHPUT_EMA_ALPHA = 0.1
LOSS_FIRST_BATCHES = 8
"""After a start or `restart_loss`, the published loss is the plain mean of this many micro-batches, then the EMA."""
LOSS_MIN_BATCHES = 4
"""...and none is published before this many: one micro-batch's loss is noise (a peer that had just downloaded the
swarm's state showed 3.05 where its EMA had been 2.86 and went on at 2.78, failing test_training's "loss holds")."""


@dataclass(slots=True)
class Progress:
    """What the heartbeat publishes about this node's training; written by the trainer thread (but
    `reachability`)."""

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
    """Peers training in this run as the training mode last saw them, this node included."""
    swarm_samples_accumulated: int = 0
    """Samples the whole swarm accumulated toward the current global batch, as the training mode last saw them."""
    averaging_bytes_sent: int = 0
    """Serialized tensor-part bytes this node sent in averaging rounds since it started, B (SkipPipe: its hops,
    gradients and stage states)."""
    averaging_bytes_received: int = 0
    """Serialized tensor-part bytes this node received in averaging rounds since it started, B."""
    mode: str = ""
    """The run's training mode (`training.mode`); "" until training started."""
    compression: str = ""
    """The wire encoding of the mode's averaging rounds."""
    inner_step: int = 0
    """diloco: global batches the swarm completed in the current outer round; 0 in other modes."""
    inner_steps: int = 0
    """diloco: H, global batches per outer round; 0 in other modes."""
    round_bytes_sent: int | None = None
    """Averaging bytes sent during the last completed round (global step or outer round); None before one."""
    compute_utilisation: float | None = None
    """Time computing / wall time over the last completed round, in [0, 1]; None before one."""
    held_out_loss: float | None = None
    """The loss of this node's replica on the run's held-out windows at `held_out_epoch`; None before a score."""
    held_out_epoch: int = 0
    experts_owned: int = 0
    """spes: the experts (of all layers) this node trains now; 0 in other modes."""
    experts_total: int = 0
    """spes: the experts of all layers in the model; 0 in other modes."""
    experts_capacity: int | None = None
    """spes: the experts whose gradients and AdamW moments fit this node's memory; None in other modes or unknown."""
    skippipe_stage: int | None = None
    """skippipe: the stage this node serves; None in other modes and before it took one."""
    skippipe_iteration: int = 0
    """skippipe: the last iteration this node stepped; 0 in other modes."""
    samples_trained: int = 0
    """Samples this node computed forward and backward since it started (all epochs; skipped micro-batches not)."""
    reachability: str = ""
    """How peers reach this node (`links.relays.REACHABILITY`), as its last status record said; written by the
    heartbeat, "" before its first beat."""
    excluded_peers: dict[str, Verdict] = field(default_factory=dict)
    """Peers this node keeps out of its averaging groups for sending bad parts (averaging/quarantine.py)."""
    loss_batches: int = 0
    """Micro-batches folded into `loss` since it was last restarted."""
    _loss_mean: float = field(default=0.0, repr=False)

    def observe(self, loss: float, num_samples: int, elapsed_s: float) -> None:
        """Fold one micro-step into the exponential moving averages."""
        self.samples_trained += num_samples
        rate = num_samples / max(elapsed_s, 1e-6)
        alpha = THROUGHPUT_EMA_ALPHA
        self.samples_per_second = (
            rate if self.samples_per_second == 0 else (1 - alpha) * self.samples_per_second + alpha * rate
        )
        self.loss_batches += 1
        if self.loss_batches <= LOSS_FIRST_BATCHES:
            self._loss_mean += (loss - self._loss_mean) / self.loss_batches
            self.loss = self._loss_mean if self.loss_batches >= LOSS_MIN_BATCHES else None
        else:
            assert self.loss is not None
            self.loss = (1 - alpha) * self.loss + alpha * loss

    def restart_loss(self) -> None:
        """Forget the losses so far (they were those of weights this node no longer has)."""
        self.loss, self.loss_batches, self._loss_mean = None, 0, 0.0

    def complete_round(self, *, compute_s: float, wall_s: float, bytes_sent: int) -> None:
        """A round (global step or outer round) completed after `wall_s` seconds, `compute_s` of them computing,
        `bytes_sent` averaging bytes sent during it."""
        self.round_bytes_sent = max(bytes_sent, 0)
        self.compute_utilisation = min(max(compute_s / wall_s, 0.0), 1.0) if wall_s > 0 else 0.0

    def excluded_peer_statuses(self, now: float | None = None) -> list[proto.ExcludedPeer]:
        """The PeerStatus entries of the peers kept out now, soonest-readmitted last."""
        now = time.time() if now is None else now
        current = sorted(self.excluded_peers.items(), key=lambda item: -item[1].until)
        return [
            proto.ExcludedPeer(peer_id=peer, reason=verdict.reason, remaining_s=verdict.until - now)
            for peer, verdict in current
            if verdict.until > now
        ]

    def training_status(self) -> proto.TrainingStatus | None:
        """The PeerStatus message of the mode and its last round; None until a round completed."""
        if not self.mode or self.round_bytes_sent is None or self.compute_utilisation is None:
            return None
        return proto.TrainingStatus(
            **{name: getattr(self, name) for name in proto.TrainingStatus.DESCRIPTOR.fields_by_name}
        )
