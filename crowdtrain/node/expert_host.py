"""The expert-host role of a node: an ExpertSupervisor configured from the node's config."""

from __future__ import annotations

import threading
from collections.abc import Callable

import hivemind
import torch

from crowdtrain.manifest import RunManifest
from crowdtrain.moe import ExpertSupervisor, HostOptions, SupervisorOptions
from crowdtrain.node.config import NodeConfig


def make_expert_supervisor(
    *,
    dht: hivemind.DHT,
    manifest: RunManifest,
    peer_id: str,
    config: NodeConfig,
    device: str,
    on_change: Callable[[tuple[str, ...]], None],
    stop: threading.Event,
) -> ExpertSupervisor:
    """Serve this run's experts as placement assigns them, announced as long-lived as the node's status."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    host = HostOptions(
        checkpoint_dir=config.state_path / "experts" / manifest.run_id,
        device=device,
        # A dead host's experts stay findable as long as its status stays listed, and no longer.
        declare_period_s=config.status_ttl_s / 3,
        declare_ttl_s=config.status_ttl_s,
    )
    options = SupervisorOptions(
        max_experts=config.max_experts,
        recheck_s=max(config.status_interval_s, 2.0),
        average_every_s=config.replica_average_interval_s,
    )
    return ExpertSupervisor(
        dht=dht, manifest=manifest, peer_id=peer_id, host_options=host, options=options, on_change=on_change, stop=stop
    )
