"""Decentralized Mixture-of-Experts: host a run's experts on volunteers and keep its grid covered.

placement   pure: which experts a host serves (uncovered first, then fewest replicas) and the grid's coverage
experts     the expert architecture, its deterministic initial weights, optimizer and hivemind backend
hosting     ExpertHost: hivemind's MoE Server over a changeable set of experts, with checkpoints
requests    pure: what an expert host accepts from a caller (tensor count, dtype, shape, batch, finite, stream bounds)
connection  BoundedConnectionHandler: hivemind's expert RPC handler with every request checked first
directory   ExpertDirectory: which hosts serve which experts, from their signed status records only
epoch       ExpertEpoch: the swarm's epoch for the experts' learning rate, bounded against lying trainers
replicas    ReplicaService: an expert's parameters between hosts, to start from a live replica and to average
supervisor  ExpertSupervisor: the host's loop that re-places, takes over vanished experts, averages
            replicas, restarts crashes

The trainer's side, the DMoE layer, lives in `crowdtrain.models.dmoe`.
"""

from crowdtrain.moe.hosting import ExpertHost, HostOptions
from crowdtrain.moe.placement import GridCoverage, choose_experts, grid_coverage
from crowdtrain.moe.supervisor import EXPERT_HOST_ROLE, ExpertSupervisor, SupervisorOptions

__all__ = [
    "EXPERT_HOST_ROLE",
    "ExpertHost",
    "ExpertSupervisor",
    "GridCoverage",
    "HostOptions",
    "SupervisorOptions",
    "choose_experts",
    "grid_coverage",
]
