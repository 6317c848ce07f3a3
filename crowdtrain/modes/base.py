"""The training-mode seam: one interface for every way the peers of a run combine their work.

The training loop (training/loop.py) draws micro-batches, keeps the progress, checkpoints and re-plans;
everything that differs between modes sits behind `TrainingMode`: how a micro-batch is taken, when and
what is synchronised with the swarm, what state a joiner downloads and a checkpoint keeps, and what the mode
reports. The daemon asks a mode class only whether the plan may give it aggregators that compute nothing.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from typing import Any, ClassVar

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.averaging.phases import PhaseAccumulator
from crowdtrain.averaging.traffic import AveragingTraffic
from crowdtrain.data import WindowSampler
from crowdtrain.manifest import RunManifest
from crowdtrain.modes.compute import LocalCompute
from crowdtrain.modes.progress import Progress


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmView:
    """What one re-planning read of the DHT found: the plan for this node and the peers that synchronise."""

    plan_share: float | None
    """This node's share of each averaging round under the DeDLOC plan; None: no plan yet (equal split)."""
    statuses: Sequence[proto.PeerStatus]
    """The run's peers that synchronise (expert hosts left out)."""


@dataclass(frozen=True, kw_only=True)
class ModeContext:
    """Everything a training mode is built from."""

    dht: hivemind.DHT
    manifest: RunManifest
    peer_id: str
    private_key: RSAPrivateKey
    """The key of the DHT's signature validator: records the mode signs must carry it."""
    parameters: Sequence[torch.nn.Parameter]
    """The local replica's trainable parameters."""
    compute: LocalCompute | None
    """Forward/backward on the local replica; None for an auxiliary peer, which computes nothing."""
    micro_batch_size: int
    client_mode: bool
    """Peers can't dial this node: it never aggregates."""
    auxiliary: bool
    """The plan makes this node aggregate without computing (only where `has_auxiliary_aggregators`)."""
    swarm: SwarmView
    """The swarm as the node found it at start."""
    partial_counter: Synchronized
    """Counts averaging rounds rejected as partial; shared with the averager processes."""
    upload_mbps: float | None = None
    """This node's measured upload (its link probes before training), Mbit/s; None: not measured."""
    download_mbps: float | None = None
    """This node's measured download, Mbit/s; None: not measured."""
    sampler: WindowSampler | None = None
    """The node's training data, for a mode that draws more than the loop's micro-batch per call (skippipe);
    None for an auxiliary peer."""
    phases: PhaseAccumulator = field(default_factory=PhaseAccumulator)
    traffic: AveragingTraffic = field(default_factory=AveragingTraffic.new)
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when the node is stopping. A mode hands it to its RPC services (`P2PService`): their calls to peers then
    raise NodeStopping, which ends `train_micro_batch` at once instead of at a peer's deadline."""


class TrainingMode(abc.ABC):
    """How the peers of a run combine their work; one implementation per `training.mode` of the manifest."""

    name: ClassVar[str]
    """The manifest's `training.mode` value."""
    has_auxiliary_aggregators: ClassVar[bool] = False
    """Whether the plan may make a peer aggregate without computing (DeDLOC's auxiliary peers)."""
    holds_whole_model: ClassVar[bool] = True
    """Whether a node holds every layer of the model, so it can score held-out loss on its own (`eval_every`)."""

    def __init__(self, context: ModeContext):
        """Join the swarm's synchronisation for `context.manifest`'s run; `context.swarm` is the swarm at start."""
        self.context = context

    @property
    def compression(self) -> str:
        """The wire encoding of this mode's averaging rounds (the manifest's `averaging.compression`)."""
        return self.context.manifest.averaging.compression

    @property
    @abc.abstractmethod
    def epoch(self) -> int:
        """The global step this replica is at; it changes when the swarm steps or a joiner downloads state."""

    @abc.abstractmethod
    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        """Train one micro-batch and synchronise with the swarm when due; its loss, or None when it was skipped
        (a non-finite loss or fp16 overflow: nothing of it may reach the swarm). A node behind the swarm
        downloads the swarm's state here first. Once `context.stop` is set it may raise NodeStopping instead,
        leaving the state as its last whole step left it (the loop then checkpoints it and closes the mode)."""

    def samples_of_last_call(self, micro_batch_size: int) -> int:
        """Samples the last `train_micro_batch` computed on this node (its throughput counts them): the
        micro-batch's, unless the mode trains more or fewer per call."""
        return micro_batch_size

    @abc.abstractmethod
    def assist(self) -> None:
        """One step of an auxiliary peer: take part in the swarm's synchronisation when one is due."""

    @abc.abstractmethod
    def apply_swarm_view(self, view: SwarmView) -> None:
        """Take a re-planning read (at an epoch boundary): the plan's share and the peers that synchronise."""

    @abc.abstractmethod
    def report(self, progress: Progress) -> None:
        """Copy what the mode knows into `progress`: epoch, samples toward the global batch, the swarm's size,
        partial and solo rounds, averaging traffic."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The mode's own state beside the model's parameters (optimizer state and epoch): what a checkpoint
        keeps; a joiner downloads the same from a peer."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` output read from a checkpoint."""

    def checkpoint_model_state(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors a checkpoint keeps, from its `state_dict()`: as they are, unless this mode computes
        on parameters that are not the state its optimizer's moments go with (SkipPipe's overlapped look-ahead)."""
        return model_state

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the swarm's synchronisation (bounded) and stop background work."""
