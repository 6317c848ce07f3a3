"""What a node's training publishes: its progress, written by the trainer thread, read by heartbeats and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from crowdtrain.averaging.phases import PhaseTimes

THROUGHPUT_EMA_ALPHA = 0.1


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
    """Peers training in this run as the training mode last saw them, this node included."""
    swarm_samples_accumulated: int = 0
    """Samples the whole swarm accumulated toward the current global batch, as the training mode last saw them."""
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
